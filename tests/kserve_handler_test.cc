// KServe v2 REST handler tests without sockets: requests in, responses out.
#include "frontends/http/kserve_handler.h"

#include <gtest/gtest.h>
#include <rapidjson/document.h>

#include <cstring>
#include <future>

#include "test_util.h"

namespace quern {
namespace {

class KServeHandlerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto e = Engine::Create({.model_repository = testing::TestModels().string()});
    ASSERT_TRUE(e.has_value()) << e.error().ToString();
    engine_ = e->release();
  }
  static void TearDownTestSuite() {
    delete engine_;
    engine_ = nullptr;
  }

  HttpResponse Call(std::string method, std::string target, std::string body = "") {
    KServeHandler h(engine_);
    Router router;
    EXPECT_TRUE(h.AddRoutes(router).ok());
    std::promise<HttpResponse> p;
    router.Dispatch({std::move(method), std::move(target), {}, std::move(body)},
                    [&](HttpResponse r) { p.set_value(std::move(r)); });
    return p.get_future().get();
  }

  static rapidjson::Document Parse(const HttpResponse& r) {
    rapidjson::Document d;
    d.Parse(r.body.c_str());
    EXPECT_FALSE(d.HasParseError()) << r.body;
    return d;
  }

  static Engine* engine_;
};
Engine* KServeHandlerTest::engine_ = nullptr;

TEST_F(KServeHandlerTest, HealthAndMetadata) {
  EXPECT_EQ(Call("GET", "/v2/health/live").status, 200);
  EXPECT_EQ(Call("GET", "/v2/health/ready").status, 200);
  auto server = Parse(Call("GET", "/v2"));
  EXPECT_STREQ(server["name"].GetString(), "quern");
  HttpResponse m = Call("GET", "/v2/models/add_sub");
  ASSERT_EQ(m.status, 200) << m.body;
  auto d = Parse(m);
  EXPECT_STREQ(d["name"].GetString(), "add_sub");
  EXPECT_EQ(d["inputs"].Size(), 2u);
  EXPECT_STREQ(d["inputs"][0]["datatype"].GetString(), "FP32");
  EXPECT_EQ(d["inputs"][0]["shape"][0].GetInt(), -1);
  EXPECT_EQ(d["inputs"][0]["shape"][1].GetInt(), 4);
  EXPECT_EQ(Call("GET", "/v2/models/add_sub/ready").status, 200);
  EXPECT_EQ(Call("GET", "/v2/models/versions/versions/2/ready").status, 200);
  EXPECT_EQ(Call("GET", "/v2/models/versions/versions/9/ready").status, 400);
}

TEST_F(KServeHandlerTest, JsonInferNestedAndFlatData) {
  HttpResponse r = Call("POST", "/v2/models/add_sub/infer",
                        R"({"id":"req-1","inputs":[
                          {"name":"INPUT0","shape":[2,4],"datatype":"FP32","data":[[1,2,3,4],[5,6,7,8]]},
                          {"name":"INPUT1","shape":[2,4],"datatype":"FP32","data":[0.5,0.5,0.5,0.5,1,1,1,1]}],
                          "outputs":[{"name":"OUTPUT0"}]})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto d = Parse(r);
  EXPECT_STREQ(d["id"].GetString(), "req-1");
  EXPECT_STREQ(d["model_name"].GetString(), "add_sub");
  ASSERT_EQ(d["outputs"].Size(), 1u);
  const auto& out = d["outputs"][0];
  EXPECT_STREQ(out["name"].GetString(), "OUTPUT0");
  const float want[] = {1.5f, 2.5f, 3.5f, 4.5f, 6, 7, 8, 9};
  ASSERT_EQ(out["data"].Size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_FLOAT_EQ(out["data"][i].GetFloat(), want[i]);
  EXPECT_EQ(out["shape"][0].GetInt(), 2);
}

TEST_F(KServeHandlerTest, Fp16HasNoJsonFormAndIsRejectedClearly) {
  HttpResponse r = Call("POST", "/v2/models/dtypes/infer",
                        R"({"inputs":[
    {"name":"in_bool","shape":[1,2],"datatype":"BOOL","data":[true,false]},
    {"name":"in_uint8","shape":[1,2],"datatype":"UINT8","data":[1,255]},
    {"name":"in_int8","shape":[1,2],"datatype":"INT8","data":[-1,7]},
    {"name":"in_int32","shape":[1,2],"datatype":"INT32","data":[-5,5]},
    {"name":"in_int64","shape":[1,2],"datatype":"INT64","data":[1099511627776,-2]},
    {"name":"in_fp16","shape":[1,2],"datatype":"FP16","data":[1,2]},
    {"name":"in_fp32","shape":[1,2],"datatype":"FP32","data":[1,2]},
    {"name":"in_fp64","shape":[1,2],"datatype":"FP64","data":[1,2]},
    {"name":"in_string","shape":[1,2],"datatype":"BYTES","data":["quern","mill"]}]})");
  // FP16 has no JSON form: a clear 400 naming the input.
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("in_fp16"), std::string::npos) << r.body;
}

TEST_F(KServeHandlerTest, ErrorsAreMappedAndExplained) {
  HttpResponse r = Call("POST", "/v2/models/nope/infer", R"({"inputs":[]})");
  EXPECT_EQ(r.status, 404);
  EXPECT_NE(r.body.find("unknown model 'nope'"), std::string::npos) << r.body;

  r = Call("POST", "/v2/models/add_sub/infer", R"({"inputs":[{"name":"INPUT0",)");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("malformed JSON"), std::string::npos) << r.body;

  r = Call("POST", "/v2/models/add_sub/infer",
           R"({"inputs":[{"name":"INPUT0","shape":[1,3],"datatype":"FP32","data":[1,2,3]},
                         {"name":"INPUT1","shape":[1,3],"datatype":"FP32","data":[1,2,3]}]})");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("expected shape [-1,4], got [1,3]"), std::string::npos) << r.body;

  r = Call("POST", "/v2/models/add_sub/infer",
           R"({"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3]}]})");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("needs 4 values, 'data' has 3"), std::string::npos) << r.body;

  EXPECT_EQ(Call("GET", "/v2/nothing/here").status, 404);
  EXPECT_EQ(HttpStatusFor(Unavailable("queue full")), 503);
  EXPECT_EQ(HttpStatusFor(Internal("x")), 500);
}

}  // namespace
}  // namespace quern

namespace quern {
namespace {

HttpResponse CallWithHeaders(Engine* engine, HttpRequest req) {
  KServeHandler h(engine);
  Router router;
  EXPECT_TRUE(h.AddRoutes(router).ok());
  std::promise<HttpResponse> p;
  router.Dispatch(std::move(req), [&](HttpResponse r) { p.set_value(std::move(r)); });
  return p.get_future().get();
}

std::string BinaryBody(const std::string& json, const std::vector<float>& a, const std::vector<float>& b) {
  std::string body = json;
  body.append(reinterpret_cast<const char*>(a.data()), a.size() * 4);
  body.append(reinterpret_cast<const char*>(b.data()), b.size() * 4);
  return body;
}

TEST(KServeBinary, BinaryInputsAndOutputs) {
  auto e = Engine::Create({.model_repository = testing::TestModels().string()});
  ASSERT_TRUE(e.has_value());
  const std::string json =
      R"({"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","parameters":{"binary_data_size":16}},)"
      R"({"name":"INPUT1","shape":[1,4],"datatype":"FP32","parameters":{"binary_data_size":16}}],)"
      R"("outputs":[{"name":"OUTPUT1","parameters":{"binary_data":true}}]})";
  std::vector<float> a{1, 2, 3, 4}, b{4, 3, 2, 1};
  HttpRequest req{"POST",
                  "/v2/models/add_sub/infer",
                  {{"inference-header-content-length", std::to_string(json.size())}},
                  BinaryBody(json, a, b)};
  HttpResponse r = CallWithHeaders(e->get(), std::move(req));
  ASSERT_EQ(r.status, 200) << r.body;
  std::string header_len;
  for (const auto& [k, v] : r.headers) {
    if (k == "Inference-Header-Content-Length") header_len = v;
  }
  ASSERT_FALSE(header_len.empty());
  const size_t n = std::stoul(header_len);
  ASSERT_EQ(r.body.size(), n + 16);
  EXPECT_NE(r.body.substr(0, n).find("\"binary_data_size\":16"), std::string::npos) << r.body.substr(0, n);
  std::vector<float> out(4);
  std::memcpy(out.data(), r.body.data() + n, 16);
  EXPECT_EQ(out, (std::vector<float>{-3, -1, 1, 3}));
}

TEST(KServeBinary, TruncatedBinaryBodyIsAClearError) {
  auto e = Engine::Create({.model_repository = testing::TestModels().string()});
  ASSERT_TRUE(e.has_value());
  const std::string json =
      R"({"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","parameters":{"binary_data_size":16}},)"
      R"({"name":"INPUT1","shape":[1,4],"datatype":"FP32","parameters":{"binary_data_size":16}}]})";
  std::string body = BinaryBody(json, {1, 2, 3, 4}, {1, 2, 3, 4});
  body.resize(body.size() - 5);
  HttpRequest req{
      "POST", "/v2/models/add_sub/infer", {{"inference-header-content-length", std::to_string(json.size())}}, body};
  HttpResponse r = CallWithHeaders(e->get(), std::move(req));
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("input 'INPUT1': binary_data_size 16 but only 11 bytes"), std::string::npos) << r.body;

  HttpRequest bad_len{"POST", "/v2/models/add_sub/infer", {{"inference-header-content-length", "99999"}}, json};
  r = CallWithHeaders(e->get(), std::move(bad_len));
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("Inference-Header-Content-Length"), std::string::npos) << r.body;
}

}  // namespace
}  // namespace quern
