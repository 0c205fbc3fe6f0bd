// Models written in C++ and registered in code get the same batching,
// instances, ordering and telemetry as ONNX models.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include "eventually.h"
#include "metrics/collectors.h"
#include "quern/engine.h"
#include "test_util.h"

namespace quern {
namespace {

using testing::Floats;
using testing::ToFloats;

// y[i] = sum of row i of x; sleeps x[0][0] milliseconds to make completion order controllable.
class RowSum : public Model {
 public:
  explicit RowSum(std::atomic<int>* max_batch) : max_batch_(max_batch) {}
  Status Execute(const std::vector<NamedTensor>& inputs, int64_t batch_size,
                 std::vector<NamedTensor>& outputs) override {
    const Tensor& x = inputs.at(0).tensor;
    auto v = x.values<float>();
    int prev = max_batch_->load();
    while (batch_size > prev && !max_batch_->compare_exchange_weak(prev, static_cast<int>(batch_size))) {
    }
    if (v[0] < 0) return Internal("negative first value");
    if (v[0] >= 1 && v[0] < 1000) std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int>(v[0])));
    std::vector<float> y(static_cast<size_t>(batch_size));
    for (int64_t r = 0; r < batch_size; ++r) {
      for (int k = 0; k < 4; ++k) y[r] += v[r * 4 + k];
    }
    outputs = {{"y", Floats({batch_size, 1}, y)}};
    return Status::Ok();
  }

 private:
  std::atomic<int>* max_batch_;
};

ModelConfig RowSumConfig(const std::string& name, int instances, bool ordered) {
  ModelConfig c;
  c.name = name;
  c.max_batch_size = 8;
  c.inputs = {{.name = "x", .dtype = DataType::kFp32, .dims = {4}}};
  c.outputs = {{.name = "y", .dtype = DataType::kFp32, .dims = {1}}};
  c.instance_count = instances;
  c.batching = BatchingConfig{.max_queue_delay_us = 20000, .preserve_ordering = ordered};
  return c;
}

std::unique_ptr<Engine> EmptyEngine() {
  auto e = Engine::Create({});
  EXPECT_TRUE(e.has_value());
  return std::move(*e);
}

// Fails unless every input's data is aligned for its element type.
class AlignmentCheck : public Model {
 public:
  Status Execute(const std::vector<NamedTensor>& inputs, int64_t batch_size,
                 std::vector<NamedTensor>& outputs) override {
    const Tensor& x = inputs.at(0).tensor;
    if (reinterpret_cast<uintptr_t>(x.data()) % alignof(float) != 0) return Internal("misaligned input");
    std::vector<float> y(static_cast<size_t>(batch_size));
    auto v = x.values<float>();
    for (int64_t r = 0; r < batch_size; ++r) y[r] = v[r * 4] + v[r * 4 + 3];
    outputs = {{"y", Floats({batch_size, 1}, y)}};
    return Status::Ok();
  }
};

TEST(CustomModel, InputsReachModelsAligned) {
  // Binary tensors of an HTTP request are views at arbitrary offsets of its
  // body (after a JSON header of any length); a request that ran alone was
  // handed to the model as that view.
  auto engine = EmptyEngine();
  ASSERT_TRUE(
      engine->RegisterModel(RowSumConfig("aligned", 1, false), [] { return std::make_unique<AlignmentCheck>(); }).ok());
  auto body = std::make_shared<std::vector<char>>(1 + 4 * sizeof(float));
  const float values[4] = {1.5f, 2.f, 3.f, 4.25f};
  std::memcpy(body->data() + 1, values, sizeof(values));
  InferRequest r;
  r.model = "aligned";
  r.inputs = {{"x", Tensor::Borrow(DataType::kFp32, {1, 4}, body->data() + 1, sizeof(values), body)}};
  InferResponse out = engine->Infer(std::move(r)).get();
  ASSERT_TRUE(out.status.ok()) << out.status.ToString();
  EXPECT_EQ(ToFloats(*out.FindOutput("y")), (std::vector<float>{5.75f}));
}

TEST(CustomModel, BatchesConcurrentRequestsAndSplitsResults) {
  auto engine = EmptyEngine();
  std::atomic<int> max_batch{0};
  ASSERT_TRUE(
      engine->RegisterModel(RowSumConfig("rowsum", 1, false), [&] { return std::make_unique<RowSum>(&max_batch); })
          .ok());
  std::vector<std::future<InferResponse>> fs;
  for (int i = 0; i < 6; ++i) {
    InferRequest r;
    r.model = "rowsum";
    float v = 1000.f + static_cast<float>(i);  // >= 1000: no sleep
    r.inputs = {{"x", Floats({1, 4}, {v, 1, 2, 3})}};
    fs.push_back(engine->Infer(std::move(r)));
  }
  int64_t biggest = 0;
  for (int i = 0; i < 6; ++i) {
    InferResponse r = fs[i].get();
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_EQ(ToFloats(r.outputs[0].tensor), std::vector<float>{1006.f + static_cast<float>(i)});
    biggest = std::max(biggest, r.telemetry.batch_size);
    EXPECT_EQ(r.model, "rowsum");
  }
  EXPECT_GT(biggest, 1) << "the 20 ms delay lets concurrent requests share a batch";
  EXPECT_EQ(max_batch.load(), biggest);
}

// Records the thread each batch ran on.
class ThreadRecorder : public Model {
 public:
  explicit ThreadRecorder(std::vector<std::thread::id>* threads, std::mutex* mu) : threads_(threads), mu_(mu) {}
  Status Execute(const std::vector<NamedTensor>& inputs, int64_t batch_size,
                 std::vector<NamedTensor>& outputs) override {
    {
      std::lock_guard lock(*mu_);
      threads_->push_back(std::this_thread::get_id());
    }
    auto v = inputs.at(0).tensor.values<float>();
    std::vector<float> y(static_cast<size_t>(batch_size));
    for (int64_t r = 0; r < batch_size; ++r) y[r] = 2 * v[r * 4];
    outputs = {{"y", Floats({batch_size, 1}, y)}};
    return Status::Ok();
  }

 private:
  std::vector<std::thread::id>* threads_;
  std::mutex* mu_;
};

TEST(CustomModel, RunComputesOnTheCallersThreadWhenAnInstanceIsFree) {
  auto engine = EmptyEngine();
  std::vector<std::thread::id> threads;
  std::mutex mu;
  ModelConfig c = RowSumConfig("doubler", 2, false);
  c.batching = BatchingConfig{};  // no batching delay: a batch leaves at once
  ASSERT_TRUE(engine->RegisterModel(c, [&] { return std::make_unique<ThreadRecorder>(&threads, &mu); }).ok());
  for (int i = 0; i < 5; ++i) {
    InferRequest r;
    r.model = "doubler";
    r.inputs = {{"x", Floats({1, 4}, {static_cast<float>(i), 0, 0, 0})}};
    InferResponse resp = engine->Run(std::move(r));
    ASSERT_TRUE(resp.status.ok()) << resp.status.ToString();
    EXPECT_EQ(ToFloats(resp.outputs[0].tensor), std::vector<float>{2.f * static_cast<float>(i)});
  }
  // Infer hands the request to an engine thread.
  InferRequest r;
  r.model = "doubler";
  r.inputs = {{"x", Floats({1, 4}, {7, 0, 0, 0})}};
  ASSERT_TRUE(engine->Infer(std::move(r)).get().status.ok());
  std::lock_guard lock(mu);
  ASSERT_EQ(threads.size(), 6u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(threads[static_cast<size_t>(i)], std::this_thread::get_id()) << i;
  EXPECT_NE(threads[5], std::this_thread::get_id());
  // Errors come back as responses, as from Infer.
  InferRequest bad;
  bad.model = "doubler";
  bad.inputs = {{"x", Floats({1, 3}, {1, 2, 3})}};
  InferResponse refused = engine->Run(std::move(bad));
  EXPECT_EQ(refused.status.code(), StatusCode::kInvalidArgument);
  InferRequest unknown;
  unknown.model = "nope";
  EXPECT_EQ(engine->Run(std::move(unknown)).status.code(), StatusCode::kNotFound);
}

TEST(CustomModel, SendQueuedNowReachesQueuedRequestsAndModelsRegisteredAfterIt) {
  // A draining server's call: requests waiting for company leave at once, in the models served now
  // and in one whose version is published afterwards (a load the drain overtook). The fake clock
  // never moves: only the call lets a batch leave before its delay of an hour.
  FakeClock clock;
  EngineOptions options;
  options.clock = &clock;
  auto created = Engine::Create(options);
  ASSERT_TRUE(created.has_value());
  auto engine = std::move(*created);
  std::atomic<int> max_batch{0};
  ModelConfig c = RowSumConfig("before", 1, false);
  c.batching->max_queue_delay_us = uint64_t{3600} * 1'000'000;
  ASSERT_TRUE(engine->RegisterModel(c, [&] { return std::make_unique<RowSum>(&max_batch); }).ok());
  auto request = [](const std::string& model, float first) {
    InferRequest r;
    r.model = model;
    r.inputs = {{"x", Floats({1, 4}, {first + 1000, 0, 0, 1})}};
    return r;
  };
  auto waiting = engine->Infer(request("before", 0));
  ASSERT_TRUE(testing::Eventually([&] { return clock.waiters() >= 1; })) << "the worker waits out the delay";
  EXPECT_EQ(waiting.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout);
  engine->SendQueuedNow();
  ASSERT_EQ(waiting.wait_for(std::chrono::seconds(60)), std::future_status::ready) << "still waiting for company";
  InferResponse r = waiting.get();
  ASSERT_TRUE(r.status.ok()) << r.status.message();
  EXPECT_EQ(ToFloats(r.outputs[0].tensor), std::vector<float>{1001});

  c.name = "after";
  ASSERT_TRUE(engine->RegisterModel(c, [&] { return std::make_unique<RowSum>(&max_batch); }).ok());
  auto later = engine->Infer(request("after", 1));
  ASSERT_EQ(later.wait_for(std::chrono::seconds(60)), std::future_status::ready)
      << "a model published after the call waits for company";
  r = later.get();
  ASSERT_TRUE(r.status.ok()) << r.status.message();
  EXPECT_EQ(ToFloats(r.outputs[0].tensor), std::vector<float>{1002});
}

TEST(CustomModel, ErrorInOneBatchKeepsServing) {
  auto engine = EmptyEngine();
  std::atomic<int> max_batch{0};
  ModelConfig c = RowSumConfig("rowsum", 1, false);
  c.batching->max_queue_delay_us = 0;
  ASSERT_TRUE(engine->RegisterModel(c, [&] { return std::make_unique<RowSum>(&max_batch); }).ok());
  InferRequest bad;
  bad.model = "rowsum";
  bad.inputs = {{"x", Floats({1, 4}, {-1, 0, 0, 0})}};
  EXPECT_EQ(engine->Infer(std::move(bad)).get().status.code(), StatusCode::kInternal);
  InferRequest good;
  good.model = "rowsum";
  good.inputs = {{"x", Floats({1, 4}, {1000, 0, 0, 1})}};
  InferResponse r = engine->Infer(std::move(good)).get();
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(ToFloats(r.outputs[0].tensor), std::vector<float>{1001});
}

TEST(CustomModel, PreserveOrderingAcrossInstances) {
  auto engine = EmptyEngine();
  std::atomic<int> max_batch{0};
  ModelConfig c = RowSumConfig("ordered", 2, true);
  c.max_batch_size = 1;
  c.batching->max_queue_delay_us = 0;
  ASSERT_TRUE(engine->RegisterModel(c, [&] { return std::make_unique<RowSum>(&max_batch); }).ok());
  std::mutex mu;
  std::vector<int> order;
  std::atomic<int> done{0};
  // The first request sleeps 80 ms on one instance; the second finishes at
  // once on the other, but must be delivered after the first.
  for (int i = 0; i < 2; ++i) {
    InferRequest r;
    r.model = "ordered";
    r.inputs = {{"x", Floats({1, 4}, {i == 0 ? 80.f : 1000.f, 0, 0, 0})}};
    r.metadata = {{"i", std::to_string(i)}};
    InferCallback cb = [&](InferResponse&& resp) {
      std::lock_guard lock(mu);
      order.push_back(std::stoi(resp.metadata.at(0).second));
      ++done;
    };
    ASSERT_TRUE(engine->InferAsync(std::move(r), cb).ok());
  }
  ASSERT_TRUE(quern::testing::Eventually([&] { return done.load() == 2; }));
  std::lock_guard lock(mu);
  EXPECT_EQ(order, (std::vector<int>{0, 1}));
}

TEST(CustomModel, InvalidRegistrationIsRejected) {
  auto engine = EmptyEngine();
  ModelConfig c = RowSumConfig("x", 1, false);
  c.outputs.clear();
  Status st = engine->RegisterModel(c, [] { return std::unique_ptr<Model>(); });
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("no outputs"), std::string::npos);
}

}  // namespace
}  // namespace quern

namespace quern {
namespace {

TEST(Statistics, CountRequestsItemsBatchesAndFailures) {
  auto engine = EmptyEngine();
  std::atomic<int> max_batch{0};
  ModelConfig c = RowSumConfig("stats", 1, false);
  c.batching->max_queue_delay_us = 0;
  ASSERT_TRUE(engine->RegisterModel(c, [&] { return std::make_unique<RowSum>(&max_batch); }).ok());
  for (int i = 0; i < 3; ++i) {  // one after another: three batches of 2 rows
    InferRequest r;
    r.model = "stats";
    r.inputs = {{"x", Floats({2, 4}, {1000, 0, 0, 0, 1000, 0, 0, 0})}};
    ASSERT_TRUE(engine->Infer(std::move(r)).get().status.ok());
  }
  InferRequest bad;
  bad.model = "stats";
  bad.inputs = {{"x", Floats({1, 3}, {1, 2, 3})}};
  EXPECT_EQ(engine->Infer(std::move(bad)).get().status.code(), StatusCode::kInvalidArgument);
  InferRequest failing;
  failing.model = "stats";
  failing.inputs = {{"x", Floats({1, 4}, {-1, 0, 0, 0})}};
  EXPECT_EQ(engine->Infer(std::move(failing)).get().status.code(), StatusCode::kInternal);

  auto stats = engine->GetStatistics("stats");
  ASSERT_TRUE(stats.has_value());
  ASSERT_EQ(stats->size(), 1u);
  const ModelStatistics& s = (*stats)[0];
  EXPECT_EQ(s.success.count, 3u);
  EXPECT_EQ(s.fail.count, 2u);
  EXPECT_EQ(s.fail_invalid, 1u);
  EXPECT_EQ(s.fail_backend, 1u);
  EXPECT_EQ(s.inference_count, 7u) << "6 rows + the failing batch's row";
  EXPECT_EQ(s.execution_count, 4u);
  EXPECT_EQ(s.queue.count, 4u) << "requests that reached an instance";
  EXPECT_EQ(s.compute_infer.count, 4u);
  ASSERT_EQ(s.batch_stats.size(), 2u);
  EXPECT_EQ(s.batch_stats[0].batch_size, 1);
  EXPECT_EQ(s.batch_stats[1].batch_size, 2);
  EXPECT_EQ(s.batch_stats[1].compute_infer.count, 3u);
  EXPECT_GT(s.last_inference_ms, 0u);
  EXPECT_FALSE(engine->GetStatistics("nope").has_value());
  EXPECT_EQ(s.batch_size.count, 4u);
  EXPECT_EQ(s.request_us.count, 5u);

  MetricsRegistry registry;
  auto engine_metrics = AddEngineMetrics(registry, *engine);
  auto process_metrics = AddProcessMetrics(registry);
  const std::string text = registry.Render();
  EXPECT_NE(text.find("quern_request_success_total{model=\"stats\",version=\"1\"} 3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("quern_request_failure_total{model=\"stats\",version=\"1\",reason=\"invalid\"} 1\n"),
            std::string::npos);
  EXPECT_NE(text.find("quern_inference_count_total{model=\"stats\",version=\"1\"} 7\n"), std::string::npos);
  // Batch sizes 2, 2, 2, 1: three are <= 2, all four <= 4.
  EXPECT_NE(text.find("quern_batch_size_bucket{model=\"stats\",version=\"1\",le=\"1\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("quern_batch_size_bucket{model=\"stats\",version=\"1\",le=\"2\"} 4\n"), std::string::npos);
  EXPECT_NE(text.find("quern_batch_size_sum{model=\"stats\",version=\"1\"} 7\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE quern_request_duration_us histogram"), std::string::npos);
  EXPECT_NE(text.find("process_resident_memory_bytes "), std::string::npos);
}

// Costs its batch on a FakeClock: per item 100 + 25 x (batch size) us, so
// smaller batches are cheaper per item and batch 1 is the fastest. Runs
// nothing before `gate` opens (the whole load is queued by then).
class CostsMoreInBatches : public Model {
 public:
  CostsMoreInBatches(FakeClock* clock, std::shared_future<void> gate) : clock_(clock), gate_(std::move(gate)) {}
  Status Execute(const std::vector<NamedTensor>& inputs, int64_t batch_size,
                 std::vector<NamedTensor>& outputs) override {
    gate_.wait();
    clock_->AdvanceUs(batch_size * (100 + 25 * batch_size));
    outputs = {{"y", inputs.at(0).tensor}};
    return Status::Ok();
  }

 private:
  FakeClock* clock_;
  std::shared_future<void> gate_;
};

struct AfterLoad {
  int64_t limit = -1;      // batch size limit at the end
  double small_share = 0;  // share of the items that ran in batches of 1 or 2
};

// Runs 1000 requests submitted at once through a model configured by `adjust`.
AfterLoad RunLoad(const std::function<void(ModelConfig&)>& adjust) {
  FakeClock clock;
  auto engine = Engine::Create({.clock = &clock});
  EXPECT_TRUE(engine.has_value());
  ModelConfig c;
  c.name = "costly";
  c.max_batch_size = 8;
  c.inputs = {{.name = "x", .dtype = DataType::kFp32, .dims = {1}}};
  c.outputs = {{.name = "y", .dtype = DataType::kFp32, .dims = {1}}};
  c.instance_count = 1;
  c.batching = BatchingConfig{};
  adjust(c);
  std::promise<void> open;
  std::shared_future<void> gate = open.get_future().share();
  EXPECT_TRUE((*engine)->RegisterModel(c, [&] { return std::make_unique<CostsMoreInBatches>(&clock, gate); }).ok());
  constexpr int kRequests = 1000;
  std::vector<std::future<InferResponse>> fs;
  for (int i = 0; i < kRequests; ++i) {
    InferRequest r;
    r.model = "costly";
    r.inputs = {{"x", Floats({1, 1}, {static_cast<float>(i)})}};
    fs.push_back((*engine)->Infer(std::move(r)));
  }
  open.set_value();
  for (int i = 0; i < kRequests; ++i) {
    InferResponse r = fs[static_cast<size_t>(i)].get();
    EXPECT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_EQ(ToFloats(r.outputs.at(0).tensor), std::vector<float>{static_cast<float>(i)});
  }
  auto stats = (*engine)->GetStatistics("costly");
  AfterLoad out;
  if (!stats || stats->size() != 1) {
    ADD_FAILURE() << "no statistics";
    return out;
  }
  out.limit = stats->front().batch_limit;
  int64_t small = 0;
  for (const BatchSizeStats& b : stats->front().batch_stats) {
    if (b.batch_size <= 2) small += b.batch_size * static_cast<int64_t>(b.compute_infer.count);
  }
  out.small_share = static_cast<double>(small) / kRequests;
  return out;
}

TEST(BatchSizeTuning, TheEngineTunesDynamicBatchingByDefault) {
  AfterLoad r = RunLoad([](ModelConfig&) {});
  EXPECT_LE(r.limit, 2);  // settled at 1; a probe of 2 may be running at the end
  EXPECT_GT(r.small_share, 0.3);
}

TEST(BatchSizeTuning, ParameterOffKeepsMaxBatchSize) {
  AfterLoad r = RunLoad([](ModelConfig& c) { c.batch_size_tuning = false; });
  EXPECT_EQ(r.limit, 8);
  EXPECT_LT(r.small_share, 0.05);
}

TEST(BatchSizeTuning, PreferredBatchSizesTurnItOffUnlessAskedFor) {
  EXPECT_EQ(RunLoad([](ModelConfig& c) { c.batching->preferred_batch_sizes = {8}; }).limit, 8);
  EXPECT_LE(RunLoad([](ModelConfig& c) {
              c.batching->preferred_batch_sizes = {8};
              c.batch_size_tuning = true;
            }).limit,
            2);
}

}  // namespace
}  // namespace quern
