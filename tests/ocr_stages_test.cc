// The OCR stages' geometry and decoding on inputs whose answers are worked
// out by hand: minimum-area rectangles, DB boxes from synthetic probability
// maps, CTC greedy decoding.
#include "backends/stages/ocr_stages.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <cmath>
#include <numbers>
#include <random>

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

// An axis-aligned box x0..x1, y0..y1 as DetectBoxes gives it.
TextBox Box(double x0, double y0, double x1, double y1) {
  return {{Point{x0, y0}, Point{x1, y0}, Point{x1, y1}, Point{x0, y1}}, 0.8f};
}

std::vector<std::array<double, 4>> Extents(const std::vector<TextBox>& boxes) {
  std::vector<std::array<double, 4>> out;
  for (const TextBox& b : boxes) {
    double x0 = 1e9, y0 = 1e9, x1 = -1e9, y1 = -1e9;
    for (const Point& p : b.corners) {
      x0 = std::min(x0, p.x), y0 = std::min(y0, p.y), x1 = std::max(x1, p.x), y1 = std::max(y1, p.y);
    }
    out.push_back({std::round(x0), std::round(y0), std::round(x1), std::round(y1)});
  }
  return out;
}

TEST(OcrLines, WordsOnALineBecomeOneBoxAndFarOnesDoNot) {
  // Words 20 px high: gaps of 10 px (half a height) join, 40 px (two heights) do not; a word a
  // line below, a 60 px heading above and an upright box stay apart. Given out of order.
  const std::vector<TextBox> in = {Box(300, 100, 360, 120), Box(100, 101, 160, 121), Box(170, 100, 250, 119),
                                   Box(100, 140, 150, 160), Box(400, 20, 700, 80),   Box(20, 200, 30, 260)};
  const auto lines = Extents(JoinLines(in, 1.0));
  const std::vector<std::array<double, 4>> want = {
      {400, 20, 700, 80}, {100, 100, 250, 121}, {300, 100, 360, 120}, {100, 140, 150, 160}, {20, 200, 30, 260}};
  ASSERT_EQ(lines.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    for (size_t k = 0; k < 4; ++k) EXPECT_NEAR(lines[i][k], want[i][k], 1.5) << "line " << i << " coordinate " << k;
  }
  // Without joining only the order changes: rows top to bottom, each left to right.
  const auto ordered = Extents(JoinLines(in, 0));
  ASSERT_EQ(ordered.size(), in.size());
  EXPECT_EQ(ordered[1], (std::array<double, 4>{100, 101, 160, 121}));
  EXPECT_EQ(ordered[2], (std::array<double, 4>{170, 100, 250, 119}));
}

TEST(OcrLines, ABoxInsideAnotherIsDropped) {
  // A line 58 px high with a 30 px "letter" inside it (DB found the C of "gRPC" apart): one line.
  // A small box outside it, and one that pokes out of it, stay; so does a box inside the extent of
  // a turned line but outside the line itself.
  std::vector<TextBox> in = {Box(1, 1, 327, 59), Box(92, 16, 125, 46), Box(340, 10, 380, 50), Box(300, 40, 330, 70)};
  auto got = Extents(JoinLines(in, 0));
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0], (std::array<double, 4>{1, 1, 327, 59}));
  for (const auto& e : got) EXPECT_NE(e, (std::array<double, 4>{92, 16, 125, 46}));
  // A line turned 45 degrees across (0,100)-(100,0), 20 px thick, and a box in the corner of its
  // extent that the line does not cover.
  TextBox turned{{Point{0, 100}, Point{100, 0}, Point{114, 14}, Point{14, 114}}, 0.9f};
  got = Extents(JoinLines({turned, Box(80, 80, 110, 100)}, 0));
  EXPECT_EQ(got.size(), 2u);
  EXPECT_EQ(Extents(JoinLines({turned, Box(50, 55, 60, 62)}, 0)).size(), 1u) << "inside the turned line";
  // "$49" in large type, grown by its margin (its text 40..360 x 40..240, the box 0..400 x 0..280),
  // and "99" in small type beside it, inside the margin but not the text: both stay.
  TextBox big = Box(0, 0, 400, 280);
  big.core = Box(40, 40, 360, 240).corners;
  TextBox cents = Box(365, 40, 395, 70);
  cents.core = Box(368, 44, 392, 66).corners;
  EXPECT_EQ(Extents(JoinLines({big, cents}, 1.0)).size(), 2u) << "small text beside a large line";
  cents.core = Box(300, 44, 330, 66).corners;  // the same, within the large line's text: the same text
  EXPECT_EQ(Extents(JoinLines({big, cents}, 1.0)).size(), 1u);
}

TEST(OcrLines, ColumnsOfRunningTextAreReadOneAfterTheOther) {
  // A heading over two columns of four 20 px lines, 200 px long, 150 px apart: the left column
  // first. The same with short cells (a table: 40 px) is read row by row.
  for (const double w : {200.0, 40.0}) {
    const double right = 100 + w + 150;
    std::vector<TextBox> in = {Box(150, 10, 450, 40)};
    for (int r = 0; r < 4; ++r) {
      in.push_back(Box(right, 60 + 40 * r, right + w, 80 + 40 * r));  // the right column first
      in.push_back(Box(100, 60 + 40 * r, 100 + w, 80 + 40 * r));
    }
    const auto got = Extents(JoinLines(in, 1.0));
    ASSERT_EQ(got.size(), 9u);
    EXPECT_EQ(got[0][1], 10);
    for (int k = 1; k < 9; ++k) {
      const int r = w > 100 ? (k - 1) % 4 : (k - 1) / 2;
      const bool left = w > 100 ? k <= 4 : (k - 1) % 2 == 0;
      EXPECT_EQ(got[static_cast<size_t>(k)][1], 60 + 40 * r) << "w " << w << " k " << k;
      EXPECT_EQ(got[static_cast<size_t>(k)][0], left ? 100 : right) << "w " << w << " k " << k;
    }
  }
}

TEST(OcrLines, ATallBoxBesideLinesDoesNotMakeThemOneRow) {
  // An upright label 400 px tall at the left, five lines of 20 px beside it,
  // each indented less than the one before: read top to bottom, not by x.
  std::vector<TextBox> in = {Box(10, 10, 40, 410)};
  for (int r = 0; r < 5; ++r) in.push_back(Box(200 - 20 * r, 20 + 50 * r, 500, 40 + 50 * r));
  const auto got = Extents(JoinLines(in, 1.0));
  ASSERT_EQ(got.size(), 6u);
  std::vector<double> tops;
  for (const auto& e : got) {
    if (e[0] != 10) tops.push_back(e[1]);
  }
  EXPECT_EQ(tops, (std::vector<double>{20, 70, 120, 170, 220}));
}

TEST(OcrLines, AGrownBoxIsTurnedAsTheBoxItGrewFrom) {
  // A 20 x 31 box (1.55 times as tall as wide: turned) grown by a quarter of
  // its width is 30 x 41 (1.37): still turned, as the box it grew from.
  std::vector<uint8_t> page(100 * 100 * 3, 255);
  const auto tall = Box(40, 30, 60, 61).corners;
  const auto grown = ExpandBox(tall, 0.25);
  const Image plain = CropBox(page.data(), 100, 100, grown);
  EXPECT_LT(plain.width, plain.height) << "by its own shape it stays";
  const Image turned = CropBox(page.data(), 100, 100, grown, &tall);
  EXPECT_EQ(turned.width, plain.height);
  EXPECT_EQ(turned.height, plain.width);
}

TEST(OcrLines, ExpandBoxGrowsAlongTheBoxsOwnAxes) {
  const auto e = ExpandBox(Box(10, 20, 110, 40).corners, 0.25);  // 100 x 20: 5 px each side
  EXPECT_NEAR(e[0].x, 5, 1e-9);
  EXPECT_NEAR(e[0].y, 15, 1e-9);
  EXPECT_NEAR(e[2].x, 115, 1e-9);
  EXPECT_NEAR(e[2].y, 45, 1e-9);
  // Turned 90 degrees (corners starting at the bottom-left): still 5 px, along its axes.
  const std::array<Point, 4> turned = {Point{0, 100}, Point{0, 0}, Point{20, 0}, Point{20, 100}};
  const auto t = ExpandBox(turned, 0.25);
  EXPECT_NEAR(t[0].x, -5, 1e-9);
  EXPECT_NEAR(t[0].y, 105, 1e-9);
  EXPECT_NEAR(t[2].x, 25, 1e-9);
  EXPECT_NEAR(t[2].y, -5, 1e-9);
  EXPECT_EQ(ExpandBox(turned, 0)[0].x, 0);
}

// Every way to cut the sorted widths into at most `groups` runs, tried one by
// one: the fewest lines padded past their bound, then the least padding.
std::pair<int64_t, int64_t> BestByHand(std::vector<int> w, int groups, int step, int free_width, double stretch) {
  std::sort(w.begin(), w.end());
  std::pair<int64_t, int64_t> best{INT64_MAX, INT64_MAX};
  const size_t n = w.size();
  for (uint32_t cuts = 0; cuts < (1u << (n - 1)); ++cuts) {
    if (std::popcount(cuts) + 1 > groups) continue;
    std::pair<int64_t, int64_t> c{0, 0};
    size_t a = 0;
    for (size_t i = 0; i < n; ++i) {
      if (i + 1 < n && !(cuts >> i & 1u)) continue;
      const int64_t padded = (w[i] + step - 1) / step * step;  // the run [a, i] at the width of its widest
      for (size_t j = a; j <= i; ++j) {
        c.second += padded;
        if (padded > std::max<double>(free_width, stretch * w[j])) ++c.first;
      }
      a = i + 1;
    }
    best = std::min(best, c);
  }
  return best;
}

TEST(OcrLines, LinesArePackedIntoGroupsThatPadAsLittleAsTheyCan) {
  // Twelve lines, three groups; widths whose best cut is not the obvious one.
  const std::vector<int> widths = {57, 300, 61, 64, 130, 100, 129, 190, 71, 58, 450, 140};
  for (int groups : {1, 2, 3, 5, 12}) {
    const LineGroups g = PackLines(widths, groups, 8, 96, 1.5);
    ASSERT_EQ(g.group_of.size(), widths.size());
    ASSERT_EQ(g.width.size(), static_cast<size_t>(groups));
    std::pair<int64_t, int64_t> got{0, 0};
    std::vector<int> count(static_cast<size_t>(groups), 0);
    for (size_t i = 0; i < widths.size(); ++i) {
      const int padded = g.width[static_cast<size_t>(g.group_of[i])];
      EXPECT_GE(padded, widths[i]) << "line " << i << " in " << groups << " groups";
      EXPECT_EQ(padded % 8, 0);
      got.second += padded;
      if (padded > std::max<double>(96, 1.5 * widths[i])) ++got.first;
      ++count[static_cast<size_t>(g.group_of[i])];
    }
    EXPECT_EQ(got, BestByHand(widths, groups, 8, 96, 1.5)) << groups << " groups";
    EXPECT_EQ(std::vector<int>(g.count.begin(), g.count.end()), count);
    for (size_t k = 1; k < g.width.size(); ++k) {
      if (g.count[k] > 0 && g.count[k - 1] > 0) {
        EXPECT_LT(g.width[k - 1], g.width[k]) << "narrowest first";
      }
    }
  }
  // Widths where a bin's narrowest line is over its bound and its wider ones
  // are not, then random widths, each against every cut tried by hand.
  for (const std::vector<int>& w :
       {std::vector<int>{247, 291, 241, 196, 199, 114, 119}, std::vector<int>{297, 97, 71, 65, 274}}) {
    const LineGroups g = PackLines(w, 2, 8, 96, 1.5);
    std::pair<int64_t, int64_t> got{0, 0};
    for (size_t i = 0; i < w.size(); ++i) {
      const int padded = g.width[static_cast<size_t>(g.group_of[i])];
      got.second += padded;
      if (padded > std::max<double>(96, 1.5 * w[i])) ++got.first;
    }
    EXPECT_EQ(got, BestByHand(w, 2, 8, 96, 1.5)) << w.size() << " lines";
  }
  std::mt19937 random(7);
  for (int round = 0; round < 3000; ++round) {
    std::vector<int> w(static_cast<size_t>(1 + random() % 9));
    for (int& x : w) x = 60 + static_cast<int>(random() % 341);
    const int groups = 1 + static_cast<int>(random() % 3);
    const LineGroups g = PackLines(w, groups, 8, 96, 1.5);
    std::pair<int64_t, int64_t> got{0, 0};
    for (size_t i = 0; i < w.size(); ++i) {
      const int padded = g.width[static_cast<size_t>(g.group_of[i])];
      ASSERT_GE(padded, w[i]);
      got.second += padded;
      if (padded > std::max<double>(96, 1.5 * w[i])) ++got.first;
    }
    ASSERT_EQ(got, BestByHand(w, groups, 8, 96, 1.5)) << "round " << round;
  }
  // Twelve groups for twelve lines: each padded only to a multiple of 8.
  const LineGroups each = PackLines(widths, 12, 8, 96, 1.5);
  for (size_t i = 0; i < widths.size(); ++i) {
    EXPECT_EQ(each.width[static_cast<size_t>(each.group_of[i])], (widths[i] + 7) / 8 * 8);
  }
  // Widths too varied for two groups to keep every bound: the fewest lines go past theirs.
  const std::vector<int> varied = {10, 100, 1000, 1000, 1000};
  EXPECT_EQ(BestByHand(varied, 2, 8, 96, 1.5).first, 1);
  const LineGroups two = PackLines(varied, 2, 8, 96, 1.5);
  EXPECT_EQ(two.group_of[0], two.group_of[1]);  // 10 and 100 together: only the 10 is padded past 96
  EXPECT_EQ(two.width[static_cast<size_t>(two.group_of[0])], 104);
  // No lines: every group empty, at the step's width.
  const LineGroups none = PackLines({}, 3, 8, 96, 1.5);
  EXPECT_EQ(none.width, (std::vector<int>{8, 8, 8}));
  EXPECT_EQ(none.count, (std::vector<int>{0, 0, 0}));
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
