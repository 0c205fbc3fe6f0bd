// OpenVINO backend (`backend: "openvino"`): a model version's file (ONNX,
// or OpenVINO IR: model.xml beside model.bin) compiled ONCE for the CPU, its
// instances infer requests of that compiled model (the weights loaded once,
// whatever the instance count: OpenVINO's streams, one per instance by
// default). OpenVINO itself lives in a plugin (libquern_openvino.so, see
// ov_plugin_api.h) loaded when the first such model loads.
//
// Parameters, as Triton's OpenVINO backend reads them (string values, passed
// to OpenVINO's compile): PERFORMANCE_HINT (LATENCY, THROUGHPUT,
// CUMULATIVE_THROUGHPUT), NUM_STREAMS (default: the model's CPU instances),
// INFERENCE_NUM_THREADS (default: the engine's cores) and
// INFERENCE_PRECISION_HINT (f32, bf16, f16; default OpenVINO's: bf16 on a
// CPU with AVX512_BF16 or AMX, else f32).
//
// Contract: Open fails with the model's name and OpenVINO's reason when the
// file cannot be read or compiled; an instance runs one batch at a time; a
// batch whose every request is cancelled is stopped (the request's cancel).
#pragma once

#include <filesystem>
#include <memory>

#include "engine/backend.h"

namespace quern {

std::shared_ptr<Backend> NewOpenvinoBackend();

// Writes the model in `model_file` (ONNX or IR) as OpenVINO IR:
// `xml_file` and the .bin beside it, the weights as f16 when `f16`
// (OpenVINO keeps computing in the precision it chooses). UNAVAILABLE when
// this build has no OpenVINO plugin; INVALID_ARGUMENT with OpenVINO's reason.
Status SaveOpenvinoIr(const std::filesystem::path& model_file, const std::filesystem::path& xml_file, bool f16);

}  // namespace quern
