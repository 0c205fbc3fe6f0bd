// The OCR algorithms the built-in OCR stages run (backends/stages), after
// PaddleOCR / RapidOCR: DB post-processing of a text detector's probability
// map into text boxes, minimum-area rectangles, straightened crops of boxes,
// cv2-compatible resizing and normalisation, and CTC greedy decoding. Plain
// functions over pixels and floats, no engine or model types.
//
// Thread safety: every function is pure and may run on any thread.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "image/image.h"

namespace quern::ocr {

struct Point {
  double x = 0, y = 0;
};

// cv2.minAreaRect / boxPoints for a set of points: the four corners of the
// smallest rectangle holding them and its shorter side.
struct MinRect {
  std::array<Point, 4> corners;
  double short_side = 0;
};
MinRect MinAreaRect(std::vector<Point> points);

// DB post-processing of one probability map (height x width, row-major) to
// boxes in a destination image of dest_width x dest_height: each box is
// four corners, top-left, top-right, bottom-right, bottom-left, in reading
// order.
struct DbOptions {
  float threshold = 0.3f;
  float box_threshold = 0.5f;
  float unclip_ratio = 1.6f;
  int max_candidates = 1000;
  bool dilate = true;
};
struct TextBox {
  std::array<Point, 4> corners;
  float score = 0;
  // The text's own rectangle before it was grown (unclipped) into `corners`, in the same pixels;
  // all zero: the same as `corners`.
  std::array<Point, 4> core{};
};
std::vector<TextBox> DetectBoxes(const float* probability, int width, int height, int dest_width, int dest_height,
                                 const DbOptions& options);

// Text lines from the boxes DetectBoxes found in one image, in reading
// order. Boxes side by side on one line -- heights within 1.6 times of each
// other, overlapping vertically by at least half the lower one, at most
// `max_gap` times the taller one's height apart -- become one box: the
// smallest rectangle around them, scored their mean. Upright boxes (more
// than twice as tall as wide) are left alone. The order: lines top to
// bottom (a box whose middle lies within a line's height is on that line),
// each line's boxes left to right. `max_gap` 0 joins nothing and only orders.
// A box whose text lies wholly inside a larger box's text (its core's four
// corners within the other's core, before either was grown) is dropped: the
// larger box holds its text already. Text beside a line, in the margin the
// line was grown by, stays.
std::vector<TextBox> JoinLines(std::vector<TextBox> boxes, double max_gap);

// `box` grown by `margin` times its shorter side on every side, along its
// own axes (corners in DetectBoxes' order).
std::array<Point, 4> ExpandBox(const std::array<Point, 4>& box, double margin);

// The recogniser's batches for one image's lines, `widths` their widths at
// height 48: at most `groups` groups of lines, each padded to its widest line
// rounded up to a multiple of `step`, chosen so that the padded widths add up
// to as little as they can (a line's recognition costs in proportion to its
// padded width, and batching lines of one width gains little). A line is
// padded to at most max(`free_width`, `max_stretch` times its own width)
// whenever `groups` groups allow it (PP-OCRv4 drops word spaces in a line
// padded to twice its width); where they cannot, the fewest lines are padded
// past it. Groups are numbered from the narrowest; an empty group's width is
// `step`. Requires groups >= 1, step >= 1; widths are held to [1, 1 << 20].
struct LineGroups {
  std::vector<int> group_of;  // for each line, its group
  std::vector<int> width;     // for each group, its padded width
  std::vector<int> count;     // for each group, its lines
};
LineGroups PackLines(const std::vector<int>& widths, int groups, int step, int free_width, double max_stretch);

// CTC greedy decoding of one line: `probabilities` is steps x classes;
// class 0 is the blank, class i is characters[i - 1].
struct Decoded {
  std::string text;
  float confidence = 0;
};
Decoded CtcDecode(const float* probabilities, int64_t steps, int64_t classes,
                  const std::vector<std::string>& characters);

double Distance(const Point& a, const Point& b);

// cv2.resize INTER_LINEAR of an 8-bit 3-channel image (pixel centres at
// half-integers, edges clamped), rounded back to 8 bits.
std::vector<uint8_t> Resize(const uint8_t* src, int sw, int sh, int dw, int dh);

// Writes an 8-bit image as planar floats (pixel / 255 - mean) / std into a
// [3, height, stride] plane (the columns past `width` are left as they are).
void ToPlanes(const uint8_t* src, int width, int height, float* out, int stride, const std::array<float, 3>& mean,
              const std::array<float, 3>& std);

// get_rotate_crop_image: the box straightened into an image of its own
// (bilinear, edges replicated); turned 90 degrees counter-clockwise when it
// is at least 1.5 times as tall as wide -- or, given `upright_of`, when that
// box is (a box grown by a margin is turned as the box it grew from).
Image CropBox(const uint8_t* src, int sw, int sh, const std::array<Point, 4>& box,
              const std::array<Point, 4>* upright_of = nullptr);

// The width and height of the image CropBox cuts for `box` (before any turn).
std::pair<int, int> CropSize(const std::array<Point, 4>& box);

}  // namespace quern::ocr
