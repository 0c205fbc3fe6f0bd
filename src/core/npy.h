// Minimal reader for NumPy .npy files (version 1/2, little-endian,
// C order): `quern infer` takes inputs from them, tests read reference data.
#pragma once

#include <string>

#include "quern/status.h"
#include "quern/tensor.h"

namespace quern {

Result<Tensor> ReadNpy(const std::string& path);

}  // namespace quern
