// Unit tests for the pool of request-body strings (core/memory.h): what it keeps, how much, and
// that a KServe body goes back once its request is done. The pool is off under AddressSanitizer
// (a kept string would hide a use after free), so this program is built in every build, the
// release build included, where the other programs may be left to the sanitizer build.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "core/memory.h"
#include "protocol/kserve_codec.h"

namespace quern {
namespace {

TEST(BodyPool, AStringGivenBackReceivesTheNextAlikeBody) {
  if (!kBodyPoolOn) GTEST_SKIP() << "the pool is off under AddressSanitizer";
  ReturnFreedMemory();  // empty, whatever ran before in this process
  std::string a = TakeBodyBuffer(48 << 10);
  ASSERT_EQ(a.size(), size_t{48} << 10);
  a.assign(a.size(), 'x');
  const char* where = a.data();
  const BodyPoolUse before = BodyPoolInUse();
  GiveBodyBuffer(std::move(a));
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(BodyPoolInUse().strings, before.strings + 1);
  std::string b = TakeBodyBuffer((48 << 10) - 100);  // a little shorter fits too
  EXPECT_EQ(b.data(), where);
  EXPECT_EQ(b.size(), size_t{(48 << 10) - 100});
  EXPECT_EQ(BodyPoolInUse().strings, before.strings);
  GiveBodyBuffer(std::move(b));
  // Far smaller (under half its room) or larger: a string of its own.
  std::string small = TakeBodyBuffer(8 << 10);
  EXPECT_NE(small.data(), where);
  std::string large = TakeBodyBuffer(64 << 10);
  EXPECT_NE(large.data(), where);
  EXPECT_EQ(large.size(), size_t{64} << 10);
}

TEST(BodyPool, KeepsABoundedAmount) {
  if (!kBodyPoolOn) GTEST_SKIP() << "the pool is off under AddressSanitizer";
  ReturnFreedMemory();
  for (int i = 0; i < 100; ++i) GiveBodyBuffer(std::string(size_t{1} << 20, 'y'));
  BodyPoolUse use = BodyPoolInUse();
  EXPECT_LE(use.bytes, kBodyPoolBytes);
  EXPECT_GE(use.bytes, kBodyPoolBytes / 2);
  EXPECT_LE(use.strings, kBodyPoolStrings);
  for (int i = 0; i < 200; ++i) GiveBodyBuffer(std::string(8 << 10, 'z'));
  EXPECT_LE(BodyPoolInUse().strings, kBodyPoolStrings);
  EXPECT_LE(BodyPoolInUse().bytes, kBodyPoolBytes);
  // A full pool makes room for the newest: the traffic's size of now finds
  // a string, whatever sizes filled the pool before.
  EXPECT_EQ(BodyPoolInUse().strings, kBodyPoolStrings);
  std::string now(48 << 10, 'n');
  const char* where = now.data();
  GiveBodyBuffer(std::move(now));
  EXPECT_LE(BodyPoolInUse().strings, kBodyPoolStrings);
  EXPECT_EQ(TakeBodyBuffer(48 << 10).data(), where);
  ReturnFreedMemory();
  EXPECT_EQ(BodyPoolInUse().strings, 0u);
  EXPECT_EQ(BodyPoolInUse().bytes, 0u);
  // Out of range: not kept.
  GiveBodyBuffer(std::string(100, 'a'));
  GiveBodyBuffer(std::string(size_t{8} << 20, 'b'));
  EXPECT_EQ(BodyPoolInUse().strings, 0u);
}

TEST(BodyPool, AKServeBodyGoesBackWhenItsRequestIsDone) {
  if (!kBodyPoolOn) GTEST_SKIP() << "the pool is off under AddressSanitizer";
  const std::string json = R"({"inputs":[{"name":"x","shape":[1,2048],"datatype":"FP32",)"
                           R"("parameters":{"binary_data_size":8192}}]})";
  std::string body = TakeBodyBuffer(json.size() + 8192);
  std::memcpy(body.data(), json.data(), json.size());
  std::memset(body.data() + json.size(), 0, 8192);
  const char* where = body.data();
  ReturnFreedMemory();
  const size_t kept = BodyPoolInUse().strings;
  {
    auto r = ParseKServeInferBody("m", -1, std::move(body), std::to_string(json.size()));
    ASSERT_TRUE(r.has_value()) << r.error().message();
    EXPECT_EQ(BodyPoolInUse().strings, kept) << "kept while the input views it";
  }
  EXPECT_EQ(BodyPoolInUse().strings, kept + 1);
  EXPECT_EQ(TakeBodyBuffer(json.size() + 8192).data(), where);
}

}  // namespace
}  // namespace quern
