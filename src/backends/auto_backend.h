// Backend "auto" (and the default for an ONNX model whose configuration
// names neither backend nor platform): the model run by the runtime and
// precision measured fastest on this machine among those whose answers
// agree with ONNX Runtime's FP32 ones. At load, each candidate (ONNX
// Runtime FP32, OpenVINO f32, and OpenVINO bf16 where the CPU has
// AVX512_BF16 or AMX) opens the file and runs a check input as the engine
// will serve it (the configuration's first model_warmup sample when there
// is one, else one made up of the model's own shapes, batch 1): on one instance and,
// where the layout has one, on the wide instance (every core), for at most
// 0.6 s each; its time is the geometric mean of the two. The fastest whose
// outputs lie within 0.1 % (f32) or 5 % (bf16) of FP32's largest value, per
// output, and whose answers mean the same (ModelServices::compare_answers,
// when the engine has one: a detector's boxes), is kept; the others are
// dropped. One runtime's model is open at a time: ONNX Runtime's is closed
// while the others are measured (its outputs kept to compare with, its
// runs' buffers returned: Backend::ReturnIdleMemory) and opened again when
// it stays the choice, so the load's peak is about the largest candidate's. Another runtime replaces ONNX
// Runtime only when at least 10 % faster, and a model whose ONNX Runtime
// run takes under 1 ms is not measured further (ONNX Runtime serves it).
// The choice and the table behind it are logged; the served configuration
// names the chosen backend (and its INFERENCE_PRECISION_HINT), so metadata
// and metrics show it.
//
// With a cache folder, a choice made by comparing runtimes is kept there,
// named by the SHA-256 of what it depends on (the model file's bytes, the
// names, sizes and times of the plain files beside it, the configuration's
// shapes and parameters, cores, instances, the CPU, the runtimes' versions,
// Quern's own binary): a restart opens the kept choice and runs the check
// input once (a failure measures again), and a changed model file is
// measured again. Only a regular file of this user's, at most 4 KiB, is read
// as a kept choice; a new one is written aside (mkstemp) and renamed.
// Instances on a GPU run on ONNX Runtime (its CUDA), unmeasured.
//
// Contract: ONNX Runtime's candidate is the reference: when it cannot open
// the file, Open fails with its error; a candidate that cannot open (no
// OpenVINO plugin in this build) or disagrees is left out, saying why.
// QUERN_NO_BF16=1 in the environment leaves bf16 out (a CPU without it).
#pragma once

#include <filesystem>
#include <memory>

#include "engine/backend.h"

namespace quern {

// `cache_dir`: where choices are kept ("" = measured at every load);
// `measure` false: ONNX Runtime opens every model, unmeasured.
std::shared_ptr<Backend> NewAutoBackend(std::shared_ptr<Backend> onnxruntime, std::shared_ptr<Backend> openvino,
                                        std::filesystem::path cache_dir = {}, bool measure = true);

}  // namespace quern
