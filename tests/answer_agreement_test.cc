// CompareVisionAnswers: a detector's boxes compared between two runtimes' outputs (backend "auto"'s
// check by meaning). The outputs are written here in YOLOv8's layout, box by box; the expected
// overlaps are worked out by hand in the comments.
#include "pipeline/answer_agreement.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/model_config_parser.h"
#include "test_util.h"

namespace quern {
namespace {

// A 64x64 detector of two classes (cat, dog), output [1, 6, 4]: cx, cy, w, h, then the classes'
// probabilities, for 4 cells.
constexpr char kDetector[] = R"(
name: "det"
max_batch_size: 1
input [ { name: "images" data_type: TYPE_FP32 dims: [ 3, 64, 64 ] } ]
output [ { name: "output0" data_type: TYPE_FP32 dims: [ 6, 4 ] label_filename: "labels.txt" } ]
parameters { key: "quern.task" value { string_value: "detection" } }
parameters { key: "quern.detection.format" value { string_value: "yolov8" } }
)";

struct Box {
  float cx, cy, w, h;
  float cat, dog;
};

// The output tensor of up to 4 boxes (the other cells empty).
std::vector<NamedTensor> Outputs(const std::vector<Box>& boxes) {
  std::vector<float> v(6 * 4, 0.f);
  for (size_t i = 0; i < boxes.size(); ++i) {
    const Box& b = boxes[i];
    const float row[6] = {b.cx, b.cy, b.w, b.h, b.cat, b.dog};
    for (int r = 0; r < 6; ++r) v[r * 4 + i] = row[r];
  }
  return {{"output0", testing::Floats({1, 6, 4}, v)}};
}

class AnswerAgreementTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::WriteFile(dir_.path() / "labels.txt", "cat\ndog\n");
    auto proto = ParseModelConfigText(kDetector, "config.pbtxt");
    ASSERT_TRUE(proto.has_value()) << proto.error().ToString();
    auto config = ConvertModelConfig(*proto, "config.pbtxt");
    ASSERT_TRUE(config.has_value()) << config.error().ToString();
    config_ = *config;
  }
  AnswerAgreement Compare(const std::vector<Box>& reference, const std::vector<Box>& candidate) {
    return CompareVisionAnswers(config_, dir_.path(), Outputs(reference), Outputs(candidate));
  }

  testing::TempDir dir_;
  ModelConfig config_;
};

// A 20x20 cat at (32, 32).
constexpr Box kCat{32, 32, 20, 20, 0.9f, 0.05f};

TEST_F(AnswerAgreementTest, TheSameBoxesAgreeAndAreCounted) {
  // Moved by 1 px: overlap 19x20 = 380 over 400 + 400 - 380 = 420: IoU 0.905, the same box.
  const AnswerAgreement a =
      Compare({kCat, {10, 10, 8, 8, 0.02f, 0.8f}}, {{33, 32, 20, 20, 0.85f, 0.05f}, {10, 10, 8, 8, 0.02f, 0.75f}});
  EXPECT_TRUE(a.agree) << a.detail;
  EXPECT_EQ(a.detail, "its 2 boxes at IoU >= 0.9 (cat, dog)");
}

TEST_F(AnswerAgreementTest, ABoxMovedOutOfPlaceDisagreesNamingIt) {
  // Moved by 3 px: overlap 17x20 = 340 over 460: IoU 0.74.
  const AnswerAgreement a = Compare({kCat}, {{35, 32, 20, 20, 0.9f, 0.05f}});
  EXPECT_FALSE(a.agree);
  EXPECT_NE(a.detail.find("a box of 'cat' (0.90) at 22,22-42,42 found by ONNX Runtime"), std::string::npos) << a.detail;
  EXPECT_NE(a.detail.find("best IoU for it is 0.74"), std::string::npos) << a.detail;
}

TEST_F(AnswerAgreementTest, ABoxOfAnotherClassDisagrees) {
  const AnswerAgreement a = Compare({kCat}, {{32, 32, 20, 20, 0.05f, 0.9f}});
  EXPECT_FALSE(a.agree);
  EXPECT_NE(a.detail.find("'cat'"), std::string::npos) << a.detail;
  EXPECT_NE(a.detail.find("best IoU for it is 0.00"), std::string::npos) << a.detail;
}

TEST_F(AnswerAgreementTest, ABoxOnlyTheCandidateFindsDisagrees) {
  const AnswerAgreement a = Compare({kCat}, {kCat, {10, 10, 8, 8, 0.02f, 0.6f}});
  EXPECT_FALSE(a.agree);
  EXPECT_NE(a.detail.find("a box of 'dog' (0.60) at 6,6-14,14 found by this runtime"), std::string::npos) << a.detail;
}

TEST_F(AnswerAgreementTest, AConfidenceMovingAcrossTheThresholdIsNoLoss) {
  // 0.32 in the reference (counted from 0.3), 0.25 in the candidate (matched from 0.2): the same box.
  // 0.28 in the candidate alone: not counted (under 0.3), so nothing is missing from the reference.
  const AnswerAgreement a =
      Compare({{32, 32, 20, 20, 0.32f, 0.0f}}, {{32, 32, 20, 20, 0.25f, 0.0f}, {10, 10, 8, 8, 0.0f, 0.28f}});
  EXPECT_TRUE(a.agree) << a.detail;
  EXPECT_EQ(a.detail, "its 1 box at IoU >= 0.9 (cat)");
}

TEST_F(AnswerAgreementTest, NoBoxesAgreeSayingSo) {
  const AnswerAgreement a = Compare({}, {{10, 10, 8, 8, 0.1f, 0.1f}});
  EXPECT_TRUE(a.agree);
  EXPECT_EQ(a.detail, "no box at confidence >= 0.3 on it");
}

TEST_F(AnswerAgreementTest, OutputsThatAreNoBoxesDisagree) {
  const AnswerAgreement a = CompareVisionAnswers(config_, dir_.path(), Outputs({kCat}),
                                                 {{"output0", testing::Floats({1, 3, 4}, std::vector<float>(12))}});
  EXPECT_FALSE(a.agree);
  EXPECT_NE(a.detail.find("do not read as boxes"), std::string::npos) << a.detail;
}

TEST_F(AnswerAgreementTest, AReferenceThatIsNoBoxesLeavesTheNumbersToDecideSayingSo) {
  const AnswerAgreement a = CompareVisionAnswers(
      config_, dir_.path(), {{"output0", testing::Floats({1, 3, 4}, std::vector<float>(12))}}, Outputs({kCat}));
  EXPECT_TRUE(a.agree);
  EXPECT_EQ(a.detail, "boxes not compared: ONNX Runtime's outputs do not read as one image's boxes");
}

TEST_F(AnswerAgreementTest, ModelsThatAreNoDetectorsAreLeftToTheNumbers) {
  ModelConfig plain = config_;
  plain.parameters.clear();
  const AnswerAgreement a = CompareVisionAnswers(plain, dir_.path(), Outputs({kCat}), Outputs({}));
  EXPECT_TRUE(a.agree);
  EXPECT_EQ(a.detail, "");
}

}  // namespace
}  // namespace quern
