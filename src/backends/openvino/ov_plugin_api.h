// The C interface between Quern and its OpenVINO plugin
// (libquern_openvino.so). The plugin is loaded with dlopen when the first
// OpenVINO model loads, so that OpenVINO (its runtime, CPU plugin and TBB,
// about 100 MB of libraries) stays out of every process that serves none
// and out of the packages that do not ship it. Plain C: nothing of Quern's
// C++ types crosses it, and the plugin needs none of Quern's code.
//
// Thread safety: compile, ports, property and new_request may be called
// from any thread; one request runs one inference at a time (run, then
// output), and cancel may be called from another thread while it runs.
// release_memory only while none of the model's requests is between run and
// its last output.
#pragma once

#include <stddef.h>
#include <stdint.h>

extern "C" {

#define QUERN_OV_PLUGIN_ABI 3

// A tensor's bytes, dense and row-major; dtype is quern::DataType's value.
struct QuernOvTensor {
  uint8_t dtype;
  int32_t rank;  // at most 8
  int64_t dims[8];
  void* data;
  size_t bytes;
};

// A model's input or output as compiled: -1 for a dynamic dimension, rank
// -1 for a dynamic rank, -2 for a rank over 8; dtype 0 for a type Quern has
// no name for.
struct QuernOvPort {
  const char* name;
  uint8_t dtype;
  int32_t rank;
  int64_t dims[8];
};

struct QuernOvApi {
  uint32_t abi;  // QUERN_OV_PLUGIN_ABI
  // OpenVINO's version, "2026.4.1-...".
  const char* version;
  // Reads `path` (an ONNX file or OpenVINO IR's .xml beside its .bin). With
  // batch_dynamic, the first dimension of every input is made dynamic (the
  // batch). Null on failure, with *error set.
  void* (*read)(const char* path, int batch_dynamic, char** error);
  void (*release_read)(void* read);
  // Compiles what `read` read for the CPU with `n` properties, OpenVINO's
  // names and values as strings ("PERFORMANCE_HINT" = "LATENCY",
  // "NUM_STREAMS" = "2", ...). Compiles of one read share its weights where
  // they keep them as read. The read may be released afterwards. Null on
  // failure, with *error set.
  void* (*compile)(void* read, const char* const* keys, const char* const* values, int n, char** error);
  void (*release_model)(void* model);
  // The compiled model's inputs (outputs = 0) or outputs (1): their count,
  // *ports pointing at them for as long as the model lives.
  int (*ports)(void* model, int outputs, const QuernOvPort** ports);
  // A property of the compiled model as a string, or null when it has none
  // (release it with free_string).
  char* (*property)(void* model, const char* key);
  // An infer request of the compiled model (requests share its weights).
  void* (*new_request)(void* model, char** error);
  void (*release_request)(void* request);
  // Runs one inference on `n` inputs given by name, every input of the
  // model (their bytes are read, not copied, and must live until run
  // returns; `bytes` must match the shape). 0 on success; -1 with *error
  // set; 1 when cancel ended it.
  int (*run)(void* request, const char* const* names, const QuernOvTensor* inputs, int n, char** error);
  // Output `index` of the last run: its bytes stay valid until the next run
  // on this request or its release.
  int (*output)(void* request, int index, QuernOvTensor* out, char** error);
  // Ends a running inference early (from another thread); no-op otherwise.
  void (*cancel)(void* request);
  void (*free_string)(char* s);
  // Reads `path` (ONNX or IR) and writes it as OpenVINO IR: `xml_path` and
  // the .bin beside it, the weights as f16 when compress_f16 (OpenVINO's
  // save_model). 0 on success, -1 with *error set.
  int (*save_ir)(const char* path, const char* xml_path, int compress_f16, char** error);
  // Frees what the compiled model's runs keep between runs (its streams'
  // intermediate buffers and scratch: OpenVINO's release_memory); the next
  // run allocates them again. The caller makes sure none of its requests
  // runs meanwhile. 0 on success, -1 with *error set.
  int (*release_memory)(void* model, char** error);
};

// The plugin's one exported symbol.
const QuernOvApi* quern_openvino_api(void);
typedef const QuernOvApi* (*QuernOvApiFn)(void);
}
