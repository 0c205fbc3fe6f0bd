// DynamicBatcher: a BatchQueue served by N worker threads, one per model
// instance. A worker that is free asks the queue for the next batch, so a
// formed batch never waits while an instance is idle and load spreads to
// whichever instance finishes first (least-loaded dispatch). Without a
// batching delay, a worker that finds other instances free takes only its
// share of the queue and wakes one of them for the rest, so a burst does not
// run as one batch on one core while the others idle.
//
// Knows nothing of models or transports: batches leave through the
// BatchProcessor callback (run on the worker that took the batch) and dead
// tasks through the DropHandler. While every worker is busy, a reaper thread
// drops tasks that pass their deadline or are cancelled, so their callers
// hear at once rather than when an instance frees up (cancellation is
// noticed within kReapPollMs).
//
// A wide worker (options.wide_worker): the last worker runs its batches on
// every core, alone. While the load is light (on average fewer than
// kWideBelow requests in the model when one arrives) it takes the batches,
// once the others have finished theirs, and the others wait; under more
// load the others take them and it waits. A
// wide batch never runs beside another: two runs that split the cores
// between them finish later than the same two runs one after the other.
// So a lone request (a camera's frame) gets every core, and concurrent ones
// get one instance each.
//
// Thread safety: Schedule and Kick may be called from any thread.
// Shutdown()/the destructor stop intake, run every queued task to completion
// (nothing is lost) and join the workers; do not call them from a worker.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/mutex.h"
#include "quern/clock.h"
#include "scheduler/batch_queue.h"
#include "scheduler/batch_size_tuner.h"

namespace quern {

struct DynamicBatcherOptions {
  BatchQueueOptions queue;
  // Worker threads (= model instances), >= 1.
  int num_workers = 1;
  // Time source; null = the real clock.
  const Clock* clock = nullptr;
  // When set, the batch size limit is tuned under load (see
  // BatchSizeTuner); batch run times are taken with `clock`.
  std::optional<BatchSizeTunerOptions> tuner;
  // Admission by waiting time: while every worker is busy, a task is
  // refused (UNAVAILABLE, without taking it) when the items already queued
  // would take longer than this to run on all workers, estimated from the
  // measured time per item of recent batches (no estimate before the first
  // batch; a free worker or an empty queue always admits). Under overload the queue
  // then holds about this much work: admitted tasks are answered within it,
  // the rest are refused at once, and memory stays bounded. 0 = no bound.
  int64_t max_queue_wait_ns = 0;
  // The last of num_workers (>= 2) is the wide worker (see above).
  bool wide_worker = false;
};

class DynamicBatcher {
 public:
  // Runs one batch on worker `worker` (0 .. num_workers-1).
  using BatchProcessor = std::function<void(int worker, std::vector<std::unique_ptr<BatchTask>>&& batch)>;
  // Completes a task that will never run (status CANCELLED or DEADLINE_EXCEEDED).
  using DropHandler = std::function<void(std::unique_ptr<BatchTask> task, const Status& status)>;

  static Result<std::unique_ptr<DynamicBatcher>> Create(DynamicBatcherOptions options, BatchProcessor processor,
                                                        DropHandler on_drop);
  ~DynamicBatcher();

  // Takes ownership of `task` only on OK (see BatchQueue::Enqueue); after
  // Shutdown returns UNAVAILABLE.
  Status Schedule(std::unique_ptr<BatchTask>& task, const ScheduleOptions& options);

  // What Schedule would answer now for admission alone (without a task):
  // UNAVAILABLE while the queue is full or the batcher stops. Lets a front
  // end refuse a request before it reads and parses the request's body.
  Status CheckAdmission() const;

  // Makes waiting workers re-evaluate the queue now (for a FakeClock that moved).
  void Kick();

  // Stops intake, drains the queue through the processor and joins workers. Idempotent.
  void Shutdown();

  // Whether Shutdown has begun (Schedule refuses everything).
  bool stopping() const;
  size_t queued() const;
  // The measured run time per item (ns, a moving average over recent
  // batches); 0 before the first batch.
  double ns_per_item() const;
  // The largest batch formed now (max_batch_size unless a tuner lowered it).
  int64_t batch_limit() const;

  // How often the reaper looks for cancelled tasks while every worker is busy.
  static constexpr int kReapPollMs = 5;
  // The wide worker takes batches while the average number of requests in
  // the model, seen by arriving requests, stays under this.
  static constexpr double kWideBelow = 1.5;
  int num_workers() const { return num_workers_; }
  // Batches run by the wide worker so far.
  int64_t wide_batches() const;

 private:
  DynamicBatcher(BatchQueue queue, const Clock* clock, BatchProcessor processor, DropHandler on_drop);
  void WorkerLoop(int worker);
  void ReaperLoop();
  // Would a task due at `due_ns` (0 = no deadline of its own) be reaped
  // late without a wake-up?
  bool ReaperNeedsWake(int64_t due_ns) const QUERN_REQUIRES(mu_);
  // Schedule's admission decision; `queue_wait` false for work its caller
  // admitted already (only a stopping model refuses it).
  Status AdmissionLocked(bool queue_wait) const QUERN_REQUIRES(mu_);
  // Whether a free worker (the wide one or another) may take a batch now.
  bool MayTake(bool wide) const QUERN_REQUIRES(mu_);
  // Whether some free worker may take a batch now (if not, queued tasks
  // wait and the reaper watches them).
  bool AnyTaker() const QUERN_REQUIRES(mu_);
  int narrow_workers() const { return num_workers_ - (wide_ ? 1 : 0); }

  const Clock* clock_;
  int num_workers_ = 1;  // set before any thread starts
  BatchProcessor processor_;
  DropHandler on_drop_;
  mutable Mutex mu_;
  CondVar cv_;       // the workers but the wide one: work or stop
  CondVar wide_cv_;  // the wide worker
  BatchQueue queue_ QUERN_GUARDED_BY(mu_);
  std::optional<BatchSizeTuner> tuner_ QUERN_GUARDED_BY(mu_);
  bool stopping_ QUERN_GUARDED_BY(mu_) = false;
  int64_t max_queue_wait_ns_ = 0;  // set before any thread starts
  double ns_per_item_ QUERN_GUARDED_BY(mu_) = 0;
  int busy_workers_ QUERN_GUARDED_BY(mu_) = 0;  // not counting the wide worker
  bool wide_ = false;                           // set before any thread starts
  bool wide_running_ QUERN_GUARDED_BY(mu_) = false;
  int64_t wide_batches_ QUERN_GUARDED_BY(mu_) = 0;
  int64_t running_tasks_ QUERN_GUARDED_BY(mu_) = 0;
  // Requests in the model seen by arriving requests (themselves included), a
  // moving average.
  double load_ QUERN_GUARDED_BY(mu_) = 1.0;
  // When the reaper wakes by itself: 0 = only when notified, -1 = it is
  // running. Schedule notifies it only when a new task could need it sooner,
  // so a saturated model does not wake it once per request.
  int64_t reaper_wake_ns_ QUERN_GUARDED_BY(mu_) = -1;
  CondVar reaper_cv_;
  std::vector<std::thread> workers_;
  std::thread reaper_;
};

}  // namespace quern
