// ONNX Runtime's sessions allocate what their runs need from Quern's
// BlockCache (backends/onnxruntime/ort_internal.h's OrtRunMemory): a run's
// large output is a block of the cache while it is held, and kept for the
// next run once it is let go.
#include <gtest/gtest.h>

#include <vector>

#include "backends/onnxruntime/ort_internal.h"
#include "backends/onnxruntime/ort_model.h"
#include "core/block_cache.h"
#include "test_util.h"

namespace quern {
namespace {

TEST(OrtRunMemory, ARunsLargeOutputIsABlockOfTheCache) {
  OrtModel model("linear", testing::TestModels() / "linear" / "1" / "model.onnx", OrtSessionOptions{}, {});
  ASSERT_TRUE(model.Load().ok());
  // 40000 rows of 8 in, 3 out: a 480 KB output, over the cache's 256 KiB.
  constexpr int64_t kLargeRows = 40000;
  std::vector<float> x(kLargeRows * 8, 0.5f);
  std::vector<NamedTensor> inputs{{"x", Tensor::From<float>(DataType::kFp32, {kLargeRows, 8}, x)}};
  const BlockCache::Use before = OrtRunMemory().InUse();
  std::vector<NamedTensor> outputs;
  Status st = model.Execute(inputs, kLargeRows, outputs);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_EQ(outputs.size(), 1u);
  EXPECT_EQ(outputs[0].tensor.byte_size(), size_t{kLargeRows} * 3 * sizeof(float));
  const BlockCache::Use held = OrtRunMemory().InUse();
  EXPECT_GE(held.in_use_bytes, before.in_use_bytes + OrtRunMemory().ClassBytes(kLargeRows * 3 * sizeof(float)))
      << "the output is not in a block of the cache: sessions do not allocate from it";
  outputs.clear();
  const BlockCache::Use after = OrtRunMemory().InUse();
  EXPECT_EQ(after.in_use_bytes, before.in_use_bytes);
  EXPECT_GT(after.kept_bytes, 0u);
}

}  // namespace
}  // namespace quern
