// The Redis pieces that need no server: RESP parsing and encoding, URL
// parsing, and the stored form of a job result. Talking to a real
// redis-server is tested in tests/python/test_redis.py.
#include <gtest/gtest.h>
#include <rapidjson/document.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "store/redis_client.h"
#include "store/redis_store.h"

namespace quern {
namespace {

RedisReply ParseAll(std::string_view data) {
  size_t consumed = 0;
  auto r = ParseRedisReply(data, consumed);
  EXPECT_TRUE(r.has_value());
  EXPECT_TRUE(r.has_value() && r->has_value()) << data;
  EXPECT_EQ(consumed, data.size());
  return r.has_value() && r->has_value() ? **r : RedisReply{};
}

TEST(Resp, ParsesEveryReplyType) {
  EXPECT_EQ(ParseAll("+OK\r\n").type, RedisReply::Type::kStatus);
  EXPECT_EQ(ParseAll("+OK\r\n").str, "OK");
  const RedisReply err = ParseAll("-NOGROUP no such key\r\n");
  EXPECT_TRUE(err.is_error());
  EXPECT_EQ(err.str, "NOGROUP no such key");
  EXPECT_EQ(ParseAll(":-42\r\n").integer, -42);
  EXPECT_TRUE(ParseAll("$-1\r\n").is_nil());
  EXPECT_TRUE(ParseAll("*-1\r\n").is_nil());
  // A bulk string may hold CRLF and NUL bytes: its length decides.
  const std::string binary("a\r\nb\0c", 6);
  const RedisReply bulk = ParseAll("$6\r\n" + binary + "\r\n");
  EXPECT_EQ(bulk.type, RedisReply::Type::kString);
  EXPECT_EQ(bulk.str, binary);
  EXPECT_EQ(ParseAll("$0\r\n\r\n").str, "");
  // XREADGROUP's shape: [[stream, [[id, [field, value]]]]].
  const RedisReply nested = ParseAll("*1\r\n*2\r\n$3\r\nkey\r\n*1\r\n*2\r\n$3\r\n1-0\r\n*2\r\n$2\r\nid\r\n$1\r\nx\r\n");
  ASSERT_TRUE(nested.is_array());
  ASSERT_EQ(nested.elements.size(), 1u);
  EXPECT_EQ(nested.elements[0].elements[0].str, "key");
  EXPECT_EQ(nested.elements[0].elements[1].elements[0].elements[1].elements[1].str, "x");
  EXPECT_TRUE(ParseAll("*0\r\n").elements.empty());
}

TEST(Resp, IncompleteReplyAsksForMoreAtEveryCut) {
  const std::string full = "*3\r\n$5\r\nhello\r\n:7\r\n*2\r\n+a\r\n$-1\r\n";
  for (size_t cut = 0; cut < full.size(); ++cut) {
    size_t consumed = 0;
    auto r = ParseRedisReply(std::string_view(full).substr(0, cut), consumed);
    ASSERT_TRUE(r.has_value()) << cut;
    EXPECT_FALSE(r->has_value()) << "a reply from only " << cut << " bytes";
  }
  // Two replies back to back: the first is taken, the rest left.
  size_t consumed = 0;
  auto r = ParseRedisReply(":1\r\n:2\r\n", consumed);
  ASSERT_TRUE(r.has_value() && r->has_value());
  EXPECT_EQ((*r)->integer, 1);
  EXPECT_EQ(consumed, 4u);
}

TEST(Resp, GarbageIsAnErrorNotACrash) {
  for (std::string bad : {std::string("?what\r\n"), std::string(":12x\r\n"), std::string("$-5\r\n"),
                          std::string("$3\r\nabcde\r\n"), std::string("*-2\r\n")}) {
    size_t consumed = 0;
    EXPECT_FALSE(ParseRedisReply(bad, consumed).has_value()) << bad;
  }
  // Deep nesting is refused rather than recursed into without bound.
  std::string deep;
  for (int i = 0; i < 100; ++i) deep += "*1\r\n";
  deep += ":1\r\n";
  size_t consumed = 0;
  EXPECT_FALSE(ParseRedisReply(deep, consumed).has_value());
  // An array claiming a huge length with few bytes waits for more.
  auto r = ParseRedisReply("*2000000000\r\n:1\r\n", consumed);
  ASSERT_TRUE(r.has_value());
  EXPECT_FALSE(r->has_value());
}

TEST(Resp, PipelineEncodesCommandsBackToBack) {
  RedisPipeline p;
  p.Add({"SET", "k", std::string_view("v\r\n\0", 4)});
  p.Add(std::vector<std::string>{"PING"});
  EXPECT_EQ(p.size(), 2u);
  EXPECT_EQ(p.Joined(), std::string("*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\nv\r\n") + std::string(1, '\0') +
                            std::string("\r\n*1\r\n$4\r\nPING\r\n"));
  RedisPipeline q;
  q.Add({"MULTI"});
  q.Append(p);
  EXPECT_EQ(q.size(), 3u);
  EXPECT_EQ(q.Joined(), "*1\r\n$5\r\nMULTI\r\n" + p.Joined());
}

TEST(Resp, ViewedArgumentsAreSentInPlaceWithTheSameEncoding) {
  auto big = std::make_shared<const std::string>(std::string(100000, 'x') + "\r\n");
  RedisPipeline copied, viewed;
  copied.Add({"SET", "a", *big});
  copied.Add({"SET", "b", "small"});
  viewed.AddViewing({"SET", "a"}, *big, big);
  viewed.Add({"SET", "b", "small"});
  EXPECT_EQ(viewed.Joined(), copied.Joined());
  EXPECT_EQ(viewed.bytes(), copied.bytes());
  // The big value is one piece of its own, not a copy.
  const auto pieces = viewed.Pieces();
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[1].data(), big->data());
  // Appended after other commands, twice: the offsets move with it.
  RedisPipeline all;
  all.Add({"MULTI"});
  all.Append(viewed);
  all.Append(viewed);
  all.Add({"EXEC"});
  EXPECT_EQ(all.size(), 6u);
  EXPECT_EQ(all.Joined(), "*1\r\n$5\r\nMULTI\r\n" + copied.Joined() + copied.Joined() + "*1\r\n$4\r\nEXEC\r\n");
  // The pipeline keeps the value alive.
  std::weak_ptr<const std::string> watch = big;
  big.reset();
  viewed.Clear();
  copied.Clear();
  EXPECT_FALSE(watch.expired());  // `all` holds it still
  all.Clear();
  EXPECT_TRUE(watch.expired());
}

TEST(RedisUrl, ParsesHostPortDbAndCredentials) {
  RedisOptions o;
  ASSERT_TRUE(ParseRedisUrl("redis://cache.local:6380/3", o).ok());
  EXPECT_EQ(o.host, "cache.local");
  EXPECT_EQ(o.port, 6380);
  EXPECT_EQ(o.db, 3);
  EXPECT_FALSE(o.tls);
  EXPECT_TRUE(o.password.empty());

  ASSERT_TRUE(ParseRedisUrl("rediss://app:p%40ss:w@10.0.0.2", o).ok());
  EXPECT_TRUE(o.tls);
  EXPECT_EQ(o.user, "app");
  EXPECT_EQ(o.password, "p@ss:w");
  EXPECT_EQ(o.port, 6379);
  EXPECT_EQ(o.db, 0);

  ASSERT_TRUE(ParseRedisUrl("redis://:secret@[::1]:7000", o).ok());
  EXPECT_EQ(o.host, "::1");
  EXPECT_EQ(o.port, 7000);
  EXPECT_EQ(o.user, "");
  EXPECT_EQ(o.password, "secret");

  for (const char* bad : {"http://host", "redis://", "redis://host:0", "redis://host:99999", "redis://host:x",
                          "redis://host/db1", "redis://[::1"}) {
    Status s = ParseRedisUrl(bad, o);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("--redis-url"), std::string::npos) << s.message();
  }
}

TEST(RedisUrl, ParsesSentinelsMasterAndOptions) {
  RedisOptions o;
  ASSERT_TRUE(ParseRedisUrl("redis+sentinel://:pw@s1,s2:26380,[fd00::3]/my%20master/2?wait_replicas=1&"
                            "wait_timeout_ms=250&sentinel_password=s%26cret",
                            o)
                  .ok());
  ASSERT_EQ(o.sentinels.size(), 3u);
  EXPECT_EQ(o.sentinels[0].host, "s1");
  EXPECT_EQ(o.sentinels[0].port, 26379);
  EXPECT_EQ(o.sentinels[1].host, "s2");
  EXPECT_EQ(o.sentinels[1].port, 26380);
  EXPECT_EQ(o.sentinels[2].host, "fd00::3");
  EXPECT_EQ(o.sentinel_master, "my master");
  EXPECT_EQ(o.db, 2);
  EXPECT_EQ(o.password, "pw");
  EXPECT_EQ(o.sentinel_password, "s&cret");
  EXPECT_EQ(o.wait_replicas, 1);
  EXPECT_EQ(o.wait_timeout.count(), 250);
  EXPECT_FALSE(o.tls);
  EXPECT_NE(o.sentinel_first, nullptr);
  // Messages name the master and its sentinels, never a password.
  EXPECT_EQ(o.Address(), "master 'my master' via sentinels s1:26379,s2:26380,fd00::3:26379");

  ASSERT_TRUE(ParseRedisUrl("rediss+sentinel://s1/m", o).ok());
  EXPECT_TRUE(o.tls);
  EXPECT_EQ(o.db, 0);
  EXPECT_EQ(o.sentinel_master, "m");
  EXPECT_TRUE(o.password.empty() && o.sentinel_password.empty());
  EXPECT_EQ(o.wait_replicas, 0);

  // Options apply to a plain URL too; parsing again forgets the sentinels.
  ASSERT_TRUE(ParseRedisUrl("redis://h:7000/1?wait_replicas=2", o).ok());
  EXPECT_TRUE(o.sentinels.empty());
  EXPECT_EQ(o.host, "h");
  EXPECT_EQ(o.port, 7000);
  EXPECT_EQ(o.db, 1);
  EXPECT_EQ(o.wait_replicas, 2);
  EXPECT_EQ(o.Address(), "h:7000");

  for (const char* bad :
       {"redis+sentinel://s1", "redis+sentinel://s1/", "redis+sentinel://s1,,s2/m", "redis+sentinel://s1:0/m",
        "redis+sentinel://s1/m/x", "redis://h1,h2", "redis://h?wait_replicas=-1", "redis://h?wait_timeout_ms=0",
        "redis://h?sentinel_password=x", "redis://h?nope=1", "redis+sentinel//s1/m"}) {
    Status s = ParseRedisUrl(bad, o);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("--redis-url"), std::string::npos) << s.message();
  }
}

TEST(RedisResultStore, RecordRoundTripsThroughJsonAndBinaryValues) {
  JobRecord rec;
  rec.id = NewJobId(1'700'000'000'123);
  rec.model = "m";
  rec.version = 2;
  rec.state = JobState::kDone;
  rec.submitted_ms = 1'700'000'000'123;
  rec.started_ms = rec.submitted_ms + 5;
  rec.finished_ms = rec.submitted_ms + 9;
  rec.binary_default = true;
  rec.binary_outputs = {{"small", false}};
  const std::vector<float> small{1.5f, -2.25f, 3.0f};
  rec.outputs.push_back({"small", Tensor::From(DataType::kFp32, Shape{1, 3}, std::span<const float>(small))});
  std::vector<int64_t> big(1000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<int64_t>(i * i) - 7;
  rec.outputs.push_back({"big", Tensor::From(DataType::kInt64, Shape{10, 100}, std::span<const int64_t>(big))});

  RedisResultStoreOptions o;
  o.inline_max_bytes = 4096;
  auto enc = RedisResultStore::Encode(rec, o);
  ASSERT_TRUE(enc.has_value()) << enc.error().ToString();
  // The small output is JSON data; the 8000-byte one is a separate value.
  EXPECT_NE(enc->json.find("\"data\":[1.5,-2.25,3.0]"), std::string::npos) << enc->json;
  ASSERT_EQ(enc->binary.size(), 1u);
  EXPECT_EQ(enc->binary[0].first, "results:" + rec.id + ":bin:0");
  ASSERT_EQ(enc->binary[0].second.size(), 8000u);
  EXPECT_EQ(std::memcmp(enc->binary[0].second.data(), big.data(), 8000), 0);

  auto dec = RedisResultStore::Decode(enc->json, {std::string(enc->binary[0].second)});
  ASSERT_TRUE(dec.has_value()) << dec.error().ToString();
  const JobRecord& back = **dec;
  EXPECT_EQ(back.id, rec.id);
  EXPECT_EQ(back.model, "m");
  EXPECT_EQ(back.version, 2);
  EXPECT_EQ(back.state, JobState::kDone);
  EXPECT_EQ(back.started_ms, rec.started_ms);
  EXPECT_EQ(back.finished_ms, rec.finished_ms);
  EXPECT_TRUE(back.binary_default);
  EXPECT_EQ(back.binary_outputs, rec.binary_outputs);
  ASSERT_EQ(back.outputs.size(), 2u);
  EXPECT_EQ(back.outputs[0].name, "small");
  EXPECT_EQ(back.outputs[0].tensor.shape(), (Shape{1, 3}));
  EXPECT_EQ(
      std::vector<float>(back.outputs[0].tensor.values<float>().begin(), back.outputs[0].tensor.values<float>().end()),
      small);
  EXPECT_EQ(back.outputs[1].tensor.dtype(), DataType::kInt64);
  EXPECT_EQ(back.outputs[1].tensor.shape(), (Shape{10, 100}));
  EXPECT_EQ(std::memcmp(back.outputs[1].tensor.data(), big.data(), 8000), 0);

  // A missing binary value is damage, reported as such.
  EXPECT_FALSE(RedisResultStore::Decode(enc->json, {}).has_value());
}

TEST(RedisResultStore, ADecoupledModelsResponsesRoundTripInOrderWithTheirBinaryValues) {
  JobRecord rec;
  rec.id = NewJobId(1'700'000'000'123);
  rec.model = "stream";
  rec.version = 1;
  rec.state = JobState::kDone;
  rec.decoupled = true;
  // Response k: "y", k * 1000 + i; the first 3 values, the others k + 1 rows of 300 (past the inline
  // bound): an output name is a binary value in every response once one needs it.
  std::vector<std::vector<int32_t>> values;
  for (int k = 0; k < 3; ++k) {
    std::vector<int32_t> v(static_cast<size_t>(k == 0 ? 3 : (k + 1) * 300));
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int32_t>(k * 1000 + static_cast<int>(i));
    const int64_t rows = k == 0 ? 1 : k + 1;
    rec.responses.push_back({{"y", Tensor::From(DataType::kInt32, Shape{rows, static_cast<int64_t>(v.size()) / rows},
                                                std::span<const int32_t>(v))}});
    values.push_back(std::move(v));
  }
  rec.responses.push_back({});  // a response without outputs
  RedisResultStoreOptions o;
  o.inline_max_bytes = 1024;
  auto enc = RedisResultStore::Encode(rec, o);
  ASSERT_TRUE(enc.has_value()) << enc.error().ToString();
  EXPECT_EQ(enc->json.find("\"result\""), std::string::npos) << enc->json;
  ASSERT_EQ(enc->binary.size(), 3u);
  std::vector<std::string> binary;
  for (const auto& [key, bytes] : enc->binary) binary.emplace_back(bytes);
  auto dec = RedisResultStore::Decode(enc->json, binary);
  ASSERT_TRUE(dec.has_value()) << dec.error().ToString();
  const JobRecord& back = **dec;
  EXPECT_TRUE(back.decoupled);
  EXPECT_TRUE(back.outputs.empty());
  ASSERT_EQ(back.responses.size(), 4u);
  for (size_t k = 0; k < 3; ++k) {
    ASSERT_EQ(back.responses[k].size(), 1u) << k;
    const Tensor& t = back.responses[k][0].tensor;
    EXPECT_EQ(t.shape(), rec.responses[k][0].tensor.shape()) << k;
    EXPECT_EQ(std::vector<int32_t>(t.values<int32_t>().begin(), t.values<int32_t>().end()), values[k]) << k;
  }
  EXPECT_TRUE(back.responses[3].empty());
  // A binary value missing: damage, reported as such.
  EXPECT_FALSE(RedisResultStore::Decode(enc->json, {binary[0]}).has_value());
}

TEST(RedisResultStore, SmallUtf8BytesOutputsAreJsonStrings) {
  // Labels and OCR text: read with any Redis client as JSON strings. Bytes
  // that are not UTF-8, and large BYTES outputs, stay binary values.
  JobRecord rec;
  rec.id = "job-text";
  rec.model = "ocr";
  rec.state = JobState::kDone;
  auto text = Tensor::FromStrings(Shape{1, 3}, {"cat", "Zo\xc3\xab \xe5\xbc\xa0\xe4\xbc\x9f", "a \"quoted\"\n line"});
  auto raw = Tensor::FromStrings(Shape{1, 2}, {"ok", "\xff\xfe not UTF-8"});
  auto long_text = Tensor::FromStrings(Shape{1, 1}, {std::string(5000, 'x')});
  rec.outputs = {{"text", text}, {"raw", raw}, {"long", long_text}};
  RedisResultStoreOptions o;
  o.inline_max_bytes = 4096;
  auto enc = RedisResultStore::Encode(rec, o);
  ASSERT_TRUE(enc.has_value()) << enc.error().ToString();
  rapidjson::Document d;
  d.Parse(enc->json.c_str());
  ASSERT_FALSE(d.HasParseError()) << enc->json;
  const auto& outputs = d["result"]["outputs"];
  ASSERT_TRUE(outputs[0].HasMember("data")) << enc->json;
  EXPECT_STREQ(outputs[0]["data"][1].GetString(), "Zo\xc3\xab \xe5\xbc\xa0\xe4\xbc\x9f");
  EXPECT_STREQ(outputs[0]["data"][2].GetString(), "a \"quoted\"\n line");
  EXPECT_FALSE(outputs[1].HasMember("data")) << "not UTF-8: a binary value";
  EXPECT_FALSE(outputs[2].HasMember("data")) << "over inline_max_bytes: a binary value";
  ASSERT_EQ(enc->binary.size(), 2u);
  std::vector<std::string> values;
  for (const auto& [key, bytes] : enc->binary) values.emplace_back(bytes);
  auto dec = RedisResultStore::Decode(enc->json, values);
  ASSERT_TRUE(dec.has_value()) << dec.error().ToString();
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ((*dec)->outputs[i].tensor.dtype(), DataType::kBytes);
    EXPECT_EQ(*(*dec)->outputs[i].tensor.Strings(), *rec.outputs[i].tensor.Strings()) << i;
  }
}

TEST(RedisResultStore, NonFiniteOutputsRoundTrip) {
  // A stored result with NaN or infinite outputs was read back as damaged
  // (the plain writer refused them).
  JobRecord rec;
  rec.id = "job-nan";
  rec.model = "m";
  rec.state = JobState::kDone;
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> values{std::numeric_limits<float>::quiet_NaN(), inf, -inf, 1.0f};
  rec.outputs.push_back({"y", Tensor::From(DataType::kFp32, Shape{1, 4}, std::span<const float>(values))});
  auto enc = RedisResultStore::Encode(rec, RedisResultStoreOptions{});
  ASSERT_TRUE(enc.has_value());
  auto dec = RedisResultStore::Decode(enc->json, {});
  ASSERT_TRUE(dec.has_value()) << dec.error().ToString();
  auto back = (*dec)->outputs.at(0).tensor.values<float>();
  ASSERT_EQ(back.size(), 4u);
  EXPECT_TRUE(std::isnan(back[0]));
  EXPECT_EQ(back[1], inf);
  EXPECT_EQ(back[2], -inf);
  EXPECT_EQ(back[3], 1.0f);
}

TEST(RedisResultStore, BinaryValuesMustMatchTheirShape) {
  // An INT8 [1,4] output with 16 bytes was accepted and served as 16 values.
  const std::string json = R"({"job_id":"j","status":"done","model_name":"m","model_version":"1","result":{"outputs":[)"
                           R"({"name":"y","datatype":"INT8","shape":[1,4],"parameters":{"binary_data_size":16}}]}})";
  auto dec = RedisResultStore::Decode(json, {std::string(16, '\1')});
  ASSERT_FALSE(dec.has_value());
  EXPECT_NE(dec.error().message().find("damaged"), std::string::npos) << dec.error().message();
  std::string fitting = json;
  fitting.replace(fitting.find("\"binary_data_size\":16"), 21, "\"binary_data_size\":4");
  auto right = RedisResultStore::Decode(fitting, {std::string(4, '\1')});
  ASSERT_TRUE(right.has_value()) << right.error().ToString();
  EXPECT_EQ((*right)->outputs.at(0).tensor.byte_size(), 4u);
}

TEST(RedisResultStore, FailedRecordKeepsItsError) {
  JobRecord rec;
  rec.id = "job-1";
  rec.model = "m";
  rec.state = JobState::kFailed;
  rec.error = InvalidArgument("model 'm': input 'x' has 3 values, expected 4");
  auto enc = RedisResultStore::Encode(rec, RedisResultStoreOptions{});
  ASSERT_TRUE(enc.has_value());
  EXPECT_TRUE(enc->binary.empty());
  auto dec = RedisResultStore::Decode(enc->json, {});
  ASSERT_TRUE(dec.has_value());
  EXPECT_EQ((*dec)->state, JobState::kFailed);
  EXPECT_EQ((*dec)->error, rec.error);
  EXPECT_TRUE((*dec)->outputs.empty());
  EXPECT_FALSE(RedisResultStore::Decode("{\"job_id\": ", {}).has_value());
}

}  // namespace
}  // namespace quern
