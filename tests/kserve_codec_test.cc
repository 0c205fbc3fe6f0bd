// The KServe v2 codec on bytes alone: a JSON header with the binary data in
// a buffer of its own (as Redis stores them), one body with both (as HTTP
// and stream entries carry them), and results written back.
#include "protocol/kserve_codec.h"

#include <gtest/gtest.h>
#include <rapidjson/document.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "test_util.h"

namespace quern {
namespace {

using testing::Floats;
using testing::ToFloats;

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

TEST(KServeCodec, BinaryInputsViewTheCallersBytesWithoutCopying) {
  const std::string json =
      R"({"id": "r1", "inputs": [{"name": "a", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}},
                                 {"name": "b", "shape": [1, 2], "datatype": "INT64", "data": [[7, -9]]},
                                 {"name": "c", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}],
          "outputs": [{"name": "y", "parameters": {"binary_data": true}}, {"name": "z"}],
          "parameters": {"priority": 2, "timeout": 5000}})";
  auto binary = std::make_shared<const std::string>(Bytes({1.5f, -2.0f}) + Bytes({3.25f}));
  std::weak_ptr<const std::string> watch = binary;
  auto parsed = ParseKServeInfer("m", 3, json, *binary, binary);
  ASSERT_TRUE(parsed.has_value()) << parsed.error().ToString();
  binary.reset();
  EXPECT_FALSE(watch.expired()) << "the binary inputs keep their bytes alive";
  const InferRequest& r = parsed->request;
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(r.version, 3);
  EXPECT_EQ(r.priority, 2u);
  EXPECT_EQ(r.timeout_us, 5000u);
  ASSERT_EQ(r.inputs.size(), 3u);
  EXPECT_EQ(r.inputs[0].name, "a");
  EXPECT_EQ(ToFloats(r.inputs[0].tensor), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(static_cast<const void*>(r.inputs[0].tensor.data()), static_cast<const void*>(watch.lock()->data()));
  EXPECT_EQ(r.inputs[1].tensor.shape(), (Shape{1, 2}));
  EXPECT_EQ(r.inputs[1].tensor.values<int64_t>()[1], -9);
  EXPECT_EQ(ToFloats(r.inputs[2].tensor), (std::vector<float>{3.25f}));
  EXPECT_EQ(r.requested_outputs, (std::vector<std::string>{"y", "z"}));
  EXPECT_EQ(parsed->format.id, "r1");
  EXPECT_TRUE(parsed->format.WantsBinary("y"));
  EXPECT_FALSE(parsed->format.WantsBinary("z"));
}

TEST(KServeCodec, TheModelGetsTheRequestsOwnParametersAsJson) {
  auto parse = [](const std::string& parameters) {
    return ParseKServeInfer("m", -1,
                            R"({"inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [1]}],
                                "parameters": )" +
                                parameters + "}",
                            "", nullptr);
  };
  auto r = parse(R"({"priority": 1, "timeout": 9, "binary_data_output": true, "sequence_id": 3, "sequence_start": true,
                     "sequence_end": false, "headers": "h", "triton_enable_empty_final_response": true,
                     "temperature": 0.5, "n": -3, "stop": "\u00e9\"", "flag": false})");
  ASSERT_TRUE(r.has_value()) << r.error().ToString();
  EXPECT_EQ(r->request.parameters, R"({"temperature":0.5,"n":-3,"stop":"é\"","flag":false})");
  EXPECT_EQ(r->request.priority, 1u);
  auto none = parse(R"({"priority": 1})");
  ASSERT_TRUE(none.has_value());
  EXPECT_EQ(none->request.parameters, "") << "only the server's: the model gets none";
  for (const char* bad : {R"({"x": [1]})", R"({"x": {"y": 1}})", R"({"x": null})"}) {
    auto refused = parse(bad);
    ASSERT_FALSE(refused.has_value()) << bad;
    EXPECT_NE(refused.error().message().find("parameter 'x' must be a bool, a number or a string"), std::string::npos)
        << refused.error().message();
  }
  auto twice = parse(R"({"t": 1, "t": 2})");
  ASSERT_FALSE(twice.has_value());
  EXPECT_NE(twice.error().message().find("parameter 't' is given twice"), std::string::npos);
  auto nan = parse(R"({"x": NaN})");
  ASSERT_FALSE(nan.has_value());
  EXPECT_NE(nan.error().message().find("parameter 'x' must be a finite number"), std::string::npos);
  auto big = parse(R"({"x": ")" + std::string(70000, 'a') + R"("})");
  ASSERT_FALSE(big.has_value());
  EXPECT_NE(big.error().message().find("at most 65536"), std::string::npos) << big.error().message();
  // Bytes that are no UTF-8 (a lone continuation byte, a cut sequence, an encoded surrogate) in a
  // value or a name: refused, not handed to a model whose JSON reader would fail on them. The
  // error does not quote them.
  for (const std::string& bad : {std::string("\x80"), std::string("ab\xC3"), std::string("\xED\xA0\x80")}) {
    auto value = parse(R"({"stop": ")" + bad + R"("})");
    ASSERT_FALSE(value.has_value()) << bad;
    EXPECT_EQ(value.error().message(), "model 'm': parameter 'stop' is not valid UTF-8");
    auto name = parse(R"({")" + bad + R"(": 1})");
    ASSERT_FALSE(name.has_value()) << bad;
    EXPECT_EQ(name.error().message(), "model 'm': a parameter's name is not valid UTF-8");
  }
}

TEST(KServeCodec, BinaryDataMustBeClaimedExactly) {
  const std::string json =
      R"({"inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}]})";
  const std::string extra = Bytes({1.0f}) + "x";
  auto r = ParseKServeInfer("m", -1, json, extra, nullptr);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message().find("1 bytes of binary data are not claimed"), std::string::npos)
      << r.error().message();
  r = ParseKServeInfer("m", -1, json, "ab", nullptr);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message().find("input 'a': binary_data_size 4 but only 2 bytes"), std::string::npos)
      << r.error().message();
}

TEST(KServeCodec, OneBodySplitsWhereTheHeaderLengthSays) {
  const std::string json =
      R"({"inputs": [{"name": "a", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}}]})";
  auto r = ParseKServeInferBody("m", -1, json + Bytes({4.0f, 5.0f}), std::to_string(json.size()));
  ASSERT_TRUE(r.has_value()) << r.error().ToString();
  EXPECT_EQ(ToFloats(r->request.inputs[0].tensor), (std::vector<float>{4.0f, 5.0f}));

  for (const std::string& bad :
       std::vector<std::string>{"x", "-1", "12 ", std::to_string(json.size() + 9), "99999999999999999999999"}) {
    auto e = ParseKServeInferBody("m", -1, json + Bytes({4.0f, 5.0f}), bad);
    ASSERT_FALSE(e.has_value()) << bad;
    EXPECT_EQ(e.error().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(e.error().message().find("Inference-Header-Content-Length"), std::string::npos) << e.error().message();
  }
  // No header length: the whole body is JSON.
  auto j = ParseKServeInferBody("m", -1,
                                R"({"inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [2]}]})", "");
  ASSERT_TRUE(j.has_value()) << j.error().ToString();
  EXPECT_EQ(ToFloats(j->request.inputs[0].tensor), (std::vector<float>{2.0f}));
}

TEST(KServeCodec, ResultsAreJsonThenBinaryPartsInOrder) {
  std::vector<NamedTensor> outputs = {
      {"y", Floats({2}, {0.5f, 1e30f})}, {"z", Floats({1, 2}, {-1.0f, 0.25f})}, {"w", Floats({1}, {7.0f})}};
  KServeOutputFormat format;
  format.binary_default = true;
  format.binary_outputs = {{"z", false}};
  rapidjson::StringBuffer sb;
  JsonWriter w(sb);
  std::vector<const Tensor*> parts;
  ASSERT_TRUE(WriteKServeResult(w, "req-7", "m", 4, outputs, format, parts).ok());
  KServeMessage m = JoinKServeMessage(sb, parts);
  EXPECT_TRUE(m.binary);
  ASSERT_EQ(m.bytes.size(), m.json_size + 12);
  EXPECT_EQ(m.bytes.substr(m.json_size), Bytes({0.5f, 1e30f}) + Bytes({7.0f}));

  rapidjson::Document d;
  d.Parse(m.bytes.data(), m.json_size);
  ASSERT_FALSE(d.HasParseError()) << m.bytes.substr(0, m.json_size);
  EXPECT_STREQ(d["id"].GetString(), "req-7");
  EXPECT_STREQ(d["model_name"].GetString(), "m");
  EXPECT_STREQ(d["model_version"].GetString(), "4");
  const auto& out = d["outputs"];
  ASSERT_EQ(out.Size(), 3u);
  EXPECT_EQ(out[0]["parameters"]["binary_data_size"].GetUint64(), 8u);
  EXPECT_FALSE(out[1].HasMember("parameters"));
  EXPECT_EQ(out[1]["data"][0].GetDouble(), -1.0);
  EXPECT_EQ(out[1]["data"][1].GetDouble(), 0.25);
  EXPECT_EQ(out[1]["shape"][1].GetInt(), 2);
  EXPECT_EQ(out[2]["parameters"]["binary_data_size"].GetUint64(), 4u);

  // Without an id the key is left out; without binary parts there is JSON only.
  rapidjson::StringBuffer sb2;
  JsonWriter w2(sb2);
  std::vector<const Tensor*> none;
  ASSERT_TRUE(WriteKServeResult(w2, "", "m", 1, {outputs[1]}, KServeOutputFormat{}, none).ok());
  KServeMessage m2 = JoinKServeMessage(sb2, none);
  EXPECT_FALSE(m2.binary);
  EXPECT_EQ(m2.bytes.size(), m2.json_size);
  EXPECT_EQ(m2.bytes.find("\"id\""), std::string::npos) << m2.bytes;
}

TEST(KServeCodec, ARequestWrittenAsResultsReadsBackTheSameTensors) {
  // What the Redis store does: results written, read back as the "inputs" of
  // a request (the tensor format is the same both ways).
  std::vector<NamedTensor> outputs = {{"y", Floats({3}, {1.0f, -0.0f, 3.5f})}, {"z", Floats({1}, {9.0f})}};
  KServeOutputFormat format;
  format.binary_outputs = {{"z", true}};
  rapidjson::StringBuffer sb;
  JsonWriter w(sb);
  std::vector<const Tensor*> parts;
  w.StartObject();
  w.Key("inputs");
  ASSERT_TRUE(WriteKServeOutputs(w, outputs, format, parts).ok());
  w.EndObject();
  KServeMessage m = JoinKServeMessage(sb, parts);
  auto back = ParseKServeInferBody("m", -1, m.bytes, std::to_string(m.json_size));
  ASSERT_TRUE(back.has_value()) << back.error().ToString();
  ASSERT_EQ(back->request.inputs.size(), 2u);
  EXPECT_EQ(ToFloats(back->request.inputs[0].tensor), (std::vector<float>{1.0f, -0.0f, 3.5f}));
  EXPECT_EQ(ToFloats(back->request.inputs[1].tensor), (std::vector<float>{9.0f}));
}

// Classification (KServe's extension): expected top-k written out by hand
// from the values.
std::vector<std::string> StringsOf(const Tensor& t) {
  auto views = t.Strings();
  EXPECT_TRUE(views.has_value());
  std::vector<std::string> out;
  if (views) {
    for (auto v : *views) out.emplace_back(v);
  }
  return out;
}

TEST(KServeClassification, TopKPerRowHighestFirstTiesByIndexNanLast) {
  const float nan = std::nanf("");
  Tensor t = Tensor::From<float>(DataType::kFp32, {2, 4},
                                 std::vector<float>{1.5f, 3.25f, 0.5f, 3.25f,  //
                                                    nan, -1.0f, 2.0f, -7.0f});
  auto c = ClassifyOutput(t, 3, nullptr, "m");
  ASSERT_TRUE(c.has_value()) << c.error().message();
  EXPECT_EQ(c->dtype(), DataType::kBytes);
  EXPECT_EQ(c->shape(), (Shape{2, 3}));
  EXPECT_EQ(StringsOf(*c), (std::vector<std::string>{"3.25:1", "3.25:3", "1.5:0", "2:2", "-1:1", "-7:3"}));
}

TEST(KServeClassification, OneRowIntegersLabelsAndCountsAboveTheSize) {
  Tensor t = Tensor::From<int64_t>(DataType::kInt64, {3}, std::vector<int64_t>{-5, 9007199254740993, 4});
  const std::vector<std::string> labels{"cat", "", "dog"};  // index 1 has no label, index 3 none at all
  auto c = ClassifyOutput(t, 10, &labels, "m");
  ASSERT_TRUE(c.has_value()) << c.error().message();
  EXPECT_EQ(c->shape(), (Shape{3}));
  EXPECT_EQ(StringsOf(*c), (std::vector<std::string>{"9007199254740993:1", "4:2:dog", "-5:0:cat"}));
}

TEST(KServeClassification, BadCountsAndTextOutputsAreRefused) {
  Tensor t = Tensor::From<float>(DataType::kFp32, {1, 2}, std::vector<float>{1, 2});
  auto zero = ClassifyOutput(t, 0, nullptr, "model 'm' output 'y'");
  ASSERT_FALSE(zero.has_value());
  EXPECT_NE(zero.error().message().find("model 'm' output 'y'"), std::string::npos);
  Tensor text = Tensor::FromStrings({1}, {"a"});
  EXPECT_FALSE(ClassifyOutput(text, 1, nullptr, "m").has_value());
}

TEST(KServeClassification, ParsedFromTheRequestAndRefusedWhenNotACount) {
  const std::string ok = R"({"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}],)"
                         R"("outputs":[{"name":"y","parameters":{"classification":2}}]})";
  auto parsed = ParseKServeInfer("m", -1, ok, {}, nullptr);
  ASSERT_TRUE(parsed.has_value()) << parsed.error().message();
  ASSERT_EQ(parsed->format.classifications.size(), 1u);
  EXPECT_EQ(parsed->format.classifications[0], (std::pair<std::string, int64_t>{"y", 2}));
  for (const char* bad : {"0", "-1", "2.5", "\"2\"", "true"}) {
    const std::string body = R"({"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}],)"
                             R"("outputs":[{"name":"y","parameters":{"classification":)" +
                             std::string(bad) + "}}]}";
    auto refused = ParseKServeInfer("m", -1, body, {}, nullptr);
    ASSERT_FALSE(refused.has_value()) << bad;
    EXPECT_NE(refused.error().message().find("output 'y'"), std::string::npos) << refused.error().message();
  }
}

TEST(KServeClassification, ManyRowsOfNothingAreAnsweredAtOnce) {
  // A model may return [N, 0]: no values to rank, whatever N is.
  Tensor t = Tensor::Allocate(DataType::kFp32, {int64_t{1} << 40, 0}, 0);
  auto c = ClassifyOutput(t, 5, nullptr, "m");
  ASSERT_TRUE(c.has_value()) << c.error().message();
  EXPECT_EQ(c->shape(), (Shape{int64_t{1} << 40, 0}));
}

TEST(KServeClassification, IntegersRankExactlyAndSmallTypesPrintAsNumbers) {
  // 2^53 and 2^53 + 1 are one double: ranked as integers, the larger wins.
  Tensor big = Tensor::From<int64_t>(DataType::kInt64, {2}, std::vector<int64_t>{9007199254740992, 9007199254740993});
  auto c = ClassifyOutput(big, 1, nullptr, "m");
  ASSERT_TRUE(c.has_value()) << c.error().message();
  EXPECT_EQ(StringsOf(*c), (std::vector<std::string>{"9007199254740993:1"}));
  Tensor bytes = Tensor::From<uint8_t>(DataType::kUint8, {1, 3}, std::vector<uint8_t>{7, 200, 65});
  auto b = ClassifyOutput(bytes, 2, nullptr, "m");
  ASSERT_TRUE(b.has_value()) << b.error().message();
  EXPECT_EQ(StringsOf(*b), (std::vector<std::string>{"200:1", "65:2"}));
}

TEST(KServeClassification, AnAnswerOfOverAMillionClassesIsRefused) {
  // Any count is "all of them" beyond the output's size; a row of 2^20 + 1
  // values would become as many strings.
  const int64_t n = (int64_t{1} << 20) + 1;
  Tensor t = Tensor::Allocate(DataType::kFp32, {n}, static_cast<size_t>(n) * 4);
  auto c = ClassifyOutput(t, INT64_MAX, nullptr, "model 'm' output 'y'");
  ASSERT_FALSE(c.has_value());
  EXPECT_NE(c.error().message().find("at most 1048576"), std::string::npos) << c.error().message();
  EXPECT_TRUE(ClassifyOutput(t, 5, nullptr, "m").has_value());  // a few of them: fine
}

TEST(KServeClassification, AnOutputAskedTwiceIsClassifiedOnce) {
  KServeOutputFormat format;
  format.classifications = {{"y", 1}, {"y", 2}};
  std::vector<NamedTensor> outputs;
  outputs.push_back({"y", Tensor::From<float>(DataType::kFp32, {1, 3}, std::vector<float>{0.5f, 2.5f, 1.0f})});
  ASSERT_TRUE(ApplyClassifications(outputs, format, "m", nullptr).ok());
  EXPECT_EQ(StringsOf(outputs[0].tensor), (std::vector<std::string>{"2.5:1"}));
}

}  // namespace
}  // namespace quern
