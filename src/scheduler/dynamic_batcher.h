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
// hear at once rather than when an instance frees up (it looks every
// kReapPollMs while tasks wait). A reaper asleep without a time limit is
// woken by any task left queued with no worker free. Once woken, it keeps
// watch for as long as batches keep beginning, waking every kReapWatchMs;
// while it watches, a task queued behind a batch expected to end before the
// reaper would have to look does not wake it (the worker looks at the queue
// sooner): a request that arrives while a lone caller's previous one
// finishes costs no wake-up. If that batch overruns (a model that hangs),
// the watch catches it: such a task hears of its deadline or cancellation
// at most kReapWatchMs late.
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
// A caller that would only wait for its answer (ScheduleOptions::run_here)
// lends its thread: when an instance that may take work is free and the
// queue sends a batch off at once, Schedule runs that batch (its task and
// any queued with it) on the calling thread, on that instance, before it
// returns. A caller that would not wait (an asynchronous front end's
// thread) may lend itself too, into an idle model and not on the wide
// instance, for batches expected to end within
// ScheduleOptions::run_here_below_ns. A hand-off to a worker and
// back costs two sleeps and wake-ups (tens of µs of CPU on a virtual
// machine, more than a small model's run); a caller's own run costs none. A
// worker whose instance a caller holds waits for it.
//
// A loop that lends its thread (ScheduleOptions::loop, the LoopLender its
// caller passed, on the loop's thread; see loop_lender.h): a task it queues
// wakes no worker while the model's batches are short (kLoopLendBelowNs,
// never before one was measured) and there is no wide worker; the loop
// takes the batch later, on its own thread, by the same queue policy as a
// worker (LendRun), and feeds the tuners as a worker does. A worker that is awake leaves the
// queue to a loop that has looked at it within kLendGraceNs; work queued by
// another thread wakes one as usual.
//
// The caller-run and lending members are in caller_runs.cc; the workers,
// the reaper and Schedule in dynamic_batcher.cc.
//
// Shared runs (options.shared_runs): a caller that lends its thread but
// finds every instance busy would wait for a worker to take its task and
// wake it with the answer. While batches are short (under kSharedBelowNs
// per item, where that hand-off costs more than batching saves) it runs
// its batch at once instead, on an instance that is running another one:
// for backends whose instances may run batches concurrently (an ONNX
// Runtime session may). At most options.shared_runs such runs at a time;
// beyond that, callers queue and batch as before. Their times feed neither
// the time per item nor the batch size tuner (they share the cores).
//
// Thread safety: Schedule and Kick may be called from any thread.
// Shutdown()/the destructor stop intake, run every queued task to completion
// (nothing is lost), wait for batches callers run and join the workers; do
// not call them from a worker or a batch's callbacks.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/mutex.h"
#include "quern/clock.h"
#include "scheduler/batch_delay_tuner.h"
#include "scheduler/batch_queue.h"
#include "scheduler/batch_size_tuner.h"
#include "scheduler/loop_lender.h"

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
  // With a latency target and a batching delay (queue.latency_target_ns,
  // queue.max_queue_delay_ns): when set, whether batches leave as soon as an
  // instance is free, once every recent client is queued, or after the
  // delay is measured online (see BatchDelayTuner); unset, they leave once
  // everyone is here.
  std::optional<BatchDelayTunerOptions> delay_tuner;
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
  // Shared runs callers may add beside busy instances (see above); 0 =
  // none. Only for instances whose batches may run concurrently.
  int shared_runs = 0;
  // A budget for the run memory the model's batches hold at once, all
  // instances running together (0 = none). Each batch's run memory is
  // measured on the thread that runs it (BlockCache::ThreadScope: the large
  // buffers a backend takes from Quern's allocator, as ONNX Runtime's runs
  // do), and the batch limit is kept at the largest size whose estimate,
  // times the instances that run side by side (not the wide one, which runs
  // alone), fits. The estimate for a size: the most measured at it, else
  // interpolated between the nearest sizes measured around it, else the
  // largest measured scaled up in proportion (an upper bound), every size
  // at least what a smaller one measured. The limit starts at one and grows
  // at most to twice the largest size measured, so a size is measured
  // before one twice as large runs. A batch of one may exceed the budget
  // (it runs all the same); a backend whose runs take nothing from the
  // allocator is not bounded. With a budget there are no shared runs
  // (their memory would come on top of one run per instance).
  int64_t memory_budget_bytes = 0;
  // The sizes batches run at, padded up to the next (fixed batch sizes;
  // empty: as formed): their memory is that of the padded size.
  std::vector<int64_t> run_sizes;
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
  // Shutdown returns UNAVAILABLE. A full queue first drops its dead tasks
  // (cancelled, past a deadline) through the DropHandler, on this thread:
  // they hold no place in it.
  Status Schedule(std::unique_ptr<BatchTask>& task, const ScheduleOptions& options);

  // What Schedule would answer now for admission alone (without a task):
  // UNAVAILABLE while the queue is full or the batcher stops. Lets a front
  // end refuse a request before it reads and parses the request's body.
  Status CheckAdmission() const;

  // Wakes the idle workers to look at the queue now, as a worker that ends
  // a batch does; a queued task's cancellation calls it, so that the task
  // leaves at once rather than when the batching delay ends. (Time passing
  // wakes only workers waiting for a time: a batching delay, a deadline, a
  // lending loop's grace once a worker is awake; a worker asleep while a
  // loop has the queue stays asleep.)
  void Kick();

  // From now on every queued task leaves in the next batch an instance can
  // take, without waiting for company (the batching delay, preferred sizes,
  // "everyone here"): for a draining server, whose callers should not wait
  // for arrivals that will not come. Intake goes on. Idempotent.
  void SendQueuedNow();

  // Stops intake, drains the queue through the processor and joins workers. Idempotent.
  void Shutdown();

  // Whether Shutdown has begun (Schedule refuses everything).
  bool stopping() const;
  size_t queued() const;
  // Tasks in batches that run now (on workers or callers' threads); a batch
  // counts until its end has been recorded (time per item, tuners).
  int64_t running_tasks() const;
  // The measured run time per item (ns, a moving average over recent
  // batches); 0 before the first batch.
  double ns_per_item() const;
  // The largest batch formed now (max_batch_size unless a tuner or the
  // memory budget lowered it).
  int64_t batch_limit() const;
  // The largest batch the memory budget allows now (options.memory_budget_bytes;
  // 0 = no bound).
  int64_t memory_limit() const;
  // The run memory a batch at batch_limit() is expected to hold, as measured
  // (with or without a budget; see memory_budget_bytes); 0 before a batch is
  // measured.
  int64_t batch_memory_bytes() const;
  // The way the delay tuner settled on (options.delay_tuner), if it runs.
  std::optional<BatchLeave> batch_leave() const;

  // For a LoopLender, on its thread: runs the batch the slot's model's
  // worker would take now, on a free instance. `ran`: a batch ran (or dead
  // tasks were dropped); `keep`: the loop should look again (after
  // `wait_ns`, -1 = after its next event), else the queue is empty or left
  // to the workers (the instance is busy, batches grew long, the model
  // stopped).
  struct LendOutcome {
    bool ran = false;
    bool keep = false;
    int64_t wait_ns = -1;
  };
  static LendOutcome LendRun(LendSlot& slot);
  // A lender that listed the slot's model stops lending (paused, or its loop
  // ends): the workers take the queue.
  static void LendEnd(LendSlot& slot);
  // Batches loops ran (LendRun) so far.
  int64_t lent_batches() const;

  // A loop lends its thread to batches expected to take less than this.
  static constexpr double kLoopLendBelowNs = 2'000'000;
  // A worker takes a queued batch a lending loop has not looked at for this long.
  static constexpr int64_t kLendGraceNs = 5'000'000;

  // How often the reaper looks for cancelled tasks while every worker is busy.
  static constexpr int kReapPollMs = 5;
  // How often it looks while batches run (see above).
  static constexpr int kReapWatchMs = 20;
  // The wide worker takes batches while the average number of requests in
  // the model, seen by arriving requests, stays under this.
  static constexpr double kWideBelow = 1.5;
  // ... and while the requests in the batcher, averaged over time (over
  // about kLoadWindowNs), stay under this. Callers that send their next
  // request only after their answer arrive to find the model nearly empty
  // (the others are between requests); the time average sees how many are
  // in it while they compute: a lone caller keeps it at or below 1.
  static constexpr double kWideBelowAverage = 1.2;
  static constexpr int64_t kLoadWindowNs = 2'000'000;
  // The wide worker stays idle while its runs take less than this per item
  // (averaged over kWideSamples runs at least): a run that short gains
  // little from more cores, and their threads would spin or be woken
  // around it. The load counts as heavy then, and the others take every
  // batch; it takes them again once theirs, at light load, take twice this.
  static constexpr double kWideMinNs = 1'000'000;
  static constexpr int kWideSamples = 16;
  // Callers run shared batches while the time per item (of a run alone)
  // stays under this.
  static constexpr double kSharedBelowNs = 250'000;
  int num_workers() const { return num_workers_; }
  // Batches run by the wide worker so far.
  int64_t wide_batches() const;
  // Batches callers ran beside busy instances (shared runs) so far.
  int64_t shared_batches() const;
  // When the reaper next looks at the queue by itself (a NowNs time; 0 =
  // only when told, -1 = it is looking now).
  int64_t reaper_wake_at_ns() const;
  // Batches callers ran on their own threads on an idle instance so far
  // (ScheduleOptions::run_here: a front end's thread lent for a short batch,
  // Engine::Run's blocking caller).
  int64_t caller_batches() const;
  // Batches the workers ran so far (the wide one's included).
  int64_t worker_batches() const;

 private:
  DynamicBatcher(BatchQueue queue, const Clock* clock, BatchProcessor processor, DropHandler on_drop);
  void WorkerLoop(int worker);
  // A free instance for a caller that lends its thread (the wide one while
  // the load is light, if `wide_ok`, else a free other one), or -1.
  int ClaimLocked(bool wide_ok) const QUERN_REQUIRES(mu_);
  // Whether the batch a caller would run now is expected to take less than
  // `below_ns` (0 = no bound; false before the first batch is measured).
  bool RunsBriefly(int64_t below_ns) const QUERN_REQUIRES(mu_);
  // For a caller that found every instance busy: the instance (not the
  // wide one) to share for a run now, or -1.
  int ShareLocked() const QUERN_REQUIRES(mu_);
  // Runs batch `d` (begun on `worker`'s instance, `shared` beside its own
  // batch) on the calling thread; `tune`: its time feeds the batch size
  // tuner (not a bounded caller's: those run while the load is light, and
  // their wall time, free of the front end's work that a worker's batch
  // shares the core with, is no fair comparison).
  void RunHere(int worker, BatchQueue::Decision d, bool shared, bool tune) QUERN_EXCLUDES(mu_);
  // Whether a lending loop may take the queue's batches (see LendRun).
  bool LoopMayRunLocked() const QUERN_REQUIRES(mu_);
  // A loop stops looking at the queue: a worker that may take it looks.
  void DropLenderLocked() QUERN_REQUIRES(mu_);
  // Marks `worker`'s instance busy with `d` / free again after `ran_ns`;
  // `shared`: a shared run beside the instance's own batch (counted apart).
  void BeginLocked(int worker, const BatchQueue::Decision& d, int64_t now_ns, bool shared) QUERN_REQUIRES(mu_);
  // What running one batch took: its wall time and the run memory its thread
  // held at most (BlockCache::ThreadPeak).
  struct Ran {
    int64_t ns = 0;
    int64_t bytes = 0;
  };
  // Runs `batch` on the calling thread through the processor, measured.
  Ran Process(int worker, std::vector<std::unique_ptr<BatchTask>>&& batch) QUERN_EXCLUDES(mu_);
  void EndLocked(int worker, int64_t tasks, const BatchQueue::Decision& d, Ran ran, bool shared, bool tune)
      QUERN_REQUIRES(mu_);
  // The memory budget: records a batch of `items` that held `bytes`, and
  // lowers or raises the limit it allows.
  void NoteRunMemoryLocked(int64_t items, int64_t bytes) QUERN_REQUIRES(mu_);
  // The run memory a batch run at `rows` (a run size) is expected to hold
  // (see memory_budget_bytes); needs one measured batch.
  double ExpectedRunBytesLocked(int64_t rows) const QUERN_REQUIRES(mu_);
  // The rows a batch of `items` runs at (options.run_sizes).
  int64_t RunRows(int64_t items) const;
  // The queue's limit: the tuner's (else max_batch_size) within the memory limit.
  void ApplyBatchLimitLocked() QUERN_REQUIRES(mu_);
  // Wakes one waiting worker (not the wide one) whose instance is free.
  void WakeNarrowLocked() QUERN_REQUIRES(mu_);
  void SignalAllLocked() QUERN_REQUIRES(mu_);
  // Brings average_load_ up to `now_ns`, before the number of tasks changes.
  void TrackLoadLocked(int64_t now_ns) QUERN_REQUIRES(mu_);
  void ReaperLoop();
  // Would a task due at `due_ns` (0 = no deadline of its own), queued at
  // `now_ns` while no worker may take it, be reaped late without a wake-up?
  bool ReaperNeedsWake(int64_t due_ns, int64_t now_ns) const QUERN_REQUIRES(mu_);
  // Schedule's admission decision; `queue_wait` false for work its caller
  // admitted already (only a stopping model refuses it).
  Status AdmissionLocked(bool queue_wait) const QUERN_REQUIRES(mu_);
  // The instances' time to run `items_ahead` queued items: at the time per
  // item, or in whole full batches at full_ns_per_item_ when that is less
  // (never more pessimistic than the queue's measured pace under backlog).
  double QueueWorkLocked(int64_t items_ahead) const QUERN_REQUIRES(mu_);
  // Refuses (UNAVAILABLE) a task of `items` that cannot start before its
  // queue timeout or finish before its deadline, judged from the work ahead
  // of it and the measured time per item; admits while that is unknown.
  Status DeadlineAdmissionLocked(int64_t items, const ScheduleOptions& options, int64_t now_ns) const
      QUERN_REQUIRES(mu_);
  // Whether a free worker (the wide one or another) may take a batch now.
  bool MayTake(bool wide) const QUERN_REQUIRES(mu_);
  // Whether some free worker may take a batch now (if not, queued tasks
  // wait and the reaper watches them).
  bool AnyTaker() const QUERN_REQUIRES(mu_);
  int narrow_workers() const { return num_workers_ - (wide_ ? 1 : 0); }
  // With a latency target (queue.latency_target_ns): whether a batch waiting
  // for company leaves now. By default (BatchLeave::kEveryoneHere) once the
  // tasks queued or running are as many as the model has held on average
  // lately (average_load_, rounded; at least one): clients that send their
  // next request only after their answer (a closed loop) bring none a
  // batching delay could wait for. With a delay tuner, as it says:
  // always (kAtOnce), or never (kAfterDelay: the queue's delay decides).
  bool SendNowLocked() const QUERN_REQUIRES(mu_);

  const Clock* clock_;
  int num_workers_ = 1;  // set before any thread starts
  BatchProcessor processor_;
  DropHandler on_drop_;
  mutable Mutex mu_;
  std::unique_ptr<CondVar[]> worker_cv_;  // each worker but the wide one: work or stop
  CondVar wide_cv_;                       // the wide worker
  BatchQueue queue_ QUERN_GUARDED_BY(mu_);
  std::optional<BatchSizeTuner> tuner_ QUERN_GUARDED_BY(mu_);
  std::optional<BatchDelayTuner> delay_tuner_ QUERN_GUARDED_BY(mu_);
  bool stopping_ QUERN_GUARDED_BY(mu_) = false;
  bool send_now_ QUERN_GUARDED_BY(mu_) = false;  // SendQueuedNow
  bool waits_for_company_ = false;               // a delay or preferred sizes; set before any thread starts
  int64_t max_queue_wait_ns_ = 0;                // set before any thread starts
  bool latency_target_ = false;                  // set before any thread starts
  double ns_per_item_ QUERN_GUARDED_BY(mu_) = 0;
  // The same, each run's time scaled by its share of the cores while shared
  // runs ran beside it: what a run takes alone (decides shared runs, whose
  // own slowing must not turn them off).
  double alone_ns_per_item_ QUERN_GUARDED_BY(mu_) = 0;
  // The time per item of batches the batch limit cut short (more work was
  // queued: a backlog), on the narrow instances; 0 = none yet. A queue
  // drains in such batches, which cost less per item than the small ones of
  // a light load that mostly feed ns_per_item_: the admission estimates take
  // the smaller of the two (QueueWorkLocked).
  double full_ns_per_item_ QUERN_GUARDED_BY(mu_) = 0;
  int busy_workers_ QUERN_GUARDED_BY(mu_) = 0;  // not counting the wide worker
  // Per worker: its instance runs a batch (not kept for the wide one: see
  // wide_running_), and it waits on its condition variable.
  std::vector<char> busy_ QUERN_GUARDED_BY(mu_);
  std::vector<char> waiting_ QUERN_GUARDED_BY(mu_);
  // Batches callers run on their own threads (RunHere) now, shared runs
  // included.
  int callers_running_ QUERN_GUARDED_BY(mu_) = 0;
  // Shared runs now, in all and per instance, and the bound.
  int shared_running_ QUERN_GUARDED_BY(mu_) = 0;
  std::vector<int> shared_on_ QUERN_GUARDED_BY(mu_);
  int max_shared_runs_ = 0;         // set before any thread starts
  int64_t memory_budget_ = 0;       // set before any thread starts
  std::vector<int64_t> run_sizes_;  // set before any thread starts, sorted
  // The most run memory measured per run size (each at least a smaller
  // one's), and the limit it allows (0 = none).
  std::map<int64_t, int64_t> run_bytes_ QUERN_GUARDED_BY(mu_);
  int64_t memory_limit_ QUERN_GUARDED_BY(mu_) = 0;
  int64_t shared_batches_ QUERN_GUARDED_BY(mu_) = 0;
  int64_t caller_batches_ QUERN_GUARDED_BY(mu_) = 0;
  int64_t worker_batches_ QUERN_GUARDED_BY(mu_) = 0;
  CondVar callers_cv_;
  bool wide_ = false;  // set before any thread starts
  bool wide_running_ QUERN_GUARDED_BY(mu_) = false;
  int64_t wide_batches_ QUERN_GUARDED_BY(mu_) = 0;
  int64_t running_tasks_ QUERN_GUARDED_BY(mu_) = 0;
  // When each worker's batch is expected to end (its items x ns_per_item_);
  // 0 = idle.
  std::vector<int64_t> expected_end_ns_ QUERN_GUARDED_BY(mu_);
  // Requests in the model seen by arriving requests (themselves included), a
  // moving average.
  double load_ QUERN_GUARDED_BY(mu_) = 1.0;
  // Tasks queued or running, averaged over time (TrackLoadLocked, before
  // every change of that number), and when it was last brought up to date.
  double average_load_ QUERN_GUARDED_BY(mu_) = 0.0;
  int64_t load_at_ns_ QUERN_GUARDED_BY(mu_) = 0;
  // Time per item of batches run at light load (see kWideMinNs), over how
  // many, and whether the wide worker stays idle for it.
  double light_ns_per_item_ QUERN_GUARDED_BY(mu_) = 0;
  int light_samples_ QUERN_GUARDED_BY(mu_) = 0;
  bool wide_off_ QUERN_GUARDED_BY(mu_) = false;
  // When the reaper wakes by itself: 0 = only when notified (it is, for
  // any task left queued with no worker free), -1 = it is running. Else the
  // threads that queue or begin batches notify it only when a task could
  // need it sooner, so a saturated model does not wake it once per request.
  int64_t reaper_wake_ns_ QUERN_GUARDED_BY(mu_) = -1;
  // Batches begun (BeginLocked), and how many had begun when the reaper
  // last went to sleep with nothing to do: it keeps watch while the count
  // moves.
  int64_t begun_ QUERN_GUARDED_BY(mu_) = 0;
  int64_t reaper_saw_begun_ QUERN_GUARDED_BY(mu_) = 0;
  CondVar reaper_cv_;
  // Lending loops that list this model, until when the workers leave its
  // queue to them (kLendGraceNs after one last looked at it; 0 = work from
  // elsewhere arrived, the workers take it all), and the batches they ran.
  // The slot links them to it.
  int lenders_ QUERN_GUARDED_BY(mu_) = 0;
  int64_t lend_until_ns_ QUERN_GUARDED_BY(mu_) = 0;
  int64_t lent_batches_ QUERN_GUARDED_BY(mu_) = 0;
  // A queued task no loop may run (ScheduleOptions::loop_may_run unset):
  // until the queue empties, the loops leave it all to the workers.
  bool foreign_queued_ QUERN_GUARDED_BY(mu_) = false;
  std::shared_ptr<LendSlot> lend_slot_ = std::make_shared<LendSlot>();
  std::vector<std::thread> workers_;
  std::thread reaper_;
};

}  // namespace quern
