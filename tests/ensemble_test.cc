// Ensembles (platform "ensemble"): steps run in their own models' batchers,
// tensors handed on, errors naming the step, load-time validation,
// cancellation and deadlines, reloads of a step model under load.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "core/model_config_parser.h"
#include "engine/ensemble_model.h"
#include "eventually.h"
#include "test_util.h"

namespace quern {
namespace {

using testing::CopyModel;
using testing::Floats;
using testing::TempDir;
using testing::ToFloats;
using testing::WriteFile;

// A = INPUT0, B = INPUT1 of add_sub ([N, 4] floats): OUTPUT0 = A + B, OUTPUT1 = A - B.
// chain: (A + B) + (A - B) = 2A and (A + B) - (A - B) = 2B, and beside it A + A = 2A.
// The steps are listed out of order: they run when their inputs are ready.
constexpr char kChain[] = R"(
platform: "ensemble"
max_batch_size: 8
input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "TWICE_A" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "TWICE_B" data_type: TYPE_FP32 dims: [ 4 ] },
         { name: "A_PLUS_A" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling {
  step [
    { model_name: "add_sub" model_version: -1
      input_map { key: "INPUT0" value: "sum" } input_map { key: "INPUT1" value: "diff" }
      output_map { key: "OUTPUT0" value: "TWICE_A" } output_map { key: "OUTPUT1" value: "TWICE_B" } },
    { model_name: "add_sub" model_version: -1
      input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
      output_map { key: "OUTPUT0" value: "sum" } output_map { key: "OUTPUT1" value: "diff" } },
    { model_name: "add_sub"
      input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "A" }
      output_map { key: "OUTPUT0" value: "A_PLUS_A" } }
  ]
}
)";

// An ensemble of an ensemble; its name sorts before "chain", so loading it
// waits for a second pass.
constexpr char kNested[] = R"(
platform: "ensemble"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling {
  step [
    { model_name: "chain" input_map { key: "A" value: "X" } input_map { key: "B" value: "X" }
      output_map { key: "TWICE_A" value: "Y" } }
  ]
}
)";

// fail_on_3 reshapes its [N, M] input to [N, 4]: a runtime error unless M is 4.
constexpr char kFailing[] = R"(
platform: "ensemble"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "fail_on_3" input_map { key: "x" value: "x" } output_map { key: "y" value: "y" } } ] }
)";

// slow_batch waits up to a second for a batch of 4 to form.
constexpr char kSlow[] = R"(
platform: "ensemble"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]
ensemble_scheduling { step [ { model_name: "slow_batch" input_map { key: "x" value: "x" } output_map { key: "y" value: "y" } } ] }
)";

void WriteEnsemble(const std::filesystem::path& repo, const std::string& name, const std::string& config) {
  WriteFile(repo / name / "config.pbtxt", config);
  std::filesystem::create_directories(repo / name / "1");
}

class EnsembleTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    const auto& repo = dir_->path();
    for (const char* m : {"add_sub", "linear", "fail_on_3", "slow_batch"}) CopyModel(m, repo);
    WriteEnsemble(repo, "chain", kChain);
    WriteEnsemble(repo, "a_nested", kNested);
    WriteEnsemble(repo, "failing", kFailing);
    WriteEnsemble(repo, "slow", kSlow);
    EngineOptions o;
    o.model_repository = repo.string();
    auto e = Engine::Create(o);
    ASSERT_TRUE(e.has_value()) << e.error().ToString();
    engine_ = e->release();
  }
  static void TearDownTestSuite() {
    delete engine_;
    delete dir_;
  }
  // Writes `config` as ensemble `name` and loads it: the load's status.
  static Status Load(const std::string& name, const std::string& config) {
    WriteEnsemble(dir_->path(), name, config);
    return engine_->LoadModel(name);
  }
  static TempDir* dir_;
  static Engine* engine_;
};
TempDir* EnsembleTest::dir_ = nullptr;
Engine* EnsembleTest::engine_ = nullptr;

std::vector<float> Times(const std::vector<float>& v, float k) {
  std::vector<float> out;
  for (float x : v) out.push_back(x * k);
  return out;
}

InferRequest Chain(const std::vector<float>& a, const std::vector<float>& b, int64_t rows) {
  InferRequest r;
  r.model = "chain";
  r.inputs = {{"A", Floats({rows, 4}, a)}, {"B", Floats({rows, 4}, b)}};
  return r;
}

TEST_F(EnsembleTest, StepsRunWhenTheirInputsAreReadyAndHandTensorsOn) {
  const std::vector<float> a = {1, 2, 3, 4, -1, 0.5f, 8, 9}, b = {10, 20, 30, 40, 7, 7, 7, 7};
  InferResponse r = engine_->Infer(Chain(a, b, 2)).get();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.model, "chain");
  ASSERT_EQ(r.outputs.size(), 3u);
  EXPECT_EQ(ToFloats(*r.FindOutput("TWICE_A")), Times(a, 2));
  EXPECT_EQ(ToFloats(*r.FindOutput("TWICE_B")), Times(b, 2));
  EXPECT_EQ(ToFloats(*r.FindOutput("A_PLUS_A")), Times(a, 2));
  EXPECT_EQ(r.FindOutput("TWICE_A")->shape(), (Shape{2, 4}));
  // Every step reports where its time went; the one that reads "sum" and
  // "diff" (step 0) ran after the one that wrote them (step 1).
  ASSERT_EQ(r.steps.size(), 3u);
  std::map<int, Telemetry> by_step;
  for (const auto& s : r.steps) {
    EXPECT_EQ(s.model, "add_sub");
    by_step[s.step] = s.telemetry;
  }
  ASSERT_EQ(by_step.size(), 3u);
  EXPECT_GE(by_step[0].compute_start_ns, by_step[1].compute_end_ns);
  EXPECT_EQ(r.telemetry.batch_size, 2);
}

TEST_F(EnsembleTest, RequestedOutputsOnly) {
  InferRequest req = Chain({1, 2, 3, 4}, {4, 3, 2, 1}, 1);
  req.requested_outputs = {"TWICE_B"};
  InferResponse r = engine_->Infer(std::move(req)).get();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  ASSERT_EQ(r.outputs.size(), 1u);
  EXPECT_EQ(ToFloats(r.outputs[0].tensor), (std::vector<float>{8, 6, 4, 2}));
}

TEST_F(EnsembleTest, AnEnsembleCanBeAStepAndLoadsAfterIt) {
  auto st = engine_->GetModel("a_nested");
  ASSERT_TRUE(st.has_value());
  ASSERT_EQ(st->state, ModelState::kReady) << st->reason;
  InferRequest req;
  req.model = "a_nested";
  req.inputs = {{"X", Floats({1, 4}, {1, -2, 3, -4})}};
  InferResponse r = engine_->Infer(std::move(req)).get();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(ToFloats(r.outputs[0].tensor), (std::vector<float>{2, -4, 6, -8}));
}

TEST_F(EnsembleTest, ConfigurationKeepsTheStepsInTritonsSchema) {
  auto st = engine_->GetModel("chain");
  ASSERT_TRUE(st.has_value());
  EXPECT_TRUE(st->config.is_ensemble());
  ASSERT_EQ(st->config.ensemble_steps.size(), 3u);
  inference::ModelConfig p = ToProto(st->config);
  EXPECT_EQ(p.platform(), "ensemble");
  ASSERT_EQ(p.ensemble_scheduling().step_size(), 3);
  EXPECT_EQ(p.ensemble_scheduling().step(1).input_map().at("INPUT1"), "B");
  EXPECT_EQ(p.ensemble_scheduling().step(0).output_map().at("OUTPUT1"), "TWICE_B");
  EXPECT_EQ(p.instance_group_size(), 0);
}

TEST_F(EnsembleTest, ConcurrentCallersEachGetTheirOwnResultAndMeetInBatches) {
  auto before = engine_->GetStatistics("add_sub");
  ASSERT_TRUE(before.has_value());
  constexpr int kThreads = 12, kEach = 40;
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        const float base = static_cast<float>(t * 1000 + i);
        const std::vector<float> a = {base, base + 1, base + 2, base + 3}, b = {-base, 1, 2, 3};
        InferResponse r = engine_->Infer(Chain(a, b, 1)).get();
        if (!r.status.ok() || ToFloats(*r.FindOutput("TWICE_A")) != Times(a, 2) ||
            ToFloats(*r.FindOutput("TWICE_B")) != Times(b, 2)) {
          ++wrong;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  auto after = engine_->GetStatistics("add_sub");
  ASSERT_TRUE(after.has_value());
  const uint64_t items = (*after)[0].inference_count - (*before)[0].inference_count;
  const uint64_t batches = (*after)[0].execution_count - (*before)[0].execution_count;
  EXPECT_EQ(items, 3u * kThreads * kEach) << "three add_sub steps per request";
  EXPECT_LT(batches, items) << "step requests of different callers share batches";
  auto chain = engine_->GetStatistics("chain");
  ASSERT_TRUE(chain.has_value());
  EXPECT_GE((*chain)[0].success.count, static_cast<uint64_t>(kThreads * kEach));
}

TEST_F(EnsembleTest, AFailedStepNamesTheStepAndModel) {
  InferRequest ok;
  ok.model = "failing";
  ok.inputs = {{"x", Floats({1, 4}, {1, 2, 3, 4})}};
  InferResponse good = engine_->Infer(std::move(ok)).get();
  ASSERT_TRUE(good.status.ok()) << good.status.ToString();
  EXPECT_EQ(ToFloats(good.outputs[0].tensor), (std::vector<float>{1, 2, 3, 4}));

  InferRequest bad;
  bad.model = "failing";
  bad.inputs = {{"x", Floats({1, 3}, {1, 2, 3})}};
  InferResponse r = engine_->Infer(std::move(bad)).get();
  ASSERT_FALSE(r.status.ok());
  EXPECT_NE(r.status.message().find("ensemble 'failing' step 0 (model 'fail_on_3')"), std::string::npos)
      << r.status.message();
  EXPECT_EQ(r.model, "failing");
}

TEST_F(EnsembleTest, BadRequestsAreRefusedWithTheEnsemblesNames) {
  InferRequest r;
  r.model = "chain";
  r.inputs = {{"A", Floats({1, 4}, {1, 2, 3, 4})}};
  InferResponse resp = engine_->Infer(std::move(r)).get();
  EXPECT_EQ(resp.status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(resp.status.message().find("input 'B' is missing"), std::string::npos) << resp.status.message();

  InferRequest wrong_type;
  wrong_type.model = "chain";
  wrong_type.inputs = {{"A", Floats({1, 4}, {1, 2, 3, 4})},
                       {"B", Tensor::From<int32_t>(DataType::kInt32, {1, 4}, std::vector<int32_t>{1, 2, 3, 4})}};
  resp = engine_->Infer(std::move(wrong_type)).get();
  EXPECT_EQ(resp.status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(resp.status.message().find("model 'chain' input 'B'"), std::string::npos) << resp.status.message();
}

TEST_F(EnsembleTest, CancellationAndDeadlinesReachTheSteps) {
  // slow_batch holds a lone request for up to a second, waiting for company.
  auto cancel = std::make_shared<CancellationToken>();
  InferRequest r;
  r.model = "slow";
  r.inputs = {{"x", Floats({1, 3}, {1, 2, 3})}};
  r.cancel = cancel;
  const auto t0 = std::chrono::steady_clock::now();
  auto f = engine_->Infer(std::move(r));
  cancel->Cancel();
  InferResponse resp = f.get();
  EXPECT_EQ(resp.status.code(), StatusCode::kCancelled) << resp.status.ToString();
  // The step model dropped it (the cancellation wakes its batcher: the
  // request leaves the queue then, not when its batch would form), so it
  // never ran.
  EXPECT_NE(resp.status.message().find("ensemble 'slow' step 0 (model 'slow_batch')"), std::string::npos)
      << resp.status.message();
  EXPECT_TRUE(resp.steps.empty());
  // Ended, not left waiting (a generous bound: the step's batch would form after 1 s).
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));

  // A request cancelled before it is submitted runs no step at all.
  InferRequest pre;
  pre.model = "chain";
  pre.inputs = {{"A", Floats({1, 4}, {1, 2, 3, 4})}, {"B", Floats({1, 4}, {1, 2, 3, 4})}};
  pre.cancel = std::make_shared<CancellationToken>();
  pre.cancel->Cancel();
  resp = engine_->Infer(std::move(pre)).get();
  EXPECT_EQ(resp.status.code(), StatusCode::kCancelled) << resp.status.ToString();
}

// A request's deadline reaches the step that holds it: on the engine's clock
// (a FakeClock here), 150 ms pass, past the request's 100 ms and short of the
// step's 1 s batching delay, and the request ends DEADLINE_EXCEEDED without
// the clock moving further.
TEST(EnsembleDeadline, ReachesTheStepsOnTheEnginesClock) {
  TempDir dir;
  CopyModel("slow_batch", dir.path());
  WriteEnsemble(dir.path(), "slow", kSlow);
  FakeClock clock;
  EngineOptions o;
  o.model_repository = dir.path().string();
  o.clock = &clock;
  auto engine = Engine::Create(o);
  ASSERT_TRUE(engine.has_value()) << engine.error().ToString();
  const int idle_waiters = clock.waiters();
  InferRequest d;
  d.model = "slow";
  d.inputs = {{"x", Floats({1, 3}, {1, 2, 3})}};
  d.deadline_ns = clock.NowNs() + 100'000'000;
  auto f = (*engine)->Infer(std::move(d));
  // Once the step waits for company (or at once: a clock moved before the
  // step looks finds the deadline passed all the same).
  (void)quern::testing::Eventually([&] { return clock.waiters() > idle_waiters; });
  clock.AdvanceNs(150'000'000);
  ASSERT_EQ(f.wait_for(std::chrono::seconds(30)), std::future_status::ready)
      << "the deadline passed on the engine's clock and the request still waited for its batch";
  InferResponse resp = f.get();
  EXPECT_EQ(resp.status.code(), StatusCode::kDeadlineExceeded) << resp.status.ToString();
  EXPECT_NE(resp.status.message().find("slow"), std::string::npos) << resp.status.message();
}

TEST_F(EnsembleTest, AStepModelReloadedUnderLoadFailsNoRequest) {
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, failed{0};
  std::string first_error;
  std::mutex error_mu;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; !stop.load(); ++i) {
        const float base = static_cast<float>(t * 100000 + i);
        const std::vector<float> a = {base, 1, 2, 3}, b = {3, 2, 1, base};
        InferResponse r = engine_->Infer(Chain(a, b, 1)).get();
        if (r.status.ok() && ToFloats(*r.FindOutput("TWICE_A")) == Times(a, 2)) {
          ++ok;
        } else {
          ++failed;
          std::lock_guard<std::mutex> lock(error_mu);
          if (first_error.empty()) first_error = r.status.ToString();
        }
      }
    });
  }
  for (int i = 0; i < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_TRUE(engine_->LoadModel("add_sub").ok());
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  stop = true;
  for (auto& th : threads) th.join();
  EXPECT_GT(ok.load(), 0);
  EXPECT_EQ(failed.load(), 0) << first_error;
}

struct BadEnsemble {
  const char* what;
  std::string config;
  const char* error;  // a part of the load error
};

std::string Ensemble(const std::string& io, const std::string& steps) {
  return "platform: \"ensemble\"\nmax_batch_size: 8\n" + io + "\nensemble_scheduling { step [ " + steps + " ] }\n";
}

const std::string kIo = R"(input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "S" data_type: TYPE_FP32 dims: [ 4 ] } ])";
const std::string kAddSubAA =
    R"({ model_name: "add_sub" input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "A" } )";

TEST_F(EnsembleTest, LoadErrorsNameTheStep) {
  const std::vector<BadEnsemble> cases = {
      {"unknown model",
       Ensemble(kIo, R"({ model_name: "nope" input_map { key: "x" value: "A" } output_map { key: "y" value: "S" } })"),
       "step 0 (model 'nope'): unknown model 'nope'"},
      {"not an input",
       Ensemble(kIo,
                kAddSubAA + R"(input_map { key: "INPUT9" value: "A" } output_map { key: "OUTPUT0" value: "S" } })"),
       "input_map names 'INPUT9', which is not an input of the model (inputs: INPUT0, INPUT1)"},
      {"input left out",
       Ensemble(
           kIo,
           R"({ model_name: "add_sub" input_map { key: "INPUT0" value: "A" } output_map { key: "OUTPUT0" value: "S" } })"),
       "step 0 (model 'add_sub'): the model's input 'INPUT1' is not in input_map"},
      {"not an output", Ensemble(kIo, kAddSubAA + R"(output_map { key: "OUTPUT7" value: "S" } })"),
       "output_map names 'OUTPUT7', which is not an output of the model"},
      {"read, never written",
       Ensemble(
           kIo,
           R"({ model_name: "add_sub" input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "ghost" } output_map { key: "OUTPUT0" value: "S" } })"),
       "reads tensor 'ghost', which no step writes and which is not an input of the ensemble"},
      {"written twice",
       Ensemble(kIo, kAddSubAA + R"(output_map { key: "OUTPUT0" value: "S" } }, )" + kAddSubAA +
                         R"(output_map { key: "OUTPUT0" value: "S" } })"),
       "step 1 (model 'add_sub'): writes tensor 'S', which step 0 writes too"},
      {"writes an input",
       Ensemble(kIo,
                kAddSubAA + R"(output_map { key: "OUTPUT0" value: "S" } output_map { key: "OUTPUT1" value: "A" } })"),
       "writes tensor 'A', which is an input of the ensemble"},
      {"output never written",
       Ensemble(kIo + R"( output [ { name: "T" data_type: TYPE_FP32 dims: [ 4 ] } ])",
                kAddSubAA + R"(output_map { key: "OUTPUT0" value: "S" } })"),
       "output 'T' is written by no step"},
      {"unused input",
       Ensemble(
           R"(input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "U" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "S" data_type: TYPE_FP32 dims: [ 4 ] } ])",
           kAddSubAA + R"(output_map { key: "OUTPUT0" value: "S" } })"),
       "input 'U' is read by no step"},
      {"dangling tensor",
       Ensemble(kIo, kAddSubAA +
                         R"(output_map { key: "OUTPUT0" value: "S" } output_map { key: "OUTPUT1" value: "lost" } })"),
       "tensor 'lost' is read by no step and is not an output of the ensemble"},
      {"type mismatch",
       Ensemble(R"(input [ { name: "A" data_type: TYPE_INT32 dims: [ 4 ] } ]
output [ { name: "S" data_type: TYPE_FP32 dims: [ 4 ] } ])",
                kAddSubAA + R"(output_map { key: "OUTPUT0" value: "S" } })"),
       "input 'INPUT0' takes FP32, ensemble input 'A' is INT32"},
      {"shape mismatch",
       Ensemble(
           R"(input [ { name: "A" data_type: TYPE_FP32 dims: [ 8 ] } ]
output [ { name: "S" data_type: TYPE_FP32 dims: [ 4 ] } ])",
           R"({ model_name: "linear" input_map { key: "x" value: "A" } output_map { key: "y" value: "lin" } }, { model_name: "add_sub" input_map { key: "INPUT0" value: "lin" } input_map { key: "INPUT1" value: "lin" } output_map { key: "OUTPUT0" value: "S" } })"),
       "step 1 (model 'add_sub'): input 'INPUT0' takes shape [-1,4], tensor 'lin' (written by step 0) has shape "
       "[-1,3]"},
      {"output type",
       Ensemble(R"(input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "S" data_type: TYPE_FP64 dims: [ 4 ] } ])",
                kAddSubAA + R"(output_map { key: "OUTPUT0" value: "S" } })"),
       "output 'S' is FP64, step 0 writes it as FP32"},
      {"cycle",
       Ensemble(
           kIo,
           R"({ model_name: "add_sub" input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "t1" } output_map { key: "OUTPUT0" value: "t0" } output_map { key: "OUTPUT1" value: "S" } }, { model_name: "add_sub" input_map { key: "INPUT0" value: "t0" } input_map { key: "INPUT1" value: "t0" } output_map { key: "OUTPUT0" value: "t1" } })"),
       "steps 0, 1 wait for one another's tensors (a cycle)"},
      {"itself",
       Ensemble(kIo,
                R"({ model_name: "selfish" input_map { key: "A" value: "A" } output_map { key: "S" value: "S" } })"),
       "an ensemble cannot be a step of itself"},
      {"no steps", "platform: \"ensemble\"\nmax_batch_size: 8\n" + kIo + "\nensemble_scheduling { }\n",
       "ensemble_scheduling has no step"},
      {"no scheduling", "platform: \"ensemble\"\nmax_batch_size: 8\n" + kIo + "\n",
       "platform \"ensemble\" needs ensemble_scheduling"},
      {"instances",
       "platform: \"ensemble\"\nmax_batch_size: 8\ninstance_group [ { count: 2 } ]\n" + kIo +
           "\nensemble_scheduling { step [ " + kAddSubAA + R"(output_map { key: "OUTPUT0" value: "S" } } ] })",
       "an ensemble has no instance_group"},
      {"namespace", Ensemble(kIo, kAddSubAA + R"(output_map { key: "OUTPUT0" value: "S" } model_namespace: "x" })"),
       "model_namespace is not supported"},
      {"bad version", Ensemble(kIo, kAddSubAA + R"(output_map { key: "OUTPUT0" value: "S" } model_version: -7 })"),
       "model_version -7 is not a version"},
      {"missing version", Ensemble(kIo, kAddSubAA + R"(output_map { key: "OUTPUT0" value: "S" } model_version: 5 })"),
       "model 'add_sub' has no version 5"},
      {"with batching",
       "platform: \"ensemble\"\nmax_batch_size: 8\ndynamic_batching { }\n" + kIo + "\nensemble_scheduling { step [ " +
           kAddSubAA + R"(output_map { key: "OUTPUT0" value: "S" } } ] })",
       "oneof"},
  };
  for (const auto& c : cases) {
    const std::string name = c.what == std::string("itself") ? "selfish" : "bad_ensemble";
    Status st = Load(name, c.config);
    EXPECT_FALSE(st.ok()) << c.what;
    EXPECT_NE(st.message().find(c.error), std::string::npos) << c.what << ": " << st.message();
    auto status = engine_->GetModel(name);
    ASSERT_TRUE(status.has_value()) << c.what;
    EXPECT_EQ(status->state, ModelState::kUnavailable) << c.what;
    (void)engine_->UnloadModel(name);
  }
  // The same file, mended, loads and serves.
  ASSERT_TRUE(Load("bad_ensemble", Ensemble(kIo, kAddSubAA + R"(output_map { key: "OUTPUT0" value: "S" } })")).ok());
  InferRequest r;
  r.model = "bad_ensemble";
  r.inputs = {{"A", Floats({1, 4}, {1, 2, 3, 4})}};
  InferResponse resp = engine_->Infer(std::move(r)).get();
  ASSERT_TRUE(resp.status.ok()) << resp.status.ToString();
  EXPECT_EQ(ToFloats(resp.outputs[0].tensor), (std::vector<float>{2, 4, 6, 8}));
  (void)engine_->UnloadModel("bad_ensemble");
}

// Rows that are not the request's batch: any number of them, more than the
// step model's max_batch_size (16 for add_sub) or none.
constexpr char kRows[] = R"(
platform: "ensemble"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ -1, 4 ] }, { name: "z" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
ensemble_scheduling { step [
  { model_name: "add_sub" input_map { key: "INPUT0" value: "x" } input_map { key: "INPUT1" value: "x" }
    output_map { key: "OUTPUT0" value: "y" } output_map { key: "OUTPUT1" value: "zero" } },
  { model_name: "add_sub" input_map { key: "INPUT0" value: "zero" } input_map { key: "INPUT1" value: "y" }
    output_map { key: "OUTPUT1" value: "z" } }
] }
)";

TEST_F(EnsembleTest, RowsBeyondAStepsBatchSizeAreSplitAndJoinedInOrder) {
  ASSERT_TRUE(Load("rows", kRows).ok());
  for (int64_t n : {1, 16, 17, 40, 0}) {
    std::vector<float> x;
    for (int64_t i = 0; i < n * 4; ++i) x.push_back(static_cast<float>(i) * 0.5f - 7);
    InferRequest r;
    r.model = "rows";
    r.inputs = {{"x", Floats({n, 4}, x)}};
    InferResponse resp = engine_->Infer(std::move(r)).get();
    ASSERT_TRUE(resp.status.ok()) << n << ": " << resp.status.ToString();
    const Tensor* y = resp.FindOutput("y");
    const Tensor* z = resp.FindOutput("z");
    ASSERT_TRUE(y && z);
    EXPECT_EQ(y->shape(), (Shape{n, 4})) << n;
    EXPECT_EQ(z->shape(), (Shape{n, 4})) << n;
    EXPECT_EQ(ToFloats(*y), Times(x, 2)) << n;   // x + x
    EXPECT_EQ(ToFloats(*z), Times(x, -2)) << n;  // (x - x) - 2x
    EXPECT_EQ(resp.steps.size(), n == 0 ? 0u : 2u) << "zero rows run no step";
  }
  // A batched ensemble's rows beyond its step model's max_batch_size too.
  ASSERT_TRUE(Load("wide_batch", "platform: \"ensemble\"\nmax_batch_size: 64\n" + kIo +
                                     "\nensemble_scheduling { step [ " + kAddSubAA +
                                     R"(output_map { key: "OUTPUT0" value: "S" } } ] })")
                  .ok());
  std::vector<float> a;
  for (int i = 0; i < 50 * 4; ++i) a.push_back(static_cast<float>(i));
  InferRequest r;
  r.model = "wide_batch";
  r.inputs = {{"A", Floats({50, 4}, a)}};
  InferResponse resp = engine_->Infer(std::move(r)).get();
  ASSERT_TRUE(resp.status.ok()) << resp.status.ToString();
  EXPECT_EQ(ToFloats(resp.outputs[0].tensor), Times(a, 2));
  // Rows that would take more than kMaxStepRequests requests of 16 fail the
  // request with an error naming the step, before any is sent.
  const int64_t too_many = 16 * EnsembleModel::kMaxStepRequests + 1;
  InferRequest huge;
  huge.model = "rows";
  huge.inputs = {{"x", Floats({too_many, 4}, std::vector<float>(static_cast<size_t>(too_many) * 4, 1.f))}};
  auto before = engine_->GetStatistics("add_sub");
  ASSERT_TRUE(before.has_value());
  resp = engine_->Infer(std::move(huge)).get();
  EXPECT_EQ(resp.status.code(), StatusCode::kInvalidArgument) << resp.status.ToString();
  EXPECT_NE(resp.status.message().find("ensemble 'rows' step 0 (model 'add_sub')"), std::string::npos)
      << resp.status.message();
  auto after = engine_->GetStatistics("add_sub");
  ASSERT_TRUE(after.has_value());
  EXPECT_EQ((*after)[0].inference_count, (*before)[0].inference_count) << "nothing was computed";
  (void)engine_->UnloadModel("rows");
  (void)engine_->UnloadModel("wide_batch");
}

TEST_F(EnsembleTest, AnUnloadedStepModelFailsTheRequestClearly) {
  ASSERT_TRUE(Load("uses_linear", R"(
platform: "ensemble"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 8 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]
ensemble_scheduling { step [ { model_name: "linear" input_map { key: "x" value: "x" } output_map { key: "y" value: "y" } } ] }
)")
                  .ok());
  ASSERT_TRUE(engine_->UnloadModel("linear").ok());
  InferRequest r;
  r.model = "uses_linear";
  r.inputs = {{"x", Floats({1, 8}, std::vector<float>(8, 1.f))}};
  InferResponse resp = engine_->Infer(std::move(r)).get();
  EXPECT_EQ(resp.status.code(), StatusCode::kNotFound);
  EXPECT_NE(resp.status.message().find("ensemble 'uses_linear' step 0 (model 'linear'): unknown model 'linear'"),
            std::string::npos)
      << resp.status.message();
  ASSERT_TRUE(engine_->LoadModel("linear").ok());
  (void)engine_->UnloadModel("uses_linear");
}

// An ensemble of x [4] -> y [4] whose one step is `step` (an ensemble of the
// same signature, or add_sub adding x to itself).
std::string Passing(const std::string& step) {
  if (step == "add_sub") {
    return R"(
platform: "ensemble"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "add_sub" input_map { key: "INPUT0" value: "x" }
  input_map { key: "INPUT1" value: "x" } output_map { key: "OUTPUT0" value: "y" } } ] }
)";
  }
  return R"(
platform: "ensemble"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: ")" +
         step + R"(" input_map { key: "x" value: "x" } output_map { key: "y" value: "y" } } ] }
)";
}

InferRequest Doubling(const std::string& model) {
  InferRequest r;
  r.model = model;
  r.inputs = {{"x", Floats({1, 4}, {1, 2, 3, 4})}};
  return r;
}

TEST_F(EnsembleTest, AReloadThatWouldMakeACycleIsRefusedAndNothingRecursesForever) {
  // cyc_a -> cyc_b -> cyc_c -> add_sub, then cyc_c reloaded to call cyc_a:
  // each version passes its own checks, the graph would not end.
  ASSERT_TRUE(Load("cyc_c", Passing("add_sub")).ok());
  ASSERT_TRUE(Load("cyc_b", Passing("cyc_c")).ok());
  ASSERT_TRUE(Load("cyc_a", Passing("cyc_b")).ok());
  Status st = Load("cyc_c", Passing("cyc_a"));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("cycle of ensembles: 'cyc_c' -> 'cyc_a' -> 'cyc_b' -> 'cyc_c'"), std::string::npos)
      << st.message();
  // Asking for admission and inferring walk the steps: they end.
  for (const char* m : {"cyc_a", "cyc_b", "cyc_c"}) {
    (void)engine_->CheckAdmission(m);
    InferResponse r = engine_->Infer(Doubling(m)).get();
    if (r.status.ok()) {
      EXPECT_EQ(ToFloats(r.outputs[0].tensor), (std::vector<float>{2, 4, 6, 8}));
    }
  }
  // An ensemble that calls itself is refused as well.
  st = Load("cyc_self", Passing("cyc_self"));
  EXPECT_NE(st.message().find("an ensemble cannot be a step of itself"), std::string::npos) << st.message();
  for (const char* m : {"cyc_a", "cyc_b", "cyc_c", "cyc_self"}) (void)engine_->UnloadModel(m);
}

TEST(EnsembleGraphTest, AStartWithACycleNamesItOnceAndLoadsTheRest) {
  TempDir dir;
  CopyModel("add_sub", dir.path());
  // loop_1 -> loop_2 -> loop_1, user -> loop_1, fine -> add_sub.
  WriteEnsemble(dir.path(), "loop_1", Passing("loop_2"));
  WriteEnsemble(dir.path(), "loop_2", Passing("loop_1"));
  WriteEnsemble(dir.path(), "a_user", Passing("loop_1"));
  WriteEnsemble(dir.path(), "fine", Passing("add_sub"));
  EngineOptions o;
  o.model_repository = dir.path().string();
  auto e = Engine::Create(o);
  ASSERT_TRUE(e.has_value()) << e.error().ToString();
  for (const char* m : {"loop_1", "loop_2"}) {
    auto st = (*e)->GetModel(m);
    ASSERT_TRUE(st.has_value());
    EXPECT_EQ(st->state, ModelState::kUnavailable);
    EXPECT_NE(st->reason.find("part of a cycle of ensembles"), std::string::npos) << st->reason;
    EXPECT_LT(st->reason.size(), 200u) << st->reason;
  }
  auto user = (*e)->GetModel("a_user");
  ASSERT_TRUE(user.has_value());
  EXPECT_EQ(user->state, ModelState::kUnavailable);
  EXPECT_LT(user->reason.size(), 600u) << user->reason;
  InferResponse r = (*e)->Infer(Doubling("fine")).get();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(ToFloats(r.outputs[0].tensor), (std::vector<float>{2, 4, 6, 8}));
  EXPECT_FALSE((*e)->Infer(Doubling("a_user")).get().status.ok());
}

TEST(EnsembleGraphTest, ADeepChainLoadsInAnyNameOrderUpToTheNestingBound) {
  // chain_0000 -> chain_0001 -> ... -> add_sub: names sort against the
  // order the chain must load in. Deeper than kMaxNesting is refused with
  // a clear error; everything within it serves, from the deepest end.
  TempDir dir;
  CopyModel("add_sub", dir.path());
  const int n = EnsembleModel::kMaxNesting + 4;
  auto name = [](int i) {
    char b[32];
    std::snprintf(b, sizeof b, "chain_%04d", i);
    return std::string(b);
  };
  for (int i = 0; i < n; ++i) WriteEnsemble(dir.path(), name(i), Passing(i + 1 < n ? name(i + 1) : "add_sub"));
  EngineOptions o;
  o.model_repository = dir.path().string();
  auto e = Engine::Create(o);
  ASSERT_TRUE(e.has_value()) << e.error().ToString();
  for (int i = 0; i < n; ++i) {
    auto st = (*e)->GetModel(name(i));
    ASSERT_TRUE(st.has_value());
    const int depth = n - i;
    if (depth <= EnsembleModel::kMaxNesting) {
      EXPECT_EQ(st->state, ModelState::kReady) << name(i) << ": " << st->reason;
    } else {
      EXPECT_EQ(st->state, ModelState::kUnavailable) << name(i);
      EXPECT_LT(st->reason.size(), 600u);
    }
  }
  auto deep = (*e)->GetModel(name(n - EnsembleModel::kMaxNesting - 1));
  ASSERT_TRUE(deep.has_value());
  EXPECT_NE(deep->reason.find("nests ensembles " + std::to_string(EnsembleModel::kMaxNesting + 1) + " deep"),
            std::string::npos)
      << deep->reason;
  const std::string top = name(n - EnsembleModel::kMaxNesting);
  EXPECT_TRUE((*e)->CheckAdmission(top).ok());
  InferResponse r = (*e)->Infer(Doubling(top)).get();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(ToFloats(r.outputs[0].tensor), (std::vector<float>{2, 4, 6, 8}));
}

TEST(EnsembleGraphTest, ARecursionTheRegistryLetThroughIsCutAtTheNestingBound) {
  // An ensemble whose step model is itself, built without the registry's
  // check: admission and submission stop at the bound with an error.
  auto proto = ParseModelConfigText(Passing("other"), "config.pbtxt");
  ASSERT_TRUE(proto.has_value()) << proto.error().ToString();
  auto converted = ConvertModelConfig(*proto, "config.pbtxt");
  ASSERT_TRUE(converted.has_value()) << converted.error().ToString();
  ModelConfig config = *converted;
  config.name = "self";
  std::shared_ptr<EnsembleModel> self;
  EnsembleModel::StepModels steps;
  steps.config = [&](const std::string&, int64_t) -> Result<ModelConfig> { return config; };
  steps.check_admission = [&](const std::string&, int64_t) { return self->CheckAdmission(); };
  steps.submit = [&](InferRequest&& r, InferCallback& done, const SubmitOptions& o) {
    return self->Submit(std::move(r), 1, done, o, false);
  };
  auto created = EnsembleModel::Create(config, 1, steps, &RealClockInstance());
  ASSERT_TRUE(created.has_value()) << created.error().ToString();
  self = *created;
  Status st = self->CheckAdmission();
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
  EXPECT_NE(st.message().find("nested more than"), std::string::npos) << st.message();
  InferRequest r = Doubling("self");
  InferCallback done = [](InferResponse&&) {};
  st = self->Submit(std::move(r), 1, done, {}, false);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
  self->Shutdown();
  self.reset();
}

}  // namespace
}  // namespace quern
