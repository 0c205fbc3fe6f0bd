#include <gtest/gtest.h>

#include <utility>

#include "core/model_config_parser.h"

namespace quern {
namespace {

// A config.pbtxt as Triton users write them for ONNX models.
constexpr const char* kTritonConfig = R"pb(
  name: "densenet_onnx"
  platform: "onnxruntime_onnx"
  max_batch_size: 8
  version_policy: { latest: { num_versions: 2 } } input
  [ {
    name: "data_0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
    reshape: { shape: [ 3, 224, 224 ] }
  }] output
  [ {
    name: "fc6_1"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    label_filename: "densenet_labels.txt"
  }] instance_group
  [ { count: 2, kind: KIND_CPU }]
  dynamic_batching {
    preferred_batch_size: [ 4, 8 ]
    max_queue_delay_microseconds: 100
    preserve_ordering: true
    priority_levels: 3
    default_priority_level: 2
    default_queue_policy {
      timeout_action: DELAY
      default_timeout_microseconds: 5000
      allow_timeout_override: true
      max_queue_size: 16
    }
    priority_queue_policy {
      key: 1
      value { max_queue_size: 4 }
    }
  }
  optimization { graph: { level: 1 } } model_warmup
  [ {
    name: "zeros"
    batch_size: 2
    inputs {
      key: "data_0"
      value: {
        data_type: TYPE_FP32
        dims: [ 3, 224, 224 ]
        zero_data: true
      }
    }
  }]
  parameters {
    key: "intra_op_thread_count"
    value: { string_value: "1" }
  }
  parameters {
    key: "quern.fixed_batch_sizes"
    value: { string_value: "4, 8" }
  }
)pb";

TEST(ModelConfig, ParsesATritonConfig) {
  auto proto = ParseModelConfigText(kTritonConfig, "densenet/config.pbtxt");
  ASSERT_TRUE(proto.has_value()) << proto.error().ToString();
  auto c = ConvertModelConfig(*proto, "densenet/config.pbtxt");
  ASSERT_TRUE(c.has_value()) << c.error().ToString();
  EXPECT_EQ(c->name, "densenet_onnx");
  EXPECT_EQ(c->backend, "onnxruntime");
  EXPECT_EQ(c->max_batch_size, 8);
  ASSERT_EQ(c->inputs.size(), 1u);
  EXPECT_EQ(c->inputs[0].dtype, DataType::kFp32);
  EXPECT_EQ(c->inputs[0].dims, (Shape{3, 224, 224}));
  ASSERT_TRUE(c->inputs[0].reshape.has_value());
  EXPECT_EQ(c->outputs[0].label_filename, "densenet_labels.txt");
  EXPECT_EQ(c->instance_count, 2);
  ASSERT_TRUE(c->batching.has_value());
  EXPECT_EQ(c->batching->preferred_batch_sizes, (std::vector<int>{4, 8}));
  EXPECT_EQ(c->batching->max_queue_delay_us, 100u);
  EXPECT_TRUE(c->batching->preserve_ordering);
  EXPECT_EQ(c->batching->priority_levels, 3u);
  EXPECT_EQ(c->batching->default_priority_level, 2u);
  EXPECT_EQ(c->batching->default_queue_policy.timeout_action, QueuePolicy::TimeoutAction::kDelay);
  EXPECT_EQ(c->batching->default_queue_policy.default_timeout_us, 5000u);
  EXPECT_TRUE(c->batching->default_queue_policy.allow_timeout_override);
  EXPECT_EQ(c->batching->default_queue_policy.max_queue_size, 16u);
  EXPECT_EQ(c->batching->priority_queue_policy.at(1).max_queue_size, 4u);
  EXPECT_EQ(c->graph_optimization_level, 1);
  ASSERT_EQ(c->warmup.size(), 1u);
  EXPECT_EQ(c->warmup[0].batch_size, 2u);
  EXPECT_EQ(c->warmup[0].inputs.at("data_0").dims, (Shape{3, 224, 224}));
  EXPECT_EQ(c->parameters.at("intra_op_thread_count"), "1");
  EXPECT_EQ(c->fixed_batch_sizes, (std::vector<int>{4, 8}));
  EXPECT_TRUE(ValidateModelConfig(*c).ok()) << ValidateModelConfig(*c).ToString();

  VersionPolicy vp = ConvertVersionPolicy(*proto);
  EXPECT_EQ(vp.Select({1, 5, 3}), (std::vector<int64_t>{3, 5}));
}

// As Triton writes a configuration as JSON: every field (max_batch_size 0 included), 64-bit
// integers as numbers; and it reads back to the same configuration.
TEST(ModelConfig, TritonJsonPrintsEveryFieldAndIntegersAsNumbers) {
  auto proto = ParseModelConfigText(kTritonConfig, "densenet/config.pbtxt");
  ASSERT_TRUE(proto.has_value());
  auto c = ConvertModelConfig(*proto, "densenet/config.pbtxt");
  ASSERT_TRUE(c.has_value());
  auto json = ToTritonJson(*c);
  ASSERT_TRUE(json.has_value()) << json.error().ToString();
  EXPECT_NE(json->find("\"dims\":[3,224,224]"), std::string::npos) << *json;
  EXPECT_EQ(json->find("\"3\""), std::string::npos) << "no integer as a string: " << *json;
  EXPECT_NE(json->find("\"max_queue_delay_microseconds\":100"), std::string::npos) << *json;
  auto back = ParseModelConfigJson(*json, "back");
  ASSERT_TRUE(back.has_value()) << back.error().ToString();
  auto again = ConvertModelConfig(*back, "back");
  ASSERT_TRUE(again.has_value()) << again.error().ToString();
  EXPECT_EQ(again->inputs[0].dims, c->inputs[0].dims);
  EXPECT_EQ(again->batching->preferred_batch_sizes, c->batching->preferred_batch_sizes);

  ModelConfig none;
  none.name = "m";
  none.backend = "python";
  auto plain = ToTritonJson(none);
  ASSERT_TRUE(plain.has_value());
  EXPECT_NE(plain->find("\"max_batch_size\":0"), std::string::npos) << *plain;
  EXPECT_NE(plain->find("\"input\":[]"), std::string::npos) << *plain;
  EXPECT_FALSE(ParseModelConfigJson("{\"no_such_field\": 1}", "x").has_value());

  // A map of names keeps its values: a step input named "shape" fed from the ensemble tensor "0".
  auto ensemble = ParseModelConfigText(
      "name: \"e\"\nplatform: \"ensemble\"\ninput [ { name: \"0\" data_type: TYPE_FP32 dims: [ 2 ] } ]\n"
      "output [ { name: \"y\" data_type: TYPE_FP32 dims: [ 2 ] } ]\n"
      "ensemble_scheduling { step [ { model_name: \"m\" model_version: -1 input_map { key: \"shape\" value: \"0\" } "
      "output_map { key: \"out\" value: \"y\" } } ] }\n",
      "e/config.pbtxt");
  ASSERT_TRUE(ensemble.has_value()) << ensemble.error().ToString();
  auto e = ConvertModelConfig(*ensemble, "e/config.pbtxt");
  ASSERT_TRUE(e.has_value()) << e.error().ToString();
  auto ejson = ToTritonJson(*e);
  ASSERT_TRUE(ejson.has_value());
  EXPECT_NE(ejson->find("\"shape\":\"0\""), std::string::npos) << *ejson;
  EXPECT_NE(ejson->find("\"model_version\":-1"), std::string::npos) << *ejson;
  EXPECT_TRUE(ParseModelConfigJson(*ejson, "e").has_value());
}

// A Python model may be decoupled (model_transaction_policy), and the
// configuration says so back; a backend that answers once, an ensemble, or
// an order to preserve are refused, naming why.
TEST(ModelConfig, OnlyAPythonModelMayBeDecoupled) {
  auto proto =
      ParseModelConfigText("backend: \"python\"\nmodel_transaction_policy { decoupled: true }\n", "d/config.pbtxt");
  ASSERT_TRUE(proto.has_value());
  auto c = ConvertModelConfig(*proto, "d/config.pbtxt");
  ASSERT_TRUE(c.has_value()) << c.error().ToString();
  EXPECT_TRUE(c->decoupled);
  EXPECT_TRUE(ToProto(*c).model_transaction_policy().decoupled());
  const std::pair<const char*, const char*> refused[] = {
      {"backend: \"onnxruntime\"\nmodel_transaction_policy { decoupled: true }\n", "answers each request once"},
      {"backend: \"python\"\nmax_batch_size: 4\ndynamic_batching { preserve_ordering: true }\n"
       "model_transaction_policy { decoupled: true }\n",
       "preserve_ordering"},
  };
  // An ensemble may say so (its steps decide: EnsembleModel).
  auto ensemble = ParseModelConfigText(
      "platform: \"ensemble\"\ninput [ { name: \"x\" data_type: TYPE_FP32 dims: [ 1 ] } ]\n"
      "output [ { name: \"y\" data_type: TYPE_FP32 dims: [ 1 ] } ]\n"
      "ensemble_scheduling { step [ { model_name: \"m\" model_version: -1 input_map { key: \"a\" value: \"x\" } "
      "output_map { key: \"b\" value: \"y\" } } ] }\nmodel_transaction_policy { decoupled: true }\n",
      "e/config.pbtxt");
  ASSERT_TRUE(ensemble.has_value());
  auto e = ConvertModelConfig(*ensemble, "e/config.pbtxt");
  ASSERT_TRUE(e.has_value()) << e.error().ToString();
  EXPECT_TRUE(e->decoupled);
  for (const auto& [text, why] : refused) {
    auto p = ParseModelConfigText(text, "d/config.pbtxt");
    ASSERT_TRUE(p.has_value()) << text;
    auto r = ConvertModelConfig(*p, "d/config.pbtxt");
    ASSERT_FALSE(r.has_value()) << text;
    EXPECT_NE(r.error().message().find(why), std::string::npos) << r.error().ToString();
  }
}

// An ONNX model whose configuration names neither backend nor platform runs
// on the runtime measured fastest (backend "auto"); naming ONNX Runtime by
// backend or platform pins it.
TEST(ModelConfig, AnUnnamedRuntimeIsMeasuredAndANamedOnePinned) {
  const std::pair<const char*, const char*> cases[] = {
      {"max_batch_size: 4\n", "auto"},
      {"backend: \"auto\"\n", "auto"},
      {"platform: \"onnxruntime_onnx\"\n", "onnxruntime"},
      {"backend: \"onnxruntime\"\n", "onnxruntime"},
      {"backend: \"openvino\"\n", "openvino"},
      {"platform: \"pytorch_libtorch\"\n", "pytorch"},
  };
  for (const auto& [text, backend] : cases) {
    auto proto = ParseModelConfigText(text, "m/config.pbtxt");
    ASSERT_TRUE(proto.has_value()) << proto.error().ToString();
    auto c = ConvertModelConfig(*proto, "m/config.pbtxt");
    ASSERT_TRUE(c.has_value()) << text << c.error().ToString();
    EXPECT_EQ(c->backend, backend) << text;
  }
}

TEST(ModelConfig, SyntaxErrorNamesFileLineAndColumn) {
  auto r = ParseModelConfigText("name: \"m\"\nmax_batch_size: 4\ninput [ { name: \"x\" data_type: TYPE_FP33 } ]\n",
                                "m/config.pbtxt");
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.error().message().rfind("m/config.pbtxt:3:", 0), 0u) << r.error().message();
  EXPECT_NE(r.error().message().find("TYPE_FP33"), std::string::npos) << r.error().message();
}

TEST(ModelConfig, UnknownFieldIsNamed) {
  auto r = ParseModelConfigText("name: \"m\"\nmax_batch_sise: 4\n", "m/config.pbtxt");
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message().find("m/config.pbtxt:2:"), std::string::npos) << r.error().message();
  EXPECT_NE(r.error().message().find("max_batch_sise"), std::string::npos) << r.error().message();
}

TEST(ModelConfig, UnsupportedBackendIsRejected) {
  auto p = ParseModelConfigText("platform: \"tensorrt_plan\"", "f");
  ASSERT_TRUE(p.has_value());
  auto c = ConvertModelConfig(*p, "f");
  ASSERT_FALSE(c.has_value());
  EXPECT_NE(c.error().message().find("tensorrt_plan"), std::string::npos);
}

TEST(ModelConfig, PytorchModelsByPlatformOrBackend) {
  for (const char* text : {"platform: \"pytorch_libtorch\"", "backend: \"pytorch\"",
                           "platform: \"pytorch_libtorch\" backend: \"pytorch\""}) {
    auto p = ParseModelConfigText(text, "f");
    ASSERT_TRUE(p.has_value());
    auto c = ConvertModelConfig(*p, "f");
    ASSERT_TRUE(c.has_value()) << text << ": " << c.error().ToString();
    EXPECT_EQ(c->backend, "pytorch") << text;
    EXPECT_EQ(c->platform, "pytorch_libtorch") << text;
  }
  auto p = ParseModelConfigText("platform: \"onnxruntime_onnx\" backend: \"pytorch\"", "f");
  ASSERT_TRUE(p.has_value());
  auto c = ConvertModelConfig(*p, "f");
  ASSERT_FALSE(c.has_value());
  EXPECT_NE(c.error().message().find("not supported"), std::string::npos) << c.error().message();
}

TEST(ModelConfig, BadFixedBatchSizesParameter) {
  auto p = ParseModelConfigText(
      "max_batch_size: 4 parameters { key: \"quern.fixed_batch_sizes\" value { string_value: \"2,x\" } }", "f");
  ASSERT_TRUE(p.has_value());
  auto c = ConvertModelConfig(*p, "f");
  ASSERT_FALSE(c.has_value());
  EXPECT_NE(c.error().message().find("quern.fixed_batch_sizes"), std::string::npos) << c.error().message();
}

TEST(ModelConfig, WideInstanceParameter) {
  auto convert = [](const std::string& value) {
    auto p = ParseModelConfigText(
        "max_batch_size: 4 parameters { key: \"quern.wide_instance\" value { string_value: \"" + value + "\" } }",
        "m/config.pbtxt");
    EXPECT_TRUE(p.has_value());
    return ConvertModelConfig(*p, "m/config.pbtxt");
  };
  auto off = convert("off");
  ASSERT_TRUE(off.has_value()) << off.error().ToString();
  EXPECT_EQ(off->wide_instance, std::optional<bool>(false));
  auto on = convert("true");
  ASSERT_TRUE(on.has_value()) << on.error().ToString();
  EXPECT_EQ(on->wide_instance, std::optional<bool>(true));
  auto none = ConvertModelConfig(*ParseModelConfigText("max_batch_size: 4", "f"), "f");
  ASSERT_TRUE(none.has_value());
  EXPECT_FALSE(none->wide_instance.has_value());
  auto bad = convert("wide");
  ASSERT_FALSE(bad.has_value());
  const std::string msg = bad.error().message();
  EXPECT_NE(msg.find("m/config.pbtxt"), std::string::npos) << msg;
  EXPECT_NE(msg.find("quern.wide_instance"), std::string::npos) << msg;
  EXPECT_NE(msg.find("\"wide\""), std::string::npos) << msg;
}

TEST(ModelConfig, LatencyTargetParameter) {
  auto convert = [](const std::string& value) {
    auto p = ParseModelConfigText(
        "max_batch_size: 4 parameters { key: \"quern.latency_target_ms\" value { string_value: \"" + value + "\" } }",
        "m/config.pbtxt");
    EXPECT_TRUE(p.has_value());
    return ConvertModelConfig(*p, "m/config.pbtxt");
  };
  auto set = convert("40");
  ASSERT_TRUE(set.has_value()) << set.error().ToString();
  EXPECT_EQ(set->latency_target_ms, 40);
  EXPECT_EQ(ConvertModelConfig(*ParseModelConfigText("max_batch_size: 4", "f"), "f")->latency_target_ms, 0);
  for (const std::string bad : {"-1", "4e1", "3600001", ""}) {
    auto c = convert(bad);
    ASSERT_FALSE(c.has_value()) << bad;
    const std::string msg = c.error().message();
    EXPECT_NE(
        msg.find("m/config.pbtxt: parameter quern.latency_target_ms must be milliseconds in [0, 3600000], got \"" +
                 bad + "\""),
        std::string::npos)
        << msg;
  }
}

TEST(ModelConfig, MemoryBudgetParameter) {
  auto convert = [](const std::string& value) {
    auto p = ParseModelConfigText(
        "max_batch_size: 4 parameters { key: \"quern.memory_budget_mb\" value { string_value: \"" + value + "\" } }",
        "m/config.pbtxt");
    EXPECT_TRUE(p.has_value());
    return ConvertModelConfig(*p, "m/config.pbtxt");
  };
  auto set = convert("256");
  ASSERT_TRUE(set.has_value()) << set.error().ToString();
  EXPECT_EQ(set->memory_budget_mb, 256);
  EXPECT_EQ(convert("0")->memory_budget_mb, 0) << "no bound, over the engine's default";
  EXPECT_FALSE(ConvertModelConfig(*ParseModelConfigText("max_batch_size: 4", "f"), "f")->memory_budget_mb.has_value());
  for (const std::string bad : {"-1", "1e3", "256MB", "1073741825", ""}) {
    auto c = convert(bad);
    ASSERT_FALSE(c.has_value()) << bad;
    const std::string msg = c.error().message();
    EXPECT_NE(msg.find("m/config.pbtxt: parameter quern.memory_budget_mb must be MiB in [0, 1073741824] (0: no "
                       "bound), got \"" +
                       bad + "\""),
              std::string::npos)
        << msg;
  }
}

TEST(ModelConfig, BatchSizeTuningParameter) {
  auto convert = [](const std::string& value) {
    auto p = ParseModelConfigText(
        "max_batch_size: 4 parameters { key: \"quern.batch_size_tuning\" value { string_value: \"" + value + "\" } }",
        "m/config.pbtxt");
    EXPECT_TRUE(p.has_value());
    return ConvertModelConfig(*p, "m/config.pbtxt");
  };
  auto off = convert("off");
  ASSERT_TRUE(off.has_value()) << off.error().ToString();
  EXPECT_EQ(off->batch_size_tuning, std::optional<bool>(false));
  auto on = convert("on");
  ASSERT_TRUE(on.has_value()) << on.error().ToString();
  EXPECT_EQ(on->batch_size_tuning, std::optional<bool>(true));
  auto none = ConvertModelConfig(*ParseModelConfigText("max_batch_size: 4", "f"), "f");
  ASSERT_TRUE(none.has_value());
  EXPECT_FALSE(none->batch_size_tuning.has_value());
  auto bad = convert("sometimes");
  ASSERT_FALSE(bad.has_value());
  const std::string msg = bad.error().message();
  EXPECT_NE(msg.find("m/config.pbtxt"), std::string::npos) << msg;
  EXPECT_NE(msg.find("quern.batch_size_tuning"), std::string::npos) << msg;
  EXPECT_NE(msg.find("\"sometimes\""), std::string::npos) << msg;
}

ModelConfig Minimal() {
  ModelConfig c;
  c.name = "m";
  c.max_batch_size = 4;
  c.inputs = {{.name = "x", .dtype = DataType::kFp32, .dims = {3}}};
  c.outputs = {{.name = "y", .dtype = DataType::kFp32, .dims = {3}}};
  return c;
}

TEST(ModelConfig, ValidationNamesTheProblem) {
  ModelConfig c = Minimal();
  EXPECT_TRUE(ValidateModelConfig(c).ok());

  c = Minimal();
  c.batching = BatchingConfig{.preferred_batch_sizes = {8}};
  EXPECT_NE(ValidateModelConfig(c).message().find("preferred_batch_size 8"), std::string::npos);

  c = Minimal();
  c.inputs.push_back(c.inputs[0]);
  EXPECT_NE(ValidateModelConfig(c).message().find("declared twice"), std::string::npos);

  c = Minimal();
  c.max_batch_size = 0;
  c.batching = BatchingConfig{};
  EXPECT_NE(ValidateModelConfig(c).message().find("needs max_batch_size > 0"), std::string::npos);

  c = Minimal();
  c.fixed_batch_sizes = {2};
  EXPECT_NE(ValidateModelConfig(c).message().find("must equal max_batch_size"), std::string::npos);

  c = Minimal();
  c.inputs[0].reshape = Shape{2, 2};
  EXPECT_NE(ValidateModelConfig(c).message().find("reshape"), std::string::npos);

  c = Minimal();
  c.batching = BatchingConfig{.priority_levels = 2, .default_priority_level = 3};
  EXPECT_NE(ValidateModelConfig(c).message().find("default_priority_level 3"), std::string::npos);
}

TEST(ModelConfig, VersionPolicies) {
  VersionPolicy all{.kind = VersionPolicy::Kind::kAll};
  EXPECT_EQ(all.Select({3, 1, 2}), (std::vector<int64_t>{1, 2, 3}));
  VersionPolicy specific{.kind = VersionPolicy::Kind::kSpecific, .versions = {2, 9}};
  EXPECT_EQ(specific.Select({3, 1, 2}), (std::vector<int64_t>{2}));
  VersionPolicy latest;
  EXPECT_EQ(latest.Select({3, 1, 2}), (std::vector<int64_t>{3}));
}

TEST(Tensor, BytesRoundTripAndValidation) {
  Tensor t = Tensor::FromStrings({3}, {"a", "", "hello"});
  auto s = t.Strings();
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ((*s)[0], "a");
  EXPECT_EQ((*s)[1], "");
  EXPECT_EQ((*s)[2], "hello");
  EXPECT_TRUE(t.Validate().ok());
  Tensor bad = Tensor::Borrow(DataType::kBytes, {4}, t.data(), t.byte_size());
  EXPECT_EQ(bad.Validate().code(), StatusCode::kInvalidArgument);
  std::vector<float> v{1, 2, 3};
  Tensor f = Tensor::From<float>(DataType::kFp32, {2}, v);
  EXPECT_NE(f.Validate().message().find("needs 8 bytes, got 12"), std::string::npos) << f.Validate().message();
  EXPECT_EQ(DataTypeFromName("TYPE_STRING"), DataType::kBytes);
  EXPECT_EQ(DataTypeFromName("FP16"), DataType::kFp16);
}

}  // namespace
}  // namespace quern
