// quern::Engine: the in-process API. Front ends (HTTP, gRPC, jobs) and
// embedding applications submit InferRequests here and receive exactly one
// InferResponse per request, through a future, a callback or a CompletionQueue.
//
// Thread safety: every Engine method may be called from any thread.
// Latency: Infer* never blocks on model execution; it validates the request,
// queues it (or rejects it at once when the queue is full) and returns.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "quern/clock.h"
#include "quern/model.h"
#include "quern/status.h"
#include "quern/tensor.h"

namespace quern {

// Set by the caller to withdraw a request. A request that has not started to
// run is removed from its queue and completes with CANCELLED; one already in a
// running batch completes normally.
class CancellationToken {
 public:
  // Marks the request cancelled; the first call runs the functions added by
  // AddOnCancel. Thread-safe.
  void Cancel() {
    if (cancelled_.exchange(true, std::memory_order_acq_rel)) return;
    std::lock_guard lock(mu_);
    for (auto& [key, f] : on_cancel_) f();
  }
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

  // For the engine, while a batch holding the request runs (a token may be
  // in several at once: an ensemble's steps, a request's face crops): `f`
  // runs once when the request is cancelled (at once when it already is),
  // on the cancelling thread; it must be quick. `key` names it for
  // RemoveOnCancel; adding a key again replaces its function.
  void AddOnCancel(const void* key, std::function<void()> f) {
    std::lock_guard lock(mu_);
    if (cancelled()) {
      f();
      return;
    }
    for (auto& [k, g] : on_cancel_) {
      if (k == key) {
        g = std::move(f);
        return;
      }
    }
    on_cancel_.emplace_back(key, std::move(f));
  }
  // The function added under `key` is not running and will not run once
  // this returns.
  void RemoveOnCancel(const void* key) {
    std::lock_guard lock(mu_);
    // Keys are unique, and the order the functions run in is none: the last
    // moves into the removed one's place (a token shared by thousands of
    // queued tasks, an ensemble's chunks, pays no shifting per removal).
    for (auto& e : on_cancel_) {
      if (e.first == key) {
        e = std::move(on_cancel_.back());
        on_cancel_.pop_back();
        return;
      }
    }
  }

 private:
  std::atomic<bool> cancelled_{false};
  std::mutex mu_;
  std::vector<std::pair<const void*, std::function<void()>>> on_cancel_;
};

struct InferResponse;

// The most bytes of InferRequest::parameters a front end accepts.
inline constexpr size_t kMaxRequestParametersBytes = 64 * 1024;

struct InferRequest {
  std::string model;
  int64_t version = -1;  // -1 = the highest ready version
  // Batched models: every input has the batch dimension first, and all inputs
  // agree on it (the request's item count).
  std::vector<NamedTensor> inputs;
  // Names of outputs to return; empty = all outputs.
  std::vector<std::string> requested_outputs;
  // 1 is the highest priority; 0 = the model's default level.
  uint32_t priority = 0;
  // Queue timeout in microseconds; 0 = the model's default. May only
  // shorten the model's default timeout (see QueuePolicy).
  uint64_t timeout_us = 0;
  // Absolute deadline on the engine's clock (ns); 0 = none. Always honoured.
  int64_t deadline_ns = 0;
  std::shared_ptr<CancellationToken> cancel;
  // Small caller metadata copied into the response (for correlation). The
  // key "request_id" names the request in the engine's log lines (a request
  // the model failed is logged with it; the engine's own number otherwise).
  std::vector<std::pair<std::string, std::string>> metadata;
  // The caller's own parameters for the model (KServe's parameters
  // extension: a request's "parameters" but those the server reads itself),
  // as a JSON object of bools, numbers and strings; "" = none. A model reads
  // them per request (ModelInstance::BatchRequests::parameters; a Python
  // model's request.parameters()); an ensemble passes them to its steps.
  // The front ends take at most kMaxRequestParametersBytes of them.
  std::string parameters;
  // Decoupled models (ModelConfig::decoupled) answer a request with any
  // number of responses. Each one but the last is handed here as the model
  // sends it, in order, on the model's instance thread: it must not wait
  // long (a slow reader is best held by waiting here a bounded while, which
  // holds the model's next send). The last one, final, goes to the
  // request's callback as usual, InferResponse::final_only when the model
  // closed the request without data. A decoupled model refuses a request
  // without it (INVALID_ARGUMENT: one answer cannot carry its responses);
  // other models never call it.
  std::function<void(InferResponse&&)> on_response;
};

class CallerLoop;

// How a request is submitted (InferAsync), besides the request itself: what
// its caller did already and how the caller's thread may help.
struct SubmitOptions {
  // The caller admitted this request already: it asked CheckAdmission when
  // it took the request and bounds the work it holds itself (the vision
  // pipeline does, for the images it decodes). The queue-waiting bound is
  // not applied a second time, so work admitted upstream is not thrown away
  // downstream; queue sizes, timeouts and deadlines still apply.
  bool admitted = false;
  // Optional: called once, on an engine thread, when the batch holding this
  // request starts to run; never for a request that does not run. Must be
  // quick (it delays the batch).
  std::function<void()> on_start;
  // The submitting thread may run this request's batch itself, inside
  // InferAsync; its callback then runs on that thread before InferAsync
  // returns. A hand-off to an engine thread and back costs two sleeps and
  // wake-ups, more than a small model's run; a front end's thread that can
  // spare a short while lends itself. The engine takes it only for a backend
  // whose run is this process's own bounded compute (ONNX Runtime; a Python
  // model's process or an embedder's code may block), with nothing else
  // running or queued, a free instance other than the wide one, a batch
  // measured to take under a millisecond, and inputs of at most 64 KiB in
  // all (the time per item says nothing of an item far larger than usual).
  // Otherwise the request is handed over as usual.
  bool lend_thread = false;
  // The submitting thread is this event loop's (CallerLoop): the request's
  // batch may wait for the loop to run it, between its events, under the
  // same conditions. Used only when InferAsync is called on the loop's own
  // thread; valid for the call.
  CallerLoop* loop = nullptr;
};

// An event loop's thread that runs the batches of the requests it submits
// (SubmitOptions::loop). On a machine with one usable core, a request handed
// from the loop to an instance's thread and its answer handed back cost each
// batch two sleeps and two wake-ups of threads that share that core, and
// nothing runs in parallel in exchange: the loop runs the batches instead,
// once it has handled every ready event. Made on the loop's thread
// (Engine::NewCallerLoop) and used there only; the models it holds work for
// are handed to their workers when it is destroyed. Only the engine makes
// them.
class CallerLoop {
 public:
  virtual ~CallerLoop() = default;
  // Runs, on this thread, the batches its models would send off now, one per
  // model at most; whether any ran (their answers may now be pending
  // handlers). `*wait_ns`: how long the loop may wait for events before it
  // should call again (-1: until an event).
  virtual bool RunDue(int64_t* wait_ns) = 0;
  // While paused (the loop must answer refusals at once) requests submitted
  // with it go to the models' workers, and the next RunDue hands them what
  // it holds.
  virtual void set_paused(bool paused) = 0;

 private:
  friend class LoopLender;  // the one kind there is
  CallerLoop() = default;
};

// Where the time went, for one request. Timestamps are on the engine clock.
struct Telemetry {
  int64_t batch_size = 0;  // items in the batch this request ran in (without padding)
  int64_t padded_batch_size = 0;
  int64_t queue_start_ns = 0;
  int64_t compute_start_ns = 0;
  int64_t compute_end_ns = 0;
  int64_t response_ns = 0;
  int64_t queue_ns() const { return compute_start_ns > 0 ? compute_start_ns - queue_start_ns : 0; }
  int64_t compute_ns() const { return compute_end_ns - compute_start_ns; }
  int64_t total_ns() const { return response_ns - queue_start_ns; }
};

// One step of an ensemble's request: which model version ran it, and where
// its time went (in that model's queue and batch).
struct StepTelemetry {
  int step = 0;  // index in the ensemble's ensemble_steps
  std::string model;
  int64_t version = 0;
  Telemetry telemetry;
};

struct InferResponse {
  Status status;
  uint64_t request_id = 0;
  std::string model;
  int64_t version = 0;
  std::vector<NamedTensor> outputs;
  Telemetry telemetry;
  std::vector<std::pair<std::string, std::string>> metadata;
  // Ensembles: each step that answered, in the order they finished.
  std::vector<StepTelemetry> steps;
  // A decoupled model's last answer to a request that carries no response:
  // the model only said the request was complete (Triton's send(None,
  // TRITONSERVER_RESPONSE_COMPLETE_FINAL)). Status OK, no outputs.
  bool final_only = false;
  // From a decoupled model: one of the responses of its request (on_response)
  // or the last (the callback), as Triton's triton_final_response says.
  bool decoupled = false;

  const Tensor* FindOutput(std::string_view name) const;
};

using InferCallback = std::function<void(InferResponse&&)>;

// A queue of finished responses for callers that poll. Thread-safe.
class CompletionQueue {
 public:
  // The next finished response, or nullopt when none is ready.
  std::optional<InferResponse> TryPoll();
  // Blocks until a response is ready.
  InferResponse Wait();
  size_t size() const;

  void Push(InferResponse&& response);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<InferResponse> ready_;
};

enum class ModelState { kLoading, kReady, kUnavailable };
std::string_view ModelStateName(ModelState state);

struct ModelStatus {
  std::string name;
  int64_t version = 0;
  ModelState state = ModelState::kLoading;
  std::string reason;  // why it is unavailable
  ModelConfig config;  // the configuration in force (parsed or derived)
};

// Cumulative counters of one model version, in Triton's statistics terms.
struct DurationStat {
  uint64_t count = 0;
  uint64_t ns = 0;
};
// A cumulative histogram with fixed upper bounds (Prometheus semantics:
// counts[i] = observations <= bounds[i]; the last count is +Inf).
struct Histogram {
  std::vector<double> bounds;
  std::vector<uint64_t> counts;  // bounds.size() + 1, cumulative
  double sum = 0;
  uint64_t count = 0;

  explicit Histogram(std::vector<double> b = {}) : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}
  void Observe(double v) {
    for (size_t i = 0; i < bounds.size(); ++i) {
      if (v <= bounds[i]) ++counts[i];
    }
    ++counts.back();
    sum += v;
    ++count;
  }
};

struct BatchSizeStats {
  int64_t batch_size = 0;
  DurationStat compute_input, compute_infer, compute_output;
};
struct ModelStatistics {
  std::string name;
  int64_t version = 0;
  uint64_t last_inference_ms = 0;  // wall-clock ms since the epoch; 0 = never
  uint64_t inference_count = 0;    // items (rows) computed, without padding
  uint64_t execution_count = 0;    // batches run
  DurationStat success;            // requests answered OK: count and total time in the engine
  DurationStat fail;               // requests that failed, any reason
  DurationStat queue;              // time requests waited before their batch started
  DurationStat compute_input;      // gathering a batch's inputs (per request)
  DurationStat compute_infer;      // running the model (per request)
  DurationStat compute_output;     // splitting outputs (per request)
  // Failures by reason: rejected (queue full / unavailable), cancelled,
  // timeout (deadline exceeded), invalid (bad input), backend (model error).
  uint64_t fail_rejected = 0, fail_cancelled = 0, fail_timeout = 0, fail_invalid = 0, fail_backend = 0;
  uint64_t pending = 0;  // requests queued now
  // Largest batch formed now: max_batch_size, or less where the batch size
  // tuner found a smaller batch faster or the memory budget holds it (0 =
  // the model does not batch).
  int64_t batch_limit = 0;
  // The run memory a batch at batch_limit is expected to hold, in bytes, as
  // measured on the batches run (the large buffers their runs take from
  // Quern's allocator: ONNX Runtime's; see the memory budget,
  // ModelConfig::memory_budget_mb); 0 before a batch ran, or where runs take
  // none.
  int64_t batch_memory_bytes = 0;
  // With a latency target and a batching delay, how batches that could take
  // more requests leave, as measured online: "at_once", "everyone_here" or
  // "after_delay" (empty: the model has no such choice).
  std::string batch_leave;
  // Where the batches ran, counted as they start: on the engine's own
  // threads, on the submitting thread (a front end's thread lent for a
  // short batch, a blocking caller), on an event loop's thread between its
  // events, on a caller's thread beside a busy instance.
  uint64_t engine_batches = 0, caller_batches = 0, loop_batches = 0, shared_batches = 0;
  // Distributions, in microseconds (durations) and items (batch size).
  Histogram request_us{{100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 500000, 1000000}};
  Histogram queue_us{{10, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 50000, 100000, 500000, 1000000}};
  Histogram compute_input_us{{10, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 50000}};
  Histogram compute_infer_us{{100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 500000, 1000000}};
  Histogram compute_output_us{{10, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 50000}};
  Histogram batch_size{{1, 2, 4, 8, 16, 32, 64, 128}};
  std::vector<BatchSizeStats> batch_stats;  // by batch size, ascending
};

// What EngineOptions::compare_answers found: whether a candidate runtime's answers mean what the
// reference's do, and in words what was compared ("its 3 boxes ...") or what differs.
struct AnswerAgreement {
  bool agree = true;
  std::string detail;
};

struct EngineOptions {
  // Triton-style model repository; empty = no repository (models registered in code).
  std::string model_repository;
  // Seconds between repository scans that reload changed models; 0 = no polling.
  double repository_poll_interval_s = 0;
  // Load every model of the repository at Create (else only on LoadModel).
  bool load_all_models = true;
  // Every file a model reads must lie inside the repository (symbolic links
  // resolved); with this set, a model folder may be a symbolic link to a
  // folder elsewhere, whose files must then lie inside it.
  bool allow_links_outside_repository = false;
  // Admission by waiting time for models that do not set
  // quern.max_queue_wait_ms: a request is refused with UNAVAILABLE when the
  // work already queued for its model would take longer than this to run
  // (estimated from measured batch times). 0 = queues are not bounded by
  // time.
  int64_t max_queue_wait_ms = 0;
  // The run memory budget, in MiB, of models that do not set
  // quern.memory_budget_mb (ModelConfig::memory_budget_mb); 0 = none.
  int64_t memory_budget_mb = 0;
  // Cores the engine may use in total; 0 = UsableCores() (the affinity mask
  // and cgroup CPU quota of the process, not every CPU of the host).
  // Default thread counts divide these among instances so they do not
  // oversubscribe the machine.
  int cores = 0;
  // Time source for queue delays, timeouts and telemetry; null = real clock.
  const Clock* clock = nullptr;
  // An extra check every repository model version must pass before it
  // serves (e.g. its vision parameters and label files), called with the
  // loaded version's status and the model's folder; an error fails that
  // version's load with the error's message. Null = none.
  std::function<Status(const ModelStatus& status, const std::string& model_dir)> check_model;
  // How backend "auto" compares another runtime's answers to ONNX Runtime's on the check input
  // beyond their numbers (e.g. a detector's boxes: `quern serve` compares a vision model's so):
  // called with the candidate's configuration, the model's folder and both runtimes' outputs for
  // the check input; a candidate whose answers disagree is left out. Null = the numbers only.
  std::function<AnswerAgreement(const ModelConfig& config, const std::filesystem::path& model_dir,
                                const std::vector<NamedTensor>& reference, const std::vector<NamedTensor>& candidate)>
      compare_answers;
  // Where backend "auto" (an ONNX model whose configuration names no
  // backend) keeps the runtime it measured fastest for each model file, so
  // that a restart does not measure again: one small file per model file
  // and machine. "" = measured at every load.
  std::string runtime_cache_dir;
  // False: backend "auto" opens ONNX Runtime without measuring (a command
  // that only lists or tries models, such as `quern models`).
  bool measure_runtimes = true;
};

class ModelRegistry;

// Quern's version ("0.1.0"), as the library linked in reports it.
const char* Version();

class Engine {
 public:
  // Opens the repository and loads its models, with the backends this build
  // has (ONNX Runtime, PyTorch, Python, the OCR stages; defined where they
  // are, so a program that calls Create links them). A model that fails to
  // load is reported by ListModels with its error and does not fail Create;
  // a missing repository does.
  static Result<std::unique_ptr<Engine>> Create(EngineOptions options);
  // A loop for the calling thread (see CallerLoop).
  static std::unique_ptr<CallerLoop> NewCallerLoop();
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Submits a request; its future holds exactly one response. Every error
  // (unknown model, bad input, queue full, timeout, cancellation, backend
  // failure) is a response with a non-OK status, never an exception.
  std::future<InferResponse> Infer(InferRequest request, const SubmitOptions& options = {});

  // Runs a request and returns its response, blocking the calling thread
  // (errors as with Infer). When an instance of the model is free and the
  // request's batch would leave now, the batch runs on this thread, so a
  // caller that would only wait pays no hand-off to an engine thread and
  // back. When every instance is busy and the model's batches are short
  // (under 0.25 ms per item) on a backend whose instances may run batches
  // concurrently (ONNX Runtime), it runs at once beside one of them, up to
  // three such runs per instance; otherwise the request is queued and
  // batched as any other. For threads that would wait at once anyway; one
  // that must not block uses Infer or InferAsync.
  InferResponse Run(InferRequest request);

  // Submits a request without waiting, in two steps, as a batch scheduler
  // takes a task. Admission is synchronous: a request refused at submission
  // (unknown or unready model, invalid input, queue full, model stopping)
  // returns the refusal, and `done` is left with the caller, untouched,
  // never to run. A request taken returns OK, `done` is moved out, and it
  // runs exactly once, on an engine thread, with the response (which may
  // still carry a timeout, a cancellation or a backend failure); with
  // SubmitOptions::lend_thread it may instead run on the calling
  // thread, before InferAsync returns. `done` must not block for long.
  Status InferAsync(InferRequest request, InferCallback& done, const SubmitOptions& options = {});
  // The same with a completion queue: the request id, and the response,
  // carrying it, is pushed to `queue` (which must outlive the request); a
  // refusal is returned and nothing is pushed.
  Result<uint64_t> InferAsync(InferRequest request, CompletionQueue* queue);

  // Admission alone, before a request exists: UNAVAILABLE when a request
  // for `name` (and `version`, -1 = the latest ready) would be refused now
  // because its model's queue is full; OK otherwise, including for unknown
  // or unready models (Infer reports those). Lets a front end refuse a
  // request before reading its body. A refusal counts as a rejected request
  // in the model's statistics.
  Status CheckAdmission(const std::string& name, int64_t version = -1) const;
  // Counts a request for `name` (`version`, -1 = the latest ready) that the
  // caller refused on its own grounds (`status`, e.g. UNAVAILABLE for a
  // front end's own capacity) in the model's statistics, as a refusal of
  // CheckAdmission is counted. Unknown or unready models: nothing.
  void CountRefused(const std::string& name, int64_t version, const Status& status) const;
  // Whether `request` fits its model, without running it: its model and
  // version serve (NOT_FOUND / UNAVAILABLE otherwise) and it fits the
  // model's inputs and outputs (INVALID_ARGUMENT naming the tensor), as
  // InferAsync checks before it queues (admission aside: CheckAdmission).
  Status Validate(const InferRequest& request) const;

  // Registers a model implemented in C++. `config` describes its inputs,
  // outputs, batching and instance count; `factory` makes one Model per
  // instance. Replaces a registered model of the same name.
  Status RegisterModel(ModelConfig config, ModelFactory factory);

  // Loads (or reloads) a repository model; in-flight requests of a previous
  // version finish on it. Unload drains the model's queue, then removes it.
  Status LoadModel(const std::string& name);
  Status UnloadModel(const std::string& name);
  // Rescans the repository now: loads new models, reloads changed ones and
  // unloads removed ones (what polling does periodically).
  Status PollRepository();

  std::vector<ModelStatus> ListModels() const;
  Result<ModelStatus> GetModel(const std::string& name, int64_t version = -1) const;
  // A number that changes whenever what ListModels and GetModel answer may
  // have (a model loading, loaded, failed, reloaded, unloaded): what a
  // caller derived from them while it reads the same number is current,
  // without copying a configuration again. Thread-safe, lock-free.
  uint64_t ModelsGeneration() const;
  // The class labels of an output of a ready model version (from the
  // output's label_filename, read when the version loaded); null when the
  // output has none or the model is not ready.
  std::shared_ptr<const std::vector<std::string>> OutputLabels(const std::string& name, int64_t version,
                                                               const std::string& output) const;
  bool ModelReady(const std::string& name, int64_t version = -1) const;
  // Server readiness (HTTP /v2/health/ready, gRPC ServerReady and health):
  // every loaded or failed model version is ready.
  bool AllModelsReady() const;
  // Ends repository polling (a draining server loads and unloads nothing
  // more): a poll in progress finishes before this returns (its loads and
  // unloads done), and none starts after. Idempotent.
  void StopRepositoryPolling();
  // Requests submitted to the models in service and not yet answered
  // (queued or running, in versions being replaced or unloaded too); 0 once
  // a draining server may stop.
  int64_t InFlight() const;
  // For a draining server: every model's queued requests leave in the next
  // batch an instance can take, without waiting for company (a batching
  // delay, preferred batch sizes), and so do those queued later. Idempotent.
  void SendQueuedNow();
  // For a server past its drain deadline: asks every model's backend to end
  // its running batches and fail the rest at once (Model::Abandon: a Python
  // model's process is killed; ONNX Runtime runs finish), so that stopping
  // the engine does not wait on a batch that never ends.
  void Abandon();

  // Statistics of every loaded version of `name` (every model when empty).
  // NOT_FOUND for an unknown model or version.
  Result<std::vector<ModelStatistics>> GetStatistics(const std::string& name = "", int64_t version = -1) const;

  const Clock& clock() const;

 private:
  friend class EngineFactory;  // makes engines with a given set of backends
  explicit Engine(std::unique_ptr<ModelRegistry> impl);
  std::unique_ptr<ModelRegistry> impl_;
};

}  // namespace quern
