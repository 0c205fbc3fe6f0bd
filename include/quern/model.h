// Model configuration as Quern uses it, and the interface for models written
// in C++ and registered in code.
//
// The configuration mirrors Triton's model configuration (config.pbtxt): a
// repository's config files are parsed into this struct, a bare model.onnx is
// described by one derived from the model, and code that registers a custom
// model fills one in directly.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "quern/status.h"
#include "quern/tensor.h"

namespace quern {

struct TensorConfig {
  std::string name;
  DataType dtype = DataType::kFp32;
  // Dimensions without the batch dimension when max_batch_size > 0; -1 means
  // any size.
  Shape dims;
  // Optional: the shape the backend sees (same element count as dims).
  std::optional<Shape> reshape;
  // Inputs only: the request may leave it out.
  bool optional = false;
  // Outputs only: a file of class labels, one per line, beside config.pbtxt.
  std::string label_filename;
};

struct QueuePolicy {
  enum class TimeoutAction { kReject, kDelay };
  TimeoutAction timeout_action = TimeoutAction::kReject;
  // 0 = no timeout.
  uint64_t default_timeout_us = 0;
  // Whether a request's own timeout may shorten default_timeout_us.
  bool allow_timeout_override = false;
  // 0 = unbounded. Counted in requests.
  uint32_t max_queue_size = 0;
};

struct BatchingConfig {
  // Batch sizes that are sent at once when they can be formed.
  std::vector<int> preferred_batch_sizes;
  // How long the oldest request may wait for more to arrive. 0 = send what is
  // queued as soon as an instance is free.
  uint64_t max_queue_delay_us = 0;
  // Responses leave in the order requests arrived.
  bool preserve_ordering = false;
  // Number of priority levels (1 is highest); 0 means a single level.
  uint32_t priority_levels = 0;
  // Level used for requests that give none; must lie in [1, priority_levels].
  // 0 means the lowest level (priority_levels).
  uint32_t default_priority_level = 0;
  QueuePolicy default_queue_policy;
  // Per-level overrides of default_queue_policy.
  std::map<uint32_t, QueuePolicy> priority_queue_policy;
};

struct WarmupInput {
  DataType dtype = DataType::kFp32;
  Shape dims;  // without the batch dimension
  enum class Fill { kZero, kRandom, kFile } fill = Fill::kZero;
  std::string file;  // for kFile: path relative to the model's warmup/ folder
};

struct WarmupSample {
  std::string name;
  uint32_t batch_size = 1;
  uint32_t count = 1;
  std::map<std::string, WarmupInput> inputs;
};

// One step of an ensemble (Triton's ModelEnsembling.Step): a model run on
// tensors of the ensemble, its outputs becoming tensors of the ensemble.
struct EnsembleStep {
  std::string model_name;
  int64_t model_version = -1;  // -1 = the highest ready version
  // The step model's input name -> the ensemble tensor that feeds it.
  std::map<std::string, std::string> input_map;
  // The step model's output name -> the ensemble tensor it becomes.
  std::map<std::string, std::string> output_map;
};

// Where instances of a model run (config.pbtxt's instance_group).
struct InstanceGroup {
  enum class Kind {
    kAuto,  // KIND_AUTO: on GPUs when the backend can use one here, else the CPU
    kCpu,   // KIND_CPU
    kGpu,   // KIND_GPU: `count` instances on each device of `gpus`
  };
  Kind kind = Kind::kAuto;
  int count = 1;
  // CUDA device ordinals; empty = every device CUDA sees. Ignored on the CPU.
  std::vector<int> gpus;
};

// Where one instance runs: the CPU (device -1) or one GPU.
struct InstanceDevice {
  bool gpu = false;
  int device = -1;
};

// Where a decoupled model sends its responses while ExecuteRequests runs
// (the engine's, for one batch). Called on the instance's thread or any
// other, never after ExecuteRequests has returned.
class ResponseSink {
 public:
  virtual ~ResponseSink() = default;
  // One response to request `index` of the batch: its own outputs (no batch
  // rows of others; outputs it did not ask for are dropped), or a failed
  // `status` (outputs ignored), or, with `has_response` false, none.
  // `final` closes the request: nothing is sent for it afterwards (later
  // calls are ignored). A request's non-final responses go to its caller as
  // they come (on this thread, one Send at a time), and may wait a bounded
  // while for a slow reader.
  virtual void Send(size_t index, bool has_response, Status status, std::vector<NamedTensor> outputs, bool final) = 0;
  // Whether request `index`'s caller has gone (cancelled it): the model may
  // stop sending to it.
  virtual bool cancelled(size_t index) const = 0;
  // `wake` (quick, on the cancelling thread) runs each time a request of the
  // batch is cancelled from now until shortly after the run returns (at once
  // for one cancelled already): it must own what it uses (not refer to the
  // run's stack), and only wake the model (never Send: it may run while a
  // Send holds the sink). Once per run.
  virtual void OnCancel(std::function<void()> wake) = 0;
};

struct ModelConfig {
  std::string name;
  std::string platform;  // "onnxruntime_onnx" for ONNX models, "ensemble" for ensembles
  std::string backend;   // "onnxruntime", "python" or "custom"; empty for ensembles
  // 0 = the model does not batch: request shapes are the model's shapes.
  int max_batch_size = 0;
  std::vector<TensorConfig> inputs;
  std::vector<TensorConfig> outputs;
  // Number of instances (each with its own session and worker thread).
  // 0 = automatic: one instance per core, each with one intra-op thread, and
  // (see wide_instance) one more that runs a lone request on every core —
  // the layout follows the load. A number gives exactly that many, the
  // cores divided among them.
  int instance_count = 1;
  // The instance_group entries as written; empty = instance_count CPU
  // instances (or the automatic layout). Once a model is loaded: the groups
  // as placed, each with its kind (CPU or GPU) and devices explicit.
  std::vector<InstanceGroup> instance_groups;
  // Dynamic batching is on when max_batch_size > 0 and this is set.
  std::optional<BatchingConfig> batching;
  // Quern: the model only runs at these batch sizes; smaller batches are
  // padded up to the next size and the padding rows are dropped from the
  // outputs. Empty = any size up to max_batch_size.
  std::vector<int> fixed_batch_sizes;
  // Quern: whether the dynamic batcher tunes its batch size limit under
  // load, to the size with the most items per second
  // (parameter quern.batch_size_tuning "on" / "off"). Unset = on unless
  // preferred_batch_size is given.
  std::optional<bool> batch_size_tuning;
  // Quern: with an automatic layout (instance_count 0), an ONNX model gets
  // one more instance that runs a batch on every core, alone, while the load
  // is light: a lone request gets all cores, concurrent ones an instance
  // each (parameter quern.wide_instance "on" / "off"; unset = on). Models
  // registered in code get none: their instances have no thread setting.
  std::optional<bool> wide_instance;
  // Admission by waiting time (Quern-specific, parameter
  // quern.max_queue_wait_ms): a request is refused with UNAVAILABLE when the
  // work already queued would take longer than this to run. Unset = the
  // engine's default (EngineOptions::max_queue_wait_ms); 0 = no bound.
  std::optional<int64_t> max_queue_wait_ms;
  // A latency target for batching (Quern-specific, parameter
  // quern.latency_target_ms; 0 = none): once the time per item is measured,
  // a batch takes no more requests than it can run before the earliest of
  // their arrival + target, and leaves in time for it (see BatchQueueOptions).
  int64_t latency_target_ms = 0;
  // A budget for the run memory the model's batches hold at once, in MiB
  // (Quern-specific, parameter quern.memory_budget_mb): the batch limit is
  // kept where the measured run memory of a batch, times the instances that
  // run side by side, is expected to fit (see
  // DynamicBatcherOptions::memory_budget_bytes; models with max_batch_size
  // above 1). Unset = the engine's default (EngineOptions::memory_budget_mb);
  // 0 = none.
  std::optional<int64_t> memory_budget_mb;
  // model_transaction_policy { decoupled: true }: the model answers each
  // request with any number of responses, zero included, sent as it goes
  // (BatchRequests::responses), the last marked final. Only callers that
  // take many answers reach it (InferRequest::on_response: gRPC
  // ModelStreamInfer, HTTP generate, a Python model's exec(decoupled=True)).
  bool decoupled = false;
  std::vector<WarmupSample> warmup;
  // The model's folder in the repository (its warmup/ files, its labels), as the repository names
  // it (not a link's target); set when a repository model loads, empty for models made in code.
  std::string model_dir;
  std::map<std::string, std::string> parameters;
  // ONNX graph optimisation level: -1 off, 0 default (all), 1 basic, 2 extended.
  int graph_optimization_level = 0;
  std::string default_model_filename;  // empty = "model.onnx"
  // platform "ensemble": the steps, run by the ensemble scheduler in the
  // order their inputs become ready (no instances, no batcher of its own).
  std::vector<EnsembleStep> ensemble_steps;
  bool is_ensemble() const { return platform == "ensemble"; }

  const TensorConfig* FindInput(const std::string& n) const;
  const TensorConfig* FindOutput(const std::string& n) const;
};

// How the engine stops a running batch whose every request was cancelled
// (their clients left). A backend arms it just before its run with a
// function that makes the run end early (ONNX Runtime's terminate flag) and
// disarms it right after; a run so stopped fails its batch, and the engine
// answers CANCELLED.
class BatchInterrupt {
 public:
  virtual ~BatchInterrupt() = default;
  // `stop` runs at most once, on another thread, while armed, when the last
  // request of the batch is cancelled (before Arm returns when all already
  // are). It must be quick.
  virtual void Arm(std::function<void()> stop) = 0;
  // After the run: `stop` is not running and will not run once this returns.
  virtual void Disarm() = 0;
  // Whether `stop` ran.
  virtual bool stopped() const = 0;
};

// A model implemented in C++. Lifecycle contract: the constructor is cheap;
// Load() does the expensive work once; Execute() is never called
// concurrently on one instance (each instance is its own object, made by the
// factory given at registration) unless the instance says it may be
// (ExecutesConcurrently); different instances run in parallel.
class Model {
 public:
  virtual ~Model() = default;

  // Called once before the first Execute. A non-OK status fails the load.
  virtual Status Load() { return Status::Ok(); }

  // Runs one batch. `inputs` hold every configured input, batched along the
  // first dimension when max_batch_size > 0 (batch_size rows). On success
  // `outputs` must hold the requested outputs with the same number of rows.
  // An error fails every request of this batch; the model keeps serving.
  virtual Status Execute(const std::vector<NamedTensor>& inputs, int64_t batch_size,
                         std::vector<NamedTensor>& outputs) = 0;

  // Runs one batch like Execute, for a model that answers the requests in
  // it separately (a Python model's execute() gets a list of requests):
  // `requests.rows` holds each request's rows in batch order (padding rows,
  // for fixed batch sizes, follow them and belong to none), and the model
  // may fail single requests through `requests.status` (OK on entry) while
  // returning OK with rows for every request. The default runs Execute.
  struct BatchRequests {
    std::span<const int64_t> rows;
    std::span<Status> status;
    // Each request's id (InferRequest metadata "request_id"; "" for none),
    // or empty when the caller has none to give.
    std::span<const std::string_view> ids = {};
    // When set: a backend that can end a run early arms it for the run (see
    // BatchInterrupt), so that a batch whose every request is cancelled
    // stops instead of computing answers nobody waits for.
    BatchInterrupt* interrupt = nullptr;
    // Each request's callers: the models whose runs wait for it, one name a
    // line (InferRequest metadata "quern.callers", set on the requests a
    // model makes of other models; "" for none), or empty when none has any.
    std::span<const std::string_view> callers = {};
    // Decoupled models (ModelConfig::decoupled) only, and always for them:
    // where the model sends each request's responses. Rows, statuses and
    // outputs returned are then not used: a request's outcome is what was
    // sent for it (see ResponseSink); one never closed fails when
    // ExecuteRequests returns (with its error, or INTERNAL).
    ResponseSink* responses = nullptr;
    // Each request's parameters (InferRequest::parameters, a JSON object;
    // "" for none), or empty when no request of the batch has any.
    std::span<const std::string_view> parameters = {};
  };
  virtual Status ExecuteRequests(const std::vector<NamedTensor>& inputs, int64_t batch_size, BatchRequests /*requests*/,
                                 std::vector<NamedTensor>& outputs) {
    return Execute(inputs, batch_size, outputs);
  }

  // Whether Execute/ExecuteRequests may run on this instance from several
  // threads at once (an ONNX Runtime session allows it). The engine then
  // lets a caller that blocks for its answer and finds every instance busy
  // run a short batch at once on one of them, beside its batch, instead of
  // handing it to an engine thread and back. The default: no.
  virtual bool ExecutesConcurrently() const { return false; }

  // Called from another thread, at most once, when the engine stops waiting
  // for this instance (a server past its drain deadline): a backend that
  // can end a running Execute early does so, failing that batch, and fails
  // later ones at once. The only method that may run beside Execute. The
  // default does nothing (the running batch is waited for).
  virtual void Abandon() {}
};

using ModelFactory = std::function<std::unique_ptr<Model>()>;

}  // namespace quern
