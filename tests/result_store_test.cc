// The embedded result store: ids, replacement, byte bound with eviction of
// the oldest results, TTL on an injected clock, and the messages that tell
// an expired or evicted id from an unknown one.
#include "store/result_store.h"

#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cstring>
#include <set>

namespace quern {
namespace {

std::shared_ptr<const JobRecord> Done(std::string id, size_t output_bytes) {
  auto r = std::make_shared<JobRecord>();
  r->id = std::move(id);
  r->model = std::string(1, 'm');  // (GCC 12 misreports -Wrestrict for = "m")
  r->state = JobState::kDone;
  Tensor t = Tensor::Allocate(DataType::kUint8, {static_cast<int64_t>(output_bytes)}, output_bytes);
  if (output_bytes > 0) std::memset(t.mutable_data(), 7, output_bytes);
  r->outputs.push_back({"y", std::move(t)});
  return r;
}

TEST(JobId, CarriesItsSubmissionTimeAnd128RandomBits) {
  const std::string id = NewJobId(0x0193A7C2F1E0);
  ASSERT_EQ(id.size(), 45u);
  EXPECT_EQ(id.substr(0, 13), "0193a7c2f1e0-");
  EXPECT_EQ(JobIdSubmittedMs(id), 0x0193A7C2F1E0);
  EXPECT_NE(NewJobId(1), NewJobId(1));  // random part
  EXPECT_EQ(JobIdSubmittedMs("not-a-job"), -1);
  EXPECT_EQ(JobIdSubmittedMs("0193a7c2f1e0-0123456789abcdeg"), -1);
  EXPECT_EQ(JobIdSubmittedMs("0193a7c2f1e0_0123456789abcdef"), -1);
  // Ids of the older form (16 random digits) still tell their time.
  EXPECT_EQ(JobIdSubmittedMs("0193a7c2f1e0-0123456789abcdef"), 0x0193A7C2F1E0);
  // Every digit of the random part varies (a 64-bit generator's output
  // would leave the last 16 alike or derived from the first).
  std::set<std::string> seen;
  std::array<std::set<char>, 32> digits;
  for (int i = 0; i < 2000; ++i) {
    const std::string r = NewJobId(1).substr(13);
    ASSERT_EQ(r.size(), 32u);
    seen.insert(r);
    for (size_t k = 0; k < r.size(); ++k) digits[k].insert(r[k]);
  }
  EXPECT_EQ(seen.size(), 2000u);
  for (const auto& d : digits) EXPECT_EQ(d.size(), 16u);
}

TEST(MemoryResultStore, AnOwnerFillingTheStoreEvictsItsOwnResultsNotAnothers) {
  FakeClock clock;
  MemoryResultStoreOptions o;
  o.clock = &clock;
  o.ttl_s = 0;
  o.max_bytes = 40 << 10;
  MemoryResultStore store(o);
  auto owned = [](std::string id, std::string owner, size_t bytes) {
    auto r = std::const_pointer_cast<JobRecord>(Done(std::move(id), bytes));
    r->owner = std::move(owner);
    return std::shared_ptr<const JobRecord>(r);
  };
  store.Put({owned("victim", "b", 4 << 10)});
  for (int i = 0; i < 100; ++i) store.Put({owned("flood" + std::to_string(i), "a", 8 << 10)});
  EXPECT_TRUE(store.Get("victim").has_value()) << "another owner's flood evicted it";
  EXPECT_TRUE(store.Get("flood99").has_value());
  auto gone = store.Get("flood0");
  ASSERT_FALSE(gone.has_value());
  EXPECT_NE(gone.error().message().find("evicted"), std::string::npos);
  EXPECT_LE(store.bytes(), size_t{40} << 10);
  // A third owner's result takes room from the largest owner, the flood.
  store.Put({owned("c1", "c", 8 << 10)});
  EXPECT_LE(store.bytes(), size_t{40} << 10);
  EXPECT_TRUE(store.Get("c1").has_value());
  EXPECT_TRUE(store.Get("victim").has_value());
  EXPECT_FALSE(store.Get("flood96").has_value());
}

TEST(MemoryResultStore, StoresReplacesAndEvictsOldestFirst) {
  FakeClock clock;
  MemoryResultStoreOptions o;
  o.clock = &clock;
  o.ttl_s = 0;
  const size_t one = Done("a", 1000)->ByteSize();
  o.max_bytes = 3 * one;  // three results of this size fit
  MemoryResultStore store(o);
  store.Put({Done("a", 1000), Done("b", 1000)});
  store.Put({Done("a", 1000)});  // replaced, not duplicated
  EXPECT_EQ(store.size(), 2u);
  EXPECT_EQ(store.bytes(), 2 * one);
  store.Put({Done("c", 1000)});
  EXPECT_EQ(store.size(), 3u);
  store.Put({Done("d", 1000)});  // over the bound: the oldest ("b"; "a" was rewritten after it) goes
  EXPECT_EQ(store.size(), 3u);
  auto b = store.Get("b");
  ASSERT_FALSE(b.has_value());
  EXPECT_EQ(b.error().code(), StatusCode::kNotFound);
  EXPECT_NE(b.error().message().find("evicted"), std::string::npos) << b.error().message();
  for (const char* id : {"a", "c", "d"}) {
    auto r = store.Get(id);
    ASSERT_TRUE(r.has_value()) << id;
    EXPECT_EQ((*r)->outputs[0].tensor.byte_size(), 1000u);
    EXPECT_EQ(static_cast<int>((*r)->outputs[0].tensor.data()[999]), 7);
  }
  auto unknown = store.Get("zz");
  ASSERT_FALSE(unknown.has_value());
  EXPECT_NE(unknown.error().message().find("no job 'zz'"), std::string::npos);
  // A result larger than the whole bound is not kept either.
  store.Put({Done("huge", 10 * 1000)});
  EXPECT_FALSE(store.Get("huge").has_value());
  EXPECT_LE(store.bytes(), o.max_bytes);
}

TEST(MemoryResultStore, TtlOnTheInjectedClock) {
  FakeClock clock;
  MemoryResultStoreOptions o;
  o.clock = &clock;
  o.ttl_s = 10;
  MemoryResultStore store(o);
  const std::string id = NewJobId(clock.WallMs());
  store.Put({Done(id, 8)});
  clock.AdvanceUs(9'000'000);
  store.Put({Done("later", 8)});
  EXPECT_TRUE(store.Get(id).has_value());
  clock.AdvanceUs(1'000'000);  // 10 s after the first put
  auto gone = store.Get(id);
  ASSERT_FALSE(gone.has_value());
  EXPECT_NE(gone.error().message().find("expired"), std::string::npos) << gone.error().message();
  EXPECT_TRUE(store.Get("later").has_value());
  EXPECT_EQ(store.size(), 1u);
  // Without a tombstone, an id older than the TTL (by the clock's date)
  // still reads as expired.
  const std::string old = NewJobId(clock.WallMs() - 60'000);
  auto o2 = store.Get(old);
  ASSERT_FALSE(o2.has_value());
  EXPECT_NE(o2.error().message().find("expired"), std::string::npos);
  const std::string fresh = NewJobId(clock.WallMs());
  EXPECT_NE(store.Get(fresh).error().message().find("no job"), std::string::npos);
}

}  // namespace
}  // namespace quern
