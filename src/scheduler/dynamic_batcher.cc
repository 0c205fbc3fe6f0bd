#include "scheduler/dynamic_batcher.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "core/block_cache.h"
#include "core/cpus.h"

namespace quern {

Result<std::unique_ptr<DynamicBatcher>> DynamicBatcher::Create(DynamicBatcherOptions options, BatchProcessor processor,
                                                               DropHandler on_drop) {
  if (options.num_workers < 1) return Err(InvalidArgument("a batcher needs at least one worker"));
  if (options.wide_worker && options.num_workers < 2) {
    return Err(InvalidArgument("a wide worker needs at least one other worker"));
  }
  if (options.max_queue_wait_ns < 0) return Err(InvalidArgument("max_queue_wait_ns must be >= 0"));
  if (options.shared_runs < 0) return Err(InvalidArgument("shared_runs must be >= 0"));
  const bool latency_target = options.queue.latency_target_ns > 0;
  auto queue = BatchQueue::Create(std::move(options.queue));
  if (!queue) return Err(queue.error());
  const Clock* clock = options.clock ? options.clock : &RealClockInstance();
  std::unique_ptr<DynamicBatcher> b(
      new DynamicBatcher(std::move(*queue), clock, std::move(processor), std::move(on_drop)));
  b->num_workers_ = options.num_workers;
  b->worker_cv_ = std::make_unique<CondVar[]>(static_cast<size_t>(options.num_workers));
  b->wide_ = options.wide_worker;
  b->max_queue_wait_ns_ = options.max_queue_wait_ns;
  b->memory_budget_ = std::max<int64_t>(options.memory_budget_bytes, 0);
  b->run_sizes_ = options.run_sizes;
  std::sort(b->run_sizes_.begin(), b->run_sizes_.end());
  b->max_shared_runs_ = b->memory_budget_ > 0 ? 0 : options.shared_runs;
  b->latency_target_ = latency_target;
  {
    MutexLock lock(b->mu_);  // no thread runs yet; taken for the analysis
    b->waits_for_company_ = b->queue_.options().max_queue_delay_ns > 0 ||
                            !b->queue_.options().preferred_batch_sizes.empty() || latency_target ||
                            options.delay_tuner.has_value();
    if (options.tuner) b->tuner_.emplace(std::move(*options.tuner));
    if (b->memory_budget_ > 0) {
      // Until a batch is measured: batches of one, or as many as run at the same padded size.
      int64_t free = 1;
      while (free < b->queue_.options().max_batch_size && b->RunRows(free + 1) == b->RunRows(1)) ++free;
      b->memory_limit_ = free;
      if (b->tuner_) b->tuner_->SetCeiling(free);
    }
    b->ApplyBatchLimitLocked();
  }
  if (options.delay_tuner && latency_target) {
    MutexLock lock(b->mu_);  // no thread runs yet; taken for the analysis
    if (b->queue_.options().max_queue_delay_ns > 0) b->delay_tuner_.emplace(*options.delay_tuner);
  }
  {
    MutexLock lock(b->mu_);
    b->expected_end_ns_.assign(static_cast<size_t>(options.num_workers), 0);
    b->busy_.assign(static_cast<size_t>(options.num_workers), 0);
    b->waiting_.assign(static_cast<size_t>(options.num_workers), 0);
    b->shared_on_.assign(static_cast<size_t>(options.num_workers), 0);
  }
  {
    MutexLock lock(b->lend_slot_->mu);
    b->lend_slot_->batcher = b.get();
  }
  b->workers_.reserve(options.num_workers);
  for (int i = 0; i < options.num_workers; ++i) {
    b->workers_.emplace_back([raw = b.get(), i] {
      NameThisThread("quern-infer");
      raw->WorkerLoop(i);
    });
  }
  b->reaper_ = std::thread([raw = b.get()] {
    NameThisThread("quern-reaper");
    raw->ReaperLoop();
  });
  return b;
}

DynamicBatcher::DynamicBatcher(BatchQueue queue, const Clock* clock, BatchProcessor processor, DropHandler on_drop)
    : clock_(clock), processor_(std::move(processor)), on_drop_(std::move(on_drop)), queue_(std::move(queue)) {}

DynamicBatcher::~DynamicBatcher() {
  Shutdown();
}

Status DynamicBatcher::Schedule(std::unique_ptr<BatchTask>& task, const ScheduleOptions& options) {
  int claimed = -1;
  bool shared = false;
  BatchQueue::Decision here;
  // Dead tasks found by a full queue, answered once the lock is released.
  struct Dead {
    DynamicBatcher* b;
    std::vector<BatchQueue::Dropped> tasks;
    ~Dead() {
      for (auto& d : tasks) b->on_drop_(std::move(d.task), d.status);
    }
  } dead{this, {}};
  {
    MutexLock lock(mu_);
    QUERN_RETURN_IF_ERROR(AdmissionLocked(!options.admitted));
    const int64_t now = clock_->NowNs();
    QUERN_RETURN_IF_ERROR(DeadlineAdmissionLocked(task->size(), options, now));
    if (queue_.empty()) foreign_queued_ = false;
    TrackLoadLocked(now);
    Status queued = queue_.Enqueue(task, options, now);
    if (queued.code() == StatusCode::kUnavailable) {
      // A full queue: tasks cancelled (or past their deadlines) while they
      // waited hold no place in it, whether or not a worker has looked yet.
      queue_.Reap(now, dead.tasks);
      if (!dead.tasks.empty()) queued = queue_.Enqueue(task, options, now);
    }
    QUERN_RETURN_IF_ERROR(queued);
    const double present = options.in_model >= 0
                               ? static_cast<double>(options.in_model)
                               : static_cast<double>(queue_.size()) + static_cast<double>(running_tasks_);
    load_ = 0.75 * load_ + 0.25 * present;  // with the load this arrival leaves
    if (options.run_here && RunsBriefly(options.run_here_below_ns)) {
      // A bounded caller never takes the wide instance: its runs feed no
      // time per item, so nothing would tell the bound it was exceeded.
      claimed = ClaimLocked(/*wide_ok=*/options.run_here_below_ns <= 0);
      if (claimed < 0 && options.run_here_below_ns <= 0) {
        claimed = ShareLocked();
        shared = claimed >= 0;
      }
    }
    if (claimed >= 0) {
      // The queue's own decision, as for a worker: a batching delay or
      // preferred sizes keep the task queued for company.
      here = queue_.Next(now, /*flush=*/SendNowLocked(), /*takers=*/1);
      if (here.batch.empty() && here.dropped.empty()) {
        claimed = -1;
        shared = false;
      } else {
        BeginLocked(claimed, here, now, shared);
        ++callers_running_;
        if (!shared && !here.batch.empty()) ++caller_batches_;
      }
    }
    // A lending loop takes the batch later, on its thread: no worker is woken.
    bool lent = false;
    if (claimed < 0 && options.loop_may_run && LoopMayRunLocked()) {
      if (LoopLender* lender = options.loop; lender != nullptr) {
        // The grace runs from the listing or the loop's last look, not from
        // each arrival: a loop too busy to look (a flood of events) leaves
        // its queue to the workers.
        if (lender->Add(lend_slot_)) {
          ++lenders_;
          lend_until_ns_ = now + kLendGraceNs;
        }
        lent = true;
      }
    }
    // Work from elsewhere is the workers' (they take the loops' with it),
    // and a task no loop may run (a large input, another thread's) keeps
    // the loops out of the queue until it has left.
    if (!lent && lenders_ > 0) lend_until_ns_ = 0;
    if (!options.loop_may_run && (claimed < 0 || !queue_.empty())) foreign_queued_ = true;
    if (claimed < 0 || !queue_.empty()) {
      // Only a worker that may take the queue's work is woken: the wide one
      // while the load is light, else a free one of the others. One that
      // may not take it now is left asleep: the worker that finishes a
      // batch looks at the queue before it waits.
      if (lent) {
        // The loop takes it (the reaper still watches deadlines below).
      } else if (wide_ && MayTake(true)) {
        wide_cv_.Signal();
      } else if (busy_workers_ < narrow_workers() && MayTake(false)) {
        WakeNarrowLocked();
      }
      int64_t due = options.deadline_ns;
      if (options.timeout_ns > 0 && (due == 0 || now + options.timeout_ns < due)) due = now + options.timeout_ns;
      if (!AnyTaker() && ReaperNeedsWake(due, now)) reaper_cv_.Signal();
    }
  }
  if (claimed >= 0) RunHere(claimed, std::move(here), shared, /*tune=*/options.run_here_below_ns <= 0);
  return Status::Ok();
}

bool DynamicBatcher::SendNowLocked() const {
  if (queue_.empty()) return false;
  // After SendQueuedNow, a queue that would wait for company sends at once; one that never waits
  // keeps its way of sharing a backlog among free instances (which a flush would give to one).
  if (send_now_ && waits_for_company_) return true;
  if (!latency_target_) return false;
  if (delay_tuner_) {
    switch (delay_tuner_->leave()) {
      case BatchLeave::kAtOnce: return true;
      case BatchLeave::kAfterDelay: return false;
      case BatchLeave::kEveryoneHere: break;
    }
  }
  return static_cast<int64_t>(queue_.size()) + running_tasks_ >= std::max<int64_t>(1, std::llround(average_load_));
}

void DynamicBatcher::TrackLoadLocked(int64_t now_ns) {
  const int64_t dt = now_ns - load_at_ns_;
  if (dt <= 0) return;
  const double keep = std::exp(-static_cast<double>(dt) / static_cast<double>(kLoadWindowNs));
  const double present = static_cast<double>(queue_.size()) + static_cast<double>(running_tasks_);
  average_load_ = keep * average_load_ + (1 - keep) * present;
  load_at_ns_ = now_ns;
}

void DynamicBatcher::BeginLocked(int worker, const BatchQueue::Decision& d, int64_t now_ns, bool shared) {
  TrackLoadLocked(now_ns);  // dropped tasks leave
  running_tasks_ += static_cast<int64_t>(d.batch.size());
  ++begun_;
  if (shared) {  // beside the instance's own batch, which keeps its state
    ++shared_running_;
    ++shared_on_[static_cast<size_t>(worker)];
    if (!d.batch.empty()) ++shared_batches_;
    return;
  }
  if (wide_ && worker == num_workers_ - 1) {
    wide_running_ = true;
    if (!d.batch.empty()) ++wide_batches_;
  } else {
    busy_[static_cast<size_t>(worker)] = 1;
    ++busy_workers_;
  }
  // Unknown before the first batch: taken as long.
  expected_end_ns_[static_cast<size_t>(worker)] =
      ns_per_item_ > 0 ? now_ns + static_cast<int64_t>(ns_per_item_ * static_cast<double>(d.items)) : INT64_MAX;
}

DynamicBatcher::Ran DynamicBatcher::Process(int worker, std::vector<std::unique_ptr<BatchTask>>&& batch) {
  Ran ran;
  if (batch.empty()) return ran;
  BlockCache::ThreadScope memory;
  const int64_t start = clock_->NowNs();
  processor_(worker, std::move(batch));
  ran.ns = clock_->NowNs() - start;
  ran.bytes = static_cast<int64_t>(memory.peak());
  return ran;
}

void DynamicBatcher::ApplyBatchLimitLocked() {
  int64_t limit = tuner_ ? tuner_->limit() : queue_.options().max_batch_size;
  if (memory_limit_ > 0) limit = std::min(limit, memory_limit_);
  queue_.set_batch_limit(limit);
}

int64_t DynamicBatcher::RunRows(int64_t items) const {
  auto at = std::lower_bound(run_sizes_.begin(), run_sizes_.end(), items);
  return at == run_sizes_.end() ? items : *at;
}

double DynamicBatcher::ExpectedRunBytesLocked(int64_t rows) const {
  // Measured sizes hold at least what smaller ones measured (run_bytes_ keeps them so).
  auto above = run_bytes_.lower_bound(rows);
  if (above != run_bytes_.end() && above->first == rows) return static_cast<double>(above->second);
  if (above == run_bytes_.end()) {  // beyond the largest measured: in proportion (an upper bound)
    const auto& [largest, bytes] = *run_bytes_.rbegin();
    return static_cast<double>(bytes) * static_cast<double>(rows) / static_cast<double>(largest);
  }
  if (above == run_bytes_.begin()) return static_cast<double>(above->second);  // below the smallest: as it
  const auto below = std::prev(above);
  const double f = static_cast<double>(rows - below->first) / static_cast<double>(above->first - below->first);
  return static_cast<double>(below->second) + f * static_cast<double>(above->second - below->second);
}

void DynamicBatcher::NoteRunMemoryLocked(int64_t items, int64_t bytes) {
  const int64_t rows = RunRows(items);
  auto [at, fresh] = run_bytes_.try_emplace(rows, bytes);
  if (!fresh) {
    if (bytes <= at->second) return;  // nothing new
    at->second = bytes;
  } else if (at != run_bytes_.begin()) {
    // A new size holds at least what a smaller one measured (a run that failed early measures little).
    at->second = std::max(at->second, std::prev(at)->second);
  }
  // Larger sizes hold at least as much as this one.
  for (auto it = std::next(at); it != run_bytes_.end(); ++it) it->second = std::max(it->second, at->second);
  if (memory_budget_ == 0) return;  // measured for batch_memory_bytes() only
  // The largest limit whose batches fit: never beyond twice the largest size measured (the next
  // size up is measured before one further), and never below the sizes that run as many rows as a
  // batch of one (a smaller limit would save nothing).
  const int64_t most = std::min(queue_.options().max_batch_size, 2 * run_bytes_.rbegin()->first);
  const double budget = static_cast<double>(memory_budget_) / static_cast<double>(narrow_workers());
  int64_t lo = 1, hi = most;
  while (lo < hi) {  // the estimate grows with the size
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (RunRows(mid) == RunRows(1) || ExpectedRunBytesLocked(RunRows(mid)) <= budget) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  if (lo == memory_limit_) return;
  memory_limit_ = lo;
  if (tuner_) tuner_->SetCeiling(lo);
  ApplyBatchLimitLocked();
}

void DynamicBatcher::EndLocked(int worker, int64_t tasks, const BatchQueue::Decision& d, Ran ran, bool shared,
                               bool tune) {
  const int64_t items = d.items;
  const int64_t ran_ns = ran.ns;
  const bool capped = d.capped;
  const bool wide = wide_ && worker == num_workers_ - 1;
  const int64_t now = clock_->NowNs();
  TrackLoadLocked(now);
  running_tasks_ -= tasks;
  // Every batch counts for the delay tuner: it compares the answers' rate
  // (shared and caller's runs included) under each mode.
  if (delay_tuner_ && items > 0 && !stopping_) delay_tuner_->Observe(now, items, ran_ns, now - d.oldest_enqueue_ns);
  if (items > 0 && !stopping_) NoteRunMemoryLocked(items, ran.bytes);
  if (shared) {  // its time shared the cores: it feeds no estimate
    --shared_running_;
    --shared_on_[static_cast<size_t>(worker)];
    return;
  }
  expected_end_ns_[static_cast<size_t>(worker)] = 0;
  if (wide) {
    wide_running_ = false;
  } else {
    busy_[static_cast<size_t>(worker)] = 0;
    --busy_workers_;
  }
  // The time per item and the batch size tuner describe the instances
  // that share the cores; a wide batch has them all.
  if (items > 0 && ran_ns > 0 && (!wide || ns_per_item_ == 0)) {
    const double sample = static_cast<double>(ran_ns) / static_cast<double>(items);
    ns_per_item_ = ns_per_item_ == 0 ? sample : 0.9 * ns_per_item_ + 0.1 * sample;
    queue_.set_run_ns_per_item(ns_per_item_);
    // With shared runs beside it the run had the cores only in part (the
    // runs now, this one included, over the instances that have a core).
    const double runs = static_cast<double>(busy_workers_ + 1 + shared_running_);
    const double alone = sample * std::min(1.0, static_cast<double>(narrow_workers()) / runs);
    alone_ns_per_item_ = alone_ns_per_item_ == 0 ? alone : 0.9 * alone_ns_per_item_ + 0.1 * alone;
    if (capped && !wide) full_ns_per_item_ = full_ns_per_item_ == 0 ? sample : 0.75 * full_ns_per_item_ + 0.25 * sample;
  }
  // Batches of a light load (the wide instance's, or the narrow ones' while
  // it is off) tell whether the wide instance pays.
  if (wide_ && items > 0 && ran_ns > 0 && (wide || wide_off_)) {
    const double sample = static_cast<double>(ran_ns) / static_cast<double>(items);
    light_ns_per_item_ = light_samples_ == 0 ? sample : 0.9 * light_ns_per_item_ + 0.1 * sample;
    if (++light_samples_ >= kWideSamples) {
      if (!wide_off_ && light_ns_per_item_ < kWideMinNs) {
        wide_off_ = true;
        light_samples_ = 0;
      } else if (wide_off_ && light_ns_per_item_ >= 2 * kWideMinNs) {
        wide_off_ = false;
        light_samples_ = 0;
      }
    }
  }
  if (tuner_ && tune && items > 0 && !wide && !stopping_ && tuner_->Observe(items, ran_ns, capped)) {
    ApplyBatchLimitLocked();
  }
}

void DynamicBatcher::WakeNarrowLocked() {
  for (int i = 0; i < narrow_workers(); ++i) {
    const auto w = static_cast<size_t>(i);
    if (!busy_[w] && waiting_[w]) {
      waiting_[w] = 0;  // the next wake-up goes to another
      worker_cv_[w].Signal();
      return;
    }
  }
}

void DynamicBatcher::SignalAllLocked() {
  for (int i = 0; i < num_workers_; ++i) worker_cv_[static_cast<size_t>(i)].SignalAll();
  wide_cv_.SignalAll();
  reaper_cv_.SignalAll();
}

bool DynamicBatcher::stopping() const {
  MutexLock lock(mu_);
  return stopping_;
}

Status DynamicBatcher::AdmissionLocked(bool queue_wait) const {
  if (stopping_) return Unavailable("model is shutting down");
  if (!queue_wait) return Status::Ok();
  // Admitted whenever an instance is free or nothing waits (a slow first
  // batch must not lock a model out); otherwise while the work queued
  // ahead of it fits in the limit.
  // Work a loop has queued for itself waits for it as for a busy instance.
  if (max_queue_wait_ns_ > 0 && ns_per_item_ > 0 && (!AnyTaker() || lenders_ > 0) && queue_.items() > 0) {
    const double wait_ns = QueueWorkLocked(queue_.items()) / static_cast<double>(narrow_workers());
    if (wait_ns > static_cast<double>(max_queue_wait_ns_)) {
      return Unavailable("the queue is full: its " + std::to_string(queue_.items()) + " items need about " +
                         std::to_string(static_cast<int64_t>(wait_ns / 1e6)) + " ms, over the limit of " +
                         std::to_string(max_queue_wait_ns_ / 1'000'000) + " ms; try again later");
    }
  }
  return Status::Ok();
}

double DynamicBatcher::QueueWorkLocked(int64_t items_ahead) const {
  const double modelled = ns_per_item_ * static_cast<double>(items_ahead);
  if (full_ns_per_item_ <= 0 || items_ahead <= 0) return modelled;
  const int64_t limit = queue_.batch_limit();
  const int64_t batches = (items_ahead + limit - 1) / limit;
  return std::min(modelled, full_ns_per_item_ * static_cast<double>(batches * limit));
}

Status DynamicBatcher::DeadlineAdmissionLocked(int64_t items, const ScheduleOptions& options, int64_t now_ns) const {
  if (ns_per_item_ <= 0 || stopping_) return Status::Ok();
  const auto arrival = queue_.Peek(options);
  if (!arrival) return Status::Ok();  // Enqueue says why
  const int64_t queue_due = arrival->drop_after_ns > 0 ? now_ns + arrival->drop_after_ns : 0;
  if (options.deadline_ns <= 0 && queue_due == 0) return Status::Ok();
  // When it would start: at once when an instance may take it and nothing
  // is queued ahead; otherwise once the work ahead -- what the running
  // batches have left and the items queued ahead of it -- has gone through
  // the instances (and the wide instance, which the others wait for, is done).
  double wait_ns = 0;
  if (arrival->items_ahead > 0 || !AnyTaker()) {
    double left_ns = 0;
    for (int w = 0; w < num_workers_; ++w) {
      const bool wide = wide_ && w == num_workers_ - 1;
      if (wide ? !wide_running_ : !busy_[static_cast<size_t>(w)]) continue;
      const int64_t end = expected_end_ns_[static_cast<size_t>(w)];
      if (end == INT64_MAX) return Status::Ok();  // a batch of unknown length runs
      const double left = static_cast<double>(std::max<int64_t>(0, end - now_ns));
      left_ns += wide ? left * narrow_workers() : left;
    }
    wait_ns = (left_ns + QueueWorkLocked(arrival->items_ahead)) / narrow_workers();
  }
  const double finish_ns = wait_ns + ns_per_item_ * static_cast<double>(items);
  auto ms = [](double ns) {  // "1200", "50", "1.5", "0.032"
    char buf[32];
    std::snprintf(buf, sizeof buf, ns >= 100e6 ? "%.0f" : "%.3g", ns / 1e6);
    return std::string(buf);
  };
  // Built only for a refusal (this runs for every request with a deadline);
  // the lambda reads no guarded member.
  const int busy = busy_workers_ + (wide_running_ ? 1 : 0);
  auto ahead = [&] {
    return std::to_string(arrival->items_ahead) + " items queued ahead of it and " + std::to_string(busy) + " of " +
           std::to_string(num_workers_) + " instances busy";
  };
  if (queue_due > 0 && static_cast<double>(now_ns) + wait_ns > static_cast<double>(queue_due)) {
    return Unavailable("the request would wait about " + ms(wait_ns) + " ms (" + ahead() +
                       "), longer than its queue timeout of " + ms(static_cast<double>(arrival->drop_after_ns)) +
                       " ms; refused at once, try again later");
  }
  if (options.deadline_ns > 0 && static_cast<double>(now_ns) + finish_ns > static_cast<double>(options.deadline_ns)) {
    return Unavailable("the request would finish in about " + ms(finish_ns) + " ms (" + ahead() +
                       "), after its deadline in " + ms(static_cast<double>(options.deadline_ns - now_ns)) +
                       " ms; refused at once, try again later");
  }
  return Status::Ok();
}

Status DynamicBatcher::CheckAdmission() const {
  MutexLock lock(mu_);
  return AdmissionLocked(/*queue_wait=*/true);
}

void DynamicBatcher::Kick() {
  MutexLock lock(mu_);
  SignalAllLocked();
}

void DynamicBatcher::SendQueuedNow() {
  MutexLock lock(mu_);
  if (send_now_) return;
  send_now_ = true;
  SignalAllLocked();  // workers waiting out a delay look again
}

void DynamicBatcher::Shutdown() {
  {
    // Lending loops that list this model look no further (one running its
    // batch now is waited for below).
    MutexLock lock(lend_slot_->mu);
    lend_slot_->batcher = nullptr;
  }
  {
    MutexLock lock(mu_);
    if (stopping_ && workers_.empty()) return;
    stopping_ = true;
    SignalAllLocked();
  }
  for (auto& t : workers_) {
    if (t.joinable()) t.join();
  }
  if (reaper_.joinable()) reaper_.join();
  MutexLock lock(mu_);
  // Batches that callers run on their own threads end too before it returns.
  callers_cv_.Wait(lock, [this]() QUERN_REQUIRES(mu_) { return callers_running_ == 0; });
  workers_.clear();
}

size_t DynamicBatcher::queued() const {
  MutexLock lock(mu_);
  return queue_.size();
}

int64_t DynamicBatcher::running_tasks() const {
  MutexLock lock(mu_);
  return running_tasks_;
}

double DynamicBatcher::ns_per_item() const {
  MutexLock lock(mu_);
  return ns_per_item_;
}

int64_t DynamicBatcher::batch_memory_bytes() const {
  MutexLock lock(mu_);
  if (run_bytes_.empty()) return 0;
  return static_cast<int64_t>(ExpectedRunBytesLocked(RunRows(queue_.batch_limit())));
}

int64_t DynamicBatcher::memory_limit() const {
  MutexLock lock(mu_);
  return memory_limit_;
}

int64_t DynamicBatcher::batch_limit() const {
  MutexLock lock(mu_);
  return queue_.batch_limit();
}

std::optional<BatchLeave> DynamicBatcher::batch_leave() const {
  MutexLock lock(mu_);
  if (!delay_tuner_) return std::nullopt;
  return delay_tuner_->settled();
}

int64_t DynamicBatcher::wide_batches() const {
  MutexLock lock(mu_);
  return wide_batches_;
}

int64_t DynamicBatcher::worker_batches() const {
  MutexLock lock(mu_);
  return worker_batches_;
}

int64_t DynamicBatcher::caller_batches() const {
  MutexLock lock(mu_);
  return caller_batches_;
}

int64_t DynamicBatcher::reaper_wake_at_ns() const {
  MutexLock lock(mu_);
  return reaper_wake_ns_;
}

int64_t DynamicBatcher::shared_batches() const {
  MutexLock lock(mu_);
  return shared_batches_;
}

bool DynamicBatcher::MayTake(bool wide) const {
  if (wide_running_) return false;
  if (!wide_) return true;
  // Light load: the wide worker, once the others' batches are done (a
  // worker that has just answered its batch still counts as busy for a
  // moment; its caller's next request waits for it rather than run narrow).
  const bool light = !wide_off_ && load_ < kWideBelow && average_load_ < kWideBelowAverage;
  if (wide) return light && busy_workers_ == 0 && shared_running_ == 0;  // alone, shared runs included
  return !light;
}

bool DynamicBatcher::AnyTaker() const {
  if (wide_ && MayTake(true)) return true;
  return busy_workers_ < narrow_workers() && MayTake(false);
}

void DynamicBatcher::WorkerLoop(int worker) {
  const bool wide = wide_ && worker == num_workers_ - 1;
  CondVar& cv = wide ? wide_cv_ : worker_cv_[static_cast<size_t>(worker)];
  const auto w = static_cast<size_t>(worker);
  MutexLock lock(mu_);
  while (true) {
    // A caller may be running a batch on this worker's instance (RunHere).
    const bool instance_free = wide ? !wide_running_ : !busy_[w];
    if (stopping_ && queue_.empty()) break;
    int64_t wake_at_ns = 0;
    int64_t now = 0;
    if (instance_free && !stopping_ && lenders_ > 0 && !foreign_queued_ && !queue_.empty()) {
      // A lending loop takes the queue; this worker only if it stops looking.
      now = clock_->NowNs();
      if (now < lend_until_ns_) {
        if (!wide) waiting_[w] = 1;
        cv.WaitUntil(lock, *clock_, lend_until_ns_);
        if (!wide) waiting_[w] = 0;
        continue;
      }
    }
    if (instance_free && (stopping_ || MayTake(wide))) {
      now = clock_->NowNs();
      BatchQueue::Decision d =
          queue_.Next(now, /*flush=*/stopping_ || SendNowLocked(), wide ? 1 : narrow_workers() - busy_workers_);
      if (!d.batch.empty() || !d.dropped.empty()) {
        const bool more = !queue_.empty();
        const auto tasks = static_cast<int64_t>(d.batch.size());
        BeginLocked(worker, d, now, /*shared=*/false);
        if (!d.batch.empty()) ++worker_batches_;
        if (!AnyTaker() && more && ReaperNeedsWake(0, now)) reaper_cv_.Signal();
        if (more && !wide) WakeNarrowLocked();  // let another free instance take the next batch
        lock.Unlock();
        for (auto& dropped : d.dropped) on_drop_(std::move(dropped.task), dropped.status);
        const Ran ran = Process(worker, std::move(d.batch));
        lock.Lock();
        EndLocked(worker, tasks, d, ran, /*shared=*/false, /*tune=*/true);
        if (wide) {
          if (!queue_.empty() && MayTake(false)) {
            for (int i = 0; i < narrow_workers(); ++i) WakeNarrowLocked();  // the others may take batches again
          }
        } else if (wide_ && !queue_.empty() && MayTake(true)) {
          wide_cv_.Signal();  // the load turned light: the wide worker's turn
        }
        continue;
      }
      wake_at_ns = d.wake_at_ns;
    } else if (instance_free && !stopping_ && !queue_.empty()) {
      // The load moved the queue to the other kind of worker (the wide one
      // at light load, the others under load) since it was last told: time
      // passing, or an arrival refused after it was counted, changes the
      // load without waking anyone. Hand the queue over, or nobody may look
      // at it again until the next arrival.
      if (!wide && wide_ && MayTake(true)) {
        wide_cv_.Signal();
      } else if (wide && busy_workers_ < narrow_workers() && MayTake(false)) {
        WakeNarrowLocked();
      }
    }
    if (!wide) waiting_[w] = 1;
    if (wake_at_ns == 0) {
      cv.Wait(lock);
    } else {
      cv.WaitUntil(lock, *clock_, wake_at_ns);
    }
    if (!wide) waiting_[w] = 0;
  }
}

bool DynamicBatcher::ReaperNeedsWake(int64_t due_ns, int64_t now_ns) const {
  if (reaper_wake_ns_ < 0) return false;  // awake: it looks at the queue before it sleeps
  if (reaper_wake_ns_ == 0) return true;  // asleep until told: nobody else would notice an overrun
  // It must look by the task's deadline, and within kReapPollMs for a cancellation.
  int64_t look_by = now_ns + int64_t{kReapPollMs} * 1'000'000;
  if (due_ns > 0) look_by = std::min(look_by, due_ns);
  if (reaper_wake_ns_ <= look_by) return false;
  // Not while a batch is expected to end by then: its worker takes the
  // queue sooner. One that overruns is caught at the reaper's own wake
  // (kReapWatchMs at most). A batch past its expected end no longer counts.
  for (const int64_t end : expected_end_ns_) {
    if (end > now_ns && end <= look_by) return false;
  }
  return true;
}

void DynamicBatcher::ReaperLoop() {
  MutexLock lock(mu_);
  while (!stopping_) {
    // Idle workers sweep the queue themselves; the reaper covers the time when none is free.
    if (AnyTaker() || queue_.empty()) {
      if (begun_ != reaper_saw_begun_) {
        // Batches ran since it last looked: it keeps watch, for one that
        // overruns while a task queued behind it did not wake it.
        reaper_saw_begun_ = begun_;
        const int64_t until = clock_->NowNs() + int64_t{kReapWatchMs} * 1'000'000;
        reaper_wake_ns_ = until;
        reaper_cv_.WaitUntil(lock, *clock_, until);
      } else {
        reaper_wake_ns_ = 0;
        reaper_cv_.Wait(lock);
      }
      reaper_wake_ns_ = -1;
      continue;
    }
    std::vector<BatchQueue::Dropped> dropped;
    const int64_t now = clock_->NowNs();
    const int64_t next = queue_.Reap(now, dropped);
    if (!dropped.empty()) {
      lock.Unlock();
      for (auto& d : dropped) on_drop_(std::move(d.task), d.status);
      lock.Lock();
      continue;
    }
    int64_t wait_ns = int64_t{kReapPollMs} * 1'000'000;
    if (next > 0) wait_ns = std::min(wait_ns, std::max<int64_t>(next - now, 0));
    reaper_wake_ns_ = now + wait_ns;
    reaper_cv_.WaitUntil(lock, *clock_, now + wait_ns);
    reaper_wake_ns_ = -1;
  }
}

}  // namespace quern
