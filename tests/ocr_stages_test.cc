// The OCR stages' geometry and decoding on inputs whose answers are worked
// out by hand: minimum-area rectangles, DB boxes from synthetic probability
// maps, CTC greedy decoding.
#include "backends/stages/ocr_stages.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "image/ocr.h"

namespace quern::ocr {
namespace {

TEST(OcrGeometry, MinAreaRectOfARotatedRectanglesPoints) {
  // The lattice points of a 40 x 10 rectangle turned 30 degrees.
  const double a = std::numbers::pi / 6;
  std::vector<Point> points;
  for (int u = 0; u <= 40; ++u) {
    for (int v = 0; v <= 10; ++v) {
      points.push_back({100 + u * std::cos(a) - v * std::sin(a), 50 + u * std::sin(a) + v * std::cos(a)});
    }
  }
  const MinRect r = MinAreaRect(points);
  EXPECT_NEAR(r.short_side, 10, 1e-6);
  const double long_side = std::max(std::hypot(r.corners[1].x - r.corners[0].x, r.corners[1].y - r.corners[0].y),
                                    std::hypot(r.corners[3].x - r.corners[0].x, r.corners[3].y - r.corners[0].y));
  EXPECT_NEAR(long_side, 40, 1e-6);
  // Two points, or none: no area.
  EXPECT_EQ(MinAreaRect({{1, 1}, {5, 1}}).short_side, 0);
  EXPECT_EQ(MinAreaRect({}).short_side, 0);
}

// A width x height map, zero but for rectangles of probability `p`.
struct Map {
  int width, height;
  std::vector<float> p;
  Map(int w, int h) : width(w), height(h), p(static_cast<size_t>(w) * static_cast<size_t>(h), 0.f) {}
  void Fill(int x0, int y0, int x1, int y1, float v) {  // inclusive
    for (int y = y0; y <= y1; ++y)
      for (int x = x0; x <= x1; ++x)
        p[static_cast<size_t>(y) * static_cast<size_t>(width) + static_cast<size_t>(x)] = v;
  }
};

TEST(OcrGeometry, DbBoxesFromAProbabilityMap) {
  Map m(200, 100);
  m.Fill(20, 30, 119, 49, 0.9f);
  const auto boxes = DetectBoxes(m.p.data(), m.width, m.height, m.width, m.height, DbOptions{});
  ASSERT_EQ(boxes.size(), 1u);
  // Dilated by one pixel right and down: pixels 20..120 x 30..50, a 100 x
  // 20 rectangle of pixel positions; unclipped by 100 * 20 * 1.6 / 240 =
  // 13.33 on every side: 6.67..133.33 x 16.67..63.33, rounded.
  const auto& c = boxes[0].corners;
  const double want[4][2] = {{7, 17}, {133, 17}, {133, 63}, {7, 63}};
  for (int k = 0; k < 4; ++k) {
    EXPECT_NEAR(c[static_cast<size_t>(k)].x, want[k][0], 1) << k;
    EXPECT_NEAR(c[static_cast<size_t>(k)].y, want[k][1], 1) << k;
  }
  // The score is the mean inside the box before unclipping: the 101 x 21
  // dilated pixels, of which the 100 x 20 filled ones hold 0.9.
  EXPECT_NEAR(boxes[0].score, 0.9 * 2000 / 2121, 1e-4);

  // Scaled to a destination twice the size.
  const auto scaled = DetectBoxes(m.p.data(), m.width, m.height, 2 * m.width, 2 * m.height, DbOptions{});
  ASSERT_EQ(scaled.size(), 1u);
  EXPECT_NEAR(scaled[0].corners[2].x, 267, 2);
  EXPECT_NEAR(scaled[0].corners[2].y, 127, 2);
}

TEST(OcrGeometry, DbDropsFaintSmallAndEmptyRegionsAndOrdersLines) {
  Map m(300, 200);
  m.Fill(150, 20, 250, 39, 0.95f);    // line 1, right
  m.Fill(10, 22, 100, 41, 0.95f);     // line 1, left (its top within 10 px of the right one's)
  m.Fill(10, 100, 200, 119, 0.95f);   // line 2
  m.Fill(10, 160, 200, 179, 0.35f);   // above the binarisation threshold, below the box threshold
  m.Fill(250, 150, 251, 151, 0.99f);  // two pixels: too small
  const auto boxes = DetectBoxes(m.p.data(), m.width, m.height, m.width, m.height, DbOptions{});
  ASSERT_EQ(boxes.size(), 3u);
  EXPECT_LT(boxes[0].corners[0].x, 20);   // left part of line 1 first
  EXPECT_GT(boxes[1].corners[0].x, 120);  // then its right part
  EXPECT_GT(boxes[2].corners[0].y, 80);   // then line 2
  std::vector<float> empty(100 * 50, 0.f);
  EXPECT_TRUE(DetectBoxes(empty.data(), 100, 50, 100, 50, DbOptions{}).empty());
}

TEST(OcrDecode, CtcGreedyDecoding) {
  // Classes: 0 blank, 1 'a', 2 'b', 3 '中', 4 the space after the dictionary.
  const std::vector<std::string> dict = {"a", "b", "中"};
  const int classes = 5;
  // Steps (best class, its probability): a a blank a b b 中 space blank.
  const std::vector<std::pair<int, float>> steps = {{1, 0.9f}, {1, 0.8f}, {0, 0.99f}, {1, 0.7f}, {2, 0.6f},
                                                    {2, 0.9f}, {3, 0.5f}, {4, 0.8f},  {0, 0.9f}};
  std::vector<float> p;
  for (const auto& [best, prob] : steps) {
    std::vector<float> row(classes, (1 - prob) / (classes - 1));
    row[static_cast<size_t>(best)] = prob;
    p.insert(p.end(), row.begin(), row.end());
  }
  const Decoded d = CtcDecode(p.data(), static_cast<int64_t>(steps.size()), classes, dict);
  // Repeats merge unless a blank parts them; blanks vanish.
  EXPECT_EQ(d.text, "aab中 ");
  // Kept: a (0.9), a (0.7), b (0.6), 中 (0.5), space (0.8).
  EXPECT_NEAR(d.confidence, (0.9 + 0.7 + 0.6 + 0.5 + 0.8) / 5, 1e-6);
  std::vector<float> blanks(3 * classes, 0.f);
  for (int t = 0; t < 3; ++t) blanks[static_cast<size_t>(t * classes)] = 1.f;
  const Decoded none = CtcDecode(blanks.data(), 3, classes, dict);
  EXPECT_EQ(none.text, "");
  EXPECT_EQ(none.confidence, 0.f);
}

}  // namespace
}  // namespace quern::ocr
