// BatchQueue: the batching policy of a model, with no threads, no clock of its
// own and no knowledge of models or transports (TF Serving's batch scheduler
// and Triton's dynamic batcher are the models for its semantics).
//
// Tasks wait in priority levels (1 is the highest). Next() decides, for the
// time `now`, which tasks leave as one batch, which are dropped (cancelled or
// past their deadline: never computed) and when to ask again. Tasks with
// different batch_key() values never share a batch.
//
// Thread safety: none; DynamicBatcher serialises access. Ownership: Enqueue
// takes the task only when it returns OK; Next hands tasks back to the caller.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "quern/status.h"

namespace quern {

// What the batcher needs to know about a queued unit of work.
class BatchTask {
 public:
  virtual ~BatchTask() = default;
  // Items this task adds to a batch (a request with 4 rows has size 4).
  virtual int64_t size() const = 0;
  // Tasks with different keys (e.g. different non-batch shapes) never share a batch.
  virtual uint64_t batch_key() const = 0;
  // True once the caller withdrew the task.
  virtual bool cancelled() const = 0;
};

struct QueueLevelPolicy {
  // On timeout: false = drop with DEADLINE_EXCEEDED, true = move behind the
  // level's requests that have not timed out (Triton's DELAY).
  bool delay_on_timeout = false;
  // Default queue timeout for this level; 0 = none.
  int64_t default_timeout_ns = 0;
  // Whether a request's own timeout may shorten default_timeout_ns.
  bool allow_timeout_override = false;
  // Requests this level may hold; 0 = unbounded.
  uint32_t max_queue_size = 0;
};

struct BatchQueueOptions {
  // Largest batch, in items. Tasks larger than this are rejected.
  int64_t max_batch_size = 1;
  // A batch is one task, whatever its size (a model without dynamic
  // batching: requests are never combined, each may hold up to
  // max_batch_size items).
  bool one_task_per_batch = false;
  // Sizes sent at once when the queue can form them (ascending or not).
  std::vector<int64_t> preferred_batch_sizes;
  // How long the oldest queued task may wait for a fuller batch.
  int64_t max_queue_delay_ns = 0;
  // Number of levels, >= 1; level 1 is served first.
  uint32_t priority_levels = 1;
  // Level for tasks that ask for priority 0.
  uint32_t default_priority_level = 1;
  // One per level (index 0 = level 1); missing levels use QueueLevelPolicy{}.
  std::vector<QueueLevelPolicy> level_policies;
  // A target for each task's time from enqueue to the end of its batch (0 =
  // none). Once the run cost is known (set_run_ns_per_item), a batch takes
  // no more tasks than it can run before the earliest target among them and
  // leaves in time for it, as for a hard deadline; but a target is never a
  // reason to drop a task, and one it can no longer meet (even alone, now)
  // no longer limits its batch: that batch leaves at once, as large as the
  // limit allows (a queue that fell behind keeps its full batches).
  int64_t latency_target_ns = 0;
};

struct ScheduleOptions {
  uint32_t priority = 0;    // 0 = default level
  int64_t timeout_ns = 0;   // the task's own queue timeout; 0 = none
  int64_t deadline_ns = 0;  // absolute hard deadline; 0 = none
  bool admitted = false;    // the caller admitted it: no queue-wait bound
  // Requests in the caller's model now, not yet answered (queued or
  // running), this one included: the load a wide worker follows
  // (DynamicBatcher). -1 = the batcher counts what it queues and runs.
  int64_t in_model = -1;
  // The caller waits for the answer anyway (DynamicBatcher): when an
  // instance is free and the queue sends a batch off now, the batch runs on
  // the calling thread, inside Schedule, with no hand-off to a worker and
  // back.
  bool run_here = false;
  // With run_here: only into an idle model (nothing running, nothing else
  // queued), when the batch is expected to take less than this (the
  // measured time per item times its items; never before a batch was
  // measured), never on the wide instance, and never beside a busy
  // instance (a shared run).
  // For a caller that would not otherwise wait (an asynchronous front end's
  // thread lending itself briefly). 0 = no bound.
  int64_t run_here_below_ns = 0;
  // A lending loop may run the task's batch later (DynamicBatcher): set
  // where that run is bounded (a backend that says so, inputs of usual
  // size), whether or not the caller is a loop.
  bool loop_may_run = false;
  // With loop_may_run: the loop that may, when Schedule is called on its
  // thread while it lends (LoopLender::Lending); null: none.
  class LoopLender* loop = nullptr;
};

class BatchQueue {
 public:
  struct Dropped {
    std::unique_ptr<BatchTask> task;
    Status status;  // CANCELLED or DEADLINE_EXCEEDED
  };
  struct Decision {
    std::vector<std::unique_ptr<BatchTask>> batch;  // empty = no batch now
    std::vector<Dropped> dropped;
    // When to call Next again if nothing changes; 0 = only after an Enqueue.
    int64_t wake_at_ns = 0;
    // Items in `batch`, and whether the batch limit cut it short (more
    // same-key work was waiting).
    int64_t items = 0;
    bool capped = false;
    // When the batch's oldest task was enqueued.
    int64_t oldest_enqueue_ns = 0;
  };

  BatchQueue(BatchQueue&&) = default;
  BatchQueue& operator=(BatchQueue&&) = default;
  BatchQueue(const BatchQueue&) = delete;
  BatchQueue& operator=(const BatchQueue&) = delete;

  // Validates the options (sizes positive, levels consistent).
  static Result<BatchQueue> Create(BatchQueueOptions options);

  // On OK the queue owns `task` (it is moved from). Errors leave `task` with
  // the caller: INVALID_ARGUMENT for a task larger than max_batch_size or an
  // unknown priority, UNAVAILABLE when the level's queue is full.
  Status Enqueue(std::unique_ptr<BatchTask>& task, const ScheduleOptions& options, int64_t now_ns);

  // Only drops dead tasks (cancelled or past a deadline) into `dropped`.
  // Returns the earliest deadline of what remains (0 = none).
  int64_t Reap(int64_t now_ns, std::vector<Dropped>& dropped) { return Sweep(now_ns, dropped); }

  // Drops dead tasks and, if the policy says a batch should leave at `now`,
  // returns it. `flush` sends whatever is queued without waiting (shutdown).
  // `free_workers` instances (the caller included) are free to run batches
  // now: with no batching delay, the batch takes only its share of the
  // queued items so that the others get the rest.
  Decision Next(int64_t now_ns, bool flush = false, int free_workers = 1);

  // What a task enqueued now with `options` would find: the items queued
  // ahead of it (at its level and the levels served before it), and after
  // how long the queue would drop it for waiting (its queue timeout; 0 =
  // never: none, or a level that delays timed-out tasks instead). Nothing
  // for a priority Enqueue would refuse.
  struct Arrival {
    int64_t items_ahead = 0;
    int64_t drop_after_ns = 0;
  };
  std::optional<Arrival> Peek(const ScheduleOptions& options) const;

  // What one item costs to run (ns; 0 = unknown, the default): a task whose
  // hard deadline comes before it could finish even if it started now, run
  // at this cost, is dropped (DEADLINE_EXCEEDED) rather than computed late,
  // and a batch takes no more tasks than it can run before the earliest
  // deadline among them (it leaves at once with those).
  void set_run_ns_per_item(double ns) { run_ns_per_item_ = ns > 0 ? ns : 0; }

  // Largest batch Next forms, in [1, max_batch_size] (a batch tuner lowers
  // it). A single task larger than the limit still leaves alone.
  void set_batch_limit(int64_t limit) { limit_ = std::clamp<int64_t>(limit, 1, options_.max_batch_size); }
  int64_t batch_limit() const { return limit_; }

  size_t size() const { return size_; }
  // Items in the queued tasks.
  int64_t items() const { return items_; }
  bool empty() const { return size_ == 0; }
  const BatchQueueOptions& options() const { return options_; }

 private:
  struct Entry {
    std::unique_ptr<BatchTask> task;
    int64_t enqueue_ns = 0;
    int64_t timeout_at_ns = 0;  // queue-policy timeout; 0 = none
    int64_t deadline_ns = 0;    // hard deadline; 0 = none
    int64_t target_ns = 0;      // enqueue + latency target; 0 = none
  };
  struct Level {
    Level() = default;
    Level(Level&&) = default;
    Level& operator=(Level&&) = default;
    Level(const Level&) = delete;
    Level& operator=(const Level&) = delete;
    QueueLevelPolicy policy;
    std::deque<Entry> active;
    std::deque<Entry> delayed;  // timed out under a DELAY policy
    int64_t items = 0;          // in both
    size_t size() const { return active.size() + delayed.size(); }
  };

  explicit BatchQueue(BatchQueueOptions options);
  // Removes cancelled/expired entries into `dropped`; returns the earliest
  // future deadline of what remains (0 = none).
  int64_t Sweep(int64_t now_ns, std::vector<Dropped>& dropped);

  // Where a task Next would take sits (kept between calls: no allocation
  // per batch).
  struct Pick {
    Level* level;
    std::deque<Entry>* q;
    size_t index;
  };
  // The level a task of `options` joins, or null for an unknown priority.
  const Level* LevelFor(const ScheduleOptions& options) const;
  // A task's queue timeout at `lv` (0 = none).
  static int64_t QueueTimeout(const Level& lv, const ScheduleOptions& options);
  // Whether `e` can no longer finish before its hard deadline at `now_ns`.
  bool TooLate(const Entry& e, int64_t now_ns) const;

  BatchQueueOptions options_;
  std::vector<Level> levels_;
  std::vector<Pick> picks_;
  size_t size_ = 0;
  int64_t items_ = 0;  // items in the queued tasks
  int64_t limit_ = 1;
  double run_ns_per_item_ = 0;
};

}  // namespace quern
