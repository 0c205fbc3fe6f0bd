// Clock waits: a FakeClock ends a wait when it is moved to the deadline (and
// not before), a notify ends it at once, and the real clock waits real time.
#include "quern/clock.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "core/mutex.h"
#include "eventually.h"

namespace quern {
namespace {

using testing::Eventually;

TEST(FakeClock, AWaitEndsWhenTheClockIsMovedToItsDeadlineAndNotBefore) {
  FakeClock clock;
  Mutex mu;
  CondVar cv;
  std::atomic<int> ended{0};
  std::atomic<bool> timed_out{false};
  const int64_t deadline = clock.NowNs() + 1'000'000'000;
  std::thread waiter([&] {
    MutexLock lock(mu);
    timed_out = !cv.WaitUntil(lock, clock, deadline, [] { return false; });
    ended = 1;
  });
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 1; }));
  clock.AdvanceNs(999'999'999);  // a nanosecond short
  EXPECT_EQ(clock.waiters(), 1) << "the wait ended before its deadline";
  EXPECT_EQ(ended.load(), 0);
  clock.AdvanceNs(1);
  waiter.join();
  EXPECT_TRUE(timed_out.load());
  EXPECT_EQ(clock.waiters(), 0);
}

TEST(FakeClock, ANotifyEndsAWaitWithoutTheClockMoving) {
  FakeClock clock;
  Mutex mu;
  CondVar cv;
  bool ready = false;
  bool in_time = false;
  std::thread waiter([&] {
    MutexLock lock(mu);
    in_time = cv.WaitFor(lock, clock, std::chrono::hours(1), [&]() QUERN_REQUIRES(mu) { return ready; });
  });
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 1; }));
  {
    MutexLock lock(mu);
    ready = true;
  }
  cv.SignalAll();
  waiter.join();
  EXPECT_TRUE(in_time);
  EXPECT_EQ(clock.NowNs(), 1'000'000'000) << "nobody moved the clock";
}

TEST(FakeClock, AWaitWhoseDeadlineHasPassedReturnsAtOnce) {
  FakeClock clock;
  Mutex mu;
  CondVar cv;
  MutexLock lock(mu);
  EXPECT_TRUE(cv.WaitUntil(lock, clock, clock.NowNs()));
  EXPECT_FALSE(cv.WaitFor(lock, clock, std::chrono::seconds(0), [] { return false; }));
  EXPECT_EQ(clock.waiters(), 0);
}

TEST(FakeClock, ManyWaitersEachEndAtTheirOwnDeadline) {
  // Waiters on one condition variable and on others, deadlines 1..8 ms:
  // each step of 1 ms ends exactly one more.
  FakeClock clock;
  Mutex mu;
  CondVar shared_cv;
  CondVar own_cv[4];
  std::atomic<int> ended{0};
  std::vector<std::thread> waiters;
  const int64_t start = clock.NowNs();
  for (int i = 1; i <= 8; ++i) {
    waiters.emplace_back([&, i] {
      CondVar& cv = i % 2 == 0 ? shared_cv : own_cv[i / 2];
      MutexLock lock(mu);
      cv.WaitUntil(lock, clock, start + i * 1'000'000, [] { return false; });
      ++ended;
    });
  }
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 8; }));
  for (int step = 1; step <= 8; ++step) {
    clock.AdvanceNs(1'000'000);
    ASSERT_TRUE(Eventually([&] { return ended.load() == step; })) << "step " << step;
    // (An early waiter woken with a due one on its condition variable
    // leaves the registry for a moment and waits again.)
    EXPECT_TRUE(Eventually([&] { return clock.waiters() == 8 - step; })) << "step " << step;
  }
  for (auto& t : waiters) t.join();
}

TEST(RealClock, AWaitLastsUntilItsDeadline) {
  const Clock& clock = RealClockInstance();
  Mutex mu;
  CondVar cv;
  MutexLock lock(mu);
  const int64_t start = clock.NowNs();
  EXPECT_FALSE(cv.WaitFor(lock, clock, std::chrono::milliseconds(20), [] { return false; }));
  EXPECT_GE(clock.NowNs() - start, 20'000'000);
}

}  // namespace
}  // namespace quern
