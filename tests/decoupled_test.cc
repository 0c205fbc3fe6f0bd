// Decoupled models (ModelConfig::decoupled) registered in code: any number of
// responses per request through BatchRequests::responses, each before the
// last to the request's on_response, the last to its callback.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "eventually.h"
#include "quern/engine.h"
#include "test_util.h"

namespace quern {
namespace {

using testing::Floats;
using testing::ToFloats;

// Request i (x = [n]) gets n responses y = [n, k] for k = 0..n-1, the last final; n = 0 gets only
// the final flag, n < 0 an error, n = 99 is never closed, n = 50 waits until cancelled then closes.
class Countdown : public Model {
 public:
  Status Execute(const std::vector<NamedTensor>&, int64_t, std::vector<NamedTensor>&) override {
    return Internal("a decoupled model runs through ExecuteRequests");
  }
  Status ExecuteRequests(const std::vector<NamedTensor>& inputs, int64_t, BatchRequests requests,
                         std::vector<NamedTensor>&) override {
    if (!requests.responses) return Internal("no sink for a decoupled model");
    auto x = inputs.at(0).tensor.values<float>();
    auto woken = std::make_shared<std::atomic<int>>(0);  // (wake may run just after this returns)
    requests.responses->OnCancel([woken] { woken->fetch_add(1); });
    for (size_t i = 0; i < requests.rows.size(); ++i) {
      const int n = static_cast<int>(x[i]);
      if (n < 0) {
        requests.responses->Send(i, true, InvalidArgument("below zero"), {}, true);
      } else if (n == 0) {
        requests.responses->Send(i, false, Status::Ok(), {}, true);
      } else if (n == 50) {
        ++waiting_for_cancel;
        if (!testing::Eventually([&] { return woken->load() > 0 && requests.responses->cancelled(i); })) {
          return Internal("never cancelled");
        }
        ++closed_when_cancelled;
        requests.responses->Send(i, false, Status::Ok(), {}, true);
      } else if (n != 99) {
        for (int k = 0; k < n; ++k) {
          requests.responses->Send(i, true, Status::Ok(), {{"y", Floats({1, 2}, {float(n), float(k)})}}, k == n - 1);
        }
        requests.responses->Send(i, true, Status::Ok(), {{"y", Floats({1, 2}, {-1, -1})}}, true);  // ignored
      }
    }
    return Status::Ok();
  }
  static inline std::atomic<int> waiting_for_cancel{0};     // requests for 50 that began to wait
  static inline std::atomic<int> closed_when_cancelled{0};  // requests for 50 that saw their cancellation
};

ModelConfig CountdownConfig() {
  ModelConfig c;
  c.name = "countdown";
  c.max_batch_size = 4;
  c.decoupled = true;
  c.inputs = {{.name = "x", .dtype = DataType::kFp32, .dims = {1}}};
  c.outputs = {{.name = "y", .dtype = DataType::kFp32, .dims = {2}}};
  c.instance_count = 1;
  return c;
}

struct Collected {
  std::mutex mu;
  std::vector<std::vector<float>> partial;
  std::promise<InferResponse> last;
};

InferRequest Request(float n, const std::shared_ptr<Collected>& got) {
  InferRequest r;
  r.model = "countdown";
  r.inputs = {{"x", Floats({1, 1}, {n})}};
  r.cancel = std::make_shared<CancellationToken>();
  r.on_response = [got](InferResponse&& response) {
    EXPECT_TRUE(response.decoupled);
    std::lock_guard lock(got->mu);
    got->partial.push_back(ToFloats(response.outputs.at(0).tensor));
  };
  return r;
}

class DecoupledTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto e = Engine::Create({});
    ASSERT_TRUE(e.has_value());
    engine_ = std::move(*e);
    ASSERT_TRUE(engine_->RegisterModel(CountdownConfig(), [] { return std::make_unique<Countdown>(); }).ok());
  }

  // The responses before the last, and the last, of a request for `n`.
  std::pair<std::vector<std::vector<float>>, InferResponse> Run(float n) {
    auto got = std::make_shared<Collected>();
    InferCallback done = [got](InferResponse&& r) { got->last.set_value(std::move(r)); };
    auto future = got->last.get_future();
    EXPECT_TRUE(engine_->InferAsync(Request(n, got), done).ok());
    InferResponse last = future.get();
    std::lock_guard lock(got->mu);
    return {got->partial, std::move(last)};
  }

  std::unique_ptr<Engine> engine_;
};

TEST_F(DecoupledTest, EachResponseBeforeTheLastGoesToOnResponseInOrder) {
  auto [partial, last] = Run(3);
  ASSERT_TRUE(last.status.ok()) << last.status.message();
  EXPECT_TRUE(last.decoupled);
  EXPECT_FALSE(last.final_only);
  EXPECT_EQ(partial, (std::vector<std::vector<float>>{{3, 0}, {3, 1}}));
  EXPECT_EQ(ToFloats(last.outputs.at(0).tensor), (std::vector<float>{3, 2}));  // the response after the last ignored
}

TEST_F(DecoupledTest, OnlyTheFinalFlagAndErrorsAndUnclosedRequests) {
  auto [none, closed] = Run(0);
  EXPECT_TRUE(none.empty());
  EXPECT_TRUE(closed.status.ok());
  EXPECT_TRUE(closed.final_only);
  EXPECT_TRUE(closed.outputs.empty());
  auto [before_error, failed] = Run(-1);
  EXPECT_EQ(failed.status.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(failed.status.message(), "below zero");
  auto [before_unclosed, unclosed] = Run(99);
  EXPECT_EQ(unclosed.status.code(), StatusCode::kInternal);
  EXPECT_NE(unclosed.status.message().find("without closing"), std::string::npos) << unclosed.status.message();
  // The model serves on.
  auto [partial, last] = Run(2);
  EXPECT_EQ(partial.size(), 1u);
  EXPECT_TRUE(last.status.ok());
}

TEST_F(DecoupledTest, ACallThatTakesOneAnswerIsRefusedSayingWhichToUse) {
  InferRequest r;
  r.model = "countdown";
  r.inputs = {{"x", Floats({1, 1}, {2})}};
  const InferResponse answer = engine_->Infer(std::move(r)).get();
  EXPECT_EQ(answer.status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(answer.status.message().find("decoupled"), std::string::npos) << answer.status.message();
  EXPECT_NE(answer.status.message().find("ModelStreamInfer"), std::string::npos) << answer.status.message();
}

TEST_F(DecoupledTest, TheModelIsWokenWhenARequestIsCancelled) {
  auto got = std::make_shared<Collected>();
  InferCallback done = [got](InferResponse&& r) { got->last.set_value(std::move(r)); };
  auto future = got->last.get_future();
  InferRequest request = Request(50, got);
  auto cancel = request.cancel;
  std::atomic<bool> started{false};
  ASSERT_TRUE(engine_->InferAsync(std::move(request), done, {.on_start = [&started] { started = true; }}).ok());
  ASSERT_TRUE(testing::Eventually([&] { return started.load(); })) << "the batch never started";
  cancel->Cancel();
  InferResponse last = future.get();
  // The model saw the cancellation (woken, cancelled(i) true) and closed the request.
  EXPECT_TRUE(last.status.ok()) << last.status.message();
  EXPECT_TRUE(last.final_only);
}

// y = 2x, any width: the step after the decoupled one (`delay`: slept first; `fail`: refuses instead,
// once a countdown request waits for its cancellation, so that it is cancelled while it runs rather
// than in its queue).
class Doubler : public Model {
 public:
  explicit Doubler(std::chrono::milliseconds delay = {}, bool fail = false) : delay_(delay), fail_(fail) {}
  Status Execute(const std::vector<NamedTensor>& inputs, int64_t, std::vector<NamedTensor>& outputs) override {
    std::this_thread::sleep_for(delay_);
    if (fail_) {
      if (!testing::Eventually(
              [] { return Countdown::waiting_for_cancel.load() > Countdown::closed_when_cancelled.load(); })) {
        return Internal("no countdown request waited for its cancellation");
      }
      return InvalidArgument("fails on purpose");
    }
    const Tensor& x = inputs.at(0).tensor;
    std::vector<float> v = ToFloats(x);
    for (float& f : v) f *= 2;
    outputs.push_back({"y", Floats(x.shape(), v)});
    return Status::Ok();
  }

 private:
  std::chrono::milliseconds delay_;
  bool fail_;
};

ModelConfig DoublerConfig(const std::string& name, int64_t width) {
  ModelConfig c;
  c.name = name;
  c.max_batch_size = 8;
  c.inputs = {{.name = "x", .dtype = DataType::kFp32, .dims = {width}}};
  c.outputs = {{.name = "y", .dtype = DataType::kFp32, .dims = {width}}};
  c.instance_count = 1;
  return c;
}

// n -> countdown (c = [n, k], k = 0..n-1) -> double2 (z = 2c); beside it, n -> double1 (w = 2n), which
// does not read the decoupled step's answers: it runs once, and every response carries it.
constexpr char kStreamEnsemble[] = R"(
platform: "ensemble"
max_batch_size: 8
input [ { name: "n" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "z" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "w" data_type: TYPE_FP32 dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "double2" input_map { key: "x" value: "c" } output_map { key: "y" value: "z" } },
    { model_name: "countdown" input_map { key: "x" value: "n" } output_map { key: "y" value: "c" } },
    { model_name: "double1" input_map { key: "x" value: "n" } output_map { key: "y" value: "w" } }
  ]
}
)";

// The ensemble above as a step: decoupled too.
constexpr char kOuterEnsemble[] = R"(
platform: "ensemble"
max_batch_size: 8
input [ { name: "m" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "out" data_type: TYPE_FP32 dims: [ 2 ] } ]
ensemble_scheduling {
  step [ { model_name: "stream" input_map { key: "n" value: "m" } output_map { key: "z" value: "out" } } ]
}
)";

// countdown's responses are the ensemble's answers themselves, beside a step that takes 300 ms
// (every response waits for it: they are branched together) or one that fails (the request fails,
// and countdown's request is cancelled).
constexpr char kBesideSlow[] = R"(
platform: "ensemble"
max_batch_size: 8
input [ { name: "n" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "c" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "w" data_type: TYPE_FP32 dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "countdown" input_map { key: "x" value: "n" } output_map { key: "y" value: "c" } },
    { model_name: "STEP" input_map { key: "x" value: "n" } output_map { key: "y" value: "w" } }
  ]
}
)";

// Two decoupled steps side by side: their responses cannot be paired.
constexpr char kTwoStreams[] = R"(
platform: "ensemble"
max_batch_size: 4
input [ { name: "n" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "a" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "b" data_type: TYPE_FP32 dims: [ 2 ] } ]
ensemble_scheduling {
  step [
    { model_name: "countdown" input_map { key: "x" value: "n" } output_map { key: "y" value: "a" } },
    { model_name: "countdown" input_map { key: "x" value: "n" } output_map { key: "y" value: "b" } }
  ]
}
)";

class DecoupledEnsembleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string beside_slow = kBesideSlow, beside_failing = kBesideSlow;
    beside_slow.replace(beside_slow.find("STEP"), 4, "slow1");
    beside_failing.replace(beside_failing.find("STEP"), 4, "failing1");
    for (const auto& [name, text] : {std::pair<std::string, std::string>{"stream", kStreamEnsemble},
                                     {"outer", kOuterEnsemble},
                                     {"two_streams", kTwoStreams},
                                     {"beside_slow", beside_slow},
                                     {"beside_failing", beside_failing}}) {
      testing::WriteFile(dir_.path() / name / "config.pbtxt", text);
      std::filesystem::create_directories(dir_.path() / name / "1");
    }
    EngineOptions o;
    o.model_repository = dir_.path().string();
    o.load_all_models = false;
    auto e = Engine::Create(o);
    ASSERT_TRUE(e.has_value()) << e.error().ToString();
    engine_ = std::move(*e);
    ASSERT_TRUE(engine_->RegisterModel(CountdownConfig(), [] { return std::make_unique<Countdown>(); }).ok());
    for (const auto& [name, width] : {std::pair{"double1", 1}, std::pair{"double2", 2}}) {
      ASSERT_TRUE(engine_->RegisterModel(DoublerConfig(name, width), [] { return std::make_unique<Doubler>(); }).ok());
    }
    ASSERT_TRUE(engine_
                    ->RegisterModel(DoublerConfig("slow1", 1),
                                    [] { return std::make_unique<Doubler>(std::chrono::milliseconds(300)); })
                    .ok());
    ASSERT_TRUE(engine_
                    ->RegisterModel(DoublerConfig("failing1", 1),
                                    [] { return std::make_unique<Doubler>(std::chrono::milliseconds(0), true); })
                    .ok());
  }

  // Every response of a request for `n` to `model` (its outputs by name, flattened), and the last.
  std::pair<std::vector<std::map<std::string, std::vector<float>>>, InferResponse> Stream(const std::string& model,
                                                                                          const std::string& input,
                                                                                          std::vector<float> n) {
    struct Got {
      std::mutex mu;
      std::vector<std::map<std::string, std::vector<float>>> responses;
      std::promise<InferResponse> last;
    };
    auto got = std::make_shared<Got>();
    InferRequest r;
    r.model = model;
    const auto rows = static_cast<int64_t>(n.size());
    r.inputs = {{input, Floats({rows, 1}, std::move(n))}};
    r.on_response = [got](InferResponse&& response) {
      EXPECT_TRUE(response.decoupled);
      std::map<std::string, std::vector<float>> outputs;
      for (const auto& o : response.outputs) outputs[o.name] = ToFloats(o.tensor);
      std::lock_guard lock(got->mu);
      got->responses.push_back(std::move(outputs));
    };
    InferCallback done = [got](InferResponse&& response) { got->last.set_value(std::move(response)); };
    auto future = got->last.get_future();
    Status st = engine_->InferAsync(std::move(r), done);
    if (!st.ok()) {
      InferResponse refused;
      refused.status = st;
      return {{}, std::move(refused)};
    }
    InferResponse last = future.get();
    std::lock_guard lock(got->mu);
    return {got->responses, std::move(last)};
  }

  testing::TempDir dir_;
  std::unique_ptr<Engine> engine_;
};

TEST_F(DecoupledEnsembleTest, EachResponseOfTheStepRunsTheStepsAfterItAndAnswersInOrder) {
  ASSERT_TRUE(engine_->LoadModel("stream").ok());
  auto status = engine_->GetModel("stream");
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(status->config.decoupled);  // a decoupled step makes it so
  auto [responses, last] = Stream("stream", "n", {3});
  ASSERT_TRUE(last.status.ok()) << last.status.ToString();
  EXPECT_TRUE(last.decoupled);
  EXPECT_TRUE(last.final_only);
  EXPECT_TRUE(last.outputs.empty());
  using Outputs = std::map<std::string, std::vector<float>>;
  EXPECT_EQ(responses, (std::vector<Outputs>{
                           {{"z", {6, 0}}, {"w", {6}}}, {{"z", {6, 2}}, {"w", {6}}}, {{"z", {6, 4}}, {"w", {6}}}}));
  // No response: only the final answer. The step's error: the request's, naming the step.
  auto [none, closed] = Stream("stream", "n", {0});
  EXPECT_TRUE(none.empty());
  EXPECT_TRUE(closed.status.ok() && closed.final_only) << closed.status.ToString();
  auto [before, failed] = Stream("stream", "n", {-1});
  EXPECT_EQ(failed.status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(failed.status.message().find("step 1 (model 'countdown')"), std::string::npos) << failed.status.ToString();
  // Rows the step model would take in several requests: refused, saying why.
  auto [split, refused] = Stream("stream", "n", {1, 1, 1, 1, 1});
  EXPECT_EQ(refused.status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status.message().find("a decoupled step takes its rows in one request"), std::string::npos)
      << refused.status.ToString();
  // A call that takes one answer is refused, as for the decoupled model itself.
  InferRequest one;
  one.model = "stream";
  one.inputs = {{"n", Floats({1, 1}, {2})}};
  const InferResponse answer = engine_->Infer(std::move(one)).get();
  EXPECT_EQ(answer.status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(answer.status.message().find("decoupled"), std::string::npos) << answer.status.ToString();
  // The models serve on.
  auto [again, end] = Stream("stream", "n", {2});
  EXPECT_TRUE(end.status.ok());
  EXPECT_EQ(again.size(), 2u);
}

TEST_F(DecoupledEnsembleTest, AnEnsembleOfADecoupledEnsembleStreamsToo) {
  ASSERT_TRUE(engine_->LoadModel("stream").ok());
  ASSERT_TRUE(engine_->LoadModel("outer").ok());
  auto [responses, last] = Stream("outer", "m", {2});
  ASSERT_TRUE(last.status.ok()) << last.status.ToString();
  EXPECT_TRUE(last.final_only);
  using Outputs = std::map<std::string, std::vector<float>>;
  EXPECT_EQ(responses, (std::vector<Outputs>{{{"out", {4, 0}}}, {{"out", {4, 2}}}}));
}

TEST_F(DecoupledEnsembleTest, ResponsesQueuedBehindASlowStepAllComeInOrder) {
  // countdown sends its 1,000 responses while slow1 sleeps; each becomes an answer once it has
  // answered, one after another (not a frame deeper each).
  ASSERT_TRUE(engine_->LoadModel("beside_slow").ok());
  auto [responses, last] = Stream("beside_slow", "n", {1000});
  ASSERT_TRUE(last.status.ok()) << last.status.ToString();
  ASSERT_EQ(responses.size(), 1000u);
  for (size_t k = 0; k < responses.size(); ++k) {
    EXPECT_EQ(responses[k]["c"], (std::vector<float>{1000, static_cast<float>(k)})) << k;
    EXPECT_EQ(responses[k]["w"], (std::vector<float>{2000})) << k;
  }
}

TEST_F(DecoupledEnsembleTest, AFailedStepFailsTheRequestAndCancelsTheDecoupledStep) {
  ASSERT_TRUE(engine_->LoadModel("beside_failing").ok());
  const int before = Countdown::closed_when_cancelled.load();
  // countdown, given 50, sends nothing until its request is cancelled.
  auto [responses, last] = Stream("beside_failing", "n", {50});
  EXPECT_EQ(last.status.code(), StatusCode::kInvalidArgument) << last.status.ToString();
  EXPECT_NE(last.status.message().find("step 1 (model 'failing1'): fails on purpose"), std::string::npos)
      << last.status.ToString();
  EXPECT_TRUE(last.decoupled);  // a decoupled request's last answer, an error too
  EXPECT_TRUE(responses.empty());
  EXPECT_TRUE(testing::Eventually([&] { return Countdown::closed_when_cancelled.load() > before; }))
      << "the decoupled step's request was never cancelled";
}

TEST_F(DecoupledEnsembleTest, TwoDecoupledStepsThatCannotBePairedAreRefusedAtLoad) {
  const Status st = engine_->LoadModel("two_streams");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("steps 0 (model 'countdown') and 1 (model 'countdown') are decoupled"), std::string::npos)
      << st.ToString();
}

}  // namespace
}  // namespace quern
