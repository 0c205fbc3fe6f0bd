// Backend "auto": an ONNX model run by the runtime and precision measured
// fastest on this machine among those whose answers agree with ONNX
// Runtime's FP32 ones. At load, each candidate (ONNX Runtime FP32, OpenVINO
// f32, and OpenVINO bf16 where the CPU has AVX512_BF16 or AMX) opens the
// file, runs a check input of the model's own shapes (batch 1) on one
// instance for at most 0.6 s, and the fastest whose outputs lie within 0.1 %
// (f32) or 5 % (bf16) of FP32's largest value, per output, is kept; the
// others are dropped. The choice and the table behind it are
// logged; the served configuration names the chosen backend (and its
// INFERENCE_PRECISION_HINT), so metadata and metrics show it.
//
// Contract: ONNX Runtime's candidate is the reference: when it cannot open
// the file, Open fails with its error; a candidate that cannot open (no
// OpenVINO plugin in this build) or disagrees is left out, saying why.
// QUERN_NO_BF16=1 in the environment leaves bf16 out (a CPU without it).
#pragma once

#include <memory>

#include "engine/backend.h"

namespace quern {

std::shared_ptr<Backend> NewAutoBackend(std::shared_ptr<Backend> onnxruntime, std::shared_ptr<Backend> openvino);

}  // namespace quern
