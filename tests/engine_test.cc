// End-to-end tests: Engine over a real repository and the real ONNX Runtime.
// Expected values are computed here from the inputs (and, for `linear`, from
// the weights the generator saved), never by ONNX Runtime.
#include "quern/engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <thread>

#include "core/npy.h"
#include "test_util.h"

namespace quern {
namespace {

using testing::CopyModel;
using testing::Floats;
using testing::TempDir;
using testing::TestModels;
using testing::ToFloats;
using testing::WriteFile;

std::unique_ptr<Engine> Open(const std::filesystem::path& repo) {
  EngineOptions o;
  o.model_repository = repo.string();
  auto e = Engine::Create(o);
  EXPECT_TRUE(e.has_value()) << e.error().ToString();
  return std::move(*e);
}

class EngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { engine_ = Open(TestModels()).release(); }
  static void TearDownTestSuite() {
    delete engine_;
    engine_ = nullptr;
  }
  static Engine* engine_;
};
Engine* EngineTest::engine_ = nullptr;

InferRequest AddSub(const std::vector<float>& a, const std::vector<float>& b, int64_t rows) {
  InferRequest r;
  r.model = "add_sub";
  r.inputs = {{"INPUT0", Floats({rows, 4}, a)}, {"INPUT1", Floats({rows, 4}, b)}};
  return r;
}

TEST_F(EngineTest, BareModelIsAutoConfiguredAndServes) {
  auto st = engine_->GetModel("add_sub");
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->state, ModelState::kReady);
  EXPECT_GT(st->config.max_batch_size, 0) << "dynamic first dimension means batching";
  EXPECT_TRUE(st->config.batching.has_value());
  EXPECT_EQ(st->config.instance_count, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())))
      << "no config: one instance per core";
  ASSERT_EQ(st->config.inputs.size(), 2u);
  EXPECT_EQ(st->config.inputs[0].dims, (Shape{4}));

  std::vector<float> a{1, 2, 3, 4, 5, 6, 7, 8}, b{0.5f, 1, 1.5f, 2, -1, -2, -3, -4};
  InferRequest req = AddSub(a, b, 2);
  req.metadata = {{"caller", "test"}};
  InferResponse r = engine_->Infer(std::move(req)).get();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  const Tensor* sum = r.FindOutput("OUTPUT0");
  const Tensor* diff = r.FindOutput("OUTPUT1");
  ASSERT_TRUE(sum && diff);
  EXPECT_EQ(sum->shape(), (Shape{2, 4}));
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_FLOAT_EQ(ToFloats(*sum)[i], a[i] + b[i]);
    EXPECT_FLOAT_EQ(ToFloats(*diff)[i], a[i] - b[i]);
  }
  EXPECT_EQ(r.model, "add_sub");
  EXPECT_EQ(r.version, 1);
  EXPECT_NE(r.request_id, 0u);
  EXPECT_EQ(r.metadata, (std::vector<std::pair<std::string, std::string>>{{"caller", "test"}}));
  EXPECT_GE(r.telemetry.batch_size, 2);
  EXPECT_GT(r.telemetry.compute_ns(), 0);
  EXPECT_GE(r.telemetry.total_ns(), r.telemetry.compute_ns());
}

TEST_F(EngineTest, LinearMatchesNumpyWeights) {
  auto w = ReadNpy((TestModels() / "linear" / "W.npy").string());
  auto b = ReadNpy((TestModels() / "linear" / "b.npy").string());
  ASSERT_TRUE(w && b);
  auto W = w->values<float>();
  auto B = b->values<float>();
  std::vector<float> x(3 * 8);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) * 0.25f - 2.f;
  InferRequest req;
  req.model = "linear";
  req.inputs = {{"x", Floats({3, 8}, x)}};
  InferResponse r = engine_->Infer(std::move(req)).get();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  auto y = ToFloats(r.outputs.at(0).tensor);
  ASSERT_EQ(y.size(), 9u);
  for (int row = 0; row < 3; ++row) {
    for (int j = 0; j < 3; ++j) {
      double want = B[j];
      for (int k = 0; k < 8; ++k) want += static_cast<double>(x[row * 8 + k]) * W[k * 3 + j];
      EXPECT_NEAR(y[row * 3 + j], want, 1e-4) << "row " << row << " col " << j;
    }
  }
}

TEST_F(EngineTest, EveryDataTypeRoundTrips) {
  InferRequest req;
  req.model = "dtypes";
  const Shape s{1, 2};
  std::vector<uint8_t> bools{1, 0}, u8{7, 250};
  std::vector<int8_t> i8{-5, 9};
  std::vector<int32_t> i32{-70000, 123};
  std::vector<int64_t> i64{int64_t{1} << 40, -3};
  std::vector<uint16_t> f16{0x3c00, 0xc000};  // 1.0, -2.0
  std::vector<float> f32{1.5f, -2.25f};
  std::vector<double> f64{1e300, -0.125};
  req.inputs = {{"in_bool", Tensor::From<uint8_t>(DataType::kBool, s, bools)},
                {"in_uint8", Tensor::From<uint8_t>(DataType::kUint8, s, u8)},
                {"in_int8", Tensor::From<int8_t>(DataType::kInt8, s, i8)},
                {"in_int32", Tensor::From<int32_t>(DataType::kInt32, s, i32)},
                {"in_int64", Tensor::From<int64_t>(DataType::kInt64, s, i64)},
                {"in_fp16", Tensor::From<uint16_t>(DataType::kFp16, s, f16)},
                {"in_fp32", Tensor::From<float>(DataType::kFp32, s, f32)},
                {"in_fp64", Tensor::From<double>(DataType::kFp64, s, f64)},
                {"in_string", Tensor::FromStrings(s, {"hello", std::string("a\0b", 3)})}};
  InferResponse r = engine_->Infer(std::move(req)).get();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  auto same = [&](const char* name, const auto& want) {
    const Tensor* t = r.FindOutput(name);
    ASSERT_NE(t, nullptr) << name;
    using T = typename std::decay_t<decltype(want)>::value_type;
    auto got = t->values<T>();
    EXPECT_EQ(std::vector<T>(got.begin(), got.end()), want) << name;
  };
  same("out_bool", bools);
  same("out_uint8", u8);
  same("out_int8", i8);
  same("out_int32", i32);
  same("out_int64", i64);
  same("out_fp16", f16);
  same("out_fp32", f32);
  same("out_fp64", f64);
  auto strs = r.FindOutput("out_string")->Strings();
  ASSERT_TRUE(strs.has_value());
  EXPECT_EQ((*strs)[0], "hello");
  EXPECT_EQ((*strs)[1], std::string_view("a\0b", 3));
}

TEST_F(EngineTest, BadRequestsGetClearErrors) {
  auto err = [&](InferRequest req) { return engine_->Infer(std::move(req)).get().status; };
  InferRequest unknown;
  unknown.model = "nope";
  Status st = err(std::move(unknown));
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_NE(st.message().find("'nope'"), std::string::npos);

  InferRequest wrong_type = AddSub({1, 2, 3, 4}, {1, 2, 3, 4}, 1);
  std::vector<int32_t> ints{1, 2, 3, 4};
  wrong_type.inputs[1].tensor = Tensor::From<int32_t>(DataType::kInt32, {1, 4}, ints);
  st = err(std::move(wrong_type));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("input 'INPUT1': expected data type FP32, got INT32"), std::string::npos) << st.message();

  InferRequest wrong_shape = AddSub({1, 2, 3}, {1, 2, 3}, 1);
  wrong_shape.inputs[0].tensor = Floats({1, 3}, {1, 2, 3});
  wrong_shape.inputs[1].tensor = Floats({1, 3}, {1, 2, 3});
  st = err(std::move(wrong_shape));
  EXPECT_NE(st.message().find("expected shape [-1,4], got [1,3]"), std::string::npos) << st.message();

  InferRequest missing = AddSub({1, 2, 3, 4}, {1, 2, 3, 4}, 1);
  missing.inputs.pop_back();
  st = err(std::move(missing));
  EXPECT_NE(st.message().find("input 'INPUT1' is missing"), std::string::npos) << st.message();

  InferRequest short_buffer = AddSub({1, 2, 3, 4}, {1, 2, 3, 4}, 1);
  short_buffer.inputs[0].tensor = Tensor::Borrow(DataType::kFp32, {1, 4}, ints.data(), 12);
  st = err(std::move(short_buffer));
  EXPECT_NE(st.message().find("needs 16 bytes, got 12"), std::string::npos) << st.message();

  InferRequest too_big = AddSub(std::vector<float>(17 * 4), std::vector<float>(17 * 4), 17);
  st = err(std::move(too_big));
  EXPECT_NE(st.message().find("exceeds max_batch_size 16"), std::string::npos) << st.message();

  InferRequest bad_output = AddSub({1, 2, 3, 4}, {1, 2, 3, 4}, 1);
  bad_output.requested_outputs = {"OUTPUT9"};
  st = err(std::move(bad_output));
  EXPECT_NE(st.message().find("no output 'OUTPUT9'"), std::string::npos) << st.message();
}

TEST_F(EngineTest, RequestedOutputsSubset) {
  InferRequest req = AddSub({1, 1, 1, 1}, {2, 2, 2, 2}, 1);
  req.requested_outputs = {"OUTPUT1"};
  InferResponse r = engine_->Infer(std::move(req)).get();
  ASSERT_TRUE(r.status.ok());
  ASSERT_EQ(r.outputs.size(), 1u);
  EXPECT_EQ(r.outputs[0].name, "OUTPUT1");
  EXPECT_EQ(ToFloats(r.outputs[0].tensor), (std::vector<float>{-1, -1, -1, -1}));
}

TEST_F(EngineTest, AnOutputAskedForTwiceComesTwiceWhole) {
  // A lone request's outputs move to it rather than being copied: one it
  // names twice must still come back twice, with its values (through Run
  // and through Infer).
  for (bool run : {true, false}) {
    InferRequest req = AddSub({1, 2, 3, 4}, {1, 1, 1, 1}, 1);
    req.requested_outputs = {"OUTPUT0", "OUTPUT0", "OUTPUT1"};
    InferResponse r = run ? engine_->Run(std::move(req)) : engine_->Infer(std::move(req)).get();
    ASSERT_TRUE(r.status.ok()) << r.status.message();
    ASSERT_EQ(r.outputs.size(), 3u);
    for (const auto& o : r.outputs) EXPECT_EQ(o.tensor.shape(), (Shape{1, 4})) << o.name << " " << run;
    EXPECT_EQ(ToFloats(r.outputs[0].tensor), (std::vector<float>{2, 3, 4, 5})) << run;
    EXPECT_EQ(ToFloats(r.outputs[1].tensor), (std::vector<float>{2, 3, 4, 5})) << run;
    EXPECT_EQ(ToFloats(r.outputs[2].tensor), (std::vector<float>{0, 1, 2, 3})) << run;
  }
}

TEST_F(EngineTest, AFailingBatchFailsOnlyItsRequestsAndTheModelKeepsServing) {
  InferRequest bad;
  bad.model = "fail_on_3";
  bad.inputs = {{"x", Floats({1, 3}, {1, 2, 3})}};
  InferResponse r = engine_->Infer(std::move(bad)).get();
  EXPECT_EQ(r.status.code(), StatusCode::kInternal);
  EXPECT_NE(r.status.message().find("model 'fail_on_3'"), std::string::npos) << r.status.message();

  InferRequest good;
  good.model = "fail_on_3";
  good.inputs = {{"x", Floats({1, 4}, {1, 2, 3, 4})}};
  r = engine_->Infer(std::move(good)).get();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(ToFloats(r.outputs[0].tensor), (std::vector<float>{1, 2, 3, 4}));
}

TEST_F(EngineTest, FixedBatchSizeIsPaddedAndPaddingNeverReturns) {
  // Three concurrent single-row requests run in one batch padded to 4.
  std::vector<std::future<InferResponse>> fs;
  for (int i = 0; i < 3; ++i) {
    InferRequest req;
    req.model = "fixed4";
    float v = static_cast<float>(i + 1);
    req.inputs = {{"x", Floats({1, 3}, {v, v * 10, v * 100})}};
    fs.push_back(engine_->Infer(std::move(req)));
  }
  for (int i = 0; i < 3; ++i) {
    InferResponse r = fs[i].get();
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    float v = static_cast<float>(i + 1);
    EXPECT_EQ(r.outputs[0].tensor.shape(), (Shape{1, 3}));
    EXPECT_EQ(ToFloats(r.outputs[0].tensor), (std::vector<float>{2 * v, 20 * v, 200 * v}));
    EXPECT_EQ(r.telemetry.padded_batch_size, 4);
    EXPECT_LE(r.telemetry.batch_size, 3);
  }
}

TEST_F(EngineTest, NonBatchingModel) {
  auto st = engine_->GetModel("nobatch");
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->config.max_batch_size, 0);
  InferRequest req;
  req.model = "nobatch";
  req.inputs = {{"x", Floats({2, 3}, {1, 2, 3, 4, 5, 6})}};
  InferResponse r = engine_->Infer(std::move(req)).get();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(ToFloats(r.outputs[0].tensor), (std::vector<float>{3, 6, 9, 12, 15, 18}));
}

TEST_F(EngineTest, NonBatchingModelTakesMisalignedInputs) {
  // A binary tensor may sit at any offset of a request body: unaligned data
  // is copied whole (not as rows of a batch, which this model has none of).
  const float values[6] = {1, 2, 3, 4, 5, 6};
  auto body = std::make_shared<std::vector<char>>(1 + sizeof(values));
  std::memcpy(body->data() + 1, values, sizeof(values));
  InferRequest req;
  req.model = "nobatch";
  req.inputs = {{"x", Tensor::Borrow(DataType::kFp32, {2, 3}, body->data() + 1, sizeof(values), body)}};
  InferResponse r = engine_->Infer(std::move(req)).get();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.outputs[0].tensor.shape(), (Shape{2, 3}));
  EXPECT_EQ(ToFloats(r.outputs[0].tensor), (std::vector<float>{3, 6, 9, 12, 15, 18}));
}

TEST_F(EngineTest, VersionsAreServedSeparately) {
  for (int64_t v : {1, 2, -1}) {
    InferRequest req;
    req.model = "versions";
    req.version = v;
    req.inputs = {{"x", Floats({1, 3}, {1, 2, 3})}};
    InferResponse r = engine_->Infer(std::move(req)).get();
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    const float k = v == 1 ? 1.f : 10.f;  // -1 = latest = version 2
    EXPECT_EQ(ToFloats(r.outputs[0].tensor), (std::vector<float>{k, 2 * k, 3 * k})) << "version " << v;
  }
  InferRequest req;
  req.model = "versions";
  req.version = 7;
  req.inputs = {{"x", Floats({1, 3}, {1, 2, 3})}};
  EXPECT_EQ(engine_->Infer(std::move(req)).get().status.code(), StatusCode::kNotFound);
}

TEST_F(EngineTest, CallbackAndCompletionQueueForms) {
  std::promise<InferResponse> p;
  InferCallback done = [&](InferResponse&& r) { p.set_value(std::move(r)); };
  ASSERT_TRUE(engine_->InferAsync(AddSub({1, 1, 1, 1}, {1, 1, 1, 1}, 1), done).ok());
  EXPECT_FALSE(done) << "a request taken takes its callback";
  InferResponse r = p.get_future().get();
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(ToFloats(r.outputs[0].tensor), (std::vector<float>{2, 2, 2, 2}));

  CompletionQueue cq;
  std::map<uint64_t, float> expected;
  for (int i = 0; i < 8; ++i) {
    float v = static_cast<float>(i);
    auto id = engine_->InferAsync(AddSub({v, v, v, v}, {v, v, v, v}, 1), &cq);
    ASSERT_TRUE(id.has_value()) << id.error().ToString();
    expected[*id] = 2 * v;
  }
  for (int i = 0; i < 8; ++i) {
    InferResponse got = cq.Wait();
    ASSERT_TRUE(got.status.ok());
    ASSERT_TRUE(expected.count(got.request_id));
    EXPECT_EQ(ToFloats(got.outputs[0].tensor)[0], expected[got.request_id]);
    expected.erase(got.request_id);
  }
  EXPECT_FALSE(cq.TryPoll().has_value());
}

TEST_F(EngineTest, RefusalsAtSubmissionAreReturnedAndTheCallbackNeverRuns) {
  std::atomic<int> calls{0};
  InferCallback done = [&](InferResponse&&) { calls.fetch_add(1); };
  InferRequest unknown;
  unknown.model = "no_such_model";
  Status st = engine_->InferAsync(std::move(unknown), done);
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
  ASSERT_TRUE(done) << "a refused request leaves its callback with the caller";

  InferRequest bad = AddSub({1, 1, 1, 1}, {1, 1, 1, 1}, 1);
  bad.inputs.pop_back();  // one input missing
  st = engine_->InferAsync(std::move(bad), done);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  ASSERT_TRUE(done);

  CompletionQueue cq;
  InferRequest unknown2;
  unknown2.model = "no_such_model";
  auto id = engine_->InferAsync(std::move(unknown2), &cq);
  ASSERT_FALSE(id.has_value());
  EXPECT_EQ(id.error().code(), StatusCode::kNotFound);

  // The callback is still usable, and taken by the next accepted request.
  ASSERT_TRUE(engine_->InferAsync(AddSub({1, 1, 1, 1}, {1, 1, 1, 1}, 1), done).ok());
  for (int i = 0; i < 30000 && calls.load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(calls.load(), 1) << "only the accepted request answers";
  EXPECT_FALSE(cq.TryPoll().has_value()) << "nothing is pushed for a refusal";
}

TEST_F(EngineTest, ManyThreadsEachGetTheirOwnResult) {
  constexpr int kThreads = 16, kPerThread = 60;
  std::atomic<int> wrong{0}, failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const int64_t rows = 1 + (t + i) % 3;
        std::vector<float> a(rows * 4), b(rows * 4);
        for (size_t k = 0; k < a.size(); ++k) {
          a[k] = static_cast<float>(t * 1000 + i) + static_cast<float>(k) * 0.5f;
          b[k] = static_cast<float>(k);
        }
        InferResponse r = engine_->Infer(AddSub(a, b, rows)).get();
        if (!r.status.ok()) {
          ++failed;
          continue;
        }
        auto sum = ToFloats(*r.FindOutput("OUTPUT0"));
        auto diff = ToFloats(*r.FindOutput("OUTPUT1"));
        if (sum.size() != a.size()) {
          ++wrong;
          continue;
        }
        for (size_t k = 0; k < a.size(); ++k) {
          if (sum[k] != a[k] + b[k] || diff[k] != a[k] - b[k]) {
            ++wrong;
            break;
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(wrong.load(), 0);
}

TEST(EngineRepository, MissingRepositoryIsAnError) {
  EngineOptions o;
  o.model_repository = "/nonexistent/quern/repo";
  auto e = Engine::Create(o);
  ASSERT_FALSE(e.has_value());
  EXPECT_EQ(e.error().code(), StatusCode::kNotFound);
  EXPECT_NE(e.error().message().find("/nonexistent/quern/repo"), std::string::npos);
}

TEST(EngineRepository, ABrokenModelDoesNotAffectTheOthers) {
  TempDir repo;
  CopyModel("add_sub", repo.path());
  CopyModel("linear", repo.path(), "broken_config");
  WriteFile(repo.path() / "broken_config" / "config.pbtxt", "max_batch_size: 4\ninput [ { name: \"x\" dims: [ 8 ] ");
  CopyModel("linear", repo.path(), "wrong_type");
  WriteFile(repo.path() / "wrong_type" / "config.pbtxt",
            "max_batch_size: 4\ninput [ { name: \"x\" data_type: TYPE_INT64 dims: [ 8 ] } ]\n"
            "output [ { name: \"y\" data_type: TYPE_FP32 dims: [ 3 ] } ]\n");
  std::filesystem::create_directories(repo.path() / "no_file" / "1");
  auto engine = Open(repo.path());
  EXPECT_TRUE(engine->ModelReady("add_sub"));

  auto broken = engine->GetModel("broken_config");
  ASSERT_TRUE(broken.has_value());
  EXPECT_EQ(broken->state, ModelState::kUnavailable);
  EXPECT_NE(broken->reason.find("config.pbtxt:2:"), std::string::npos) << broken->reason;

  auto wrong = engine->GetModel("wrong_type");
  ASSERT_TRUE(wrong.has_value());
  EXPECT_NE(wrong->reason.find("configured as INT64 but the model has FP32"), std::string::npos) << wrong->reason;

  auto no_file = engine->GetModel("no_file");
  ASSERT_TRUE(no_file.has_value());
  EXPECT_NE(no_file->reason.find("does not exist"), std::string::npos) << no_file->reason;

  InferRequest req;
  req.model = "wrong_type";
  EXPECT_EQ(engine->Infer(std::move(req)).get().status.code(), StatusCode::kUnavailable);
}

TEST(EngineRepository, ConfigServingASubsetOfTheOutputs) {
  TempDir repo;
  CopyModel("add_sub", repo.path());
  WriteFile(repo.path() / "add_sub" / "config.pbtxt",
            "max_batch_size: 4\ninstance_group [ { count: 2 } ]\n"
            "output [ { name: \"OUTPUT1\" data_type: TYPE_FP32 dims: [ 4 ] } ]\n");
  auto engine = Open(repo.path());
  auto st = engine->GetModel("add_sub");
  ASSERT_TRUE(st.has_value());
  ASSERT_EQ(st->state, ModelState::kReady) << st->reason;
  EXPECT_EQ(st->config.inputs.size(), 2u) << "inputs derived from the model";
  ASSERT_EQ(st->config.outputs.size(), 1u);
  for (int i = 0; i < 4; ++i) {  // reaches both instances
    InferRequest req;
    req.model = "add_sub";
    req.inputs = {{"INPUT0", Floats({1, 4}, {5, 6, 7, 8})}, {"INPUT1", Floats({1, 4}, {1, 1, 1, 1})}};
    InferResponse r = engine->Infer(std::move(req)).get();
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    ASSERT_EQ(r.outputs.size(), 1u);
    EXPECT_EQ(r.outputs[0].name, "OUTPUT1");
    EXPECT_EQ(ToFloats(r.outputs[0].tensor), (std::vector<float>{4, 5, 6, 7}));
  }
}

TEST(EngineRepository, PollingReloadsChangedModelsAndUnloadsRemovedOnes) {
  TempDir repo;
  CopyModel("versions", repo.path(), "m");
  WriteFile(repo.path() / "m" / "config.pbtxt", "max_batch_size: 8\nversion_policy { specific { versions: 1 } }\n");
  auto engine = Open(repo.path());
  auto run = [&]() {
    InferRequest req;
    req.model = "m";
    req.inputs = {{"x", Floats({1, 3}, {1, 2, 3})}};
    return engine->Infer(std::move(req)).get();
  };
  InferResponse r = run();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(ToFloats(r.outputs[0].tensor)[0], 1.f);

  // Switch to version 2 by editing the config; also add a new model.
  WriteFile(repo.path() / "m" / "config.pbtxt", "max_batch_size: 8\nversion_policy { specific { versions: 2 } }\n");
  CopyModel("add_sub", repo.path());
  ASSERT_TRUE(engine->PollRepository().ok());
  r = run();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.version, 2);
  EXPECT_EQ(ToFloats(r.outputs[0].tensor)[0], 10.f);
  EXPECT_TRUE(engine->ModelReady("add_sub"));

  std::filesystem::remove_all(repo.path() / "add_sub");
  ASSERT_TRUE(engine->PollRepository().ok());
  EXPECT_FALSE(engine->GetModel("add_sub").has_value());
}

TEST(EngineRepository, AReloadThatFailsLeavesTheServingVersionServing) {
  TempDir repo;
  CopyModel("versions", repo.path(), "m");
  const std::string good = "max_batch_size: 8\nversion_policy { specific { versions: 1 } }\n";
  WriteFile(repo.path() / "m" / "config.pbtxt", good);
  auto engine = Open(repo.path());
  auto first = [&]() {
    InferRequest req;
    req.model = "m";
    req.inputs = {{"x", Floats({1, 3}, {1, 2, 3})}};
    InferResponse r = engine->Infer(std::move(req)).get();
    EXPECT_TRUE(r.status.ok()) << r.status.ToString();
    return r.status.ok() ? ToFloats(r.outputs[0].tensor)[0] : -1.f;
  };
  auto reason = [&]() {
    auto st = engine->GetModel("m");
    return st ? st->reason : std::string("no model");
  };
  ASSERT_EQ(first(), 1.f);

  // A configuration that does not parse: version 1 serves on, the failure is
  // the ready version's reason, and the load says it failed.
  WriteFile(repo.path() / "m" / "config.pbtxt", "max_batch_size: [[[ garbage\n");
  ASSERT_TRUE(engine->PollRepository().ok());
  EXPECT_TRUE(engine->ModelReady("m"));
  EXPECT_EQ(first(), 1.f);
  EXPECT_NE(reason().find("a reload failed, the version loaded before serves on"), std::string::npos) << reason();
  EXPECT_FALSE(engine->LoadModel("m").ok());
  EXPECT_EQ(first(), 1.f);

  // A new version whose model file is truncated: version 1 serves on.
  WriteFile(repo.path() / "m" / "config.pbtxt", "max_batch_size: 8\n");  // latest: version 3
  std::filesystem::create_directories(repo.path() / "m" / "3");
  std::string onnx;
  {
    std::ifstream in(repo.path() / "m" / "2" / "model.onnx", std::ios::binary);
    onnx.assign(std::istreambuf_iterator<char>(in), {});
  }
  WriteFile(repo.path() / "m" / "3" / "model.onnx", onnx.substr(0, onnx.size() / 2));
  ASSERT_TRUE(engine->PollRepository().ok());
  EXPECT_TRUE(engine->ModelReady("m"));
  EXPECT_EQ(first(), 1.f);
  EXPECT_NE(reason().find("version loaded before serves on"), std::string::npos) << reason();

  // The files fixed: the next poll loads them and the note is gone.
  WriteFile(repo.path() / "m" / "3" / "model.onnx", onnx);
  ASSERT_TRUE(engine->PollRepository().ok());
  EXPECT_EQ(first(), 10.f);
  EXPECT_EQ(reason(), "");
  auto v1 = engine->GetModel("m", 1);
  EXPECT_FALSE(v1.has_value());
}

TEST(EngineRepository, ABrokenVersionRemovedTakesItsFailureNoteWithIt) {
  TempDir repo;
  CopyModel("versions", repo.path(), "m");
  WriteFile(repo.path() / "m" / "config.pbtxt", "max_batch_size: 8\n");  // the latest version: 2
  auto engine = Open(repo.path());
  auto reason = [&]() {
    auto st = engine->GetModel("m");
    return st ? st->reason : std::string("no model");
  };
  ASSERT_EQ(reason(), "");
  // A broken version 3 appears: version 2 serves on, the failure its reason.
  std::filesystem::create_directories(repo.path() / "m" / "3");
  WriteFile(repo.path() / "m" / "3" / "model.onnx", "not a model");
  ASSERT_TRUE(engine->PollRepository().ok());
  EXPECT_TRUE(engine->ModelReady("m"));
  EXPECT_NE(reason().find("a reload failed"), std::string::npos) << reason();
  // It is taken away: the files are those that loaded, and nothing failed any more.
  std::filesystem::remove_all(repo.path() / "m" / "3");
  ASSERT_TRUE(engine->PollRepository().ok());
  EXPECT_TRUE(engine->ModelReady("m"));
  EXPECT_EQ(reason(), "");
}

TEST(EngineRepository, ReloadDoesNotDropInFlightRequests) {
  TempDir repo;
  CopyModel("fixed4", repo.path(), "m");
  // A long batching delay keeps requests queued while the reload happens.
  WriteFile(repo.path() / "m" / "config.pbtxt",
            "max_batch_size: 4\ndynamic_batching { max_queue_delay_microseconds: 300000 }\n"
            "parameters { key: \"quern.fixed_batch_sizes\" value { string_value: \"4\" } }\n");
  auto engine = Open(repo.path());
  std::vector<std::future<InferResponse>> fs;
  for (int i = 0; i < 3; ++i) {
    InferRequest req;
    req.model = "m";
    req.inputs = {{"x", Floats({1, 3}, {1, 1, static_cast<float>(i)})}};
    fs.push_back(engine->Infer(std::move(req)));
  }
  ASSERT_TRUE(engine->LoadModel("m").ok());
  for (int i = 0; i < 3; ++i) {
    InferResponse r = fs[i].get();
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_EQ(ToFloats(r.outputs[0].tensor)[2], 2.f * static_cast<float>(i));
  }
  EXPECT_TRUE(engine->ModelReady("m"));
  ASSERT_TRUE(engine->UnloadModel("m").ok());
  EXPECT_FALSE(engine->ModelReady("m"));
}

TEST(EngineRepository, WithoutDynamicBatchingARequestRunsAloneWithUpToMaxBatchSizeRows) {
  // Triton's meaning: max_batch_size bounds a request's rows; without
  // dynamic_batching requests are never combined, but one may hold several.
  TempDir repo;
  CopyModel("linear", repo.path(), "m");
  WriteFile(repo.path() / "m" / "config.pbtxt", "max_batch_size: 4\ninstance_group [ { count: 1 } ]\n");
  auto engine = Open(repo.path());
  auto request = [](int rows) {
    InferRequest req;
    req.model = "m";
    req.inputs = {{"x", Floats({rows, 8}, std::vector<float>(static_cast<size_t>(rows) * 8, 1.f))}};
    return req;
  };
  std::vector<std::future<InferResponse>> fs;
  for (int i = 0; i < 6; ++i) fs.push_back(engine->Infer(request(3)));
  for (auto& f : fs) {
    InferResponse r = f.get();
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_EQ(r.outputs[0].tensor.shape(), (Shape{3, 3}));
  }
  InferResponse too_many = engine->Infer(request(5)).get();
  EXPECT_EQ(too_many.status.code(), StatusCode::kInvalidArgument);
  auto stats = engine->GetStatistics("m");
  ASSERT_TRUE(stats.has_value()) << stats.error().ToString();
  ASSERT_EQ(stats->size(), 1u);
  EXPECT_EQ((*stats)[0].inference_count, 18u);
  EXPECT_EQ((*stats)[0].execution_count, 6u) << "requests are never combined";
}

TEST(EngineRepository, WarmupRunsBeforeReadyAndBadWarmupFailsTheLoad) {
  TempDir repo;
  CopyModel("linear", repo.path(), "warm");
  WriteFile(repo.path() / "warm" / "config.pbtxt",
            "max_batch_size: 4\n"
            "model_warmup [ { name: \"w\" batch_size: 2 count: 2 inputs { key: \"x\" value { data_type: TYPE_FP32 "
            "dims: [ 8 ] random_data: true } } } ]\n");
  CopyModel("linear", repo.path(), "cold");
  WriteFile(repo.path() / "cold" / "config.pbtxt",
            "max_batch_size: 4\n"
            "model_warmup [ { name: \"w\" inputs { key: \"x\" value { data_type: TYPE_FP32 dims: [ 8 ] "
            "input_data_file: \"missing.bin\" } } } ]\n");
  auto engine = Open(repo.path());
  EXPECT_TRUE(engine->ModelReady("warm"));
  auto cold = engine->GetModel("cold");
  ASSERT_TRUE(cold.has_value());
  EXPECT_EQ(cold->state, ModelState::kUnavailable);
  EXPECT_NE(cold->reason.find("missing.bin"), std::string::npos) << cold->reason;
}

TEST(EngineRepository, CancelledAndExpiredRequestsAreNeverComputed) {
  TempDir repo;
  CopyModel("linear", repo.path(), "slow_batch");
  WriteFile(repo.path() / "slow_batch" / "config.pbtxt",
            // (600 s: the cancellation below must come while the request still waits, on a busy machine too)
            "max_batch_size: 4\ndynamic_batching { max_queue_delay_microseconds: 600000000 }\n");
  auto engine = Open(repo.path());
  auto req = [] {
    InferRequest r;
    r.model = "slow_batch";
    r.inputs = {{"x", Floats({1, 8}, std::vector<float>(8, 1.f))}};
    return r;
  };
  InferRequest cancelled = req();
  cancelled.cancel = std::make_shared<CancellationToken>();
  auto token = cancelled.cancel;
  auto f1 = engine->Infer(std::move(cancelled));
  InferRequest expiring = req();
  expiring.timeout_us = 1000;  // expires long before the batching delay
  auto f2 = engine->Infer(std::move(expiring));
  token->Cancel();
  InferResponse r1 = f1.get();
  InferResponse r2 = f2.get();
  EXPECT_EQ(r1.status.code(), StatusCode::kCancelled);
  EXPECT_EQ(r2.status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(r1.telemetry.compute_start_ns, 0) << "never reached an instance";
  EXPECT_EQ(r2.telemetry.compute_start_ns, 0) << "never reached an instance";
  EXPECT_NE(r2.status.message().find("slow_batch"), std::string::npos) << r2.status.message();
}

TEST(EngineRepository, ACancelledQueuedRequestLeavesItsQueueAtOnce) {
  TempDir repo;
  CopyModel("linear", repo.path(), "slow_batch");
  // A batching delay far longer than the test waits, and room for one
  // request: the cancelled one must not wait the delay out, nor hold the
  // place of the next.
  WriteFile(repo.path() / "slow_batch" / "config.pbtxt",
            "max_batch_size: 4\ndynamic_batching { max_queue_delay_microseconds: 600000000 "
            "default_queue_policy { max_queue_size: 1 } }\n");
  auto engine = Open(repo.path());
  auto req = [] {
    InferRequest r;
    r.model = "slow_batch";
    r.inputs = {{"x", Floats({1, 8}, std::vector<float>(8, 1.f))}};
    r.cancel = std::make_shared<CancellationToken>();
    return r;
  };
  for (int round = 0; round < 3; ++round) {
    InferRequest first = req();
    auto token = first.cancel;
    auto f = engine->Infer(std::move(first));
    ASSERT_EQ(f.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout) << "waits for company";
    token->Cancel();
    ASSERT_EQ(f.wait_for(std::chrono::seconds(60)), std::future_status::ready)
        << "round " << round << ": still queued a minute after its cancellation (the delay is 10 minutes)";
    EXPECT_EQ(f.get().status.code(), StatusCode::kCancelled);
  }
  // Its place is free: the next request is queued, not refused (and leaves,
  // cancelled, the same way).
  InferRequest next = req();
  auto token = next.cancel;
  auto f = engine->Infer(std::move(next));
  ASSERT_EQ(f.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout) << "queued, not refused";
  token->Cancel();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  EXPECT_EQ(f.get().status.code(), StatusCode::kCancelled);
}

}  // namespace
}  // namespace quern

namespace quern {
namespace {

// The real PP-OCR direction classifier from the example repository, on text
// rendered upright and upside down by scripts/gen_models.py.
TEST(RealModel, TextDirectionClassifierTellsUprightFromFlipped) {
  const std::filesystem::path dir = testing::Examples();
  EngineOptions o;
  o.model_repository = (dir / "models").string();
  // The repository's detectors and classifier are backend "auto": opened on
  // ONNX Runtime unmeasured, this test is about the direction classifier.
  o.measure_runtimes = false;
  auto engine = Engine::Create(o);
  ASSERT_TRUE(engine.has_value()) << engine.error().ToString();
  ASSERT_TRUE((*engine)->ModelReady("text_direction"));
  for (const auto& [file, want] : {std::pair{"text_upright.npy", 0}, std::pair{"text_flipped.npy", 1}}) {
    auto x = ReadNpy((dir / "data" / file).string());
    ASSERT_TRUE(x.has_value()) << x.error().ToString();
    InferRequest req;
    req.model = "text_direction";
    req.inputs = {{"x", std::move(*x)}};
    InferResponse r = (*engine)->Infer(std::move(req)).get();
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    auto p = ToFloats(r.outputs.at(0).tensor);
    ASSERT_EQ(p.size(), 2u);
    EXPECT_NEAR(p[0] + p[1], 1.f, 1e-4) << "softmax output";
    EXPECT_GT(p[want], 0.9f) << file;
  }
}

TEST(CancellationTokenTest, EveryBatchWatchingATokenHearsItsCancelOnce) {
  // A token may be in two running batches at once (an ensemble's steps, a
  // request's face crops): each watch hears the cancel, once; one removed
  // hears nothing; one added after the cancel hears it at once.
  CancellationToken token;
  int a = 0, b = 0, c = 0, d = 0, e = 0;
  const int key_a = 0, key_b = 0, key_c = 0, key_d = 0, key_e = 0;
  token.AddOnCancel(&key_a, [&] { ++a; });
  token.AddOnCancel(&key_b, [&] { ++b; });
  token.AddOnCancel(&key_c, [&] { ++c; });
  token.AddOnCancel(&key_d, [&] { ++d; });
  token.AddOnCancel(&key_e, [&] { ++e; });
  token.RemoveOnCancel(&key_c);  // from the end, the middle and the start
  token.RemoveOnCancel(&key_e);
  token.RemoveOnCancel(&key_a);
  token.RemoveOnCancel(&key_a);  // again: nothing
  token.Cancel();
  token.Cancel();
  EXPECT_EQ(a, 0);
  EXPECT_EQ(b, 1);
  EXPECT_EQ(c, 0);
  EXPECT_EQ(d, 1);
  EXPECT_EQ(e, 0);
  int late = 0;
  token.AddOnCancel(&key_c, [&] { ++late; });
  EXPECT_EQ(late, 1);
}

}  // namespace
}  // namespace quern
