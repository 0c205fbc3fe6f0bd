// Minimal reader/writer for NumPy .npy files (version 1/2, little-endian,
// C order), used by `quern infer` to take inputs from files.
#pragma once

#include <string>

#include "quern/status.h"
#include "quern/tensor.h"

namespace quern {

Result<Tensor> ReadNpy(const std::string& path);

}  // namespace quern
