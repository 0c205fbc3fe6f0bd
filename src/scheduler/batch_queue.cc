#include "scheduler/batch_queue.h"

#include <algorithm>
#include <string>

namespace quern {

Result<BatchQueue> BatchQueue::Create(BatchQueueOptions options) {
  if (options.max_batch_size < 1) {
    return Err(InvalidArgument("max_batch_size must be >= 1, got " + std::to_string(options.max_batch_size)));
  }
  if (options.priority_levels < 1) options.priority_levels = 1;
  if (options.default_priority_level < 1 || options.default_priority_level > options.priority_levels) {
    return Err(InvalidArgument("default_priority_level " + std::to_string(options.default_priority_level) +
                               " is outside [1, " + std::to_string(options.priority_levels) + "]"));
  }
  for (int64_t p : options.preferred_batch_sizes) {
    if (p < 1 || p > options.max_batch_size) {
      return Err(InvalidArgument("preferred_batch_size " + std::to_string(p) + " is outside [1, " +
                                 std::to_string(options.max_batch_size) + "]"));
    }
  }
  if (options.max_queue_delay_ns < 0) return Err(InvalidArgument("max_queue_delay must not be negative"));
  if (options.latency_target_ns < 0) return Err(InvalidArgument("latency target must not be negative"));
  return BatchQueue(std::move(options));
}

BatchQueue::BatchQueue(BatchQueueOptions options) : options_(std::move(options)), limit_(options_.max_batch_size) {
  levels_.resize(options_.priority_levels);
  for (size_t i = 0; i < levels_.size() && i < options_.level_policies.size(); ++i) {
    levels_[i].policy = options_.level_policies[i];
  }
}

const BatchQueue::Level* BatchQueue::LevelFor(const ScheduleOptions& options) const {
  const uint32_t level = options.priority == 0 ? options_.default_priority_level : options.priority;
  if (level < 1 || level > options_.priority_levels) return nullptr;
  return &levels_[level - 1];
}

int64_t BatchQueue::QueueTimeout(const Level& lv, const ScheduleOptions& options) {
  int64_t timeout = lv.policy.default_timeout_ns;
  if (options.timeout_ns > 0) {
    if (timeout == 0) {
      timeout = options.timeout_ns;
    } else if (lv.policy.allow_timeout_override) {
      timeout = std::min(timeout, options.timeout_ns);  // may only shorten
    }
  }
  return timeout;
}

bool BatchQueue::TooLate(const Entry& e, int64_t now_ns) const {
  if (e.deadline_ns <= 0) return false;
  if (now_ns >= e.deadline_ns) return true;
  return run_ns_per_item_ > 0 && static_cast<double>(now_ns) + run_ns_per_item_ * static_cast<double>(e.task->size()) >
                                     static_cast<double>(e.deadline_ns);
}

std::optional<BatchQueue::Arrival> BatchQueue::Peek(const ScheduleOptions& options) const {
  const Level* lv = LevelFor(options);
  if (!lv) return std::nullopt;
  Arrival a;
  for (const Level* l = levels_.data(); l <= lv; ++l) a.items_ahead += l->items;
  if (!lv->policy.delay_on_timeout) a.drop_after_ns = QueueTimeout(*lv, options);
  return a;
}

Status BatchQueue::Enqueue(std::unique_ptr<BatchTask>& task, const ScheduleOptions& opts, int64_t now_ns) {
  const int64_t n = task->size();
  if (n < 1 || n > options_.max_batch_size) {
    return InvalidArgument("request has " + std::to_string(n) + " items; the model's max_batch_size is " +
                           std::to_string(options_.max_batch_size));
  }
  const Level* found = LevelFor(opts);
  if (!found) {
    return InvalidArgument("priority " + std::to_string(opts.priority) + " is outside [1, " +
                           std::to_string(options_.priority_levels) + "]");
  }
  Level& lv = levels_[static_cast<size_t>(found - levels_.data())];
  if (lv.policy.max_queue_size > 0 && lv.size() >= lv.policy.max_queue_size) {
    return Unavailable("queue full: " + std::to_string(lv.size()) + " requests waiting at priority " +
                       std::to_string(found - levels_.data() + 1) + " (max_queue_size " +
                       std::to_string(lv.policy.max_queue_size) + ")");
  }
  const int64_t timeout = QueueTimeout(lv, opts);
  Entry e;
  e.enqueue_ns = now_ns;
  e.timeout_at_ns = timeout > 0 ? now_ns + timeout : 0;
  e.deadline_ns = opts.deadline_ns;
  e.target_ns = options_.latency_target_ns > 0 ? now_ns + options_.latency_target_ns : 0;
  e.task = std::move(task);
  lv.active.push_back(std::move(e));
  ++size_;
  items_ += n;
  lv.items += n;
  return Status::Ok();
}

int64_t BatchQueue::Sweep(int64_t now_ns, std::vector<Dropped>& dropped) {
  int64_t next = 0;
  auto note = [&next](int64_t t) {
    if (t > 0 && (next == 0 || t < next)) next = t;
  };
  for (Level& lv : levels_) {
    for (bool delayed_list : {false, true}) {
      auto& q = delayed_list ? lv.delayed : lv.active;
      auto out = q.begin();
      for (auto it = q.begin(); it != q.end(); ++it) {
        Entry& e = *it;
        if (e.task->cancelled()) {
          items_ -= e.task->size();
          lv.items -= e.task->size();
          dropped.push_back({std::move(e.task), Cancelled("request was cancelled while queued")});
          --size_;
          continue;
        }
        if (TooLate(e, now_ns)) {
          items_ -= e.task->size();
          lv.items -= e.task->size();
          dropped.push_back({std::move(e.task),
                             DeadlineExceeded(now_ns >= e.deadline_ns ? "request deadline passed while queued"
                                                                      : "request could no longer finish before its "
                                                                        "deadline; dropped before running")});
          --size_;
          continue;
        }
        if (!delayed_list && e.timeout_at_ns > 0 && now_ns >= e.timeout_at_ns) {
          if (lv.policy.delay_on_timeout) {
            lv.delayed.push_back(std::move(e));
          } else {
            items_ -= e.task->size();
            lv.items -= e.task->size();
            dropped.push_back(
                {std::move(e.task), DeadlineExceeded("request timed out in the queue after " +
                                                     std::to_string((now_ns - e.enqueue_ns) / 1000) + " us")});
            --size_;
          }
          continue;
        }
        // When it becomes too late to start (TooLate).
        note(e.deadline_ns > 0
                 ? e.deadline_ns - static_cast<int64_t>(run_ns_per_item_ * static_cast<double>(e.task->size()))
                 : 0);
        if (!delayed_list) note(e.timeout_at_ns);
        if (out != it) *out = std::move(e);
        ++out;
      }
      q.erase(out, q.end());
    }
  }
  return next;
}

BatchQueue::Decision BatchQueue::Next(int64_t now_ns, bool flush, int free_workers) {
  Decision d;
  const int64_t next_deadline = Sweep(now_ns, d.dropped);
  if (size_ == 0) return d;

  // Walk the queues in service order and pick the tasks that would form the
  // batch: same key as the first, as many items as fit.
  std::vector<Pick>& picks = picks_;
  picks.clear();
  uint64_t key = 0;
  int64_t total = 0;
  int64_t oldest_ns = 0;
  size_t preferred_prefix = 0;  // picks.size() when total last hit a preferred size
  bool blocked = false;         // a same-key task did not fit: stop there (keep order)
  bool due_cut = false;         // it would have made the batch end after a picked task's deadline
  int64_t earliest_due = 0;     // the earliest deadline or target among the picks (0 = none)
  bool late = false;            // a pick can no longer meet its latency target
  const auto& pref = options_.preferred_batch_sizes;
  // Without a batching delay, what is queued is shared among the instances
  // free now: one instance taking it all would leave the others idle.
  int64_t limit = limit_;
  if (free_workers > 1 && options_.max_queue_delay_ns == 0 && !flush) {
    limit = std::min(limit, std::max<int64_t>(1, (items_ + free_workers - 1) / free_workers));
  }
  for (Level& lv : levels_) {
    for (auto* q : {&lv.active, &lv.delayed}) {
      for (size_t i = 0; i < q->size() && !blocked && total < limit; ++i) {
        const Entry& e = (*q)[i];
        if (options_.one_task_per_batch && !picks.empty()) {
          blocked = true;
          break;
        }
        if (picks.empty()) {
          key = e.task->batch_key();
          oldest_ns = e.enqueue_ns;
        } else if (e.task->batch_key() != key) {
          continue;
        }
        const int64_t n = e.task->size();
        if (total + n > limit && !picks.empty()) {
          blocked = true;
          break;
        }
        // With a known run cost, a batch grows only while it would still end
        // before the earliest deadline (or latency target it can still meet)
        // in it: a request is not made late by company. It leaves now, with
        // what it has.
        int64_t own = e.deadline_ns;
        if (e.target_ns > 0 && run_ns_per_item_ > 0) {
          if (static_cast<double>(now_ns) + run_ns_per_item_ * static_cast<double>(n) <=
              static_cast<double>(e.target_ns)) {
            own = own > 0 ? std::min(own, e.target_ns) : e.target_ns;
          } else {
            late = true;  // past its target: it waits no longer, but limits nothing
          }
        }
        const int64_t due = earliest_due == 0 || (own > 0 && own < earliest_due) ? own : earliest_due;
        if (!picks.empty() && due > 0 && run_ns_per_item_ > 0 &&
            static_cast<double>(now_ns) + run_ns_per_item_ * static_cast<double>(total + n) >
                static_cast<double>(due)) {
          blocked = true;
          due_cut = true;
          break;
        }
        earliest_due = due;
        total += n;
        picks.push_back({&lv, q, i});
        if (std::find(pref.begin(), pref.end(), total) != pref.end()) preferred_prefix = picks.size();
      }
    }
  }

  size_t take = 0;
  // A batch waiting for company leaves when waiting longer would make it end
  // after the earliest deadline in it.
  const bool timed = earliest_due > 0 && run_ns_per_item_ > 0;
  const int64_t leave_by =
      timed ? earliest_due - static_cast<int64_t>(run_ns_per_item_ * static_cast<double>(total)) : 0;
  const bool delay_over = options_.max_queue_delay_ns == 0 || now_ns >= oldest_ns + options_.max_queue_delay_ns ||
                          (timed && now_ns >= leave_by) || late;
  const bool full = total >= limit || blocked;
  const bool cut_by_limit = limit == limit_ && full && !due_cut;
  if (flush || full || delay_over) {
    take = picks.size();
  } else if (preferred_prefix > 0) {
    take = preferred_prefix;
  }

  if (take == 0) {
    int64_t wake = oldest_ns + options_.max_queue_delay_ns;
    if (next_deadline > 0 && next_deadline < wake) wake = next_deadline;
    if (timed && leave_by < wake) wake = leave_by;
    d.wake_at_ns = wake;
    return d;
  }

  d.capped = cut_by_limit && take == picks.size();
  picks.resize(take);
  d.batch.reserve(take);
  d.oldest_enqueue_ns = now_ns;
  for (const Pick& p : picks) {
    Entry& e = (*p.q)[p.index];
    p.level->items -= e.task->size();
    d.items += e.task->size();
    d.oldest_enqueue_ns = std::min(d.oldest_enqueue_ns, e.enqueue_ns);
    d.batch.push_back(std::move(e.task));
  }
  // Compact the queues: remove entries whose task was taken.
  for (Level& lv : levels_) {
    for (auto* q : {&lv.active, &lv.delayed}) {
      std::erase_if(*q, [](const Entry& e) { return e.task == nullptr; });
    }
  }
  size_ -= take;
  items_ -= d.items;
  if (size_ > 0) d.wake_at_ns = now_ns;  // more may be ready at once
  return d;
}

}  // namespace quern
