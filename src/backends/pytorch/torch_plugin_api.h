// The C interface between Quern and its LibTorch plugin
// (libquern_pytorch.so). The plugin is loaded with dlopen when the first
// PyTorch model loads, so that LibTorch (a few hundred MB of libraries, its
// own C++ ABI, a process-wide thread pool) stays out of every process that
// serves none. Plain C: nothing of Quern's C++ types crosses it, and the
// plugin needs none of Quern's code.
#pragma once

#include <stddef.h>
#include <stdint.h>

extern "C" {

#define QUERN_TORCH_PLUGIN_ABI 2

// A tensor's bytes, dense and row-major.
struct QuernTorchTensor {
  uint8_t dtype;  // quern::DataType's value
  int32_t rank;   // at most 8
  int64_t dims[8];
  void* data;
  size_t bytes;
};

struct QuernTorchApi {
  uint32_t abi;  // QUERN_TORCH_PLUGIN_ABI
  // LibTorch's version, "1.13.1".
  const char* version;
  // Sets the size of LibTorch's intra-op thread pool (one per process) the
  // first time it is called; returns the size in force.
  int (*set_threads)(int intra_op);
  // Loads a TorchScript file for inference on the CPU. Null on failure,
  // with *error set (release it with free_string).
  void* (*load)(const char* path, char** error);
  void (*unload)(void* module);
  // forward()'s arguments after self, one per line, each "name" or
  // "name=" when it has a default value (release it with free_string).
  char* (*arguments)(void* module);
  // Runs the module's forward() on `inputs`, in forward-argument order,
  // without copying them. Returns a handle that owns the results (the
  // model's tensor, or the tensors of the tuple or list it returns, in
  // order; *outputs points into the handle), or null with *error set.
  void* (*run)(void* module, const QuernTorchTensor* inputs, int n_inputs, const QuernTorchTensor** outputs,
               int* n_outputs, char** error);
  void (*release)(void* result);
  void (*free_string)(char* s);
};

// The plugin's one exported symbol.
const QuernTorchApi* quern_torch_api(void);
typedef const QuernTorchApi* (*QuernTorchApiFn)(void);
}
