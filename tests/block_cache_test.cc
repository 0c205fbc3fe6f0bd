// BlockCache: large blocks are reused by size class and returned to the
// system once unused for the idle time (a FakeClock moves it); small ones
// come from the C library; every pointer is aligned; threads never share a
// block.
#include "core/block_cache.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "eventually.h"

namespace quern {
namespace {

constexpr size_t kMin = size_t{256} << 10;
constexpr int64_t kIdle = 5'000'000'000;

using testing::Eventually;

bool Aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % BlockCache::kAlignment == 0;
}

TEST(BlockCache, SizeClassesAreEighthsOfAPowerOfTwoInWholePages) {
  FakeClock clock;
  BlockCache cache({kMin, kIdle}, clock);
  EXPECT_EQ(cache.ClassBytes(kMin - 1), 0u) << "below the minimum: the C library's";
  // 1 MiB + the 64-byte header: the next eighth of 1 MiB above it.
  EXPECT_EQ(cache.ClassBytes(size_t{1} << 20), (size_t{1} << 20) + (size_t{1} << 17));
  EXPECT_EQ(cache.ClassBytes((size_t{1} << 20) - 64), size_t{1} << 20);
  // 3 MiB + 1: 2 MiB's eighth is 256 KiB, so 3.25 MiB.
  EXPECT_EQ(cache.ClassBytes((size_t{3} << 20) + 1), (size_t{13} << 20) / 4);
  for (size_t n : {kMin, size_t{300'000}, size_t{5'000'001}, size_t{123'456'789}}) {
    const size_t c = cache.ClassBytes(n);
    EXPECT_GE(c, n + 64) << n;
    EXPECT_LE(c, (n + 64) + (n + 64) / 8 + 4096) << n;
    EXPECT_EQ(c % 4096, 0u) << n;
  }
}

TEST(BlockCache, SmallBlocksComeFromTheCLibraryAligned) {
  FakeClock clock;
  BlockCache cache({kMin, kIdle}, clock);
  std::vector<void*> blocks;
  for (size_t n : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{1000}, kMin - 1}) {
    void* p = cache.Alloc(n);
    ASSERT_NE(p, nullptr);
    EXPECT_TRUE(Aligned(p)) << n;
    std::memset(p, 0xab, n);
    blocks.push_back(p);
  }
  EXPECT_EQ(cache.InUse().in_use_bytes, 0u);
  EXPECT_EQ(cache.InUse().mapped, 0);
  EXPECT_EQ(cache.Alloc(SIZE_MAX), nullptr) << "a size whose header would wrap around";
  EXPECT_EQ(cache.Alloc(SIZE_MAX - 10), nullptr);
  for (void* p : blocks) cache.Free(p);
  cache.Free(nullptr);
  EXPECT_EQ(cache.InUse().kept_bytes, 0u);
}

TEST(BlockCache, AFreedLargeBlockIsTakenBackByTheNextRequestOfItsClass) {
  FakeClock clock;
  BlockCache cache({kMin, kIdle}, clock);
  const size_t n = (size_t{3} << 20) + 100'000;  // class 3.25 MiB, as is n - 1000
  void* a = cache.Alloc(n);
  ASSERT_NE(a, nullptr);
  EXPECT_TRUE(Aligned(a));
  std::memset(a, 1, n);
  EXPECT_EQ(cache.InUse().in_use_bytes, cache.ClassBytes(n));
  cache.Free(a);
  EXPECT_EQ(cache.InUse().in_use_bytes, 0u);
  EXPECT_EQ(cache.InUse().kept_bytes, cache.ClassBytes(n));
  // A request a little smaller falls in the same class: the same block, no new mapping.
  void* b = cache.Alloc(n - 1000);
  EXPECT_EQ(b, a);
  EXPECT_EQ(cache.InUse().mapped, 1);
  EXPECT_EQ(cache.InUse().kept_bytes, 0u);
  // Another class maps a block of its own.
  void* c = cache.Alloc(n * 2);
  EXPECT_NE(c, a);
  EXPECT_EQ(cache.InUse().mapped, 2);
  cache.Free(b);
  cache.Free(c);
}

TEST(BlockCache, WhenNoKeptBlockFitsTheNearestIsResizedInsteadOfMappingAnother) {
  FakeClock clock;
  BlockCache cache({kMin, kIdle}, clock);
  const size_t big = size_t{8} << 20, small = size_t{1} << 20;
  auto* a = static_cast<unsigned char*>(cache.Alloc(big));
  std::memset(a, 1, big);
  cache.Free(a);
  // 1 MiB does not take an 8 MiB block as it is (more than twice): the block shrinks to 1 MiB's class.
  auto* b = static_cast<unsigned char*>(cache.Alloc(small));
  ASSERT_NE(b, nullptr);
  EXPECT_TRUE(Aligned(b));
  std::memset(b, 2, small);
  EXPECT_EQ(b[small - 1], 2);
  EXPECT_EQ(cache.InUse().mapped, 1);
  EXPECT_EQ(cache.InUse().resized, 1);
  EXPECT_EQ(cache.InUse().kept_bytes, 0u);
  EXPECT_EQ(cache.InUse().in_use_bytes, cache.ClassBytes(small));
  cache.Free(b);
  // And grows again for 8 MiB, every byte writable.
  auto* c = static_cast<unsigned char*>(cache.Alloc(big));
  ASSERT_NE(c, nullptr);
  std::memset(c, 3, big);
  EXPECT_EQ(c[big - 1], 3);
  EXPECT_EQ(cache.InUse().mapped, 1);
  EXPECT_EQ(cache.InUse().resized, 2);
  EXPECT_EQ(cache.InUse().in_use_bytes, cache.ClassBytes(big));
  // With nothing kept, a new block is mapped.
  void* d = cache.Alloc(small);
  EXPECT_EQ(cache.InUse().mapped, 2);
  cache.Free(c);
  cache.Free(d);
  EXPECT_EQ(cache.InUse().kept_bytes, cache.ClassBytes(big) + cache.ClassBytes(small));
}

TEST(BlockCache, AKeptBlockGoesBackToTheSystemAfterTheIdleTimeAndNotBefore) {
  FakeClock clock;
  BlockCache cache({kMin, kIdle}, clock);
  const size_t n = size_t{2} << 20;
  void* a = cache.Alloc(n);
  void* b = cache.Alloc(n);
  void* c = cache.Alloc(n * 3);
  cache.Free(a);
  cache.Free(b);
  cache.Free(c);
  const size_t kept = cache.ClassBytes(n) * 2 + cache.ClassBytes(n * 3);
  ASSERT_EQ(cache.InUse().kept_bytes, kept);
  // The releasing thread waits for the oldest block's time.
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 1; }));
  // Half-way, one block is taken and freed again: its time starts over.
  clock.AdvanceNs(kIdle / 2);
  void* again = cache.Alloc(n);
  cache.Free(again);
  clock.AdvanceNs(kIdle / 2 - 1);
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 1; }));
  EXPECT_EQ(cache.InUse().returned, 0) << "returned before its idle time";
  EXPECT_EQ(cache.InUse().kept_bytes, kept);
  clock.AdvanceNs(1);
  ASSERT_TRUE(Eventually([&] { return cache.InUse().returned == 2; }));
  EXPECT_EQ(cache.InUse().kept_bytes, cache.ClassBytes(n));
  clock.AdvanceNs(kIdle / 2);
  ASSERT_TRUE(Eventually([&] { return cache.InUse().returned == 3; }));
  EXPECT_EQ(cache.InUse().kept_bytes, 0u);
  // Nothing kept: the thread waits without a time (no timer in an idle process).
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 0; }));
  // A new block maps again, and its free starts the timer again.
  void* d = cache.Alloc(n);
  EXPECT_EQ(cache.InUse().mapped, 4);
  cache.Free(d);
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 1; }));
  clock.AdvanceNs(kIdle);
  ASSERT_TRUE(Eventually([&] { return cache.InUse().returned == 4; }));
}

TEST(BlockCache, ReturnKeptGivesBackEveryKeptBlockAtOnceAndNoneInUse) {
  FakeClock clock;  // never advanced: only ReturnKept returns a block here
  BlockCache cache({kMin, kIdle}, clock);
  const size_t n = size_t{2} << 20;
  void* a = cache.Alloc(n);
  void* b = cache.Alloc(n * 3);
  void* in_use = cache.Alloc(n);
  static_cast<char*>(in_use)[n - 1] = 7;
  cache.Free(a);
  cache.Free(b);
  ASSERT_EQ(cache.InUse().kept_bytes, cache.ClassBytes(n) + cache.ClassBytes(n * 3));
  cache.ReturnKept();
  EXPECT_EQ(cache.InUse().kept_bytes, 0u);
  EXPECT_EQ(cache.InUse().returned, 2);
  EXPECT_EQ(cache.InUse().in_use_bytes, cache.ClassBytes(n)) << "a block in use is not returned";
  EXPECT_EQ(static_cast<char*>(in_use)[n - 1], 7);
  // The next request maps a new block (none kept), and the one in use is kept once freed.
  void* c = cache.Alloc(n);
  EXPECT_EQ(cache.InUse().mapped, 4);
  cache.Free(in_use);
  cache.Free(c);
  EXPECT_EQ(cache.InUse().kept_bytes, 2 * cache.ClassBytes(n));
  cache.ReturnKept();
  EXPECT_EQ(cache.InUse().kept_bytes, 0u);
  EXPECT_EQ(cache.InUse().returned, 4);
}

TEST(BlockCache, TheLoadIsOverWhenNothingIsKeptOrInUse) {
  FakeClock clock;
  std::atomic<int> idle{0};
  BlockCache cache({kMin, kIdle, [&] { ++idle; }}, clock);
  const size_t n = size_t{1} << 20;
  void* held = cache.Alloc(n);
  void* a = cache.Alloc(n);
  cache.Free(a);
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 1; }));
  clock.AdvanceNs(kIdle);
  ASSERT_TRUE(Eventually([&] { return cache.InUse().returned == 1; }));
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 0; }));
  EXPECT_EQ(idle.load(), 0) << "a block is still in use: the load goes on";
  cache.Free(held);
  ASSERT_TRUE(Eventually([&] { return clock.waiters() == 1; }));
  clock.AdvanceNs(kIdle);
  ASSERT_TRUE(Eventually([&] { return idle.load() == 1; }));
  EXPECT_EQ(cache.InUse().returned, 2);
}

TEST(BlockCache, ThreadsNeverShareABlock) {
  FakeClock clock;
  BlockCache cache({kMin, kIdle}, clock);
  constexpr int kThreads = 4;
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::vector<std::pair<unsigned char*, size_t>> held;
      for (int i = 0; i < 400; ++i) {
        if (held.size() < 3 && rng() % 2 == 0) {
          // Few classes, so that blocks move between threads through the cache.
          const size_t n = (rng() % 2 == 0 ? 1000 : kMin) * (1 + rng() % 3);
          auto* p = static_cast<unsigned char*>(cache.Alloc(n));
          if (p == nullptr || !Aligned(p)) ++wrong;
          std::memset(p, t + 1, n);
          held.emplace_back(p, n);
        } else if (!held.empty()) {
          auto [p, n] = held.back();
          held.pop_back();
          for (size_t k = 0; k < n; k += 997) wrong += p[k] != t + 1;
          wrong += p[n - 1] != t + 1;
          cache.Free(p);
        }
      }
      for (auto [p, n] : held) cache.Free(p);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(cache.InUse().in_use_bytes, 0u);
}

}  // namespace
}  // namespace quern

namespace quern {
namespace {

TEST(BlockCache, AThreadScopeCountsWhatItsBlocksHeldAtOnceAsAsked) {
  FakeClock clock;
  BlockCache cache({size_t{256} << 10, 5'000'000'000}, clock);
  constexpr size_t kMiB = size_t{1} << 20;
  auto mib = [](size_t n) { return n * kMiB - BlockCache::kAlignment; };  // a class of exactly n MiB
  void* before = cache.Alloc(mib(2));                                     // taken before the scope
  void* kept = cache.Alloc(mib(2));
  cache.Free(kept);  // kept for reuse: the next 1.5 MiB request takes this 2 MiB block
  {
    BlockCache::ThreadScope run;
    EXPECT_EQ(run.peak(), 0u);
    void* a = cache.Alloc(kMiB + kMiB / 2 - BlockCache::kAlignment);  // served by the kept 2 MiB block
    EXPECT_EQ(cache.InUse().mapped, 2) << "no new block: the kept one reused";
    EXPECT_EQ(run.peak(), kMiB + kMiB / 2) << "counted as asked, not as the block that served it";
    void* small = cache.Alloc(1000);  // the C library's: not counted
    cache.Free(a);
    void* b = cache.Alloc(mib(1));
    cache.Free(before);  // taken before the scope: frees nothing of the scope's (b still counts)
    void* c = cache.Alloc(mib(1));
    EXPECT_EQ(run.peak(), 2 * kMiB) << "b and c at once";
    {
      BlockCache::ThreadScope inner;  // a run inside the run: counted in both
      void* d = cache.Alloc(mib(3));
      EXPECT_EQ(inner.peak(), 3 * kMiB);
      cache.Free(d);
    }
    EXPECT_EQ(run.peak(), 5 * kMiB) << "b, c and the inner run's 3 MiB at once";
    cache.Free(b);
    cache.Free(c);
    cache.Free(small);
    // Another thread's blocks are its own.
    size_t other = 1;
    std::thread t([&] {
      BlockCache::ThreadScope there;
      void* p = cache.Alloc(mib(4));
      cache.Free(p);
      other = there.peak();
    });
    t.join();
    EXPECT_EQ(other, 4 * kMiB);
    EXPECT_EQ(run.peak(), 5 * kMiB);
  }
  BlockCache::ThreadScope after;
  EXPECT_EQ(after.peak(), 0u);
}

}  // namespace
}  // namespace quern
