// BatchQueue policy tests: everything is driven by explicit times, no threads, no sleeps.
#include "scheduler/batch_queue.h"

#include <gtest/gtest.h>

#include <memory>

namespace quern {
namespace {

constexpr int64_t kUs = 1000;

class FakeTask : public BatchTask {
 public:
  FakeTask(int id, int64_t size = 1, uint64_t key = 0) : id_(id), size_(size), key_(key) {}
  int64_t size() const override { return size_; }
  uint64_t batch_key() const override { return key_; }
  bool cancelled() const override { return cancelled_; }
  int id() const { return id_; }
  bool cancelled_ = false;

 private:
  int id_;
  int64_t size_;
  uint64_t key_;
};

BatchQueue MakeQueue(BatchQueueOptions o) {
  auto q = BatchQueue::Create(std::move(o));
  EXPECT_TRUE(q.has_value()) << q.error().ToString();
  return std::move(*q);
}

// Enqueues a task and asserts success; returns a raw pointer for later inspection.
FakeTask* Add(BatchQueue& q, int id, int64_t now, ScheduleOptions so = {}, int64_t size = 1, uint64_t key = 0) {
  auto t = std::make_unique<FakeTask>(id, size, key);
  FakeTask* raw = t.get();
  std::unique_ptr<BatchTask> base = std::move(t);
  Status st = q.Enqueue(base, so, now);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return raw;
}

std::vector<int> Ids(const std::vector<std::unique_ptr<BatchTask>>& batch) {
  std::vector<int> ids;
  for (const auto& t : batch) ids.push_back(static_cast<const FakeTask&>(*t).id());
  return ids;
}

TEST(BatchQueue, ZeroDelaySendsWhatIsQueued) {
  BatchQueueOptions o;
  o.max_batch_size = 8;
  BatchQueue q = MakeQueue(o);
  Add(q, 1, 0);
  Add(q, 2, 0);
  Add(q, 3, 0);
  auto d = q.Next(0);
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{1, 2, 3}));
  EXPECT_TRUE(q.empty());
  EXPECT_EQ(q.Next(0).wake_at_ns, 0);  // nothing pending: wait for an enqueue
}

TEST(BatchQueue, MaxBatchSizeCountsItems) {
  BatchQueueOptions o;
  o.max_batch_size = 4;
  BatchQueue q = MakeQueue(o);
  Add(q, 1, 0, {}, 3);
  Add(q, 2, 0, {}, 2);  // 3 + 2 > 4: must wait for the next batch
  Add(q, 3, 0, {}, 1);
  auto d = q.Next(0);
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{1}));
  d = q.Next(0);
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{2, 3}));
}

TEST(BatchQueue, BatchLimitCapsBatchesAndSaysWhenItCutOne) {
  BatchQueueOptions o;
  o.max_batch_size = 8;
  o.max_queue_delay_ns = 1000 * kUs;
  BatchQueue q = MakeQueue(o);
  EXPECT_EQ(q.batch_limit(), 8);
  q.set_batch_limit(2);
  for (int i = 1; i <= 5; ++i) Add(q, i, 0);
  auto d = q.Next(0);  // the limit is reached: no waiting for the delay
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{1, 2}));
  EXPECT_EQ(d.items, 2);
  EXPECT_TRUE(d.capped);
  d = q.Next(0);
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{3, 4}));
  d = q.Next(0);  // one left, under the limit: waits for the delay
  EXPECT_TRUE(d.batch.empty());
  d = q.Next(1000 * kUs);
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{5}));
  EXPECT_FALSE(d.capped);
  // A request larger than the limit (but within max_batch_size) still runs, alone.
  Add(q, 6, 0, {}, 3);
  Add(q, 7, 0);
  d = q.Next(0);
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{6}));
  EXPECT_EQ(d.items, 3);
  EXPECT_TRUE(d.capped);
  // The limit stays within [1, max_batch_size].
  q.set_batch_limit(100);
  EXPECT_EQ(q.batch_limit(), 8);
  q.set_batch_limit(0);
  EXPECT_EQ(q.batch_limit(), 1);
}

TEST(BatchQueue, WithoutADelayFreeInstancesShareTheQueue) {
  BatchQueueOptions o;
  o.max_batch_size = 8;
  BatchQueue q = MakeQueue(o);
  for (int i = 1; i <= 7; ++i) Add(q, i, 0);
  auto d = q.Next(0, false, /*free_workers=*/2);  // two instances free: this one takes its half
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{1, 2, 3, 4}));
  EXPECT_FALSE(d.capped) << "cut by sharing, not by the batch limit";
  d = q.Next(0, false, 1);  // the other takes the rest
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{5, 6, 7}));
  // Requests of several items: shares count items.
  Add(q, 8, 0, {}, 3);
  Add(q, 9, 0, {}, 3);
  d = q.Next(0, false, 2);
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{8}));
  EXPECT_EQ(q.Next(0, false, 2).items, 3);
}

TEST(BatchQueue, WithADelayBatchesAreNotShared) {
  // A batching delay asks for fuller batches: free instances do not split them.
  BatchQueueOptions o;
  o.max_batch_size = 4;
  o.max_queue_delay_ns = 100 * kUs;
  BatchQueue q = MakeQueue(o);
  for (int i = 1; i <= 4; ++i) Add(q, i, 0);
  auto d = q.Next(0, false, 2);
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{1, 2, 3, 4}));
  EXPECT_TRUE(d.capped);
}

TEST(BatchQueue, OversizeRequestIsRejectedPermanently) {
  BatchQueueOptions o;
  o.max_batch_size = 4;
  BatchQueue q = MakeQueue(o);
  std::unique_ptr<BatchTask> t = std::make_unique<FakeTask>(1, 5);
  Status st = q.Enqueue(t, {}, 0);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t, nullptr) << "a rejected task stays with the caller";
  EXPECT_NE(st.message().find("max_batch_size is 4"), std::string::npos) << st.message();
}

TEST(BatchQueue, DelayWaitsForMoreUntilTheOldestHasWaitedLongEnough) {
  BatchQueueOptions o;
  o.max_batch_size = 4;
  o.max_queue_delay_ns = 100 * kUs;
  BatchQueue q = MakeQueue(o);
  Add(q, 1, 0);
  auto d = q.Next(10 * kUs);
  EXPECT_TRUE(d.batch.empty());
  EXPECT_EQ(d.wake_at_ns, 100 * kUs);
  Add(q, 2, 50 * kUs);
  d = q.Next(99 * kUs);
  EXPECT_TRUE(d.batch.empty());
  d = q.Next(100 * kUs);
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{1, 2}));
}

TEST(BatchQueue, FullBatchLeavesBeforeTheDelay) {
  BatchQueueOptions o;
  o.max_batch_size = 3;
  o.max_queue_delay_ns = 1000 * kUs;
  BatchQueue q = MakeQueue(o);
  for (int i = 1; i <= 4; ++i) Add(q, i, 0);
  auto d = q.Next(1 * kUs);
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{1, 2, 3}));
  d = q.Next(2 * kUs);
  EXPECT_TRUE(d.batch.empty());
  EXPECT_EQ(d.wake_at_ns, 1000 * kUs);
}

TEST(BatchQueue, PreferredSizeLeavesAtOnce) {
  BatchQueueOptions o;
  o.max_batch_size = 8;
  o.preferred_batch_sizes = {2, 4};
  o.max_queue_delay_ns = 1000 * kUs;
  BatchQueue q = MakeQueue(o);
  Add(q, 1, 0);
  EXPECT_TRUE(q.Next(0).batch.empty());
  for (int i = 2; i <= 5; ++i) Add(q, i, 0);
  // Five queued: the largest preferred size reachable (4) leaves now.
  auto d = q.Next(1 * kUs);
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{1, 2, 3, 4}));
  // The fifth waits for its delay.
  d = q.Next(2 * kUs);
  EXPECT_TRUE(d.batch.empty());
  d = q.Next(1000 * kUs);
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{5}));
}

TEST(BatchQueue, HigherPriorityLeavesFirst) {
  BatchQueueOptions o;
  o.max_batch_size = 2;
  o.priority_levels = 3;
  o.default_priority_level = 2;
  BatchQueue q = MakeQueue(o);
  Add(q, 1, 0, {.priority = 3});
  Add(q, 2, 0);  // default level 2
  Add(q, 3, 0, {.priority = 1});
  Add(q, 4, 0, {.priority = 1});
  EXPECT_EQ(Ids(q.Next(0).batch), (std::vector<int>{3, 4}));
  EXPECT_EQ(Ids(q.Next(0).batch), (std::vector<int>{2, 1}));
}

TEST(BatchQueue, UnknownPriorityIsInvalid) {
  BatchQueueOptions o;
  o.priority_levels = 2;
  BatchQueue q = MakeQueue(o);
  std::unique_ptr<BatchTask> t = std::make_unique<FakeTask>(1);
  EXPECT_EQ(q.Enqueue(t, {.priority = 3}, 0).code(), StatusCode::kInvalidArgument);
}

TEST(BatchQueue, QueueFullRejectsAtOnceWithUnavailable) {
  BatchQueueOptions o;
  o.max_batch_size = 4;
  o.level_policies = {{.max_queue_size = 2}};
  BatchQueue q = MakeQueue(o);
  Add(q, 1, 0);
  Add(q, 2, 0);
  std::unique_ptr<BatchTask> t = std::make_unique<FakeTask>(3);
  Status st = q.Enqueue(t, {}, 0);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("queue full"), std::string::npos);
  q.Next(0);
  EXPECT_TRUE(q.Enqueue(t, {}, 0).ok()) << "room again once the queue drained";
}

TEST(BatchQueue, TimeoutRejectDropsWithDeadlineExceeded) {
  BatchQueueOptions o;
  o.max_batch_size = 4;
  o.max_queue_delay_ns = 1000 * kUs;
  o.level_policies = {{.default_timeout_ns = 100 * kUs}};
  BatchQueue q = MakeQueue(o);
  Add(q, 1, 0);
  Add(q, 2, 50 * kUs);
  auto d = q.Next(10 * kUs);
  EXPECT_EQ(d.wake_at_ns, 100 * kUs) << "wakes for the first timeout, before the batching delay";
  d = q.Next(100 * kUs);
  ASSERT_EQ(d.dropped.size(), 1u);
  EXPECT_EQ(static_cast<FakeTask&>(*d.dropped[0].task).id(), 1);
  EXPECT_EQ(d.dropped[0].status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(q.size(), 1u);
}

TEST(BatchQueue, RequestTimeoutMayOnlyShortenTheDefault) {
  BatchQueueOptions o;
  o.max_batch_size = 4;
  o.max_queue_delay_ns = 10'000 * kUs;
  o.level_policies = {{.default_timeout_ns = 100 * kUs, .allow_timeout_override = true}};
  BatchQueue q = MakeQueue(o);
  Add(q, 1, 0, {.timeout_ns = 500 * kUs});  // longer: ignored, 100 us applies
  Add(q, 2, 0, {.timeout_ns = 20 * kUs});   // shorter: applies
  auto d = q.Next(20 * kUs);
  ASSERT_EQ(d.dropped.size(), 1u);
  EXPECT_EQ(static_cast<FakeTask&>(*d.dropped[0].task).id(), 2);
  d = q.Next(100 * kUs);
  ASSERT_EQ(d.dropped.size(), 1u);
  EXPECT_EQ(static_cast<FakeTask&>(*d.dropped[0].task).id(), 1);
}

TEST(BatchQueue, TimeoutDelayMovesBehindTheLevel) {
  BatchQueueOptions o;
  o.max_batch_size = 1;
  o.priority_levels = 2;
  o.default_priority_level = 1;
  o.level_policies = {{.delay_on_timeout = true, .default_timeout_ns = 100 * kUs}, {}};
  BatchQueue q = MakeQueue(o);
  Add(q, 1, 0);
  Add(q, 2, 0, {.priority = 2});
  Add(q, 3, 150 * kUs);
  // At 200 us task 1 timed out: it is delayed behind task 3 (same level, not
  // timed out) but still ahead of level 2. Nothing is dropped.
  auto d = q.Next(200 * kUs);
  EXPECT_TRUE(d.dropped.empty());
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{3}));
  EXPECT_EQ(Ids(q.Next(200 * kUs).batch), (std::vector<int>{1}));
  EXPECT_EQ(Ids(q.Next(200 * kUs).batch), (std::vector<int>{2}));
}

TEST(BatchQueue, HardDeadlineAlwaysDrops) {
  BatchQueueOptions o;
  o.max_batch_size = 4;
  o.max_queue_delay_ns = 1000 * kUs;
  BatchQueue q = MakeQueue(o);
  Add(q, 1, 0, {.deadline_ns = 30 * kUs});
  Add(q, 2, 0);
  EXPECT_EQ(q.Next(0).wake_at_ns, 30 * kUs);
  auto d = q.Next(30 * kUs);
  ASSERT_EQ(d.dropped.size(), 1u);
  EXPECT_EQ(d.dropped[0].status.code(), StatusCode::kDeadlineExceeded);
}

TEST(BatchQueue, WithARunCostATaskThatCannotFinishInTimeIsDroppedBeforeRunning) {
  BatchQueueOptions o;
  o.max_batch_size = 8;  // the four items wait for company (no full batch)
  o.max_queue_delay_ns = 1000 * kUs;
  BatchQueue q = MakeQueue(o);
  // Three batch keys: each task waits for company of its own kind.
  Add(q, 1, 0, {.deadline_ns = 50 * kUs}, /*size=*/2, /*key=*/1);  // 2 items x 10 us: must start by 30 us
  Add(q, 2, 0, {.deadline_ns = 50 * kUs}, 1, /*key=*/2);           // 1 item: by 40 us
  Add(q, 3, 0, {}, 1, /*key=*/3);
  EXPECT_TRUE(q.Next(35 * kUs).dropped.empty()) << "no run cost known: only a passed deadline drops";
  q.set_run_ns_per_item(10 * kUs);
  auto d = q.Next(20 * kUs);
  EXPECT_TRUE(d.dropped.empty());
  EXPECT_EQ(d.wake_at_ns, 30 * kUs) << "wakes when the first can no longer finish";
  d = q.Next(35 * kUs);
  ASSERT_EQ(d.dropped.size(), 1u);
  EXPECT_EQ(static_cast<FakeTask&>(*d.dropped[0].task).id(), 1);
  EXPECT_EQ(d.dropped[0].status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(d.dropped[0].status.message().find("could no longer finish before its deadline"), std::string::npos)
      << d.dropped[0].status.message();
  EXPECT_EQ(q.items(), 2);
  d = q.Next(40 * kUs + 1);
  ASSERT_EQ(d.dropped.size(), 1u);
  EXPECT_EQ(static_cast<FakeTask&>(*d.dropped[0].task).id(), 2);
  EXPECT_EQ(Ids(q.Next(40 * kUs + 1, /*flush=*/true).batch), (std::vector<int>{3})) << "no deadline: never dropped";
}

TEST(BatchQueue, ABatchTakesNoMoreThanItCanRunBeforeTheEarliestDeadlineInIt) {
  BatchQueueOptions o;
  o.max_batch_size = 8;
  o.max_queue_delay_ns = 1000 * kUs;
  BatchQueue q = MakeQueue(o);
  q.set_run_ns_per_item(10 * kUs);
  Add(q, 1, 0, {.deadline_ns = 35 * kUs});
  for (int id = 2; id <= 4; ++id) Add(q, id, 0);
  // 1, 2, 3 end at 30 us; with 4 the batch would end at 40, after 1's deadline.
  auto d = q.Next(0);
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{1, 2, 3})) << "leaves at once, before the batching delay";
  EXPECT_FALSE(d.capped) << "cut by a deadline, not by the limit (the tuner must not read it as a full queue)";
  d = q.Next(0);
  EXPECT_TRUE(d.batch.empty());
  EXPECT_EQ(d.wake_at_ns, 1000 * kUs) << "4 has no deadline: it waits for company as before";
  // A task with a deadline behind one without: the batch stops where the later one's deadline would pass.
  Add(q, 5, 0, {.deadline_ns = 25 * kUs});
  Add(q, 6, 0);
  d = q.Next(0);
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{4, 5})) << "4 and 5 end at 20 us; 6 would end the batch at 30";
  // Without a known cost, deadlines do not cut batches.
  BatchQueue plain = MakeQueue(o);
  Add(plain, 1, 0, {.deadline_ns = 35 * kUs});
  for (int id = 2; id <= 8; ++id) Add(plain, id, 0);
  EXPECT_EQ(plain.Next(0).batch.size(), 8u);
}

TEST(BatchQueue, ABatchWaitingForCompanyLeavesInTimeForItsEarliestDeadline) {
  BatchQueueOptions o;
  o.max_batch_size = 8;
  o.max_queue_delay_ns = 1000 * kUs;
  BatchQueue q = MakeQueue(o);
  q.set_run_ns_per_item(10 * kUs);
  Add(q, 1, 0, {.deadline_ns = 100 * kUs});
  Add(q, 2, 0);
  // The two would run 20 us: they wait for company until 80 us, not the 1000 us batching delay.
  auto d = q.Next(0);
  EXPECT_TRUE(d.batch.empty());
  EXPECT_EQ(d.wake_at_ns, 80 * kUs);
  Add(q, 3, 50 * kUs);
  d = q.Next(50 * kUs);
  EXPECT_TRUE(d.batch.empty());
  EXPECT_EQ(d.wake_at_ns, 70 * kUs) << "three items: 30 us of running";
  d = q.Next(70 * kUs);
  EXPECT_TRUE(d.dropped.empty()) << "run in time, not dropped as too late";
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{1, 2, 3}));
  // Due exactly when the batch would end if it left now (at time 0): it leaves now.
  Add(q, 4, 0, {.deadline_ns = 20 * kUs});
  Add(q, 5, 0);
  EXPECT_EQ(Ids(q.Next(0).batch), (std::vector<int>{4, 5}));
}

TEST(BatchQueue, ALatencyTargetSizesBatchesAndTimesThemButDropsNothing) {
  BatchQueueOptions o;
  o.max_batch_size = 16;
  o.max_queue_delay_ns = 1000 * kUs;
  o.latency_target_ns = 100 * kUs;
  BatchQueue q = MakeQueue(o);
  Add(q, 1, 0);
  auto d = q.Next(0);
  EXPECT_EQ(d.wake_at_ns, 1000 * kUs) << "no run cost known yet: the batching delay as configured";
  q.set_run_ns_per_item(10 * kUs);
  d = q.Next(0);
  EXPECT_EQ(d.wake_at_ns, 90 * kUs) << "alone it runs 10 us: it waits for company until 90 us, not 1000";
  for (int id = 2; id <= 12; ++id) Add(q, id, 0);
  d = q.Next(0);
  EXPECT_EQ(d.batch.size(), 10u) << "ten items end at 100 us; an eleventh would end the batch past the target";
  EXPECT_FALSE(d.capped);
  d = q.Next(0);
  EXPECT_TRUE(d.batch.empty());
  EXPECT_EQ(d.wake_at_ns, 80 * kUs);
  // At 95 us (a worker woken late) the two can no longer meet their target: they leave at once,
  // and are never dropped for it.
  d = q.Next(95 * kUs);
  EXPECT_TRUE(d.dropped.empty());
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{11, 12}));
  // Late tasks do not shrink batches (a queue that fell behind gets its full batches).
  for (int id = 13; id <= 40; ++id) Add(q, id, 0);
  d = q.Next(200 * kUs);
  EXPECT_EQ(d.batch.size(), 16u);
  EXPECT_EQ(Ids(d.batch).front(), 13);
}

TEST(BatchQueue, PeekCountsTheItemsAheadAndTheQueueTimeout) {
  BatchQueueOptions o;
  o.max_batch_size = 8;
  o.max_queue_delay_ns = 1000 * kUs;
  o.priority_levels = 3;
  o.default_priority_level = 2;
  o.level_policies = {{.default_timeout_ns = 100 * kUs, .allow_timeout_override = true},
                      {.delay_on_timeout = true, .default_timeout_ns = 100 * kUs},
                      {}};
  BatchQueue q = MakeQueue(o);
  Add(q, 1, 0, {.priority = 1}, /*size=*/3);
  Add(q, 2, 0, {}, /*size=*/2);  // level 2
  Add(q, 3, 0, {.priority = 3}, /*size=*/4);
  auto a = q.Peek({.priority = 1, .timeout_ns = 40 * kUs});
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->items_ahead, 3) << "only its own level is served before it";
  EXPECT_EQ(a->drop_after_ns, 40 * kUs) << "its own, shorter timeout";
  a = q.Peek({});
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->items_ahead, 5);
  EXPECT_EQ(a->drop_after_ns, 0) << "a level that delays timed-out tasks never drops them";
  a = q.Peek({.priority = 3, .timeout_ns = 70 * kUs});
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->items_ahead, 9);
  EXPECT_EQ(a->drop_after_ns, 70 * kUs);
  EXPECT_FALSE(q.Peek({.priority = 4}).has_value());
  // Items leave the count as batches leave.
  EXPECT_EQ(Ids(q.Next(0, /*flush=*/true).batch), (std::vector<int>{1, 2}));
  EXPECT_EQ(q.Peek({.priority = 3})->items_ahead, 4);
}

TEST(BatchQueue, CancelledTasksAreRemovedAndNeverBatched) {
  BatchQueueOptions o;
  o.max_batch_size = 4;
  BatchQueue q = MakeQueue(o);
  Add(q, 1, 0);
  FakeTask* two = Add(q, 2, 0);
  Add(q, 3, 0);
  two->cancelled_ = true;
  auto d = q.Next(0);
  EXPECT_EQ(Ids(d.batch), (std::vector<int>{1, 3}));
  ASSERT_EQ(d.dropped.size(), 1u);
  EXPECT_EQ(static_cast<FakeTask&>(*d.dropped[0].task).id(), 2);
  EXPECT_EQ(d.dropped[0].status.code(), StatusCode::kCancelled);
}

TEST(BatchQueue, DifferentKeysNeverShareABatch) {
  BatchQueueOptions o;
  o.max_batch_size = 8;
  BatchQueue q = MakeQueue(o);
  Add(q, 1, 0, {}, 1, /*key=*/7);
  Add(q, 2, 0, {}, 1, /*key=*/9);
  Add(q, 3, 0, {}, 1, /*key=*/7);
  Add(q, 4, 0, {}, 1, /*key=*/9);
  EXPECT_EQ(Ids(q.Next(0).batch), (std::vector<int>{1, 3}));
  EXPECT_EQ(Ids(q.Next(0).batch), (std::vector<int>{2, 4}));
}

TEST(BatchQueue, FlushSendsWithoutWaiting) {
  BatchQueueOptions o;
  o.max_batch_size = 8;
  o.max_queue_delay_ns = 1'000'000 * kUs;
  BatchQueue q = MakeQueue(o);
  Add(q, 1, 0);
  EXPECT_TRUE(q.Next(0).batch.empty());
  EXPECT_EQ(Ids(q.Next(0, /*flush=*/true).batch), (std::vector<int>{1}));
}

TEST(BatchQueue, InvalidOptionsAreRejected) {
  EXPECT_FALSE(BatchQueue::Create({.max_batch_size = 0}).has_value());
  EXPECT_FALSE(BatchQueue::Create({.max_batch_size = 4, .preferred_batch_sizes = {8}}).has_value());
  EXPECT_FALSE(
      BatchQueue::Create({.max_batch_size = 4, .priority_levels = 2, .default_priority_level = 3}).has_value());
}

}  // namespace
}  // namespace quern
