// IdleRelease: a touch arms a resting key, whose release function runs an
// idle time later (a FakeClock moves it), not before, and further touches do
// not postpone it; a key that says it still keeps memory is looked at again
// an idle time later, one that released everything rests until touched;
// Remove waits for a running call; with nothing armed the thread waits
// without a timer.
#include "core/idle_release.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <thread>

#include "eventually.h"

namespace quern {
namespace {

constexpr int64_t kIdleNs = 5'000'000'000;
using testing::Eventually;

TEST(IdleRelease, ATouchArmsARestingKeyWhoseFunctionRunsAnIdleTimeLater) {
  FakeClock clock;
  IdleRelease idle(clock, kIdleNs);
  std::atomic<int> released{0};
  int key = 0;
  idle.Add(&key, [&] {
    released.fetch_add(1);
    return IdleRelease::Outcome::kReleased;
  });
  // Registered but never touched: nothing is armed, no timer.
  clock.AdvanceNs(10 * kIdleNs);
  EXPECT_EQ(clock.waiters(), 0);
  EXPECT_EQ(released.load(), 0);

  idle.Touch(&key);
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 1; }));
  clock.AdvanceNs(kIdleNs / 2);
  idle.Touch(&key);  // used again: a steady load does not put its look off
  clock.AdvanceNs(kIdleNs / 2 - 1);
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 1; }));
  EXPECT_EQ(released.load(), 0) << "looked at before an idle time had passed since it was armed";
  clock.AdvanceNs(1);
  ASSERT_TRUE(Eventually([&] { return released.load() == 1; }));
  // Released: it rests (no timer) until the next touch.
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 0; }));
  clock.AdvanceNs(10 * kIdleNs);
  EXPECT_EQ(released.load(), 1);
  idle.Touch(&key);
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 1; }));
  clock.AdvanceNs(kIdleNs);
  ASSERT_TRUE(Eventually([&] { return released.load() == 2; }));
  idle.Remove(&key);
}

TEST(IdleRelease, AnOwnerStillHoldingMemoryIsLookedAtAgainAnIdleTimeLater) {
  FakeClock clock;
  IdleRelease idle(clock, kIdleNs);
  std::atomic<int> calls{0};
  int key = 0;
  // Busy twice (its owner's lock was taken), then released.
  idle.Add(&key,
           [&] { return calls.fetch_add(1) < 2 ? IdleRelease::Outcome::kHeld : IdleRelease::Outcome::kReleased; });
  idle.Touch(&key);
  for (int i = 1; i <= 3; ++i) {
    ASSERT_TRUE(Eventually([&] { return clock.waiters() == 1; })) << "call " << i;
    clock.AdvanceNs(kIdleNs - 1);
    ASSERT_TRUE(Eventually([&] { return clock.waiters() == 1; }));
    EXPECT_EQ(calls.load(), i - 1) << "looked at again before an idle time had passed";
    clock.AdvanceNs(1);
    ASSERT_TRUE(Eventually([&] { return calls.load() == i; }));
  }
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 0; }));
  EXPECT_EQ(idle.calls(), 3);
  idle.Remove(&key);
}

TEST(IdleRelease, KeysAreDueEachByItsOwnTouches) {
  FakeClock clock;
  IdleRelease idle(clock, kIdleNs);
  std::atomic<int> a_calls{0}, b_calls{0};
  int a = 0, b = 0;
  idle.Add(&a, [&] {
    a_calls.fetch_add(1);
    return IdleRelease::Outcome::kReleased;
  });
  idle.Add(&b, [&] {
    b_calls.fetch_add(1);
    return IdleRelease::Outcome::kReleased;
  });
  idle.Touch(&a);
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 1; }));
  clock.AdvanceNs(kIdleNs / 2);
  idle.Touch(&b);
  clock.AdvanceNs(kIdleNs / 2);
  ASSERT_TRUE(Eventually([&] { return a_calls.load() == 1; }));
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 1; }));
  EXPECT_EQ(b_calls.load(), 0);
  clock.AdvanceNs(kIdleNs / 2);
  ASSERT_TRUE(Eventually([&] { return b_calls.load() == 1; }));
  idle.Remove(&a);
  idle.Remove(&b);
  idle.Touch(&a);  // unknown now: ignored
  EXPECT_EQ(clock.waiters(), 0);
}

TEST(IdleRelease, RemoveWaitsForARunningCallAndNoCallFollowsIt) {
  // Declared before the IdleRelease, so that they outlive its thread (a failed assertion below
  // must not leave it spinning on a freed flag).
  std::atomic<bool> entered{false}, leave{false}, after_remove{false};
  std::atomic<int> calls{0};
  FakeClock clock;
  IdleRelease idle(clock, kIdleNs);
  struct LetGo {  // before the IdleRelease's thread is joined, however the test ends
    std::atomic<bool>& leave;
    ~LetGo() { leave = true; }
  } let_go{leave};
  int key = 0;
  idle.Add(&key, [&] {
    calls.fetch_add(1);
    entered = true;
    while (!leave.load()) std::this_thread::yield();
    return IdleRelease::Outcome::kHeld;  // would be looked at again, were it still registered
  });
  idle.Touch(&key);
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 1; }));
  clock.AdvanceNs(kIdleNs);
  ASSERT_TRUE(Eventually([&] { return entered.load(); }));
  std::thread remover([&] {
    idle.Remove(&key);
    after_remove = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(after_remove.load()) << "Remove returned while the key's function ran";
  leave = true;
  remover.join();
  EXPECT_TRUE(after_remove.load());
  clock.AdvanceNs(10 * kIdleNs);
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 0; }));
  EXPECT_EQ(calls.load(), 1);
}

}  // namespace
}  // namespace quern
