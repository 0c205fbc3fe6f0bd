// The job API without sockets, on a fake clock: its timestamps are the
// engine clock's date, so they are known exactly without sleeping.
#include "frontends/jobs/job_handler.h"

#include <gtest/gtest.h>
#include <rapidjson/document.h>

#include <algorithm>
#include <future>
#include <string>
#include <thread>

#include "store/result_store.h"
#include "test_util.h"

namespace quern {
namespace {

class Echo : public Model {
 public:
  Status Execute(const std::vector<NamedTensor>& inputs, int64_t, std::vector<NamedTensor>& outputs) override {
    outputs = {{"y", inputs.at(0).tensor}};
    return Status::Ok();
  }
};

// "echo": y = x, one FP32 value per row, one row a batch.
Status RegisterEcho(Engine& engine) {
  ModelConfig c;
  c.name = "echo";
  c.max_batch_size = 1;
  c.instance_count = 1;
  c.inputs = {{.name = "x", .dtype = DataType::kFp32, .dims = {1}}};
  c.outputs = {{.name = "y", .dtype = DataType::kFp32, .dims = {1}}};
  return engine.RegisterModel(c, [] { return std::make_unique<Echo>(); });
}

HttpResponse Call(JobHandler& h, std::string method, std::string target, std::string body = "",
                  std::vector<std::pair<std::string, std::string>> headers = {}) {
  Router router;
  EXPECT_TRUE(h.AddRoutes(router).ok());
  std::promise<HttpResponse> p;
  router.Dispatch({std::move(method), std::move(target), std::move(headers), std::move(body)},
                  [&](HttpResponse r) { p.set_value(std::move(r)); });
  return p.get_future().get();
}

TEST(JobHandler, RecognisesItsRoutesWithOrWithoutPercentEscapes) {
  auto engine = Engine::Create({});
  ASSERT_TRUE(engine.has_value());
  MemoryResultStore store;
  JobHandler jobs(engine->get(), &store);
  Router router;
  ASSERT_TRUE(jobs.AddRoutes(router).ok());
  const std::string get = "/v2/jobs/{id}", submit = "/v2/models/{model}[/versions/{version}]/jobs";
  EXPECT_EQ(router.PatternOf("GET", "/v2/jobs/abc?wait=1"), get);
  EXPECT_EQ(router.PatternOf("DELETE", "/v2/jobs/abc"), get);
  EXPECT_EQ(router.PatternOf("POST", "/v2/models/m/jobs"), submit);
  EXPECT_EQ(router.PatternOf("POST", "/v2/models/m/versions/2/jobs"), submit);
  // Segments are compared decoded: these are the same routes.
  EXPECT_EQ(router.PatternOf("GET", "/v2/%6Aobs/abc"), get);
  EXPECT_EQ(router.PatternOf("POST", "/v2/models/m/jo%62s"), submit);
  EXPECT_EQ(router.ModelOf("/v2/models/m/jo%62s"), "m");
  EXPECT_EQ(router.PatternOf("GET", "/v2/jobs"), "") << "no job named";
  EXPECT_EQ(router.PatternOf("POST", "/v2/models/m/infer"), "");
  EXPECT_EQ(router.PatternOf("POST", "/v2/models/jobs/infer"), "") << "a model named jobs";
  EXPECT_EQ(router.PatternOf("POST", "/v2/models/m/infer?next=jobs"), "");
  EXPECT_EQ(router.PatternOf("POST", "/v2/models/m%2Fjobs/infer"), "");
  EXPECT_EQ(router.PatternOf("POST", "/v1/vision/detection"), "");
  EXPECT_EQ(router.PatternOf("GET", "/v2/models/m/jobs"), "") << "jobs are submitted with POST";
}

TEST(JobHandler, TimestampsAndExpiryFollowTheInjectedClock) {
  // 2026-03-04T05:06:07.089Z on the fake clock's calendar.
  FakeClock clock(1'000'000'000, 1'772'600'767'089'000'000);
  auto engine = Engine::Create({.clock = &clock});
  ASSERT_TRUE(engine.has_value());
  ASSERT_TRUE(RegisterEcho(**engine).ok());
  MemoryResultStoreOptions so;
  so.clock = &clock;
  so.ttl_s = 60;
  MemoryResultStore store(so);
  JobHandler jobs(engine->get(), &store);

  HttpResponse submitted = Call(jobs, "POST", "/v2/models/echo/jobs",
                                R"({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [2.5]}]})");
  ASSERT_EQ(submitted.status, 202) << submitted.body;
  rapidjson::Document d;
  d.Parse(submitted.body.c_str());
  const std::string id = d["job_id"].GetString();
  EXPECT_EQ(JobIdSubmittedMs(id), 1'772'600'767'089) << "the id carries the clock's date";

  rapidjson::Document done;
  for (int i = 0; i < 5000; ++i) {
    HttpResponse got = Call(jobs, "GET", "/v2/jobs/" + id);
    done.Parse(got.body.c_str());
    if (done.HasMember("status") && std::string(done["status"].GetString()) == "done") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_STREQ(done["status"].GetString(), "done");
  EXPECT_STREQ(done["submitted"].GetString(), "2026-03-04T05:06:07.089Z");
  EXPECT_STREQ(done["finished"].GetString(), "2026-03-04T05:06:07.089Z") << "the fake clock did not move";
  EXPECT_EQ(done["result"]["outputs"][0]["data"][0].GetDouble(), 2.5);

  clock.AdvanceUs(61'000'000);  // past the 60 s TTL
  HttpResponse expired = Call(jobs, "GET", "/v2/jobs/" + id);
  EXPECT_EQ(expired.status, 404);
  EXPECT_NE(expired.body.find("expired"), std::string::npos) << expired.body;
}

TEST(JobHandler, WithKeysAJobIsOnlyItsSubmittersToReadAndCancel) {
  auto engine = Engine::Create({});
  ASSERT_TRUE(engine.has_value());
  ASSERT_TRUE(RegisterEcho(**engine).ok());
  MemoryResultStore store;
  JobHandler jobs(engine->get(), &store);
  jobs.set_owner_of([](const HttpRequest& r) { return JobOwner(r.Header("x-api-key")); });
  auto call = [&](std::string method, std::string target, std::string key, std::string body = "") {
    return Call(jobs, std::move(method), std::move(target), std::move(body), {{"x-api-key", std::move(key)}});
  };
  HttpResponse submitted = call("POST", "/v2/models/echo/jobs", "key-a",
                                R"({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [2.5]}]})");
  ASSERT_EQ(submitted.status, 202) << submitted.body;
  rapidjson::Document d;
  d.Parse(submitted.body.c_str());
  const std::string id = d["job_id"].GetString();
  std::string status;
  for (int i = 0; i < 5000 && status != "done"; ++i) {
    HttpResponse got = call("GET", "/v2/jobs/" + id, "key-a");
    ASSERT_EQ(got.status, 200) << got.body;
    d.Parse(got.body.c_str());
    status = d["status"].GetString();
    if (status != "done") std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(status, "done");
  for (const char* method : {"GET", "DELETE"}) {
    HttpResponse other = call(method, "/v2/jobs/" + id, "key-b");
    EXPECT_EQ(other.status, 404) << method << " " << other.body;
    EXPECT_EQ(other.body.find("2.5"), std::string::npos);
  }
  EXPECT_EQ(call("GET", "/v2/jobs/" + id, "").status, 404);
  EXPECT_EQ(call("GET", "/v2/jobs/" + id, "key-a").status, 200);
}

TEST(JobHandler, InMemoryAJobFromBeforeTheServerStartedIsGoneNotUnknown) {
  FakeClock clock(1'000'000'000, 1'772'600'767'089'000'000);  // wall clock 1'772'600'767'089 ms
  auto engine = Engine::Create({.clock = &clock});
  ASSERT_TRUE(engine.has_value());
  ASSERT_TRUE(RegisterEcho(**engine).ok());
  MemoryResultStoreOptions so;
  so.clock = &clock;
  MemoryResultStore store(so);
  JobHandler jobs(engine->get(), &store);
  // A job accepted by the process before this one: its result was in memory.
  const std::string before = NewJobId(1'772'600'767'089 - 60'000);
  for (const char* method : {"GET", "DELETE"}) {
    HttpResponse r = Call(jobs, method, "/v2/jobs/" + before);
    EXPECT_EQ(r.status, 410) << method << " " << r.body;
    EXPECT_NE(r.body.find("the server restarted after this job was accepted; its result is lost"), std::string::npos)
        << r.body;
  }
  // Never issued: unknown, not gone.
  clock.AdvanceUs(5'000'000);
  for (const std::string& id : {NewJobId(1'772'600'767'089 + 1'000), std::string("nope")}) {
    HttpResponse r = Call(jobs, "GET", "/v2/jobs/" + id);
    EXPECT_EQ(r.status, 404) << r.body;
  }
  // The acceptance says the job lives in this process only.
  HttpResponse submitted = Call(jobs, "POST", "/v2/models/echo/jobs",
                                R"({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [2.5]}]})");
  ASSERT_EQ(submitted.status, 202) << submitted.body;
  rapidjson::Document d;
  d.Parse(submitted.body.c_str());
  ASSERT_TRUE(d.HasMember("durable")) << submitted.body;
  EXPECT_FALSE(d["durable"].GetBool());
  // (Its callback must come before the store and the handler go.)
  const std::string id = d["job_id"].GetString();
  std::string status;
  for (int i = 0; i < 5000 && status != "done"; ++i) {
    d.Parse(Call(jobs, "GET", "/v2/jobs/" + id).body.c_str());
    status = d["status"].GetString();
    if (status != "done") std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(status, "done");
}

}  // namespace
}  // namespace quern

namespace quern {
namespace {

KServeInfer ParsedJob(float x) {
  std::string body = R"({"inputs":[{"name":"x","shape":[1,1],"datatype":"FP32","data":[)";
  body.append(std::to_string(x)).append("]}]}");
  auto parsed = ParseKServeInferBody("echo", -1, std::move(body), "");
  EXPECT_TRUE(parsed.has_value());
  return std::move(*parsed);
}

float FirstInput(const KServeInfer& infer) {
  return reinterpret_cast<const float*>(infer.request.inputs.at(0).tensor.data())[0];
}

TEST(LocalJobInputs, KeepsEachJobUntilTakenOnce) {
  FakeClock clock;
  LocalJobInputs local({.clock = &clock});
  ASSERT_TRUE(local.Put("a", ParsedJob(1), 100));
  ASSERT_TRUE(local.Put("b", ParsedJob(2), 100));
  EXPECT_FALSE(local.Put("a", ParsedJob(3), 100)) << "an id kept already is not replaced";
  EXPECT_EQ(local.bytes(), 200u);
  // Taken out of the order they were kept in.
  auto b = local.Take("b");
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(FirstInput(*b), 2.0f);
  EXPECT_FALSE(local.Take("b").has_value()) << "taken once";
  EXPECT_FALSE(local.Take("never").has_value());
  local.Drop("a");
  EXPECT_FALSE(local.Take("a").has_value());
  EXPECT_EQ(local.bytes(), 0u);
  EXPECT_EQ(local.size(), 0u);
}

TEST(LocalJobInputs, BoundedByBytesCountAndAge) {
  FakeClock clock;
  LocalJobInputs local({.max_bytes = 1000, .max_entries = 3, .max_age_ms = 30000, .clock = &clock});
  ASSERT_TRUE(local.Put("big", ParsedJob(1), 900));
  EXPECT_FALSE(local.Put("over", ParsedJob(2), 101)) << "past max_bytes: not kept";
  ASSERT_TRUE(local.Put("fits", ParsedJob(3), 100));
  EXPECT_EQ(local.bytes(), 1000u);
  ASSERT_TRUE(local.Take("big").has_value());
  ASSERT_TRUE(local.Put("c", ParsedJob(4), 10));
  ASSERT_TRUE(local.Put("d", ParsedJob(5), 10));
  EXPECT_FALSE(local.Put("e", ParsedJob(6), 10)) << "past max_entries: not kept";
  // Too old: forgotten (its job has most likely been taken elsewhere); room again.
  clock.AdvanceUs(30'000'001);
  ASSERT_TRUE(local.Put("f", ParsedJob(7), 10));
  EXPECT_FALSE(local.Take("fits").has_value());
  EXPECT_FALSE(local.Take("c").has_value());
  EXPECT_EQ(local.size(), 1u);
  EXPECT_EQ(local.bytes(), 10u);
  auto f = local.Take("f");
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(FirstInput(*f), 7.0f);
}

TEST(LocalJobInputs, TheOrderOfIdsStaysBoundedWhenJobsAreTakenOutOfOrder) {
  FakeClock clock;
  LocalJobInputs local({.clock = &clock});
  ASSERT_TRUE(local.Put("first", ParsedJob(0), 1));  // never taken: holds the front of the order
  size_t longest = 0;
  for (int i = 0; i < 5000; ++i) {  // past the bound (4 * 1 + 1024) four times
    std::string id = "j";
    id.append(std::to_string(i));
    ASSERT_TRUE(local.Put(id, ParsedJob(1), 1));
    ASSERT_TRUE(local.Take(id).has_value());
    longest = std::max(longest, local.ordered());
  }
  EXPECT_LE(longest, 4u * 1 + 1025);
  EXPECT_GT(longest, 1000u) << "taken ids behind the kept one wait in the order until the bound";
  EXPECT_EQ(local.size(), 1u);
  EXPECT_TRUE(local.Take("first").has_value());
}

}  // namespace
}  // namespace quern
