// instance_group: parsing (KIND_AUTO / KIND_CPU / KIND_GPU, gpus) and where
// each instance goes for a given count of GPUs and a backend that can or
// cannot use them. No GPU is needed: the machine's devices are an input.
#include "engine/instance_placement.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "backends/onnxruntime/ort_model.h"
#include "core/gpus.h"
#include "core/model_config_parser.h"

namespace quern {
namespace {

Result<ModelConfig> Parse(const std::string& groups) {
  const std::string text = "name: \"m\" backend: \"onnxruntime\" max_batch_size: 4 " + groups;
  auto proto = ParseModelConfigText(text, "m/config.pbtxt");
  if (!proto) return Err(proto.error());
  return ConvertModelConfig(*proto, "m/config.pbtxt");
}

ModelConfig MustParse(const std::string& groups) {
  auto c = Parse(groups);
  EXPECT_TRUE(c.has_value()) << c.error().message();
  return c.has_value() ? *c : ModelConfig{};
}

std::string Devices(const std::vector<InstanceDevice>& placed) {
  std::string s;
  for (const auto& d : placed) {
    if (d.gpu) {
      s.push_back('g');
      s.append(std::to_string(d.device));
      s.push_back(' ');
    } else {
      s.append("cpu ");
    }
  }
  return s;
}

GpuAvailability Gpus(int n) {
  GpuAvailability g;
  g.devices = n;
  g.auto_to_gpu = true;
  if (n == 0) g.why_no_devices = "no NVIDIA driver here";
  return g;
}

TEST(InstanceGroup, ParsesKindsCountsAndDevices) {
  ModelConfig c = MustParse(
      "instance_group [ { kind: KIND_GPU count: 2 gpus: [ 1, 0 ] }, { kind: KIND_CPU count: 3 }, { count: 1 } ]");
  ASSERT_EQ(c.instance_groups.size(), 3u);
  EXPECT_EQ(c.instance_groups[0].kind, InstanceGroup::Kind::kGpu);
  EXPECT_EQ(c.instance_groups[0].count, 2);
  EXPECT_EQ(c.instance_groups[0].gpus, (std::vector<int>{1, 0}));
  EXPECT_EQ(c.instance_groups[1].kind, InstanceGroup::Kind::kCpu);
  EXPECT_EQ(c.instance_groups[2].kind, InstanceGroup::Kind::kAuto);  // Triton's default kind
  EXPECT_EQ(c.instance_count, 2 * 2 + 3 + 1);
}

TEST(InstanceGroup, RefusesWhatCannotBePlacedWithTheGroupInTheMessage) {
  struct Case {
    const char* groups;
    const char* says;
  };
  for (const Case& k : {
           Case{"instance_group [ { kind: KIND_CPU }, { kind: KIND_GPU gpus: [ -1 ] } ]",
                "instance_group 1: gpus lists device -1"},
           Case{"instance_group [ { kind: KIND_GPU gpus: [ 0, 64 ] } ]", "device 64; a device is a CUDA ordinal"},
           Case{"instance_group [ { kind: KIND_GPU gpus: [ 2, 2 ] } ]", "gpus lists device 2 twice"},
           Case{"instance_group [ { kind: KIND_CPU gpus: [ 0 ] } ]", "KIND_CPU lists gpus"},
           Case{"instance_group [ { kind: KIND_GPU count: 200 gpus: [ 0, 1 ] } ]", "above the limit of 256"},
       }) {
    auto c = Parse(k.groups);
    ASSERT_FALSE(c.has_value()) << k.groups;
    EXPECT_NE(c.error().message().find(k.says), std::string::npos) << c.error().message();
    EXPECT_NE(c.error().message().find("m/config.pbtxt"), std::string::npos) << c.error().message();
  }
}

TEST(InstanceGroup, ReadsAsTritonDoesWhatItAccepts) {
  // KIND_MODEL: the model places its own work; its instances are CPU ones.
  // A count below 1 means 1.
  ModelConfig c =
      MustParse("instance_group [ { kind: KIND_MODEL count: 2 gpus: [ 0 ] }, { kind: KIND_GPU count: -3 } ]");
  ASSERT_EQ(c.instance_groups.size(), 2u);
  EXPECT_EQ(c.instance_groups[0].kind, InstanceGroup::Kind::kCpu);
  EXPECT_TRUE(c.instance_groups[0].gpus.empty());
  EXPECT_EQ(c.instance_groups[1].count, 1);
  auto again = ConvertModelConfig(ToProto(c), "written");  // and what is written reads back
  ASSERT_TRUE(again.has_value()) << again.error().message();
  EXPECT_EQ(again->instance_count, 3);
}

TEST(InstanceGroup, GpuGroupsPutCountInstancesOnEachListedOrEveryDevice) {
  ModelConfig c = MustParse("instance_group [ { kind: KIND_GPU count: 2 gpus: [ 1 ] }, { kind: KIND_CPU count: 1 } ]");
  auto placed = PlaceInstances(c, Gpus(2));
  ASSERT_TRUE(placed.has_value()) << placed.error().message();
  EXPECT_EQ(Devices(*placed), "g1 g1 cpu ");
  EXPECT_EQ(c.instance_count, 3);
  EXPECT_EQ(CpuInstances(c), 1);

  ModelConfig every = MustParse("instance_group [ { kind: KIND_GPU count: 2 } ]");
  placed = PlaceInstances(every, Gpus(3));
  ASSERT_TRUE(placed.has_value()) << placed.error().message();
  EXPECT_EQ(Devices(*placed), "g0 g0 g1 g1 g2 g2 ");
  ASSERT_EQ(every.instance_groups.size(), 1u);
  EXPECT_EQ(every.instance_groups[0].gpus, (std::vector<int>{0, 1, 2}));  // as placed
  EXPECT_EQ(CpuInstances(every), 0);
}

TEST(InstanceGroup, AutoKindAndTheAutomaticLayoutGoToGpusOnlyWhenTheBackendRunsThere) {
  ModelConfig c = MustParse("instance_group [ { count: 2 } ]");
  auto placed = PlaceInstances(c, Gpus(2));
  ASSERT_TRUE(placed.has_value());
  EXPECT_EQ(Devices(*placed), "g0 g0 g1 g1 ");
  EXPECT_EQ(c.instance_groups[0].kind, InstanceGroup::Kind::kGpu);

  c = MustParse("instance_group [ { count: 2 } ]");
  placed = PlaceInstances(c, Gpus(0));
  ASSERT_TRUE(placed.has_value());
  EXPECT_EQ(Devices(*placed), "cpu cpu ");
  EXPECT_EQ(c.instance_groups[0].kind, InstanceGroup::Kind::kCpu);

  GpuAvailability cpu_backend = Gpus(2);  // a GPU here, a backend that cannot use it
  cpu_backend.why_no_backend = "it runs models on the CPU only";
  c = MustParse("instance_group [ { count: 2 } ]");
  placed = PlaceInstances(c, cpu_backend);
  ASSERT_TRUE(placed.has_value());
  EXPECT_EQ(Devices(*placed), "cpu cpu ");

  // A Python model: told its device. KIND_AUTO takes it to the GPU (as
  // Triton does); the automatic layout keeps its per-core processes.
  GpuAvailability told_only = Gpus(1);
  told_only.auto_to_gpu = false;
  c = MustParse("instance_group [ { count: 2 } ]");
  placed = PlaceInstances(c, told_only);
  ASSERT_TRUE(placed.has_value());
  EXPECT_EQ(Devices(*placed), "g0 g0 ");
  ModelConfig bare = MustParse("");
  placed = PlaceInstances(bare, told_only);
  ASSERT_TRUE(placed.has_value());
  EXPECT_TRUE(placed->empty());

  ModelConfig automatic = MustParse("");
  ASSERT_EQ(automatic.instance_count, 0);
  placed = PlaceInstances(automatic, Gpus(0));
  ASSERT_TRUE(placed.has_value());
  EXPECT_TRUE(placed->empty());  // left to the CPU's automatic layout
  placed = PlaceInstances(automatic, Gpus(2));
  ASSERT_TRUE(placed.has_value());
  EXPECT_EQ(Devices(*placed), "g0 g1 ");  // one instance per GPU, as Triton does
}

TEST(InstanceGroup, GpuGroupsFailToPlaceWithTheReason) {
  ModelConfig c = MustParse("instance_group [ { kind: KIND_CPU }, { kind: KIND_GPU } ]");
  auto placed = PlaceInstances(c, Gpus(0));
  ASSERT_FALSE(placed.has_value());
  EXPECT_EQ(placed.error().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(placed.error().message().find("model 'm': instance_group 1 asks for KIND_GPU, but no NVIDIA driver here"),
            std::string::npos)
      << placed.error().message();

  GpuAvailability cpu_backend = Gpus(1);
  cpu_backend.why_no_backend = "it runs models on the CPU only";
  c = MustParse("instance_group [ { kind: KIND_GPU } ]");
  placed = PlaceInstances(c, cpu_backend);
  ASSERT_FALSE(placed.has_value());
  EXPECT_NE(placed.error().message().find("backend 'onnxruntime' cannot run on one here: it runs models on the CPU"),
            std::string::npos)
      << placed.error().message();

  c = MustParse("instance_group [ { kind: KIND_GPU gpus: [ 0, 2 ] } ]");
  placed = PlaceInstances(c, Gpus(2));
  ASSERT_FALSE(placed.has_value());
  EXPECT_NE(placed.error().message().find("lists GPU 2, but CUDA sees 2 (devices 0 to 1)"), std::string::npos)
      << placed.error().message();

  // Every visible device of a big machine times the count: bounded at load.
  c = MustParse("instance_group [ { kind: KIND_GPU count: 100 } ]");
  placed = PlaceInstances(c, Gpus(8));
  ASSERT_FALSE(placed.has_value());
  EXPECT_NE(placed.error().message().find("more than 256 instances"), std::string::npos) << placed.error().message();
}

TEST(InstanceGroup, WrittenBackAsPlaced) {
  ModelConfig c = MustParse("instance_group [ { kind: KIND_GPU count: 2 }, { count: 1 } ]");
  ASSERT_TRUE(PlaceInstances(c, Gpus(2)).has_value());
  const inference::ModelConfig p = ToProto(c);
  ASSERT_EQ(p.instance_group_size(), 2);
  EXPECT_EQ(p.instance_group(0).kind(), inference::ModelInstanceGroup::KIND_GPU);
  EXPECT_EQ(p.instance_group(0).count(), 2);
  EXPECT_EQ(p.instance_group(0).gpus_size(), 2);
  EXPECT_EQ(p.instance_group(1).kind(), inference::ModelInstanceGroup::KIND_GPU);  // KIND_AUTO, placed
  // And the text reads back to the same placement.
  auto again = ConvertModelConfig(p, "written");
  ASSERT_TRUE(again.has_value()) << again.error().message();
  auto placed = PlaceInstances(*again, Gpus(2));
  ASSERT_TRUE(placed.has_value());
  EXPECT_EQ(Devices(*placed), "g0 g0 g1 g1 g0 g1 ");
}

// Without a GPU, a session asked onto one fails to load with ONNX Runtime's
// reason (its provider library missing, or CUDA's driver), naming the model:
// no crash, no session quietly left on the CPU.
TEST(OrtCuda, WithoutAGpuASessionOnOneFailsToLoadWithTheReason) {
  if (VisibleGpus().count > 0) GTEST_SKIP() << "this machine has a GPU (test_gpu.py runs models on it)";
  EXPECT_FALSE(VisibleGpus().why_none.empty());
  OrtSessionOptions options;
  options.gpu_device = 0;
  OrtModel model("on_gpu", std::string(QUERN_TEST_MODELS_DIR) + "/linear/1/model.onnx", options, {});
  Status st = model.Load();
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.message();
  EXPECT_NE(st.message().find("model 'on_gpu': ONNX Runtime's CUDA execution provider on GPU 0 cannot be used: "),
            std::string::npos)
      << st.message();
  // The provider installed (QUERN_WITH_CUDA=1): it is CUDA's driver that is missing.
  if (OrtWhyNoCuda().empty()) {
    EXPECT_NE(st.message().find("libcuda.so.1"), std::string::npos) << st.message();
  }
  std::printf("%s\n", st.message().c_str());
}

}  // namespace
}  // namespace quern
