// Triton's model_warmup samples as tensors: what a configured warm-up runs, and what backend "auto"
// takes for its check input when the configuration names one (a real input of the user's choosing).
//
// WarmupInputs builds one sample's inputs: each input's dims with the batch dimension in front when
// the model batches (`rows`: the sample's batch_size padded to the model's fixed batch sizes, 0 when
// it does not batch), zeros, random values (seeded: the same every load) or the bytes of
// `input_data_file`, a regular file under the model's `warmup/` folder (resolved as the repository
// resolves files: no way out of the model's folder; a FIFO or a device is refused, not waited on; a
// file longer than the input is read as far as the input needs), reshaped where the input's
// configuration reshapes (strings: empty). Errors name the model, the sample and what is wrong (a
// file too short, a sample of over 1 GiB in all, string elements counted at their std::string's
// size). Thread-compatible: it reads files only.
#pragma once

#include <cstdint>
#include <filesystem>
#include <vector>

#include "quern/model.h"
#include "quern/status.h"
#include "quern/tensor.h"

namespace quern {

Result<std::vector<NamedTensor>> WarmupInputs(const ModelConfig& config, const WarmupSample& sample,
                                              const std::filesystem::path& model_dir, int64_t& rows);

}  // namespace quern
