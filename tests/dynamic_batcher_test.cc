// DynamicBatcher with worker threads and a FakeClock: batches form from the
// queue state and the injected time; nothing here sleeps to wait for batching.
#include "scheduler/dynamic_batcher.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <thread>

#include "core/block_cache.h"
#include "eventually.h"

namespace quern {
namespace {

class Item : public BatchTask {
 public:
  explicit Item(int i) : id(i) {}
  int64_t size() const override { return 1; }
  uint64_t batch_key() const override { return 0; }
  bool cancelled() const override { return false; }
  int id;
};

struct Recorder {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::vector<int>> batches;
  std::vector<int> workers;
  int items = 0;

  void Wait(int n) {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return items >= n; });
  }

  // A batch processor's record of one batch: its items' ids and its worker.
  void Record(int worker, const std::vector<std::unique_ptr<BatchTask>>& batch) {
    std::lock_guard lock(mu);
    std::vector<int> ids;
    for (const auto& t : batch) ids.push_back(static_cast<const Item&>(*t).id);
    batches.push_back(ids);
    workers.push_back(worker);
    items += static_cast<int>(ids.size());
    cv.notify_all();
  }
};

// A batcher's DropHandler that keeps each dropped task's id and status.
struct Drops {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<int, StatusCode>> list;

  DynamicBatcher::DropHandler Handler() {
    return [this](std::unique_ptr<BatchTask> task, const Status& st) {
      std::lock_guard lock(mu);
      list.emplace_back(static_cast<const Item&>(*task).id, st.code());
      cv.notify_all();
    };
  }
  // The first task dropped, once one is (waiting up to 10 s); nullopt if none was.
  std::optional<std::pair<int, StatusCode>> First() {
    std::unique_lock lock(mu);
    if (!cv.wait_for(lock, std::chrono::seconds(10), [&] { return !list.empty(); })) return std::nullopt;
    return list[0];
  }
};

// A batcher on a FakeClock for tests of what happens to queued tasks while
// batches hang. A batch whose first task is 0 takes `measured_ns` of the
// clock (so that batches are expected to take that long); one whose first
// task is among `hanging` waits until the test opens that task's gate; any
// other ends at once. Every gate opens when the model goes, before its
// batcher (a failed assertion must not leave the batcher's destructor
// waiting for a worker that waits on a gate).
struct HangingModel {
  FakeClock clock;
  std::atomic<int> started{0};
  Drops drops;
  std::unique_ptr<DynamicBatcher> batcher;

  HangingModel(int64_t max_batch_size, int64_t measured_ns, const std::vector<int>& hanging) {
    std::map<int, std::shared_future<void>> waits;
    for (int id : hanging) waits[id] = gates_[id].get_future().share();
    DynamicBatcherOptions o;
    o.queue.max_batch_size = max_batch_size;
    o.clock = &clock;
    batcher = std::move(*DynamicBatcher::Create(
        o,
        [this, measured_ns, waits](int, std::vector<std::unique_ptr<BatchTask>>&& batch) {
          ++started;
          const int id = static_cast<const Item&>(*batch[0]).id;
          if (id == 0) clock.AdvanceNs(measured_ns);
          if (auto it = waits.find(id); it != waits.end()) it->second.wait();
        },
        drops.Handler()));
  }
  ~HangingModel() {
    for (auto& [id, gate] : gates_) Open(id);
    batcher.reset();
  }
  void Open(int id) {
    if (opened_.insert(id).second) gates_.at(id).set_value();
  }
  Status Schedule(int id, ScheduleOptions so = {}) {
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(id);
    return batcher->Schedule(t, so);
  }
  // Runs task 0 and waits until its time per item is measured, once the
  // reaper sleeps with nothing to watch (nothing has run yet): the tests
  // start from that state, whenever its thread started.
  bool Measure() {
    return quern::testing::Eventually([&] { return batcher->reaper_wake_at_ns() == 0; }) && Schedule(0).ok() &&
           quern::testing::Eventually([&] { return batcher->ns_per_item() > 0; });
  }

 private:
  std::map<int, std::promise<void>> gates_;
  std::set<int> opened_;
};

// A batcher whose batches `rec` records (no task is expected to be dropped).
Result<std::unique_ptr<DynamicBatcher>> RecordedBatcher(const DynamicBatcherOptions& o, Recorder& rec) {
  return DynamicBatcher::Create(
      o, [&rec](int worker, std::vector<std::unique_ptr<BatchTask>>&& batch) { rec.Record(worker, batch); },
      [](std::unique_ptr<BatchTask>, const Status&) {});
}

TEST(DynamicBatcher, BatchLeavesWhenTheFakeClockPassesTheDelay) {
  FakeClock clock;
  Recorder rec;
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 8;
  o.queue.max_queue_delay_ns = 5'000'000;  // 5 ms of fake time
  o.clock = &clock;
  auto b = RecordedBatcher(o, rec);
  ASSERT_TRUE(b.has_value());
  for (int i = 0; i < 3; ++i) {
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(i);
    ASSERT_TRUE((*b)->Schedule(t, {}).ok());
  }
  {
    std::lock_guard lock(rec.mu);
    EXPECT_TRUE(rec.batches.empty()) << "fake time has not moved: the batch must wait";
  }
  clock.AdvanceUs(5000);
  rec.Wait(3);
  ASSERT_EQ(rec.batches.size(), 1u);
  EXPECT_EQ(rec.batches[0], (std::vector<int>{0, 1, 2}));
}

// A task whose caller may withdraw it.
class Withdrawable : public Item {
 public:
  explicit Withdrawable(int i, std::shared_ptr<std::atomic<bool>> flag) : Item(i), flag_(std::move(flag)) {}
  bool cancelled() const override { return flag_->load(); }

 private:
  std::shared_ptr<std::atomic<bool>> flag_;
};

TEST(DynamicBatcher, ACancelledTaskHoldsNoPlaceInAFullQueue) {
  // Fake time stands still: no worker looks at the queue on its own. A
  // task cancelled while queued leaves room for the next arrival at once,
  // and its caller hears before that arrival's Schedule returns.
  FakeClock clock;
  Recorder rec;
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 8;
  o.queue.max_queue_delay_ns = 5'000'000;
  o.queue.level_policies = {{.max_queue_size = 1}};
  o.clock = &clock;
  std::mutex mu;
  std::vector<std::pair<int, StatusCode>> dropped;
  auto b = DynamicBatcher::Create(
      o, [&](int worker, std::vector<std::unique_ptr<BatchTask>>&& batch) { rec.Record(worker, batch); },
      [&](std::unique_ptr<BatchTask> t, const Status& st) {
        std::lock_guard lock(mu);
        dropped.emplace_back(static_cast<Item&>(*t).id, st.code());
      });
  ASSERT_TRUE(b.has_value());
  auto flag = std::make_shared<std::atomic<bool>>(false);
  std::unique_ptr<BatchTask> first = std::make_unique<Withdrawable>(0, flag);
  ASSERT_TRUE((*b)->Schedule(first, {}).ok());
  std::unique_ptr<BatchTask> refused = std::make_unique<Item>(1);
  EXPECT_EQ((*b)->Schedule(refused, {}).code(), StatusCode::kUnavailable) << "the queue holds one";
  flag->store(true);
  std::unique_ptr<BatchTask> second = std::make_unique<Item>(2);
  ASSERT_TRUE((*b)->Schedule(second, {}).ok()) << "the cancelled task's place is free";
  {
    std::lock_guard lock(mu);
    EXPECT_EQ(dropped, (std::vector<std::pair<int, StatusCode>>{{0, StatusCode::kCancelled}}));
  }
  clock.AdvanceUs(5000);
  rec.Wait(1);
  std::lock_guard lock(rec.mu);
  EXPECT_EQ(rec.batches, (std::vector<std::vector<int>>{{2}}));
}

TEST(DynamicBatcher, WithALatencyTargetABatchLeavesOnceEveryRecentClientIsQueued) {
  // A batching delay of an hour of fake time, a latency target: a batch
  // leaves once the model holds as many requests as it has on average
  // lately (closed-loop clients bring no more).
  for (const bool target : {true, false}) {
    FakeClock clock;
    Recorder rec;
    DynamicBatcherOptions o;
    o.queue.max_batch_size = 8;
    o.queue.max_queue_delay_ns = 3'600'000'000'000;
    o.queue.latency_target_ns = target ? 7'200'000'000'000 : 0;
    o.clock = &clock;
    std::promise<void> go;
    std::shared_future<void> gate = go.get_future().share();
    auto b = DynamicBatcher::Create(
        o,
        [&](int, std::vector<std::unique_ptr<BatchTask>>&& batch) {
          std::vector<int> ids;
          for (auto& t : batch) ids.push_back(static_cast<Item&>(*t).id);
          if (ids.front() == 1) gate.wait();
          std::lock_guard lock(rec.mu);
          rec.batches.push_back(ids);
          rec.items += static_cast<int>(ids.size());
          rec.cv.notify_all();
        },
        [](std::unique_ptr<BatchTask>, const Status&) {});
    ASSERT_TRUE(b.has_value());
    auto schedule = [&](int id) {
      std::unique_ptr<BatchTask> t = std::make_unique<Item>(id);
      ASSERT_TRUE((*b)->Schedule(t, {}).ok());
    };
    schedule(1);
    if (!target) {
      // Without a target the delay holds the lone request back.
      {
        std::lock_guard lock(rec.mu);
        EXPECT_TRUE(rec.batches.empty());
      }
      go.set_value();
      (*b)->Shutdown();  // runs what is queued
      std::lock_guard lock(rec.mu);
      EXPECT_EQ(rec.batches, (std::vector<std::vector<int>>{{1}}));
      continue;
    }
    // Alone in the model: it leaves at once (the worker holds it at the gate).
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((*b)->queued() != 0 && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
    ASSERT_EQ((*b)->queued(), 0u) << "a lone request waited for company";
    for (int id = 2; id <= 4; ++id) schedule(id);  // four in the model at once: 1 running, 3 queued
    clock.AdvanceNs(100'000'000);                  // for 100 ms: on average four (kLoadWindowNs is 2 ms)
    go.set_value();
    rec.Wait(1);
    {
      std::lock_guard lock(rec.mu);
      EXPECT_EQ(rec.batches, (std::vector<std::vector<int>>{{1}}));
    }
    // 1 answered: three queued where four were on average. They wait for the fourth client.
    for (int spin = 0; spin < 1000; ++spin) std::this_thread::yield();
    {
      std::lock_guard lock(rec.mu);
      EXPECT_EQ(rec.items, 1) << "three of four recent clients: the batch waits for company";
    }
    schedule(5);
    rec.Wait(5);
    std::lock_guard lock(rec.mu);
    EXPECT_EQ(rec.batches, (std::vector<std::vector<int>>{{1}, {2, 3, 4, 5}}));
  }
}

TEST(DynamicBatcher, WhenTheLoadHandsTheQueueToTheOtherWorkersTheyAreWoken) {
  // One instance and a wide one. Two tasks arrive at light load: the wide
  // worker waits out the batching delay (20 ms) for them, the other sleeps.
  // Time passes with both queued, and a third arrival is refused (queue
  // full): the load is heavy now, so the wide worker may not take them when
  // it wakes. It must hand them to the other worker, which
  // nobody else wakes (before, both slept until the next arrival).
  FakeClock clock;
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 4;
  o.queue.max_queue_delay_ns = 20'000'000;
  o.queue.level_policies = {{.max_queue_size = 2}};
  o.num_workers = 2;
  o.wide_worker = true;
  o.clock = &clock;
  Recorder rec;
  auto b = RecordedBatcher(o, rec);
  ASSERT_TRUE(b.has_value());
  for (int id = 1; id <= 2; ++id) {
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(id);
    ASSERT_TRUE((*b)->Schedule(t, {}).ok());
  }
  // 19 ms pass with both queued (short of the delay: the wide worker waits
  // on), and a third arrival is refused: the load is heavy now. Then the
  // delay passes and the wide worker wakes to find it so.
  clock.AdvanceNs(19'000'000);
  std::unique_ptr<BatchTask> third = std::make_unique<Item>(3);
  EXPECT_EQ((*b)->Schedule(third, {}).code(), StatusCode::kUnavailable) << "the queue holds two";
  clock.AdvanceNs(10'000'000'000);
  std::unique_lock lock(rec.mu);
  ASSERT_TRUE(rec.cv.wait_for(lock, std::chrono::seconds(10), [&] { return rec.items >= 2; }))
      << "the queued tasks were left with no worker looking at them";
  EXPECT_EQ(rec.batches, (std::vector<std::vector<int>>{{1, 2}}));
  EXPECT_EQ(rec.workers, (std::vector<int>{0})) << "the narrow instance, under the heavy load";
}

TEST(DynamicBatcher, ShutdownRunsEveryQueuedTask) {
  FakeClock clock;
  std::atomic<int> ran{0};
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 4;
  o.queue.max_queue_delay_ns = 1'000'000'000'000;  // would wait "forever"
  o.num_workers = 2;
  o.clock = &clock;
  auto b = DynamicBatcher::Create(
      o, [&](int, std::vector<std::unique_ptr<BatchTask>>&& batch) { ran += static_cast<int>(batch.size()); },
      [](std::unique_ptr<BatchTask>, const Status&) {});
  ASSERT_TRUE(b.has_value());
  for (int i = 0; i < 10; ++i) {
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(i);
    ASSERT_TRUE((*b)->Schedule(t, {}).ok());
  }
  (*b)->Shutdown();
  EXPECT_EQ(ran.load(), 10);
  std::unique_ptr<BatchTask> late = std::make_unique<Item>(99);
  EXPECT_EQ((*b)->Schedule(late, {}).code(), StatusCode::kUnavailable);
}

TEST(DynamicBatcher, SendQueuedNowSendsWhatWaitsForCompanyAndWhatComesAfter) {
  // A draining server: nothing will arrive to keep a queued task company.
  FakeClock clock;  // never advanced: only SendQueuedNow lets the batches leave
  Recorder rec;
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 8;
  o.queue.max_queue_delay_ns = 1'000'000'000'000;  // would wait "forever"
  o.clock = &clock;
  auto b = RecordedBatcher(o, rec);
  ASSERT_TRUE(b.has_value());
  for (int i = 0; i < 3; ++i) {
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(i);
    ASSERT_TRUE((*b)->Schedule(t, {}).ok());
  }
  ASSERT_TRUE(quern::testing::Eventually([&] { return clock.waiters() >= 1; })) << "the worker waits out the delay";
  {
    std::lock_guard lock(rec.mu);
    EXPECT_TRUE(rec.batches.empty()) << "sent before its delay, with nothing asking for it";
  }
  auto items = [&rec] {
    std::lock_guard lock(rec.mu);
    return rec.items;
  };
  (*b)->SendQueuedNow();
  ASSERT_TRUE(quern::testing::Eventually([&] { return items() == 3; })) << "still waiting for company";
  std::unique_ptr<BatchTask> later = std::make_unique<Item>(3);
  ASSERT_TRUE((*b)->Schedule(later, {}).ok());
  ASSERT_TRUE(quern::testing::Eventually([&] { return items() == 4; })) << "a later arrival waits for company";
  std::lock_guard lock(rec.mu);
  ASSERT_EQ(rec.batches.size(), 2u);
  EXPECT_EQ(rec.batches[0], (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(rec.batches[1], (std::vector<int>{3}));
}

TEST(DynamicBatcher, AFreeInstanceTakesTheNextBatchWhileAnotherIsBusy) {
  Recorder rec;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<int> started{0};
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 1;
  o.num_workers = 2;
  auto b = DynamicBatcher::Create(
      o,
      [&](int worker, std::vector<std::unique_ptr<BatchTask>>&& batch) {
        const int id = static_cast<Item&>(*batch[0]).id;
        if (id == 0) {
          ++started;
          released.wait();  // instance busy with the first batch
        }
        std::lock_guard lock(rec.mu);
        rec.workers.push_back(worker);
        rec.batches.push_back({id});
        ++rec.items;
        rec.cv.notify_all();
      },
      [](std::unique_ptr<BatchTask>, const Status&) {});
  ASSERT_TRUE(b.has_value());
  std::unique_ptr<BatchTask> t0 = std::make_unique<Item>(0);
  ASSERT_TRUE((*b)->Schedule(t0, {}).ok());
  ASSERT_TRUE(quern::testing::Eventually([&] { return !(started.load() == 0); }));
  std::unique_ptr<BatchTask> t1 = std::make_unique<Item>(1);
  ASSERT_TRUE((*b)->Schedule(t1, {}).ok());
  rec.Wait(1);  // the second batch ran although the first still blocks
  {
    std::lock_guard lock(rec.mu);
    EXPECT_EQ(rec.batches[0], std::vector<int>{1});
  }
  release.set_value();
  rec.Wait(2);
  EXPECT_NE(rec.workers[0], rec.workers[1]);
}

TEST(DynamicBatcher, ExpiredTasksAreDroppedWhileEveryInstanceIsBusy) {
  HangingModel m(/*max_batch_size=*/1, /*measured_ns=*/0, /*hanging=*/{0});  // the only instance stays busy
  ASSERT_TRUE(m.Schedule(0).ok());
  ASSERT_TRUE(quern::testing::Eventually([&] { return m.started.load() == 1; }));
  ASSERT_TRUE(m.Schedule(1, {.deadline_ns = m.clock.NowNs() + 1'000'000}).ok());
  m.clock.AdvanceUs(1000);
  const auto first = m.drops.First();
  ASSERT_TRUE(first.has_value()) << "the task waited for the busy instance past its deadline";
  EXPECT_EQ(*first, (std::pair<int, StatusCode>{1, StatusCode::kDeadlineExceeded}));
  EXPECT_EQ(m.started.load(), 1) << "the expired task never ran";
}

// A task queued while the only instance's batch is expected to end within
// moments still hears of its deadline when that batch overruns (a model
// that hangs): the worker it waited for never comes to look.
TEST(DynamicBatcher, ATaskQueuedAsABatchIsDueToEndTimesOutWhenTheBatchOverruns) {
  // Batches are expected to take 2 ms; the one of task 1 hangs.
  HangingModel m(/*max_batch_size=*/8, /*measured_ns=*/2'000'000, /*hanging=*/{1});
  ASSERT_TRUE(m.Measure());
  ASSERT_TRUE(m.Schedule(1).ok());
  ASSERT_TRUE(quern::testing::Eventually([&] { return m.started.load() == 2; }));
  // Queued at the moment the hanging batch began (the clock has not moved):
  // it is expected to end 2 ms from now, 18 ms before this task's timeout.
  ASSERT_TRUE(m.Schedule(2, {.timeout_ns = 20'000'000}).ok());
  m.clock.AdvanceNs(50'000'000);
  const auto first = m.drops.First();
  ASSERT_TRUE(first.has_value()) << "the task waited for the hanging batch past its timeout";
  EXPECT_EQ(*first, (std::pair<int, StatusCode>{2, StatusCode::kDeadlineExceeded}));
  EXPECT_EQ(m.started.load(), 2) << "the expired task never ran";
}

// While batches keep beginning, the reaper keeps watch (a timed sleep), and
// a task queued behind a batch expected to end before the task's deadline
// does not wake it. When that batch overruns, the watch's end catches the
// task.
TEST(DynamicBatcher, AWatchingReaperCatchesATaskWhoseBatchOverran) {
  // Batches are expected to take 2 ms; those of tasks 1 and 3 hang.
  HangingModel m(/*max_batch_size=*/8, /*measured_ns=*/2'000'000, /*hanging=*/{1, 3});
  ASSERT_TRUE(m.Measure());
  // 2 waits behind 1: the reaper looks after it until 1 ends and 2 runs.
  ASSERT_TRUE(m.Schedule(1).ok());
  ASSERT_TRUE(quern::testing::Eventually([&] { return m.started.load() == 2; }));
  ASSERT_TRUE(m.Schedule(2).ok());
  m.Open(1);
  ASSERT_TRUE(quern::testing::Eventually([&] { return m.started.load() == 3 && m.batcher->queued() == 0; }));
  // Its next look finds the queue empty after batches began: it keeps watch
  // (a timed sleep longer than a poll). Its polls are let come meanwhile.
  constexpr int64_t kPollNs = int64_t{DynamicBatcher::kReapPollMs} * 1'000'000;
  int64_t watch_until = 0;
  ASSERT_TRUE(quern::testing::Eventually([&] {
    const int64_t at = m.batcher->reaper_wake_at_ns();
    const int64_t now = m.clock.NowNs();
    if (at > now + kPollNs) {
      watch_until = at;
      return true;
    }
    if (at > 0) m.clock.AdvanceNs(std::max<int64_t>(at - now, 0));
    return false;
  })) << "the reaper does not keep watch: its next look is at "
      << m.batcher->reaper_wake_at_ns();
  // 3 takes the instance and hangs; 4, due 3 ms from now, is queued while 3
  // is expected to end in 2 ms: the reaper is left to its watch.
  ASSERT_TRUE(m.Schedule(3).ok());
  ASSERT_TRUE(quern::testing::Eventually([&] { return m.started.load() == 4; }));
  ASSERT_TRUE(m.Schedule(4, {.timeout_ns = 3'000'000}).ok());
  m.clock.AdvanceNs(watch_until - m.clock.NowNs() + 1'000'000);
  const auto first = m.drops.First();
  ASSERT_TRUE(first.has_value()) << "the task waited for the overrunning batch past its timeout";
  EXPECT_EQ(*first, (std::pair<int, StatusCode>{4, StatusCode::kDeadlineExceeded}));
  EXPECT_EQ(m.started.load(), 4) << "the expired task never ran";
}

TEST(DynamicBatcher, TunerLowersTheBatchLimitToTheFastestSize) {
  // Each batch "runs" by moving the fake clock by its cost: 50 us per item at
  // batch 2, more at every other size. The tuner measures those times.
  FakeClock clock;
  const std::map<int64_t, int64_t> per_item_us{{1, 100}, {2, 50}, {4, 80}, {8, 120}};
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 8;
  o.clock = &clock;
  BatchSizeTunerOptions t;
  t.candidates = {1, 2, 4, 8};
  t.samples = 3;
  t.min_phase_ns = 0;
  t.interval = 2;
  o.tuner = t;
  std::promise<void> go;
  std::shared_future<void> gate = go.get_future().share();
  Recorder rec;
  auto b = DynamicBatcher::Create(
      o,
      [&](int, std::vector<std::unique_ptr<BatchTask>>&& batch) {
        gate.wait();  // the whole queue is in place before the first batch runs
        const auto n = static_cast<int64_t>(batch.size());
        // (The first batch was formed before the gate, of whatever was
        // queued then: any size up to 8, priced as the next size up.)
        const auto cost = per_item_us.lower_bound(n);
        clock.AdvanceUs((cost == per_item_us.end() ? per_item_us.rbegin()->second : cost->second) * n);
        std::lock_guard lock(rec.mu);
        rec.batches.push_back(std::vector<int>(batch.size()));
        rec.items += static_cast<int>(n);
        rec.cv.notify_all();
      },
      [](std::unique_ptr<BatchTask>, const Status&) {});
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ((*b)->batch_limit(), 8);
  constexpr int kTasks = 600;
  for (int i = 0; i < kTasks; ++i) {
    std::unique_ptr<BatchTask> task = std::make_unique<Item>(i);
    ASSERT_TRUE((*b)->Schedule(task, {}).ok());
  }
  go.set_value();
  rec.Wait(kTasks);
  std::map<size_t, int> items_by_size;
  for (const auto& batch : rec.batches) items_by_size[batch.size()] += static_cast<int>(batch.size());
  EXPECT_GT(items_by_size[2], kTasks * 6 / 10)
      << "items in batches of 1/2/4/8: " << items_by_size[1] << "/" << items_by_size[2] << "/" << items_by_size[4]
      << "/" << items_by_size[8];
}

TEST(DynamicBatcher, AdmissionRefusesWorkBeyondTheWaitingTimeLimit) {
  // Each item "runs" for 10 ms of fake time on one of two workers; the queue
  // may hold 100 ms of work: 2 workers x 100 ms / 10 ms = 20 items.
  FakeClock clock;
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 1;
  o.num_workers = 2;
  o.clock = &clock;
  o.max_queue_wait_ns = 100'000'000;
  std::promise<void> go;
  std::shared_future<void> gate = go.get_future().share();
  Recorder rec;
  auto b = DynamicBatcher::Create(
      o,
      [&](int, std::vector<std::unique_ptr<BatchTask>>&& batch) {
        clock.AdvanceNs(10'000'000 * static_cast<int64_t>(batch.size()));
        const int id = static_cast<Item&>(*batch[0]).id;
        if (id >= 1) gate.wait();  // the first measures the cost; then both workers are held
        std::lock_guard lock(rec.mu);
        rec.items += static_cast<int>(batch.size());
        rec.cv.notify_all();
      },
      [](std::unique_ptr<BatchTask>, const Status&) {});
  ASSERT_TRUE(b.has_value());
  std::unique_ptr<BatchTask> first = std::make_unique<Item>(0);
  ASSERT_TRUE((*b)->Schedule(first, {}).ok());  // no estimate yet: always admitted
  rec.Wait(1);
  // Measured alone: another batch running meanwhile would advance the
  // shared fake clock inside this one's measurement.
  ASSERT_TRUE(quern::testing::Eventually([&] { return !((*b)->ns_per_item() == 0); }));
  EXPECT_NEAR((*b)->ns_per_item(), 10'000'000.0, 1.0);
  // Two items occupy the workers, then the queue fills to its 100 ms.
  int admitted = 0;
  Status refused;
  for (int i = 1; i < 100; ++i) {
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(i);
    Status st = (*b)->Schedule(t, {});
    if (st.ok()) {
      ++admitted;
      EXPECT_EQ(t, nullptr);
    } else {
      refused = st;
      EXPECT_NE(t, nullptr) << "a refused task stays with the caller";
      break;
    }
    // Let the workers take the first two before counting the queue.
    if (i == 2) {
      while ((*b)->queued() > 0) std::this_thread::yield();
    }
  }
  // 20 queued items are 100 ms of work: the 21st still fits behind them, the 22nd does not.
  EXPECT_EQ(admitted, 2 + 21);
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable);
  EXPECT_NE(refused.message().find("over the limit of 100 ms"), std::string::npos) << refused.message();
  EXPECT_EQ((*b)->CheckAdmission().code(), StatusCode::kUnavailable) << "the same answer without a task";
  go.set_value();
  rec.Wait(1 + admitted);
  EXPECT_TRUE((*b)->CheckAdmission().ok());
}

TEST(DynamicBatcher, ARequestThatCannotMeetItsDeadlineIsRefusedAtOnce) {
  // Each item "runs" for 10 ms of fake time, counted when its batch ends,
  // on one worker. While item 1 runs (10 ms left) and items 2-4 wait (30
  // ms), a request would finish 50 ms from now.
  FakeClock clock;
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 1;
  o.num_workers = 1;
  o.clock = &clock;
  std::promise<void> go;
  std::shared_future<void> gate = go.get_future().share();
  std::atomic<bool> running_1{false};
  Recorder rec;
  std::atomic<int> dropped{0};
  auto b = DynamicBatcher::Create(
      o,
      [&](int, std::vector<std::unique_ptr<BatchTask>>&& batch) {
        const int id = static_cast<Item&>(*batch[0]).id;
        if (id == 1) {
          running_1 = true;
          gate.wait();
        }
        clock.AdvanceNs(10'000'000);
        std::lock_guard lock(rec.mu);
        rec.batches.push_back({id});
        rec.items += 1;
        rec.cv.notify_all();
      },
      [&](std::unique_ptr<BatchTask>, const Status&) { ++dropped; });
  ASSERT_TRUE(b.has_value());
  const int64_t start = clock.NowNs();
  std::unique_ptr<BatchTask> t = std::make_unique<Item>(0);
  ScheduleOptions impossible;
  impossible.deadline_ns = start + 1;  // nothing measured yet: admitted (and run: it starts at once)
  ASSERT_TRUE((*b)->Schedule(t, impossible).ok());
  rec.Wait(1);
  ASSERT_TRUE(quern::testing::Eventually([&] { return !((*b)->ns_per_item() == 0); }));
  t = std::make_unique<Item>(1);
  ASSERT_TRUE((*b)->Schedule(t, {}).ok());
  ASSERT_TRUE(quern::testing::Eventually([&] { return !(!running_1); }));
  const int64_t now = clock.NowNs();
  for (int i = 2; i <= 4; ++i) {
    t = std::make_unique<Item>(i);
    ASSERT_TRUE((*b)->Schedule(t, {}).ok());
  }
  ScheduleOptions tight;
  tight.deadline_ns = now + 45'000'000;
  t = std::make_unique<Item>(5);
  Status st = (*b)->Schedule(t, tight);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(t, nullptr) << "a refused task stays with the caller";
  EXPECT_NE(st.message().find("would finish in about 50 ms (3 items queued ahead of it and 1 of 1 instances busy), "
                              "after its deadline in 45 ms"),
            std::string::npos)
      << st.message();
  ScheduleOptions enough;
  enough.deadline_ns = now + 55'000'000;
  t = std::make_unique<Item>(6);
  ASSERT_TRUE((*b)->Schedule(t, enough).ok()) << "finishes at 50 ms, before 55";
  // Behind 4 queued items now: a queue timeout of 45 ms is too short for the
  // 50 ms wait, 55 ms is enough.
  ScheduleOptions short_wait;
  short_wait.timeout_ns = 45'000'000;
  t = std::make_unique<Item>(7);
  st = (*b)->Schedule(t, short_wait);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("would wait about 50 ms"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("longer than its queue timeout of 45 ms"), std::string::npos) << st.message();
  short_wait.timeout_ns = 55'000'000;
  t = std::make_unique<Item>(8);
  ASSERT_TRUE((*b)->Schedule(t, short_wait).ok());
  go.set_value();
  rec.Wait(7);
  std::lock_guard lock(rec.mu);
  EXPECT_EQ(rec.batches, (std::vector<std::vector<int>>{{0}, {1}, {2}, {3}, {4}, {6}, {8}}));
  EXPECT_EQ(dropped.load(), 0) << "6 and 8 could still finish in time when their turn came";
}

TEST(DynamicBatcher, TheWaitEstimateIsNoMorePessimisticThanTheMeasuredQueue) {
  // A batch takes 10 ms of fake time whatever its size (up to 8), on one
  // worker. Single requests make the time per item 10 ms; under load the
  // queue drains 8 items per 10 ms. A request behind 16 queued items waits
  // 30 ms (the running batch's 10, two full batches' 20): the time per item
  // alone would say about 140 ms, the full batches' time per item (1.25 ms,
  // measured on the batches the limit cut short) about 28.
  FakeClock clock;
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 8;
  o.num_workers = 1;
  o.clock = &clock;
  std::mutex gate_mu;
  std::condition_variable gate_cv;
  int held = -1;  // the id a batch holds at the gate until released
  std::atomic<int> holding{-1};
  Recorder rec;
  std::atomic<int> dropped{0};
  auto b = DynamicBatcher::Create(
      o,
      [&](int worker, std::vector<std::unique_ptr<BatchTask>>&& batch) {
        const int id = static_cast<Item&>(*batch[0]).id;
        {
          std::unique_lock lock(gate_mu);
          if (id == held) {
            holding = id;
            gate_cv.wait(lock, [&] { return held != id; });
          }
        }
        clock.AdvanceNs(10'000'000);
        rec.Record(worker, batch);
      },
      [&](std::unique_ptr<BatchTask>, const Status&) { ++dropped; });
  ASSERT_TRUE(b.has_value());
  int scheduled = 0;
  auto schedule = [&](int id, const ScheduleOptions& opts) {
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(id);
    Status st = (*b)->Schedule(t, opts);
    if (st.ok()) ++scheduled;
    return st;
  };
  for (int i = 0; i < 5; ++i) {  // a light load: one at a time
    ASSERT_TRUE(schedule(i, {}).ok());
    rec.Wait(scheduled);
  }
  EXPECT_NEAR((*b)->ns_per_item(), 10e6, 1);
  // A burst behind a held batch, twice: the first teaches the queue's pace.
  auto burst = [&](int first) {
    {
      std::lock_guard lock(gate_mu);
      held = first;
    }
    EXPECT_TRUE(schedule(first, {}).ok());
    while (holding != first) std::this_thread::yield();
    for (int i = 1; i <= 16; ++i) EXPECT_TRUE(schedule(first + i, {}).ok());
  };
  auto release = [&] {
    {
      std::lock_guard lock(gate_mu);
      held = -1;
    }
    gate_cv.notify_all();
    rec.Wait(scheduled);
  };
  burst(100);
  release();
  EXPECT_GT((*b)->ns_per_item(), 8e6) << "still mostly the single requests' time";
  burst(200);
  ScheduleOptions enough;
  enough.timeout_ns = 45'000'000;
  const Status admitted = schedule(300, enough);
  EXPECT_TRUE(admitted.ok()) << "it waits 30 ms, within its 45 ms: " << admitted.message();
  ScheduleOptions before_its_run;  // with 3 full batches ahead now (17 items), and the running one
  before_its_run.deadline_ns = clock.NowNs() + 30'000'000;
  const Status late = schedule(302, before_its_run);
  EXPECT_EQ(late.code(), StatusCode::kUnavailable) << "it would finish after about 40 ms, past its 30";
  ScheduleOptions too_short;
  too_short.timeout_ns = 20'000'000;
  const Status refused = schedule(301, too_short);
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable) << "it would wait 30 ms, over its 20 ms";
  EXPECT_NE(refused.message().find("longer than its queue timeout of 20 ms"), std::string::npos) << refused.message();
  release();
  EXPECT_EQ(dropped.load(), 0);
  std::lock_guard lock(rec.mu);
  ASSERT_FALSE(rec.batches.empty());
  EXPECT_EQ(rec.batches.back(), (std::vector<int>{300})) << "it ran, in time";
}

TEST(DynamicBatcher, AdmissionNeverLocksAModelOut) {
  // One item takes 6 s of fake time, over the 5 s limit: later tasks are
  // still admitted whenever a worker is free or nothing waits.
  FakeClock clock;
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 1;
  o.clock = &clock;
  o.max_queue_wait_ns = 5'000'000'000;
  Recorder rec;
  auto b = DynamicBatcher::Create(
      o,
      [&](int, std::vector<std::unique_ptr<BatchTask>>&& batch) {
        clock.AdvanceNs(6'000'000'000);
        std::lock_guard lock(rec.mu);
        rec.items += static_cast<int>(batch.size());
        rec.cv.notify_all();
      },
      [](std::unique_ptr<BatchTask>, const Status&) {});
  ASSERT_TRUE(b.has_value());
  for (int i = 0; i < 3; ++i) {
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(i);
    ASSERT_TRUE((*b)->Schedule(t, {}).ok()) << "task " << i;
    rec.Wait(i + 1);
  }
  EXPECT_GT((*b)->ns_per_item(), 5e9);
}

// A model whose run needs 1 MiB of run memory per row, taken from a
// BlockCache (as ONNX Runtime's runs take it); a batch runs padded up to the
// next of `pad` (fixed batch sizes) when given.
struct MemoryHarness {
  FakeClock clock;
  BlockCache cache{{size_t{256} << 10, 5'000'000'000}, clock};
  Recorder rec;
  std::promise<void> go;
  std::shared_future<void> gate = go.get_future().share();
  bool allocate = true;
  std::vector<int64_t> pad;

  Result<std::unique_ptr<DynamicBatcher>> Create(DynamicBatcherOptions o) {
    o.clock = &clock;
    o.run_sizes = pad;
    return DynamicBatcher::Create(
        o,
        [this](int worker, std::vector<std::unique_ptr<BatchTask>>&& batch) {
          gate.wait();
          auto rows = static_cast<int64_t>(batch.size());
          for (int64_t p : pad) {
            if (p >= rows) {
              rows = p;
              break;
            }
          }
          // (1 MiB - the block's header) per row: a class of exactly that many MiB.
          void* run = allocate ? cache.Alloc((static_cast<size_t>(rows) << 20) - BlockCache::kAlignment) : nullptr;
          cache.Free(run);
          rec.Record(worker, batch);
        },
        [](std::unique_ptr<BatchTask>, const Status&) {});
  }

  // Queues `n` tasks, opens the gate and waits for them all; the batch sizes in order.
  std::vector<size_t> Run(DynamicBatcher& b, int n) {
    for (int i = 0; i < n; ++i) {
      std::unique_ptr<BatchTask> task = std::make_unique<Item>(i);
      EXPECT_TRUE(b.Schedule(task, {}).ok());
    }
    go.set_value();
    rec.Wait(n);
    std::lock_guard lock(rec.mu);
    std::vector<size_t> sizes;
    for (const auto& batch : rec.batches) sizes.push_back(batch.size());
    return sizes;
  }
};

TEST(DynamicBatcher, AMemoryBudgetKeepsBatchesWhereTheirMeasuredRunMemoryFits) {
  MemoryHarness h;
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 16;
  o.num_workers = 2;
  o.memory_budget_bytes = int64_t{8} << 20;  // two instances: 4 MiB, 4 items, each
  BatchSizeTunerOptions t;
  t.candidates = {1, 2, 4, 8, 16};
  o.tuner = t;
  auto b = h.Create(o);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ((*b)->memory_limit(), 1) << "nothing measured yet: batches of one";
  EXPECT_EQ((*b)->batch_limit(), 1);
  const std::vector<size_t> sizes = h.Run(**b, 200);
  EXPECT_EQ((*b)->memory_limit(), 4);
  EXPECT_EQ((*b)->batch_limit(), 4) << "the tuner's limit (16, its largest size) within the budget";
  EXPECT_EQ((*b)->batch_memory_bytes(), int64_t{4} << 20) << "a batch of 4, measured";
  EXPECT_EQ(sizes.front(), 1u) << "the first batch, before any was measured";
  EXPECT_EQ(*std::max_element(sizes.begin(), sizes.end()), 4u) << "as large as the budget allows, never larger";
}

TEST(DynamicBatcher, WithABudgetTheLimitGrowsOnlyAsLargerBatchesAreMeasured) {
  MemoryHarness h;
  h.allocate = false;  // runs that take nothing from the allocator: in the end, no bound
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 16;
  o.memory_budget_bytes = int64_t{1} << 20;
  auto b = h.Create(o);
  ASSERT_TRUE(b.has_value());
  const std::vector<size_t> sizes = h.Run(**b, 100);
  ASSERT_GE(sizes.size(), 5u);
  // One worker: each batch formed after the one before was measured, at most twice its size.
  EXPECT_EQ(std::vector<size_t>(sizes.begin(), sizes.begin() + 5), (std::vector<size_t>{1, 2, 4, 8, 16}));
  EXPECT_EQ((*b)->memory_limit(), 16);
}

TEST(DynamicBatcher, WithoutABudgetRunMemoryIsMeasuredAndNothingBounded) {
  MemoryHarness h;
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 8;
  auto b = h.Create(o);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ((*b)->memory_limit(), 0);
  EXPECT_EQ((*b)->batch_memory_bytes(), 0) << "nothing measured yet";
  std::unique_ptr<BatchTask> first = std::make_unique<Item>(0);
  ASSERT_TRUE((*b)->Schedule(first, {}).ok());
  h.go.set_value();
  h.rec.Wait(1);
  // A batch of one measured at 1 MiB: one of 8 (the limit) expected at 8 MiB.
  EXPECT_TRUE(testing::Eventually([&] { return (*b)->batch_memory_bytes() == int64_t{8} << 20; }))
      << (*b)->batch_memory_bytes();
  EXPECT_EQ((*b)->batch_limit(), 8);
  EXPECT_EQ((*b)->memory_limit(), 0);
}

TEST(DynamicBatcher, ABudgetMeasuresABatchAtTheSizeItIsPaddedTo) {
  MemoryHarness h;
  h.pad = {4, 8};  // fixed batch sizes: a batch of 1 runs 4 rows
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 8;
  o.memory_budget_bytes = int64_t{4} << 20;  // 4 rows
  auto b = h.Create(o);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ((*b)->memory_limit(), 4) << "a batch of 4 runs as many rows as a batch of 1";
  const std::vector<size_t> sizes = h.Run(**b, 40);
  EXPECT_EQ((*b)->memory_limit(), 4) << "4 rows measured at 4 MiB, not at 1 item";
  EXPECT_EQ(*std::max_element(sizes.begin(), sizes.end()), 4u);
}

TEST(DynamicBatcher, WithoutATunerTheLimitIsMaxBatchSize) {
  FakeClock clock;
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 8;
  o.clock = &clock;
  auto b = DynamicBatcher::Create(
      o, [](int, std::vector<std::unique_ptr<BatchTask>>&&) {}, [](std::unique_ptr<BatchTask>, const Status&) {});
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ((*b)->batch_limit(), 8);
}

}  // namespace
}  // namespace quern

namespace quern {
namespace {

// Batches held at a gate while it is closed, each taking `run_ns` on the fake
// clock; records which worker ran each batch and on which thread, the most
// batches on one instance at once, and whether a wide batch (the last
// worker's, when there is a wide one) ever ran beside another.
struct GatedHarness {
  std::mutex mu;
  std::condition_variable cv;
  bool open = true;
  std::vector<int> running;              // per worker
  std::vector<int> workers;              // who ran each batch, in order
  std::vector<std::thread::id> threads;  // and where
  int most_at_once = 0;
  bool overlap = false;
  FakeClock clock;
  std::atomic<int64_t> run_ns{0};  // how long each batch takes on the fake clock
  std::unique_ptr<DynamicBatcher> batcher;
  int next_id = 0;

  explicit GatedHarness(DynamicBatcherOptions o) {
    o.clock = &clock;
    running.assign(static_cast<size_t>(o.num_workers), 0);
    const int wide = o.wide_worker ? o.num_workers - 1 : -1;
    batcher = std::move(*DynamicBatcher::Create(
        o,
        [this, wide](int worker, std::vector<std::unique_ptr<BatchTask>>&&) {
          clock.AdvanceNs(run_ns.load());
          std::unique_lock lock(mu);
          most_at_once = std::max(most_at_once, ++running[static_cast<size_t>(worker)]);
          const int all = std::accumulate(running.begin(), running.end(), 0);
          if (wide >= 0 && (worker == wide ? all > 1 : running[static_cast<size_t>(wide)] > 0)) overlap = true;
          workers.push_back(worker);
          threads.push_back(std::this_thread::get_id());
          cv.notify_all();
          cv.wait(lock, [&] { return open; });
          --running[static_cast<size_t>(worker)];
          cv.notify_all();
        },
        [](std::unique_ptr<BatchTask>, const Status&) {}));
  }
  ~GatedHarness() {
    Open();
    batcher->Shutdown();
  }
  void Send(int64_t in_model) {
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(next_id++);
    ScheduleOptions so;
    so.in_model = in_model;
    ASSERT_TRUE(batcher->Schedule(t, so).ok());
  }
  // A caller that lends its thread, on a thread of its own.
  std::thread Caller(int id) {
    return std::thread([this, id] {
      std::unique_ptr<BatchTask> t = std::make_unique<Item>(id);
      ScheduleOptions so;
      so.run_here = true;
      EXPECT_TRUE(batcher->Schedule(t, so).ok());
    });
  }
  // Waits (up to 10 s) until `n` batches have started and, with the gate
  // open, finished.
  // Waits (up to 10 s) until nothing is queued and every batch's end has
  // been recorded by the batcher (the harness's own count drops a moment
  // before): a request sent next then meets an idle batcher, whatever the
  // threads' timing on a loaded machine.
  bool WaitIdle() {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (batcher->queued() > 0 || batcher->running_tasks() > 0) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return true;
  }
  bool WaitStarted(size_t n) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(10), [&] {
      return workers.size() >= n && (!open || std::accumulate(running.begin(), running.end(), 0) == 0);
    });
  }
  void Close() {
    std::lock_guard lock(mu);
    open = false;
  }
  void Open() {
    std::lock_guard lock(mu);
    open = true;
    cv.notify_all();
  }
  int Running(int worker) {
    std::lock_guard lock(mu);
    return running[static_cast<size_t>(worker)];
  }
  size_t Started() {
    std::lock_guard lock(mu);
    return workers.size();
  }
};

// Three workers, the last one wide.
struct WideHarness : GatedHarness {
  WideHarness() : GatedHarness(Options()) {}
  static DynamicBatcherOptions Options() {
    DynamicBatcherOptions o;
    o.queue.max_batch_size = 1;
    o.num_workers = 3;
    o.wide_worker = true;
    return o;
  }
};

TEST(DynamicBatcher, ALoneRequestRunsWideAndConcurrentOnesNarrowNeverTogether) {
  WideHarness h;
  // Light load: one request at a time takes the wide worker.
  for (size_t i = 1; i <= 3; ++i) {
    h.Send(1);
    ASSERT_TRUE(h.WaitStarted(i));
    EXPECT_EQ(h.workers.back(), 2) << "request " << i;
  }
  // Four in flight: the narrow workers take them, two at a time, and the
  // wide one waits.
  h.Close();
  for (int i = 0; i < 4; ++i) h.Send(4);
  ASSERT_TRUE(h.WaitStarted(5));
  {
    std::unique_lock lock(h.mu);
    ASSERT_TRUE(h.cv.wait_for(lock, std::chrono::seconds(10), [&] { return h.running[0] + h.running[1] == 2; }));
    EXPECT_EQ(h.running[2], 0);
  }
  h.Open();
  ASSERT_TRUE(h.WaitStarted(7));
  for (size_t i = 3; i < 7; ++i) EXPECT_NE(h.workers[i], 2) << "batch " << i;
  // Back to one at a time: the wide worker takes over again once the
  // average has come down.
  bool wide_again = false;
  for (size_t i = 8; i <= 20 && !wide_again; ++i) {
    h.Send(1);
    ASSERT_TRUE(h.WaitStarted(i));
    wide_again = h.workers.back() == 2;
  }
  EXPECT_TRUE(wide_again);
  // A wide batch running: requests that arrive wait for it, even when they
  // make the load heavy, and then run narrow.
  h.Close();
  const size_t started = h.Started() + 1;  // counted before the batch can start
  h.Send(1);
  ASSERT_TRUE(h.WaitStarted(started));
  EXPECT_EQ(h.workers.back(), 2);
  for (int i = 0; i < 3; ++i) h.Send(4);
  // Time for a narrow worker that wrongly starts beside it to do so (the
  // processor records the overlap).
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(h.Running(0) + h.Running(1), 0);
  h.Open();
  ASSERT_TRUE(h.WaitStarted(started + 3));
  EXPECT_FALSE(h.overlap) << "a wide batch ran beside another";
  EXPECT_EQ(h.batcher->wide_batches(), std::count(h.workers.begin(), h.workers.end(), 2));
}

TEST(DynamicBatcher, AWideWorkerNeedsAnother) {
  DynamicBatcherOptions o;
  o.num_workers = 1;
  o.wide_worker = true;
  auto b = DynamicBatcher::Create(
      o, [](int, std::vector<std::unique_ptr<BatchTask>>&&) {}, [](std::unique_ptr<BatchTask>, const Status&) {});
  EXPECT_FALSE(b.has_value());
}

}  // namespace
}  // namespace quern

namespace quern {
namespace {

TEST(DynamicBatcher, AFreeInstanceRunsACallersBatchOnTheCallersThread) {
  std::mutex mu;
  std::vector<std::thread::id> ran_on;
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 4;
  o.num_workers = 2;
  auto b = std::move(*DynamicBatcher::Create(
      o,
      [&](int, std::vector<std::unique_ptr<BatchTask>>&& batch) {
        std::lock_guard lock(mu);
        for (size_t i = 0; i < batch.size(); ++i) ran_on.push_back(std::this_thread::get_id());
      },
      [](std::unique_ptr<BatchTask>, const Status&) {}));
  for (int i = 0; i < 3; ++i) {
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(i);
    ScheduleOptions so;
    so.run_here = true;
    ASSERT_TRUE(b->Schedule(t, so).ok());
    // Ran before Schedule returned, here.
    std::lock_guard lock(mu);
    ASSERT_EQ(ran_on.size(), static_cast<size_t>(i + 1));
    EXPECT_EQ(ran_on.back(), std::this_thread::get_id());
  }
  // Without run_here a worker runs it.
  std::unique_ptr<BatchTask> t = std::make_unique<Item>(9);
  ASSERT_TRUE(b->Schedule(t, {}).ok());
  b->Shutdown();
  ASSERT_EQ(ran_on.size(), 4u);
  EXPECT_NE(ran_on.back(), std::this_thread::get_id());
}

// An asynchronous caller lends its thread only for batches measured to be
// shorter than its bound: never before the first batch is measured, never
// for a model whose batches take longer, and never beside a busy instance.
TEST(DynamicBatcher, ACallerWithABoundRunsOnlyBatchesMeasuredShorterThanIt) {
  FakeClock clock;
  std::mutex mu;
  std::vector<std::thread::id> ran_on;
  std::atomic<int64_t> cost_ns{100'000};  // per batch of one
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 4;
  o.num_workers = 1;
  o.clock = &clock;
  auto b = std::move(*DynamicBatcher::Create(
      o,
      [&](int, std::vector<std::unique_ptr<BatchTask>>&& batch) {
        clock.AdvanceNs(cost_ns.load() * static_cast<int64_t>(batch.size()));
        std::lock_guard lock(mu);
        for (size_t i = 0; i < batch.size(); ++i) ran_on.push_back(std::this_thread::get_id());
      },
      [](std::unique_ptr<BatchTask>, const Status&) {}));
  auto ran = [&](size_t n) {
    for (int i = 0; i < 2000; ++i) {
      {
        std::lock_guard lock(mu);
        if (ran_on.size() >= n) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  };
  auto schedule = [&](int64_t below_ns) {
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(0);
    ScheduleOptions so;
    so.run_here = true;
    so.run_here_below_ns = below_ns;
    return b->Schedule(t, so);
  };
  // Nothing measured yet: a worker runs it.
  ASSERT_TRUE(schedule(1'000'000).ok());
  ASSERT_TRUE(ran(1));
  EXPECT_NE(ran_on.back(), std::this_thread::get_id());
  // (The batch is in ran_on before the worker has ended it: measured, the instance free again.)
  ASSERT_TRUE(quern::testing::Eventually([&] { return b->ns_per_item() > 0; }));
  // Measured at 100 us per item: under a 1 ms bound, here; over a 50 us bound, on the worker.
  ASSERT_TRUE(schedule(1'000'000).ok());
  ASSERT_TRUE(ran(2));
  EXPECT_EQ(ran_on.back(), std::this_thread::get_id());
  ASSERT_TRUE(schedule(50'000).ok());
  ASSERT_TRUE(ran(3));
  EXPECT_NE(ran_on.back(), std::this_thread::get_id());
  // The model slows to 5 ms per item: a 1 ms bound no longer lends the thread
  // (once the average has moved past it).
  cost_ns = 5'000'000;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(schedule(0).ok());  // unbounded (Engine::Run): measures the new cost here
    ASSERT_TRUE(ran(4 + static_cast<size_t>(i)));
  }
  ASSERT_GT(b->ns_per_item(), 1'000'000);
  ASSERT_TRUE(schedule(1'000'000).ok());
  ASSERT_TRUE(ran(7));
  EXPECT_NE(ran_on.back(), std::this_thread::get_id());
  b->Shutdown();
}

// Two workers whose batches wait at a gate; records who ran what where.
struct GatedPair {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  int running[2] = {0, 0};
  bool overlap = false;
  std::vector<std::pair<int, std::thread::id>> batches;  // worker, thread
  std::unique_ptr<DynamicBatcher> batcher;

  GatedPair() {
    DynamicBatcherOptions o;
    o.queue.max_batch_size = 1;
    o.num_workers = 2;
    batcher = std::move(*DynamicBatcher::Create(
        o,
        [this](int worker, std::vector<std::unique_ptr<BatchTask>>&&) {
          std::unique_lock lock(mu);
          if (++running[worker] > 1) overlap = true;
          batches.emplace_back(worker, std::this_thread::get_id());
          cv.notify_all();
          cv.wait(lock, [&] { return open; });
          --running[worker];
        },
        [](std::unique_ptr<BatchTask>, const Status&) {}));
  }
  ~GatedPair() {
    Open();
    batcher->Shutdown();
  }
  void Open() {
    std::lock_guard lock(mu);
    open = true;
    cv.notify_all();
  }
  bool WaitBatches(size_t n) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(10), [&] { return batches.size() >= n; });
  }
};

// At light load the wide instance takes the batches: a bounded caller does
// not take it (its runs feed no time per item, so a run that outgrew the
// bound would never be noticed); an unbounded one (Engine::Run) does.
TEST(DynamicBatcher, ABoundedCallerLeavesTheWideInstanceToItsWorker) {
  std::mutex mu;
  std::vector<std::thread::id> ran_on;
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 4;
  o.num_workers = 2;
  o.wide_worker = true;
  auto b = std::move(*DynamicBatcher::Create(
      o,
      [&](int, std::vector<std::unique_ptr<BatchTask>>&& batch) {
        std::lock_guard lock(mu);
        for (size_t i = 0; i < batch.size(); ++i) ran_on.push_back(std::this_thread::get_id());
      },
      [](std::unique_ptr<BatchTask>, const Status&) {}));
  auto schedule = [&](int64_t below_ns) {
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(0);
    ScheduleOptions so;
    so.run_here = true;
    so.run_here_below_ns = below_ns;
    return b->Schedule(t, so);
  };
  auto ran = [&](size_t n) {
    for (int i = 0; i < 2000; ++i) {
      {
        std::lock_guard lock(mu);
        if (ran_on.size() >= n) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  };
  ASSERT_TRUE(schedule(0).ok());  // here, on the wide instance: measures the time per item
  ASSERT_TRUE(ran(1));
  EXPECT_EQ(ran_on.back(), std::this_thread::get_id());
  ASSERT_GT(b->ns_per_item(), 0);
  ASSERT_TRUE(schedule(1'000'000'000).ok());
  ASSERT_TRUE(ran(2));
  EXPECT_NE(ran_on.back(), std::this_thread::get_id());
  EXPECT_EQ(b->wide_batches(), 2);  // the wide worker ran it
  b->Shutdown();
}

// A caller with a bound lends its thread only into an idle model: while
// another batch runs, its task goes to a free worker (where company may
// join it) even though an instance is free and the batch is short.
TEST(DynamicBatcher, ABoundedCallerLeavesABusyModelToItsWorkers) {
  GatedPair g;
  g.Open();
  std::unique_ptr<BatchTask> first = std::make_unique<Item>(0);
  ASSERT_TRUE(g.batcher->Schedule(first, {}).ok());
  ASSERT_TRUE(g.WaitBatches(1));
  for (int i = 0; i < 2000 && g.batcher->ns_per_item() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_GT(g.batcher->ns_per_item(), 0);  // measured: short
  {
    std::lock_guard lock(g.mu);
    g.open = false;
  }
  std::unique_ptr<BatchTask> busy = std::make_unique<Item>(1);
  ASSERT_TRUE(g.batcher->Schedule(busy, {}).ok());
  ASSERT_TRUE(g.WaitBatches(2));  // one instance held at the gate, the other free
  std::thread::id caller;
  auto f = std::async(std::launch::async, [&] {
    caller = std::this_thread::get_id();
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(2);
    ScheduleOptions so;
    so.run_here = true;
    so.run_here_below_ns = 1'000'000'000;
    return g.batcher->Schedule(t, so);
  });
  if (f.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    g.Open();  // it ran its batch here, into a busy model, and waits at the gate
    f.wait();
    FAIL() << "the caller ran its batch on its own thread beside a running batch";
  }
  ASSERT_TRUE(f.get().ok());
  ASSERT_TRUE(g.WaitBatches(3));
  std::lock_guard lock(g.mu);
  EXPECT_NE(g.batches[2].second, caller);
}

TEST(DynamicBatcher, ACallerWhoFindsEveryInstanceBusyLeavesItsTaskQueued) {
  GatedPair g;
  for (int i = 0; i < 2; ++i) {
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(i);
    ASSERT_TRUE(g.batcher->Schedule(t, {}).ok());
  }
  ASSERT_TRUE(g.WaitBatches(2));  // both instances held at the gate
  std::unique_ptr<BatchTask> t = std::make_unique<Item>(2);
  ScheduleOptions so;
  so.run_here = true;
  ASSERT_TRUE(g.batcher->Schedule(t, so).ok());  // returns at once: nothing free
  EXPECT_EQ(g.batcher->queued(), 1u);
  g.Open();
  ASSERT_TRUE(g.WaitBatches(3));
  std::lock_guard lock(g.mu);
  EXPECT_NE(g.batches[2].second, std::this_thread::get_id());
  EXPECT_FALSE(g.overlap);
}

TEST(DynamicBatcher, AWorkerWaitsForTheInstanceACallerHolds) {
  GatedPair g;
  // Callers take both instances and hold them at the gate.
  std::vector<std::thread> callers;
  for (int i = 0; i < 2; ++i) {
    callers.emplace_back([&, i] {
      std::unique_ptr<BatchTask> t = std::make_unique<Item>(i);
      ScheduleOptions so;
      so.run_here = true;
      EXPECT_TRUE(g.batcher->Schedule(t, so).ok());
    });
  }
  ASSERT_TRUE(g.WaitBatches(2));
  // Work for the workers: neither may start it beside a caller's batch.
  for (int i = 2; i < 6; ++i) {
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(i);
    ASSERT_TRUE(g.batcher->Schedule(t, {}).ok());
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // time for a wrong start
  {
    std::lock_guard lock(g.mu);
    EXPECT_EQ(g.batches.size(), 2u);
    EXPECT_FALSE(g.overlap);
  }
  g.Open();
  for (auto& c : callers) c.join();
  ASSERT_TRUE(g.WaitBatches(6));  // the callers' instances freed, the workers take the rest
  std::lock_guard lock(g.mu);
  EXPECT_FALSE(g.overlap);
  for (size_t i = 0; i < 2; ++i) EXPECT_NE(g.batches[i].second, g.batches[i + 2].second);
}

TEST(DynamicBatcher, ShutdownWaitsForTheBatchesCallersRun) {
  GatedPair g;
  std::thread caller([&] {
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(0);
    ScheduleOptions so;
    so.run_here = true;
    EXPECT_TRUE(g.batcher->Schedule(t, so).ok());
  });
  ASSERT_TRUE(g.WaitBatches(1));
  std::atomic<bool> returned{false};
  std::thread stopper([&] {
    g.batcher->Shutdown();
    returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_FALSE(returned.load()) << "Shutdown returned while a caller's batch ran";
  g.Open();
  stopper.join();
  caller.join();
  EXPECT_TRUE(returned.load());
}

TEST(DynamicBatcher, CallersAndWorkersShareInstancesWithoutOverlapAndLoseNothing) {
  std::mutex mu;
  int running[3] = {0, 0, 0};
  bool overlap = false;
  bool wide_overlap = false;
  std::atomic<int> done{0};
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 4;
  o.num_workers = 3;
  o.wide_worker = true;
  auto b = std::move(*DynamicBatcher::Create(
      o,
      [&](int worker, std::vector<std::unique_ptr<BatchTask>>&& batch) {
        {
          std::lock_guard lock(mu);
          ++running[worker];
          const int all = running[0] + running[1] + running[2];
          if (running[worker] > 1) overlap = true;
          if (running[2] > 0 && all > 1) wide_overlap = true;
        }
        std::this_thread::yield();
        {
          std::lock_guard lock(mu);
          --running[worker];
        }
        done += static_cast<int>(batch.size());
      },
      [](std::unique_ptr<BatchTask>, const Status&) {}));
  std::vector<std::thread> threads;
  for (int k = 0; k < 6; ++k) {
    threads.emplace_back([&, k] {
      for (int i = 0; i < 500; ++i) {
        std::unique_ptr<BatchTask> t = std::make_unique<Item>(i);
        ScheduleOptions so;
        so.run_here = (k + i) % 2 == 0;
        EXPECT_TRUE(b->Schedule(t, so).ok());
      }
    });
  }
  for (auto& t : threads) t.join();
  // Drained by the workers before Shutdown (which runs what is left on
  // every worker at once).
  EXPECT_TRUE(quern::testing::Eventually([&] { return done.load() == 6 * 500; })) << done.load();
  b->Shutdown();
  EXPECT_FALSE(overlap) << "two batches on one instance";
  EXPECT_FALSE(wide_overlap) << "a wide batch beside another";
}

TEST(DynamicBatcher, CallersThatKeepTheModelBusyOverTimeRunNarrow) {
  // Every request arrives to find only itself in the model (in_model 1), as
  // callers that send their next request after their answer do; the time
  // average of what is in the batcher sees two of them at once.
  WideHarness h;
  h.Close();
  h.Send(1);  // the wide worker takes it and holds it
  ASSERT_TRUE(h.WaitStarted(1));
  EXPECT_EQ(h.workers.back(), 2);
  h.Send(1);                      // queued behind it
  h.clock.AdvanceNs(10'000'000);  // two in the batcher for 10 ms
  h.Open();
  ASSERT_TRUE(h.WaitStarted(2));
  EXPECT_NE(h.workers.back(), 2) << "the second request ran wide although two were in the model";
}

TEST(DynamicBatcher, TheWideWorkerRestsWhileItsRunsAreShort) {
  WideHarness h;
  h.run_ns = 100'000;  // 0.1 ms a run: too short to gain from more cores
  size_t n = 0;
  // Each request is sent once the one before has ended in the batcher too:
  // one still counted as running when the next run's time passes makes the
  // load look like two (not light), and the wide worker rightly waits.
  for (; n < static_cast<size_t>(DynamicBatcher::kWideSamples); ++n) {
    h.Send(1);
    ASSERT_TRUE(h.WaitStarted(n + 1));
    ASSERT_TRUE(h.WaitIdle());
    EXPECT_EQ(h.workers.back(), 2) << n;
  }
  // Lone requests now run on the other workers.
  for (; n < 24; ++n) {
    h.Send(1);
    ASSERT_TRUE(h.WaitStarted(n + 1));
    ASSERT_TRUE(h.WaitIdle());
    EXPECT_NE(h.workers.back(), 2) << n;
  }
  // Runs of 3 ms (more than twice the threshold) bring it back.
  h.run_ns = 3'000'000;
  bool wide_again = false;
  for (int i = 0; i < 40 && !wide_again; ++i, ++n) {
    h.Send(1);
    ASSERT_TRUE(h.WaitStarted(n + 1));
    ASSERT_TRUE(h.WaitIdle());
    wide_again = h.workers.back() == 2;
  }
  EXPECT_TRUE(wide_again);
}

// Two instances that allow shared runs; every batch takes 50 µs on the fake
// clock unless told otherwise.
struct SharedHarness : GatedHarness {
  explicit SharedHarness(int shared_runs) : GatedHarness(Options(shared_runs)) { run_ns = 50'000; }
  static DynamicBatcherOptions Options(int shared_runs) {
    DynamicBatcherOptions o;
    o.queue.max_batch_size = 1;
    o.num_workers = 2;
    o.shared_runs = shared_runs;
    return o;
  }
  // Waits (up to 10 s) until `n` batches have started.
  bool WaitRuns(size_t n) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(10), [&] { return workers.size() >= n; });
  }
};

TEST(DynamicBatcher, ACallerWhoFindsEveryInstanceBusyRunsBesideOneWhileRunsAreShort) {
  SharedHarness h(/*shared_runs=*/2);
  // A first batch tells the batcher a run takes 50 µs.
  h.Caller(0).join();
  ASSERT_NEAR(h.batcher->ns_per_item(), 50'000, 1);
  h.Close();
  std::vector<std::thread> callers;
  callers.push_back(h.Caller(1));
  callers.push_back(h.Caller(2));
  ASSERT_TRUE(h.WaitRuns(3));  // both instances held
  // Two more callers: each runs at once, on its own thread, beside them;
  // a third waits in the queue (two shared runs at most).
  callers.push_back(h.Caller(3));
  callers.push_back(h.Caller(4));
  ASSERT_TRUE(h.WaitRuns(5));
  callers.push_back(h.Caller(5));
  EXPECT_TRUE(quern::testing::Eventually([&] { return h.batcher->queued() == 1u; }));
  EXPECT_EQ(h.Started(), 5u);
  {
    std::lock_guard lock(h.mu);
    EXPECT_EQ(h.running[0], 2);  // spread over the instances
    EXPECT_EQ(h.running[1], 2);
    std::set<std::thread::id> threads;
    for (size_t i = 1; i < 5; ++i) threads.insert(h.threads[i]);
    EXPECT_EQ(threads.size(), 4u) << "every caller's batch on its own thread";
  }
  EXPECT_EQ(h.batcher->shared_batches(), 2);
  h.Open();
  for (auto& c : callers) c.join();
  ASSERT_TRUE(h.WaitRuns(6));
}

TEST(DynamicBatcher, CallersQueueWhenRunsAreLongOrSharingIsOff) {
  for (const auto& [shared_runs, run_ns] : {std::pair{0, int64_t{50'000}}, std::pair{2, int64_t{5'000'000}}}) {
    SharedHarness h(shared_runs);
    h.run_ns = run_ns;
    h.Caller(0).join();
    h.Close();
    std::vector<std::thread> callers;
    callers.push_back(h.Caller(1));
    callers.push_back(h.Caller(2));
    ASSERT_TRUE(h.WaitRuns(3));
    callers.push_back(h.Caller(3));
    // (up to 30 s for the caller's thread to start and queue on a loaded machine)
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (h.batcher->queued() == 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(h.batcher->queued(), 1u) << "shared_runs " << shared_runs << ", run " << run_ns << " ns";
    EXPECT_EQ(h.Started(), 3u);
    EXPECT_EQ(h.batcher->shared_batches(), 0);
    h.Open();
    for (auto& c : callers) c.join();
    ASSERT_TRUE(h.WaitRuns(4));
    std::lock_guard lock(h.mu);
    EXPECT_EQ(h.most_at_once, 1);
  }
}

TEST(DynamicBatcher, ShutdownWaitsForSharedRuns) {
  SharedHarness h(/*shared_runs=*/1);
  h.Caller(0).join();
  h.Close();
  std::vector<std::thread> callers;
  for (int i = 1; i <= 3; ++i) callers.push_back(h.Caller(i));
  ASSERT_TRUE(h.WaitRuns(4));  // two instances and a shared run
  EXPECT_EQ(h.batcher->shared_batches(), 1);
  std::atomic<bool> returned{false};
  std::thread stopper([&] {
    h.batcher->Shutdown();
    returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_FALSE(returned.load()) << "Shutdown returned while a shared run ran";
  h.Open();
  stopper.join();
  for (auto& c : callers) c.join();
  EXPECT_TRUE(returned.load());
}

// A loop that lends its thread (LoopLender): a model with short measured
// batches and one worker, on a FakeClock; each batch's run moves the clock by
// its cost and records where it ran.
struct LentModel {
  FakeClock clock;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<std::vector<int>, std::thread::id>> batches;
  std::atomic<int64_t> cost_ns{100'000};  // per item
  std::function<void(int)> on_run;        // called with each batch's first id, on the thread that runs it
  std::unique_ptr<DynamicBatcher> batcher;
  // The loop Schedule passes with a task a loop may run, as a front end
  // passes its own (SubmitOptions::loop); used on its thread only.
  LoopLender* loop = nullptr;

  explicit LentModel(int64_t delay_ns = 0, int64_t max_queue_wait_ns = 0) {
    DynamicBatcherOptions o;
    o.queue.max_batch_size = 8;
    o.queue.max_queue_delay_ns = delay_ns;
    o.max_queue_wait_ns = max_queue_wait_ns;
    o.clock = &clock;
    batcher = std::move(*DynamicBatcher::Create(
        o,
        [this](int, std::vector<std::unique_ptr<BatchTask>>&& batch) {
          clock.AdvanceNs(cost_ns.load() * static_cast<int64_t>(batch.size()));
          std::vector<int> ids;
          for (const auto& t : batch) ids.push_back(static_cast<const Item&>(*t).id);
          if (on_run) on_run(ids.front());
          std::lock_guard lock(mu);
          batches.emplace_back(ids, std::this_thread::get_id());
          cv.notify_all();
        },
        [](std::unique_ptr<BatchTask>, const Status&) {}));
  }
  Status Schedule(int id, bool loop_may_run) {
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(id);
    ScheduleOptions so;
    so.loop_may_run = loop_may_run;
    so.loop = loop_may_run ? LoopLender::Lending(loop) : nullptr;
    return batcher->Schedule(t, so);
  }
  bool WaitBatches(size_t n) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(10), [&] { return batches.size() >= n; });
  }
  size_t Batches() {
    std::lock_guard lock(mu);
    return batches.size();
  }
  // The first batch, on the worker (nothing measured before it).
  void Measure() {
    ASSERT_TRUE(Schedule(0, /*loop_may_run=*/true).ok());
    ASSERT_TRUE(WaitBatches(1));
    for (int i = 0; i < 2000 && batcher->ns_per_item() == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_GT(batcher->ns_per_item(), 0);
  }
};

// A model's Schedule calls pass `lender` while this lives.
struct LoopScope {
  LoopScope(LentModel& model, LoopLender& lender) : m(model) { m.loop = &lender; }
  ~LoopScope() { m.loop = nullptr; }
  LentModel& m;
};

// A loop is passed with each request (no thread-local): it lends only on
// its own thread and while not paused; a request handed to another thread
// with the loop's pointer (a body inflated elsewhere) is not lent.
TEST(LoopLender, LendsOnlyOnItsOwnThreadAndUnpaused) {
  LoopLender lender;
  EXPECT_EQ(LoopLender::Lending(&lender), &lender);
  EXPECT_EQ(LoopLender::Lending(nullptr), nullptr);
  LoopLender* elsewhere = &lender;
  std::thread([&] { elsewhere = LoopLender::Lending(&lender); }).join();
  EXPECT_EQ(elsewhere, nullptr) << "another thread's loop";
  lender.set_paused(true);
  EXPECT_EQ(LoopLender::Lending(&lender), nullptr);
  lender.set_paused(false);
  EXPECT_EQ(LoopLender::Lending(&lender), &lender);
}

TEST(LoopLender, TheLoopRunsTheBatchItQueuedOnItsOwnThreadAndWakesNoWorker) {
  LentModel m;
  {
    LoopLender lender;
    LoopScope lending(m, lender);
    m.Measure();  // before any measurement the worker runs it, lender or not
    EXPECT_NE(m.batches[0].second, std::this_thread::get_id());
    for (int id = 1; id <= 3; ++id) ASSERT_TRUE(m.Schedule(id, true).ok());
    EXPECT_EQ(lender.listed(), 1u);
    // The worker is not woken and leaves the queue to the loop (fake time stands still).
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    EXPECT_EQ(m.Batches(), 1u);
    EXPECT_EQ(m.batcher->queued(), 3u);
    int64_t wait_ns = 0;
    EXPECT_TRUE(lender.RunDue(&wait_ns));
    ASSERT_EQ(m.Batches(), 2u);
    EXPECT_EQ(m.batches[1].first, (std::vector<int>{1, 2, 3}));
    EXPECT_EQ(m.batches[1].second, std::this_thread::get_id());
    EXPECT_EQ(m.batcher->lent_batches(), 1);
    EXPECT_EQ(lender.listed(), 0u) << "nothing queued: the model is no longer listed";
    EXPECT_FALSE(lender.RunDue(&wait_ns));
    EXPECT_EQ(wait_ns, -1);
    // Paused, the loop lends nothing: the worker runs what it queues.
    lender.set_paused(true);
    ASSERT_TRUE(m.Schedule(4, true).ok());
    ASSERT_TRUE(m.WaitBatches(3));
    EXPECT_NE(m.batches[2].second, std::this_thread::get_id());
    EXPECT_EQ(lender.listed(), 0u);
  }
  // Without a lender, or for a task the caller did not offer, the worker runs it.
  ASSERT_TRUE(m.Schedule(5, true).ok());
  ASSERT_TRUE(m.WaitBatches(4));
  EXPECT_NE(m.batches[3].second, std::this_thread::get_id());
  m.batcher->Shutdown();
}

TEST(LoopLender, TheLoopKeepsTheBatchingDelay) {
  LentModel m(/*delay_ns=*/5'000'000);
  LoopLender lender;
  LoopScope lending(m, lender);
  ASSERT_TRUE(m.Schedule(0, true).ok());  // the worker's, after its delay
  m.clock.AdvanceNs(5'000'000);
  ASSERT_TRUE(m.WaitBatches(1));
  for (int i = 0; i < 2000 && m.batcher->ns_per_item() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_GT(m.batcher->ns_per_item(), 0);
  ASSERT_TRUE(m.Schedule(1, true).ok());
  m.clock.AdvanceNs(1'000'000);
  ASSERT_TRUE(m.Schedule(2, true).ok());
  int64_t wait_ns = 0;
  EXPECT_FALSE(lender.RunDue(&wait_ns));
  EXPECT_EQ(wait_ns, 4'000'000) << "the oldest leaves 5 ms after it was queued";
  EXPECT_EQ(lender.listed(), 1u);
  m.clock.AdvanceNs(4'000'000);
  EXPECT_TRUE(lender.RunDue(&wait_ns));
  ASSERT_EQ(m.Batches(), 2u);
  EXPECT_EQ(m.batches[1].first, (std::vector<int>{1, 2}));
  EXPECT_EQ(m.batches[1].second, std::this_thread::get_id());
  m.batcher->Shutdown();
}

TEST(LoopLender, AWorkerTakesWhatTheLoopDoesNotLookAtInTime) {
  LentModel m;
  LoopLender lender;
  LoopScope lending(m, lender);
  m.Measure();
  ASSERT_TRUE(m.Schedule(1, true).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(m.Batches(), 1u);
  m.clock.AdvanceNs(DynamicBatcher::kLendGraceNs);  // the loop, busy elsewhere, never looked
  m.batcher->Kick();                                // a worker looks (as one does once it ends a batch)
  ASSERT_TRUE(m.WaitBatches(2));
  EXPECT_NE(m.batches[1].second, std::this_thread::get_id());
  int64_t wait_ns = 0;
  EXPECT_FALSE(lender.RunDue(&wait_ns));
  EXPECT_EQ(lender.listed(), 0u);
  m.batcher->Shutdown();
}

TEST(LoopLender, WorkFromAnotherThreadWakesTheWorkerWhichTakesTheLoopsToo) {
  LentModel m;
  LoopLender lender;
  LoopScope lending(m, lender);
  m.Measure();
  ASSERT_TRUE(m.Schedule(1, true).ok());
  std::thread other([&] { ASSERT_TRUE(m.Schedule(2, /*loop_may_run=*/false).ok()); });
  other.join();
  ASSERT_TRUE(m.WaitBatches(2));
  EXPECT_NE(m.batches[1].second, std::this_thread::get_id());
  size_t items = m.batches[1].first.size();
  if (items < 2) {
    ASSERT_TRUE(m.WaitBatches(3));  // the worker may have taken the first before the second came
    items += m.batches[2].first.size();
    EXPECT_NE(m.batches[2].second, std::this_thread::get_id());
  }
  EXPECT_EQ(items, 2u);
  m.batcher->Shutdown();
}

TEST(LoopLender, LongBatchesAreLeftToTheWorkers) {
  LentModel m;
  m.cost_ns = 5'000'000;  // 5 ms per item: over kLoopLendBelowNs
  LoopLender lender;
  LoopScope lending(m, lender);
  m.Measure();
  ASSERT_TRUE(m.Schedule(1, true).ok());
  EXPECT_EQ(lender.listed(), 0u);
  ASSERT_TRUE(m.WaitBatches(2));
  EXPECT_NE(m.batches[1].second, std::this_thread::get_id());
  m.batcher->Shutdown();
}

TEST(LoopLender, AModelThatStopsIsForgottenAndItsQueueIsRun) {
  auto m = std::make_unique<LentModel>();
  LoopLender lender;
  m->loop = &lender;  // the model goes first
  m->Measure();
  ASSERT_TRUE(m->Schedule(1, true).ok());
  ASSERT_EQ(lender.listed(), 1u);
  m->batcher->Shutdown();  // the worker runs what is queued: nothing is lost
  ASSERT_EQ(m->Batches(), 2u);
  EXPECT_EQ(m->batches[1].first, std::vector<int>{1});
  m.reset();  // the batcher is gone; the lender still lists its slot
  int64_t wait_ns = 0;
  EXPECT_FALSE(lender.RunDue(&wait_ns));
  EXPECT_EQ(lender.listed(), 0u);
}

TEST(LoopLender, ALenderThatEndsLeavesItsQueuesToTheWorkers) {
  LentModel m;
  m.Measure();
  {
    LoopLender lender;
    LoopScope lending(m, lender);
    ASSERT_TRUE(m.Schedule(1, true).ok());
    ASSERT_EQ(lender.listed(), 1u);
  }
  ASSERT_TRUE(m.WaitBatches(2));
  EXPECT_EQ(m.batches[1].first, std::vector<int>{1});
  EXPECT_NE(m.batches[1].second, std::this_thread::get_id());
  m.batcher->Shutdown();
}

TEST(LoopLender, APausedLoopHandsWhatItListsToTheWorkers) {
  LentModel m;
  LoopLender lender;
  LoopScope lending(m, lender);
  m.Measure();
  ASSERT_TRUE(m.Schedule(1, true).ok());
  ASSERT_EQ(lender.listed(), 1u);
  lender.set_paused(true);  // the loop must answer refusals now
  int64_t wait_ns = 0;
  EXPECT_FALSE(lender.RunDue(&wait_ns));
  EXPECT_EQ(lender.listed(), 0u);
  ASSERT_TRUE(m.WaitBatches(2));
  EXPECT_NE(m.batches[1].second, std::this_thread::get_id());
  EXPECT_EQ(m.batcher->lent_batches(), 0);
  m.batcher->Shutdown();
}

// While the instance runs a long batch of other work, a task the loop
// queued still leaves at its queue timeout: the reaper watches it.
TEST(LoopLender, ALentTaskStillTimesOutWhileTheInstanceIsBusy) {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  bool running = false;
  std::vector<std::pair<int, StatusCode>> dropped;
  DynamicBatcherOptions o;
  o.queue.max_batch_size = 8;
  auto b = std::move(*DynamicBatcher::Create(
      o,
      [&](int, std::vector<std::unique_ptr<BatchTask>>&& batch) {
        if (static_cast<const Item&>(*batch[0]).id != 100) return;
        std::unique_lock lock(mu);
        running = true;
        cv.notify_all();
        cv.wait(lock, [&] { return open; });
      },
      [&](std::unique_ptr<BatchTask> t, const Status& st) {
        std::lock_guard lock(mu);
        dropped.emplace_back(static_cast<const Item&>(*t).id, st.code());
        cv.notify_all();
      }));
  auto schedule = [&](int id, ScheduleOptions so) {
    std::unique_ptr<BatchTask> t = std::make_unique<Item>(id);
    return b->Schedule(t, so);
  };
  ASSERT_TRUE(schedule(0, {}).ok());  // measured: short
  for (int i = 0; i < 2000 && b->ns_per_item() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_GT(b->ns_per_item(), 0);
  ASSERT_TRUE(schedule(100, {}).ok());  // holds the only instance
  {
    std::unique_lock lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return running; }));
  }
  LoopLender lender;
  ScheduleOptions so;
  so.loop_may_run = true;
  so.loop = &lender;
  // (200 ms: admitted however long batch 0 was measured on a loaded machine,
  // up to that; the drop is waited for 10 s)
  so.timeout_ns = 200'000'000;
  ASSERT_TRUE(schedule(1, so).ok());
  int64_t wait_ns = 0;
  EXPECT_FALSE(lender.RunDue(&wait_ns));  // the instance is busy: left to the workers
  bool timed_out = false;
  {
    std::unique_lock lock(mu);
    timed_out = cv.wait_for(lock, std::chrono::seconds(10), [&] { return !dropped.empty(); });
    open = true;
    cv.notify_all();
  }
  b->Shutdown();
  ASSERT_TRUE(timed_out) << "the task waited for the busy instance past its timeout";
  EXPECT_EQ(dropped[0], std::make_pair(1, StatusCode::kDeadlineExceeded));
}

// Tasks a loop's batch leaves queued (more than one batch holds) still
// hear of their deadlines when that batch hangs on the loop's thread: the
// reaper is told, as when a worker's batch leaves some behind.
TEST(LoopLender, WhatALentBatchLeavesQueuedTimesOutWhenTheBatchHangs) {
  // 0.1 ms an item (short enough to lend); the batch of tasks 1 and 2 hangs.
  HangingModel m(/*max_batch_size=*/2, /*measured_ns=*/100'000, /*hanging=*/{1});
  ASSERT_TRUE(m.Measure());
  // The loop's thread: queues three tasks with timeouts (no worker is woken
  // for them), then runs the batch of the first two, which hangs.
  std::atomic<bool> queued{false};
  std::thread loop([&] {
    LoopLender lender;
    for (int id = 1; id <= 3; ++id) {
      ScheduleOptions so;
      so.timeout_ns = 20'000'000;
      so.loop_may_run = true;
      so.loop = LoopLender::Lending(&lender);
      EXPECT_TRUE(m.Schedule(id, so).ok());
    }
    queued = true;
    int64_t wait_ns = 0;
    lender.RunDue(&wait_ns);
  });
  const bool hung = quern::testing::Eventually([&] { return m.started.load() == 2; });
  m.clock.AdvanceNs(50'000'000);
  const auto first = m.drops.First();
  m.Open(1);
  loop.join();
  ASSERT_TRUE(queued.load());
  ASSERT_TRUE(hung) << "the loop did not run the first two";
  ASSERT_TRUE(first.has_value()) << "the task left queued waited for the hanging batch past its timeout";
  EXPECT_EQ(*first, (std::pair<int, StatusCode>{3, StatusCode::kDeadlineExceeded}));
  EXPECT_EQ(m.batcher->lent_batches(), 1);
}

// A task the loop may not run (a large input; another thread's) that is
// queued while the loop runs its batch is left to the worker, with what
// the loop queued after it: the loop does not run it when its batch ends.
TEST(LoopLender, ATaskNoLoopMayRunIsLeftToTheWorker) {
  LentModel m;
  LoopLender lender;
  LoopScope lending(m, lender);
  m.Measure();
  m.on_run = [&](int id) {
    if (id != 1) return;
    std::thread([&] { ASSERT_TRUE(m.Schedule(2, /*loop_may_run=*/false).ok()); }).join();
    ASSERT_TRUE(m.Schedule(3, true).ok());  // the loop's again, queued behind 2: not lent
  };
  ASSERT_TRUE(m.Schedule(1, true).ok());
  int64_t wait_ns = 0;
  EXPECT_TRUE(lender.RunDue(&wait_ns));  // runs {1}; 2 and 3 arrive meanwhile, the instance busy
  EXPECT_EQ(lender.listed(), 0u);
  auto items_after_first_two = [&] {
    size_t n = 0;
    for (size_t i = 2; i < m.batches.size(); ++i) n += m.batches[i].first.size();
    return n;
  };
  {
    std::unique_lock lock(m.mu);
    ASSERT_TRUE(m.cv.wait_for(lock, std::chrono::seconds(10), [&] { return items_after_first_two() >= 2; }));
  }
  std::lock_guard lock(m.mu);
  EXPECT_EQ(items_after_first_two(), 2u);
  EXPECT_EQ(m.batches[1].first, std::vector<int>{1});
  EXPECT_EQ(m.batches[1].second, std::this_thread::get_id());
  for (size_t i = 2; i < m.batches.size(); ++i) {
    EXPECT_NE(m.batches[i].second, std::this_thread::get_id()) << "batch " << i << " ran on the loop";
  }
}

// The queue-waiting bound counts what a loop has queued for itself: while
// the loop reads, the instance is free, yet the queued work waits for it.
TEST(LoopLender, TheQueueWaitBoundCountsTheLoopsQueuedWork) {
  LentModel m(/*delay_ns=*/0, /*max_queue_wait_ns=*/250'000);  // 2.5 items at 100 us
  LoopLender lender;
  LoopScope lending(m, lender);
  m.Measure();
  for (int id = 1; id <= 3; ++id) ASSERT_TRUE(m.Schedule(id, true).ok());
  const Status refused = m.Schedule(4, true);
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable) << refused.message();
  int64_t wait_ns = 0;
  EXPECT_TRUE(lender.RunDue(&wait_ns));
  ASSERT_EQ(m.Batches(), 2u);
  EXPECT_EQ(m.batches[1].first, (std::vector<int>{1, 2, 3}));
  EXPECT_TRUE(m.Schedule(5, true).ok()) << "the queue ran: admitted again";
  m.batcher->Shutdown();
}
}  // namespace
}  // namespace quern
