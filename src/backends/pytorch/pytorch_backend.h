// PyTorch models (platform "pytorch_libtorch" or backend "pytorch",
// <version>/model.pt: a TorchScript module), run by LibTorch through Quern's
// LibTorch plugin (torch_plugin_api.h), which is loaded when the first such
// model loads. Inputs are forward()'s first arguments: by argument name
// when every input names one, else by Triton's <name>__<index> (INPUT__0,
// ...), else in the configuration's order; outputs named <name>__<i> are the
// i-th tensor of what forward() returns (a tensor, or a tuple or list of
// tensors), others are taken in the configuration's order. The
// configuration must list both (a TorchScript file declares no types or
// shapes). forward() runs on a copy of the inputs; results are borrowed
// unless they share memory with anything else.
//
// Threads: LibTorch has one intra-op thread pool per process. Its size is
// set when the first PyTorch model loads: the model's parameter
// intra_op_thread_count, else the engine's cores; every instance of every
// PyTorch model runs its batches on it (one thread per instance would be
// the ONNX way, but Debian's LibTorch 1.13 runs a ResNet-50 11x slower on
// one thread than on two). Later models find it set.
//
// The plugin is $QUERN_PYTORCH_PLUGIN when set; else, installed
// (cmake --install --component pytorch), <libdir>/quern/libquern_pytorch.so
// beside the running binary's or library's folder; else the build tree's.
#pragma once

#include <memory>

#include "engine/backend.h"

namespace quern {

std::shared_ptr<Backend> NewPytorchBackend();

}  // namespace quern
