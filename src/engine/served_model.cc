#include "engine/served_model.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory_resource>

#include "core/log.h"
#include "core/model_config_parser.h"
#include "engine/batch_assembly.h"
#include "engine/request_validation.h"
#include "engine/warmup.h"

namespace quern {

class ServedModel::Task final : public BatchTask {
 public:
  InferRequest request;
  uint64_t id = 0;
  int64_t items = 1;
  uint64_t key = 0;
  OutputIndices output_indices;  // indices into config outputs
  InferCallback done;
  std::function<void()> on_start;  // SubmitOptions::on_start
  uint64_t ticket = 0;
  Telemetry telemetry;
  int64_t input_ns = 0;     // this request's batch: gathering inputs
  int64_t output_ns = 0;    // this request's batch: splitting outputs
  bool final_only = false;  // a decoupled model closed it without data
  // The token whose cancellation wakes the batcher while this task waits in
  // its queue (so that it leaves the queue at once, not when a batching
  // delay ends); watched from Submit until the task leaves the queue.
  CancellationToken* queued_watch = nullptr;

  ~Task() override { UnwatchQueue(); }
  void WatchQueue(DynamicBatcher* batcher) {
    if (!request.cancel) return;
    queued_watch = request.cancel.get();
    queued_watch->AddOnCancel(this, [batcher] { batcher->Kick(); });
  }
  // Before the task leaves its queue (into a batch, dropped, or refused).
  void UnwatchQueue() {
    if (queued_watch == nullptr) return;
    queued_watch->RemoveOnCancel(this);
    queued_watch = nullptr;
  }

  int64_t size() const override { return items; }
  uint64_t batch_key() const override { return key; }
  bool cancelled() const override { return request.cancel && request.cancel->cancelled(); }
};

namespace {

// Shared runs (see DynamicBatcher) allowed per instance.
constexpr int kSharedRunsPerInstance = 3;

// A caller's thread (SubmitOptions::lend_thread, a lending loop) runs only
// batches measured to take under this, of inputs of at most kLendMaxBytes
// in all (the time per item says nothing of an item far larger than usual).
constexpr int64_t kLendBelowNs = 1'000'000;
constexpr size_t kLendMaxBytes = 64 << 10;

}  // namespace

Result<std::shared_ptr<ServedModel>> ServedModel::Create(ModelConfig config, int64_t version,
                                                         std::vector<std::unique_ptr<Model>> instances,
                                                         const Clock* clock, std::filesystem::path model_dir,
                                                         ServedModelRuns runs) {
  if (instances.empty()) return Err(Internal("model '" + config.name + "' has no instances"));
  std::shared_ptr<ServedModel> m(new ServedModel(std::move(config), version, std::move(instances), clock));
  // Class labels (KServe's classification extension names them): read once,
  // here; a label file that cannot be read fails the load, as a model file would.
  if (!model_dir.empty()) {
    QUERN_ASSIGN_OR_RETURN(m->labels_, ReadOutputLabels(m->config_, model_dir));
  }
  QUERN_RETURN_IF_ERROR(m->Warmup(model_dir));

  DynamicBatcherOptions opts;
  opts.num_workers = static_cast<int>(m->instances_.size());
  opts.wide_worker = runs.wide && opts.num_workers >= 2;
  m->on_caller_threads_ = runs.on_caller_threads;
  // Callers that find every instance busy may share one for short batches
  // when every instance (the wide one aside) allows concurrent runs: up to
  // three such runs per instance, so that at most four run on a core's
  // instance at once (as many blocking callers as that run no slower
  // side by side than queued, and pay no hand-off).
  const int narrow = opts.num_workers - (opts.wide_worker ? 1 : 0);
  bool concurrent = true;
  for (int i = 0; i < narrow; ++i) {
    concurrent = concurrent && m->instances_[static_cast<size_t>(i)]->ExecutesConcurrently();
  }
  opts.shared_runs = concurrent ? kSharedRunsPerInstance * narrow : 0;
  opts.clock = clock;
  const ModelConfig& c = m->config_;
  opts.queue.max_batch_size = std::max(c.max_batch_size, 1);
  opts.max_queue_wait_ns = c.max_queue_wait_ms.value_or(0) * 1'000'000;
  // (A model that does not batch has no limit to keep: its budget would only turn shared runs off.)
  if (c.max_batch_size > 1)
    opts.memory_budget_bytes = std::clamp<int64_t>(c.memory_budget_mb.value_or(0), 0, 1 << 30) << 20;
  opts.run_sizes.assign(c.fixed_batch_sizes.begin(), c.fixed_batch_sizes.end());
  if (c.batching && c.max_batch_size > 0) {
    const BatchingConfig& b = *c.batching;
    opts.queue.preferred_batch_sizes.assign(b.preferred_batch_sizes.begin(), b.preferred_batch_sizes.end());
    opts.queue.max_queue_delay_ns = static_cast<int64_t>(b.max_queue_delay_us) * 1000;
    opts.queue.latency_target_ns = c.latency_target_ms * 1'000'000;
    opts.queue.priority_levels = std::max<uint32_t>(b.priority_levels, 1);
    opts.queue.default_priority_level =
        b.default_priority_level == 0 ? opts.queue.priority_levels : b.default_priority_level;
    for (uint32_t level = 1; level <= opts.queue.priority_levels; ++level) {
      auto it = b.priority_queue_policy.find(level);
      const QueuePolicy& q = it != b.priority_queue_policy.end() ? it->second : b.default_queue_policy;
      opts.queue.level_policies.push_back({q.timeout_action == QueuePolicy::TimeoutAction::kDelay,
                                           static_cast<int64_t>(q.default_timeout_us) * 1000, q.allow_timeout_override,
                                           q.max_queue_size});
    }
    if (c.max_batch_size > 1 && c.batch_size_tuning.value_or(b.preferred_batch_sizes.empty())) {
      BatchSizeTunerOptions t;
      if (!c.fixed_batch_sizes.empty()) {
        t.candidates.assign(c.fixed_batch_sizes.begin(), c.fixed_batch_sizes.end());
      } else {
        for (int64_t s = 1; s < c.max_batch_size; s *= 2) t.candidates.push_back(s);
        t.candidates.push_back(c.max_batch_size);
      }
      opts.tuner = std::move(t);
    }
    // With a latency target and a batching delay, whether batches wait out
    // the delay is measured online (BatchDelayTuner).
    if (c.max_batch_size > 1 && c.latency_target_ms > 0 && b.max_queue_delay_us > 0) {
      BatchDelayTunerOptions d;
      d.target_ns = c.latency_target_ms * 1'000'000;
      opts.delay_tuner = d;
    }
  } else if (c.max_batch_size > 0) {
    // No dynamic_batching: every request runs on its own, with up to
    // max_batch_size rows.
    opts.queue.one_task_per_batch = true;
  }
  ServedModel* raw = m.get();
  auto batcher = DynamicBatcher::Create(
      std::move(opts),
      [raw](int worker, std::vector<std::unique_ptr<BatchTask>>&& batch) {
        raw->ExecuteBatch(worker, std::move(batch));
      },
      [raw](std::unique_ptr<BatchTask> task, const Status& status) {
        std::unique_ptr<Task> t(static_cast<Task*>(task.release()));
        t->UnwatchQueue();
        raw->Finish(std::move(t), status, {});
      });
  if (!batcher) return Err(Status(batcher.error().code(), "model '" + c.name + "': " + batcher.error().message()));
  m->batcher_ = std::move(*batcher);
  return m;
}

ServedModel::ServedModel(ModelConfig config, int64_t version, std::vector<std::unique_ptr<Model>> instances,
                         const Clock* clock)
    : config_(std::move(config)),
      version_(version),
      clock_(clock),
      instances_(std::move(instances)),
      ordered_(config_.batching && config_.batching->preserve_ordering) {}

ServedModel::~ServedModel() {
  Shutdown();
}

void ServedModel::Shutdown() {
  if (batcher_) batcher_->Shutdown();
}

bool ServedModel::stopping() const {
  return batcher_ && batcher_->stopping();
}

Status ServedModel::Warmup(const std::filesystem::path& model_dir) {
  for (const WarmupSample& s : config_.warmup) {
    int64_t rows = 0;
    auto inputs = WarmupInputs(config_, s, model_dir, rows);
    if (!inputs) return inputs.error();
    for (auto& instance : instances_) {
      for (uint32_t i = 0; i < s.count; ++i) {
        std::vector<NamedTensor> outputs;
        Status st = instance->Execute(*inputs, rows, outputs);
        if (!st.ok()) {
          return Status(st.code(), "model '" + config_.name + "' warm-up '" + s.name + "' failed: " + st.message());
        }
      }
    }
  }
  return Status::Ok();
}

Status ServedModel::Submit(InferRequest&& request, uint64_t request_id, InferCallback& done,
                           const SubmitOptions& options, bool run_here) {
  in_flight_.fetch_add(1, std::memory_order_relaxed);
  const int64_t in_model = unanswered_.fetch_add(1, std::memory_order_relaxed) + 1;
  auto task = std::make_unique<Task>();
  task->telemetry.queue_start_ns = clock_->NowNs();
  task->id = request_id;
  Status st = ValidateRequest(config_, request, task->items, task->key, task->output_indices);
  task->request = std::move(request);
  if (!st.ok()) return Refuse(*task, std::move(st));
  task->on_start = options.on_start;
  task->ticket = ordered_ ? sequencer_.NextTicket() : 0;
  ScheduleOptions so;
  so.priority = task->request.priority;
  // A client's timeout may be any unsigned 64-bit number: beyond the bound
  // on configured queue timeouts (30 days) it waits that long, so that no
  // deadline computed from it overflows.
  so.timeout_ns = static_cast<int64_t>(std::min(task->request.timeout_us, kMaxQueueTimeoutUs)) * 1000;
  so.deadline_ns = task->request.deadline_ns;
  so.admitted = options.admitted;
  so.in_model = in_model;
  // A lent thread (SubmitOptions::lend_thread) is taken only where its run
  // is short and bounded: a backend that says so, small inputs; the batcher
  // checks the rest. A lending loop's thread (SubmitOptions::loop) likewise,
  // later, for its batches.
  LoopLender* loop = LoopLender::Lending(options.loop);
  if (!run_here && (options.lend_thread || loop != nullptr) && on_caller_threads_) {
    size_t bytes = 0;
    for (const auto& in : task->request.inputs) bytes += in.tensor.byte_size();
    if (bytes <= kLendMaxBytes) {
      so.run_here = options.lend_thread;
      so.run_here_below_ns = kLendBelowNs;
      so.loop_may_run = true;
      so.loop = loop;
    }
  }
  so.run_here = so.run_here || run_here;
  task->done = std::move(done);
  // A cancellation while the task waits wakes the batcher to drop it: the
  // caller hears at once and its place in the queue (max_queue_size) is
  // free again, rather than when the batching delay ends.
  task->WatchQueue(batcher_.get());
  std::unique_ptr<BatchTask> base(task.release());
  st = batcher_->Schedule(base, so);
  if (st.ok()) return st;
  // Schedule left ownership with us: the callback goes back to the caller,
  // and the ticket is given up so that later responses are not held back.
  std::unique_ptr<Task> back(static_cast<Task*>(base.release()));
  back->UnwatchQueue();
  done = std::move(back->done);
  if (batcher_->stopping()) request = std::move(back->request);  // for the version that replaced this one
  if (ordered_) sequencer_.Complete(back->ticket, [] {});
  return Refuse(*back, Status(st.code(), "model '" + config_.name + "': " + st.message()));
}

Status ServedModel::Refuse(const Task& task, Status status) {
  RecordOutcome(task, status);
  unanswered_.fetch_sub(1, std::memory_order_relaxed);
  in_flight_.fetch_sub(1, std::memory_order_release);
  return status;
}

void ServedModel::Abandon() {
  for (auto& instance : instances_) instance->Abandon();
}

void ServedModel::SendQueuedNow() {
  if (batcher_) batcher_->SendQueuedNow();
}

Status ServedModel::CheckAdmission() {
  Status st = batcher_->CheckAdmission();
  if (st.ok()) return st;
  CountRefused(st);  // a request refused at once (it never reaches Submit)
  return Status(st.code(), "model '" + config_.name + "': " + st.message());
}

void ServedModel::CountRefused(const Status& status) {
  Telemetry refused;
  refused.queue_start_ns = clock_->NowNs();
  stats_.RecordRequest(status, refused, 0, 0, refused.queue_start_ns);
}

void ServedModel::RecordOutcome(const Task& task, const Status& status) {
  stats_.RecordRequest(status, task.telemetry, task.input_ns, task.output_ns, clock_->NowNs());
}

void ServedModel::LogFailure(const InferResponse& r) {
  if (!LogEnabled(LogLevel::kWarning)) return;
  int64_t unlogged = 0;
  {
    MutexLock lock(failure_log_mu_);
    const int64_t second = clock_->NowNs() / 1'000'000'000;
    if (second != failure_log_second_) {
      failure_log_second_ = second;
      failures_logged_ = 0;
    }
    if (failures_logged_ == kFailuresLoggedPerSecond) {
      ++failures_unlogged_;
      return;
    }
    ++failures_logged_;
    unlogged = std::exchange(failures_unlogged_, 0);
  }
  // The front end's id when it gave one (metadata "request_id"), else the engine's.
  std::string id = std::to_string(r.request_id);
  for (const auto& [k, v] : r.metadata) {
    if (k == "request_id") id = v;
  }
  std::string message = "request failed: " + r.status.message();
  if (unlogged > 0) message += " (" + std::to_string(unlogged) + " more failures of this model not logged)";
  const std::string version = std::to_string(version_);
  Log(LogLevel::kWarning, message,
      {{"model", config_.name}, {"version", version}, {"request_id", id}, {"code", StatusCodeName(r.status.code())}});
}

void ServedModel::Finish(std::unique_ptr<Task> task, Status status, std::vector<NamedTensor> outputs) {
  InferResponse r;
  r.status = std::move(status);
  r.request_id = task->id;
  r.model = config_.name;
  r.version = version_;
  r.outputs = std::move(outputs);
  r.metadata = std::move(task->request.metadata);
  r.telemetry = task->telemetry;
  r.final_only = task->final_only && r.status.ok();
  r.decoupled = config_.decoupled;
  if (r.status.code() == StatusCode::kCancelled || r.status.code() == StatusCode::kDeadlineExceeded) {
    if (r.status.message().find(config_.name) == std::string::npos) {
      r.status = Status(r.status.code(), "model '" + config_.name + "': " + r.status.message());
    }
  }
  RecordOutcome(*task, r.status);
  switch (r.status.code()) {
    case StatusCode::kOk:
    case StatusCode::kUnavailable:  // refused: the caller is told, nothing is wrong with the model
    case StatusCode::kCancelled:
    case StatusCode::kDeadlineExceeded:
    case StatusCode::kInvalidArgument: break;
    default: LogFailure(r);
  }
  if (ordered_) {
    sequencer_.Complete(task->ticket, [this, r = std::move(r), done = std::move(task->done)]() mutable {
      r.telemetry.response_ns = clock_->NowNs();
      unanswered_.fetch_sub(1, std::memory_order_relaxed);
      done(std::move(r));
      in_flight_.fetch_sub(1, std::memory_order_release);
    });
    return;
  }
  r.telemetry.response_ns = clock_->NowNs();
  unanswered_.fetch_sub(1, std::memory_order_relaxed);
  task->done(std::move(r));
  in_flight_.fetch_sub(1, std::memory_order_release);
}

namespace {

// A batch's BatchInterrupt: counts its requests' cancellations while armed
// and stops the run at the last. A batch with a request that cannot be
// cancelled (no token) is never stopped. `tokens` may name one token more
// than once (requests that share it): each counts once.
class BatchCancelWatch final : public BatchInterrupt {
 public:
  explicit BatchCancelWatch(std::pmr::vector<CancellationToken*>& tokens) : tokens_(tokens) {
    watchable_ = !tokens_.empty() && std::none_of(tokens_.begin(), tokens_.end(), [](auto* t) { return t == nullptr; });
    std::sort(tokens_.begin(), tokens_.end());
    tokens_.erase(std::unique(tokens_.begin(), tokens_.end()), tokens_.end());
  }
  ~BatchCancelWatch() override { Disarm(); }

  bool watchable() const { return watchable_; }

  void Arm(std::function<void()> stop) override {
    if (!watchable_) return;
    {
      std::lock_guard lock(mu_);
      if (armed_) return;  // armed once per run
      stop_ = std::move(stop);
      armed_ = true;
      cancelled_.store(0, std::memory_order_relaxed);
    }
    for (CancellationToken* t : tokens_) t->AddOnCancel(this, [this] { OneCancelled(); });
  }

  void Disarm() override {
    {
      std::lock_guard lock(mu_);
      if (!armed_) return;
      armed_ = false;
    }
    for (CancellationToken* t : tokens_) t->RemoveOnCancel(this);
  }

  bool stopped() const override { return stopped_.load(std::memory_order_acquire); }

 private:
  void OneCancelled() {
    if (cancelled_.fetch_add(1, std::memory_order_acq_rel) + 1 != tokens_.size()) return;
    std::lock_guard lock(mu_);
    if (!armed_ || !stop_) return;
    stopped_.store(true, std::memory_order_release);
    stop_();
  }

  std::pmr::vector<CancellationToken*>& tokens_;  // distinct
  bool watchable_ = false;
  std::mutex mu_;
  std::function<void()> stop_;
  bool armed_ = false;
  std::atomic<size_t> cancelled_{0};
  std::atomic<bool> stopped_{false};
};

// A decoupled model's batch (BatchRequests::responses): each request's
// responses before the last go to its caller as they are sent; the last,
// final one is kept to answer the request when the run returns.
}  // namespace

class ServedModel::BatchResponses final : public ResponseSink {
 public:
  struct Closed {
    bool closed = false;
    bool has_response = false;
    Status status;
    std::vector<NamedTensor> outputs;
  };
  // `requests[i]` and `wanted[i]` (its output indices, into the configuration's outputs): alive
  // while the run is.
  BatchResponses(const ModelConfig& config, int64_t version, std::span<InferRequest* const> requests,
                 std::span<const uint64_t> ids, std::span<const OutputIndices* const> wanted)
      : config_(config), version_(version), requests_(requests), ids_(ids), wanted_(wanted), closed_(requests.size()) {}

  void Send(size_t index, bool has_response, Status status, std::vector<NamedTensor> outputs, bool final) override {
    MutexLock lock(mu_);  // one response at a time, in the order sent
    if (index >= closed_.size() || closed_[index].closed) return;
    if (status.ok()) Keep(index, outputs);
    if (final) {
      closed_[index] = {true, has_response, std::move(status), std::move(outputs)};
      return;
    }
    if (!has_response) return;
    InferRequest& request = *requests_[index];
    InferResponse r;
    r.status = std::move(status);
    r.request_id = ids_[index];
    r.model = config_.name;
    r.version = version_;
    r.outputs = std::move(outputs);
    r.metadata = request.metadata;
    r.decoupled = true;
    if (request.on_response) request.on_response(std::move(r));
  }

  bool cancelled(size_t index) const override {
    return index < requests_.size() && requests_[index]->cancel && requests_[index]->cancel->cancelled();
  }

  void OnCancel(std::function<void()> wake) override {
    {
      MutexLock lock(mu_);
      if (armed_) return;
      armed_ = true;
    }
    wake_ = std::move(wake);  // set before any token can call it; not under the lock (wake may run at once)
    for (InferRequest* r : requests_) {
      if (r->cancel) r->cancel->AddOnCancel(this, [this] { wake_(); });  // (a token twice: replaced)
    }
  }

  // After the run, before the requests are answered (and their tokens let go).
  void Disarm() {
    for (InferRequest* r : requests_) {
      if (r->cancel) r->cancel->RemoveOnCancel(this);
    }
  }

  // What was sent last for request `index`, once closed.
  Closed Take(size_t index) {
    MutexLock lock(mu_);
    return std::move(closed_[index]);
  }

 private:
  // Only the outputs the request asked for, in the order asked.
  void Keep(size_t index, std::vector<NamedTensor>& outputs) const {
    const OutputIndices& wanted = *wanted_[index];
    if (wanted.size() == config_.outputs.size()) {
      bool all = true;
      for (size_t i = 0; i < wanted.size(); ++i) all = all && wanted[i] == static_cast<int>(i);
      if (all) return;
    }
    std::vector<NamedTensor> kept;
    for (int idx : wanted) {
      const std::string& name = config_.outputs[static_cast<size_t>(idx)].name;
      for (NamedTensor& n : outputs) {
        if (n.name == name) kept.push_back(n);
      }
    }
    outputs = std::move(kept);
  }

  const ModelConfig& config_;
  const int64_t version_;
  std::span<InferRequest* const> requests_;
  std::span<const uint64_t> ids_;
  std::span<const OutputIndices* const> wanted_;
  Mutex mu_;
  std::vector<Closed> closed_ QUERN_GUARDED_BY(mu_);
  bool armed_ QUERN_GUARDED_BY(mu_) = false;
  std::function<void()> wake_;  // set once (OnCancel), before any token can call it
};

namespace {

// Outputs come back in configuration order and, when batched, with one row per padded item.
Status CheckBatchOutputs(const ModelConfig& config, const std::vector<NamedTensor>& outputs, int64_t padded) {
  if (outputs.size() != config.outputs.size()) {
    return Internal("model '" + config.name + "' returned " + std::to_string(outputs.size()) + " outputs, expected " +
                    std::to_string(config.outputs.size()));
  }
  for (const NamedTensor& out : outputs) {
    const Shape& s = out.tensor.shape();
    if (config.max_batch_size > 0 && (s.empty() || s[0] != padded)) {
      return Internal("model '" + config.name + "' output '" + out.name + "' has shape " + ShapeToString(s) +
                      ", expected " + std::to_string(padded) + " rows (the batch size)");
    }
  }
  return Status::Ok();
}

}  // namespace

void ServedModel::AnswerDecoupled(BatchResponses& responses, std::span<std::unique_ptr<Task>> tasks, const Status& st,
                                  std::span<const Status> per_status, const BatchTimes& times) {
  stats_.RecordBatch(times.items, times.start, times.gathered, times.end, times.end, clock_->WallMs());
  for (size_t k = 0; k < tasks.size(); ++k) {
    BatchResponses::Closed last = responses.Take(k);
    Status status = std::move(last.status);
    if (!last.closed) {
      status = !st.ok()              ? st
               : !per_status[k].ok() ? per_status[k]
                                     : Internal("model '" + config_.name +
                                                "' returned from its run without closing "
                                                "request " +
                                                std::to_string(k) + " of the batch (no final response)");
      last.outputs.clear();
    }
    Stamp(*tasks[k], times);
    tasks[k]->final_only = last.closed && !last.has_response;
    Finish(std::move(tasks[k]), std::move(status), std::move(last.outputs));
  }
}

void ServedModel::Stamp(Task& task, const BatchTimes& times) {
  Telemetry& t = task.telemetry;
  t.compute_start_ns = times.start;
  t.compute_end_ns = times.end;
  t.batch_size = times.items;
  t.padded_batch_size = times.padded;
  task.input_ns = times.gathered - times.start;
  task.output_ns = times.split_end - times.end;
}

void ServedModel::ExecuteBatch(int worker, std::vector<std::unique_ptr<BatchTask>>&& batch) {
  // The batch's bookkeeping lives on the stack for batches of a few
  // requests (no allocation per batch for it), on the heap beyond.
  alignas(std::max_align_t) std::byte scratch[2048];
  std::pmr::monotonic_buffer_resource arena(scratch, sizeof(scratch));
  std::pmr::vector<std::unique_ptr<Task>> tasks(&arena);
  tasks.reserve(batch.size());
  int64_t items = 0;
  for (auto& b : batch) {
    tasks.emplace_back(static_cast<Task*>(b.release()));
    tasks.back()->UnwatchQueue();
    items += tasks.back()->items;
  }
  const bool batched = config_.max_batch_size > 0;
  const int64_t padded = batched ? PaddedBatchSize(config_.fixed_batch_sizes, items) : items;
  for (const auto& task : tasks) {
    if (task->on_start) task->on_start();
  }
  const int64_t start = clock_->NowNs();

  std::vector<NamedTensor> inputs;
  inputs.reserve(config_.inputs.size());
  std::pmr::vector<const Tensor*> parts(tasks.size(), &arena);
  for (const TensorConfig& tc : config_.inputs) {
    for (size_t i = 0; i < tasks.size(); ++i) {
      const NamedTensor* nt = FindTensor(tasks[i]->request.inputs, tc.name);
      parts[i] = nt ? &nt->tensor : nullptr;
    }
    if (!parts[0]) continue;  // optional input absent (same for the whole batch: part of the key)
    // A request that runs alone is passed on as it is, unless its data is
    // not aligned for its type (binary tensors are views into a request
    // body at any offset): the batch copy aligns it; a model that does not
    // batch gets the tensor copied whole (it has no rows to gather).
    const bool aligned =
        reinterpret_cast<uintptr_t>(parts[0]->data()) % std::max<size_t>(DataTypeByteSize(tc.dtype), 1) == 0;
    // A lone request's tensor is moved (not copied): the request needs
    // its inputs no more.
    Tensor t = (tasks.size() == 1 && padded == items && aligned) ? std::move(*const_cast<Tensor*>(parts[0]))
               : batched ? ConcatenateRows(std::span<const Tensor* const>(parts), padded)
                         : CopyTensor(*parts[0]);
    if (tc.reshape) {
      Shape r = *tc.reshape;
      if (batched) r.insert(r.begin(), padded);
      t = t.Reshaped(std::move(r));
    }
    inputs.push_back({tc.name, std::move(t)});
  }

  const int64_t gathered = clock_->NowNs();
  std::vector<NamedTensor> outputs;
  std::pmr::vector<int64_t> rows(tasks.size(), &arena);
  for (size_t i = 0; i < tasks.size(); ++i) rows[i] = tasks[i]->items;
  std::pmr::vector<Status> per_status(tasks.size(), &arena);
  std::pmr::vector<std::string_view> ids(tasks.size(), &arena);
  std::pmr::vector<std::string_view> callers(tasks.size(), &arena);
  std::pmr::vector<std::string_view> parameters(tasks.size(), &arena);
  bool called = false;
  bool parameterised = false;
  for (size_t i = 0; i < tasks.size(); ++i) {
    parameters[i] = tasks[i]->request.parameters;
    parameterised |= !parameters[i].empty();
    for (const auto& [k, v] : tasks[i]->request.metadata) {
      if (k == "request_id") {
        ids[i] = v;
      } else if (k == "quern.callers") {
        callers[i] = v;
        called = true;
      }
    }
  }
  std::pmr::vector<CancellationToken*> tokens(tasks.size(), &arena);
  for (size_t i = 0; i < tasks.size(); ++i) tokens[i] = tasks[i]->request.cancel.get();
  BatchCancelWatch watch(tokens);
  std::optional<BatchResponses> responses;  // a decoupled model's
  std::pmr::vector<InferRequest*> requests(&arena);
  std::pmr::vector<uint64_t> request_ids(&arena);
  std::pmr::vector<const OutputIndices*> wanted(&arena);
  if (config_.decoupled) {
    for (const auto& task : tasks) {
      requests.push_back(&task->request);
      request_ids.push_back(task->id);
      wanted.push_back(&task->output_indices);
    }
    responses.emplace(config_, version_, requests, request_ids, wanted);
  }
  Status st = instances_[static_cast<size_t>(worker)]->ExecuteRequests(
      inputs, padded,
      {rows, per_status, ids, watch.watchable() ? &watch : nullptr,
       called ? std::span<const std::string_view>(callers) : std::span<const std::string_view>(),
       responses ? &*responses : nullptr,
       parameterised ? std::span<const std::string_view>(parameters) : std::span<const std::string_view>()},
      outputs);
  if (responses) responses->Disarm();  // wake no more: the model's run is over
  watch.Disarm();                      // before the requests (and their tokens) are answered and let go
  if (watch.stopped()) {
    st = Cancelled("model '" + config_.name + "': every request of the batch was cancelled; its run was stopped");
  }
  const int64_t end = clock_->NowNs();
  inputs.clear();
  if (responses) {
    return AnswerDecoupled(*responses, tasks, st, per_status, {items, padded, start, gathered, end, end});
  }

  if (st.ok()) st = CheckBatchOutputs(config_, outputs, padded);

  // Split the outputs for every request first, then answer them: the split
  // time is measured per batch (compute_output).
  std::pmr::vector<std::vector<NamedTensor>> per_task(tasks.size(), &arena);
  if (!st.ok()) std::fill(per_status.begin(), per_status.end(), st);
  int64_t row = 0;
  for (size_t k = 0; st.ok() && k < tasks.size(); ++k) {
    const Task& task = *tasks[k];
    if (!per_status[k].ok()) {
      row += task.items;
      continue;
    }
    per_task[k].reserve(task.output_indices.size());
    for (int idx : task.output_indices) {
      NamedTensor& out = outputs[static_cast<size_t>(idx)];
      const TensorConfig& oc = config_.outputs[static_cast<size_t>(idx)];
      // A lone request owns every row of the outputs it asked for (each
      // once): they move to it whole.
      const bool whole = tasks.size() == 1 && padded == items;
      const bool again = whole && std::count(task.output_indices.begin(), task.output_indices.end(), idx) > 1;
      Tensor t = whole && !again ? std::move(out.tensor) : out.tensor;
      if (batched && !whole) {
        auto sliced = SliceRows(out.tensor, row, task.items);
        if (!sliced) {
          per_status[k] = sliced.error();
          break;
        }
        t = std::move(*sliced);
      }
      if (oc.reshape && ElementCount(oc.dims) >= 0) {
        Shape shape = oc.dims;
        if (batched) shape.insert(shape.begin(), task.items);
        t = t.Reshaped(std::move(shape));
      }
      per_task[k].push_back({out.name, std::move(t)});
    }
    row += task.items;
  }
  const int64_t split_end = clock_->NowNs();
  stats_.RecordBatch(items, start, gathered, end, split_end, clock_->WallMs());
  const BatchTimes times{items, padded, start, gathered, end, split_end};
  for (size_t k = 0; k < tasks.size(); ++k) {
    Stamp(*tasks[k], times);
    Finish(std::move(tasks[k]), per_status[k], std::move(per_task[k]));
  }
}

ModelStatistics ServedModel::Statistics() const {
  ModelStatistics s = stats_.Snapshot();
  s.name = config_.name;
  s.version = version_;
  s.pending = batcher_ ? batcher_->queued() : 0;
  s.batch_limit = batcher_ && config_.max_batch_size > 0 ? batcher_->batch_limit() : 0;
  s.batch_memory_bytes = batcher_ ? batcher_->batch_memory_bytes() : 0;
  if (batcher_) {
    s.engine_batches = static_cast<uint64_t>(batcher_->worker_batches());
    s.caller_batches = static_cast<uint64_t>(batcher_->caller_batches());
    s.loop_batches = static_cast<uint64_t>(batcher_->lent_batches());
    s.shared_batches = static_cast<uint64_t>(batcher_->shared_batches());
  }
  if (auto leave = batcher_ ? batcher_->batch_leave() : std::nullopt) {
    switch (*leave) {
      case BatchLeave::kAtOnce: s.batch_leave = "at_once"; break;
      case BatchLeave::kEveryoneHere: s.batch_leave = "everyone_here"; break;
      case BatchLeave::kAfterDelay: s.batch_leave = "after_delay"; break;
    }
  }
  return s;
}

std::shared_ptr<const std::vector<std::string>> ServedModel::OutputLabels(const std::string& output) const {
  return FindOutputLabels(labels_, output);
}

}  // namespace quern
