// Decoupled models (ModelConfig::decoupled) registered in code: any number of
// responses per request through BatchRequests::responses, each before the
// last to the request's on_response, the last to its callback.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
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
        if (!testing::Eventually([&] { return woken->load() > 0 && requests.responses->cancelled(i); })) {
          return Internal("never cancelled");
        }
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

}  // namespace
}  // namespace quern
