// ONNX Runtime backend: one OrtModel per model instance, each with its own
// Ort::Session or sharing one (Share: instances on one intra-op thread); the
// sessions of a model's instances may share one copy of its weights
// (SharedOnnxWeights). The process shares one Ort::Env.
//
// Lifecycle (the quern::Model contract): the constructor only records what to
// load; Load() creates the session (expensive); Execute() runs one batch,
// also concurrently on one instance (a session's Run is thread-safe). Every
// ONNX Runtime exception is caught here and becomes a Status naming the
// model.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "quern/model.h"
#include "quern/status.h"

namespace quern {

struct OnnxTensorInfo {
  std::string name;
  DataType dtype = DataType::kInvalid;
  Shape shape;  // -1 for dynamic or symbolic dimensions
};

struct OnnxModelIO {
  std::vector<OnnxTensorInfo> inputs;
  std::vector<OnnxTensorInfo> outputs;
};

// Session settings, from the model configuration's `parameters`.
struct OrtSessionOptions {
  int intra_op_threads = 1;
  int inter_op_threads = 1;
  // Intra-op threads spin briefly between parallel sections and after a run
  // (ONNX Runtime's spin-then-block), then sleep: an idle server uses no CPU.
  bool allow_spinning = true;
  // Stop spinning the moment a run returns (session.force_spinning_stop):
  // leaves more CPU to other threads at the cost of small-batch throughput.
  bool stop_spinning_after_run = false;
  int graph_optimization_level = 0;  // ModelConfig::graph_optimization_level
  // >= 0: the session runs on this CUDA device (ONNX Runtime's CUDA
  // execution provider; nodes it has no kernel for stay on the CPU).
  int gpu_device = -1;
};

// Reads parameters: "intra_op_thread_count", "inter_op_thread_count",
// "allow_spinning" and "stop_spinning_after_run" (true/false). Thread
// defaults divide `cores` among the instances.
Result<OrtSessionOptions> SessionOptionsFor(const ModelConfig& config, int cores);

// For an instance on GPU `device`: one CPU thread each (for what stays on
// the CPU) unless the parameters say otherwise.
Result<OrtSessionOptions> SessionOptionsForGpu(const ModelConfig& config, int device);

// Why ONNX Runtime cannot run sessions on a GPU here (its CUDA execution
// provider library is not installed beside libonnxruntime), or empty.
std::string OrtWhyNoCuda();

// Returns the runs' kept buffers (OrtRunMemory) and the C library's free
// pages to the system now.
void OrtReturnIdleMemory();

// Default max_batch_size for a bare model.onnx whose first dimension is dynamic.
inline constexpr int kDefaultMaxBatchSize = 16;

// Fills what a configuration leaves out from the model (inputs, outputs,
// types, dims; for a model without config.pbtxt also max_batch_size and
// dynamic batching) and checks what it states against the model.
Status CompleteConfigFromOnnx(ModelConfig& config, const OnnxModelIO& io, bool has_config_file);

class SharedOnnxWeights;

class OrtModel final : public Model {
 public:
  // Loads `file`, or, given `weights`, the model they were read from with
  // the weights shared (`file` then only names the model in messages).
  OrtModel(std::string model_name, std::filesystem::path file, OrtSessionOptions options,
           std::vector<std::string> output_names, std::shared_ptr<const SharedOnnxWeights> weights = nullptr);
  ~OrtModel() override;

  Status Load() override;
  Status Execute(const std::vector<NamedTensor>& inputs, int64_t batch_size,
                 std::vector<NamedTensor>& outputs) override;
  // As Execute; with requests.interrupt, the run ends early (ONNX Runtime's
  // terminate flag, checked between its kernels) once every request of the
  // batch is cancelled.
  Status ExecuteRequests(const std::vector<NamedTensor>& inputs, int64_t batch_size, BatchRequests requests,
                         std::vector<NamedTensor>& outputs) override;

  // A session's Run is thread-safe; concurrent runs are offered only for
  // an instance on one intra-op thread (no pool to share).
  bool ExecutesConcurrently() const override { return options_.intra_op_threads == 1; }

  // Another instance on this one's session (after a successful Load): its
  // runs go beside this one's and every other sharer's (ONNX Runtime's Run
  // is thread-safe; on one intra-op thread each runs on its caller's thread),
  // and the weights, with the forms its kernels packed them into, exist once.
  std::unique_ptr<OrtModel> Share() const;

 private:
  Status Run(const std::vector<NamedTensor>& inputs, std::vector<NamedTensor>& outputs, BatchInterrupt* interrupt);

 public:
  // Valid after a successful Load().
  const OnnxModelIO& io() const { return io_; }

 private:
  struct Session;
  std::string model_name_;
  std::filesystem::path file_;
  OrtSessionOptions options_;
  std::vector<std::string> output_names_;  // empty = every model output
  OnnxModelIO io_;
  std::shared_ptr<const SharedOnnxWeights> weights_;  // outlives session_
  std::shared_ptr<Session> session_;                  // shared by the instances Share() made
};

}  // namespace quern
