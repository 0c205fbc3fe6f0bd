// Batch assembly on its own: rows gathered with zero padding, split back
// as views, and the fixed batch size chosen for a number of items.
#include "engine/batch_assembly.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "test_util.h"

namespace quern {
namespace {

using testing::Floats;
using testing::ToFloats;

TEST(BatchAssembly, RowsAreGatheredInOrderAndPaddedWithZeros) {
  const Tensor a = Floats({1, 2}, {1, 2});
  const Tensor b = Floats({2, 2}, {3, 4, 5, 6});
  const Tensor batch = ConcatenateRows({&a, &b}, 4);
  EXPECT_EQ(batch.shape(), (Shape{4, 2}));
  EXPECT_EQ(ToFloats(batch), (std::vector<float>{1, 2, 3, 4, 5, 6, 0, 0}));

  const Tensor s1 = Tensor::FromStrings({1, 1}, std::vector<std::string>{"mill"});
  const Tensor s2 = Tensor::FromStrings({1, 1}, std::vector<std::string>{"stone"});
  const Tensor strings = ConcatenateRows({&s1, &s2}, 3);
  auto got = strings.Strings();
  ASSERT_TRUE(got.has_value()) << got.error().ToString();
  ASSERT_EQ(got->size(), 3u);
  EXPECT_EQ((*got)[0], "mill");
  EXPECT_EQ((*got)[1], "stone");
  EXPECT_EQ((*got)[2], "") << "a padding row of BYTES is an empty string";
}

TEST(BatchAssembly, RowsAreSplitBackAsViews) {
  const Tensor batch = Floats({3, 2}, {1, 2, 3, 4, 5, 6});
  auto middle = SliceRows(batch, 1, 2);
  ASSERT_TRUE(middle.has_value());
  EXPECT_EQ(middle->shape(), (Shape{2, 2}));
  EXPECT_EQ(ToFloats(*middle), (std::vector<float>{3, 4, 5, 6}));
  EXPECT_EQ(static_cast<const void*>(middle->data()), static_cast<const void*>(batch.data() + 2 * sizeof(float)))
      << "no copy";
}

TEST(BatchAssembly, TheSmallestFixedSizeThatHoldsTheItems) {
  EXPECT_EQ(PaddedBatchSize({4, 8, 2}, 3), 4);
  EXPECT_EQ(PaddedBatchSize({4, 8, 2}, 8), 8);
  EXPECT_EQ(PaddedBatchSize({4, 8, 2}, 9), 9) << "none holds them: no padding";
  EXPECT_EQ(PaddedBatchSize({}, 5), 5);
}

}  // namespace
}  // namespace quern
