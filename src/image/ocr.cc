#include "image/ocr.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>

namespace quern::ocr {
namespace {

// ---------------------------------------------------------------- geometry

double Cross(const Point& o, const Point& a, const Point& b) {
  return (a.x - o.x) * (b.y - o.y) - (a.y - o.y) * (b.x - o.x);
}

// Andrew's monotone chain: the convex hull, counter-clockwise, no repeats.
std::vector<Point> ConvexHull(std::vector<Point> p) {
  std::sort(p.begin(), p.end(), [](const Point& a, const Point& b) { return a.x < b.x || (a.x == b.x && a.y < b.y); });
  p.erase(std::unique(p.begin(), p.end(), [](const Point& a, const Point& b) { return a.x == b.x && a.y == b.y; }),
          p.end());
  if (p.size() < 3) return p;
  std::vector<Point> hull(2 * p.size());
  size_t k = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    while (k >= 2 && Cross(hull[k - 2], hull[k - 1], p[i]) <= 0) --k;
    hull[k++] = p[i];
  }
  for (size_t i = p.size() - 1, t = k + 1; i > 0; --i) {
    while (k >= t && Cross(hull[k - 2], hull[k - 1], p[i - 1]) <= 0) --k;
    hull[k++] = p[i - 1];
  }
  hull.resize(k - 1);
  return hull;
}

// get_mini_boxes' order: of the corners sorted by x, the upper of the left
// two is top-left, the lower bottom-left; likewise on the right.
std::array<Point, 4> MiniBoxOrder(std::array<Point, 4> c) {
  std::stable_sort(c.begin(), c.end(), [](const Point& a, const Point& b) { return a.x < b.x; });
  const Point tl = c[1].y > c[0].y ? c[0] : c[1];
  const Point bl = c[1].y > c[0].y ? c[1] : c[0];
  const Point tr = c[3].y > c[2].y ? c[2] : c[3];
  const Point br = c[3].y > c[2].y ? c[3] : c[2];
  return {tl, tr, br, bl};
}

// order_points_clockwise: left two by y (top-left, bottom-left), right two
// by y (top-right, bottom-right).
std::array<Point, 4> ClockwiseOrder(std::array<Point, 4> c) {
  std::stable_sort(c.begin(), c.end(), [](const Point& a, const Point& b) { return a.x < b.x; });
  auto by_y = [](const Point& a, const Point& b) { return a.y < b.y; };
  std::stable_sort(c.begin(), c.begin() + 2, by_y);
  std::stable_sort(c.begin() + 2, c.end(), by_y);
  return {c[0], c[2], c[3], c[1]};
}

bool InsideOrOn(const std::array<Point, 4>& poly, double x, double y) {
  bool inside = false;
  for (size_t i = 0, j = 3; i < 4; j = i++) {
    const Point& a = poly[i];
    const Point& b = poly[j];
    // On the edge (cv2.fillPoly paints the outline too).
    const double cross = (b.x - a.x) * (y - a.y) - (b.y - a.y) * (x - a.x);
    if (std::abs(cross) < 1e-9 && x >= std::min(a.x, b.x) - 1e-9 && x <= std::max(a.x, b.x) + 1e-9 &&
        y >= std::min(a.y, b.y) - 1e-9 && y <= std::max(a.y, b.y) + 1e-9) {
      return true;
    }
    if ((a.y > y) != (b.y > y) && x < (b.x - a.x) * (y - a.y) / (b.y - a.y) + a.x) inside = !inside;
  }
  return inside;
}

// box_score_fast: the mean probability inside the box (corners truncated
// to whole pixels, as the polygon is filled).
float BoxScore(const float* prob, int width, int height, const std::array<Point, 4>& box) {
  double xmin = box[0].x, xmax = box[0].x, ymin = box[0].y, ymax = box[0].y;
  for (const Point& p : box) {
    xmin = std::min(xmin, p.x);
    xmax = std::max(xmax, p.x);
    ymin = std::min(ymin, p.y);
    ymax = std::max(ymax, p.y);
  }
  const int x0 = std::clamp(static_cast<int>(std::floor(xmin)), 0, width - 1);
  const int x1 = std::clamp(static_cast<int>(std::ceil(xmax)), 0, width - 1);
  const int y0 = std::clamp(static_cast<int>(std::floor(ymin)), 0, height - 1);
  const int y1 = std::clamp(static_cast<int>(std::ceil(ymax)), 0, height - 1);
  std::array<Point, 4> local;
  for (size_t i = 0; i < 4; ++i) {
    local[i] = {std::trunc(box[i].x - x0), std::trunc(box[i].y - y0)};
  }
  double sum = 0;
  int64_t n = 0;
  for (int y = y0; y <= y1; ++y) {
    for (int x = x0; x <= x1; ++x) {
      if (InsideOrOn(local, x - x0, y - y0)) {
        sum += prob[static_cast<size_t>(y) * static_cast<size_t>(width) + static_cast<size_t>(x)];
        ++n;
      }
    }
  }
  return n ? static_cast<float>(sum / static_cast<double>(n)) : 0.f;
}

// ---------------------------------------------------------------- pixels

// The source pixel left of (or above) output pixel `o`'s centre, and the
// weight of the next one, for a resize by `scale` = source / output size;
// edges clamped.
int SourceIndex(int o, double scale, int size, float& weight) {
  double f = (o + 0.5) * scale - 0.5;
  int i = static_cast<int>(std::floor(f));
  f -= i;
  if (i < 0) i = 0, f = 0;
  if (i >= size - 1) i = size - 1, f = 0;
  weight = static_cast<float>(f);
  return i;
}

// Solves the 8 unknowns of the perspective map taking `from` to `to`
// (cv2.getPerspectiveTransform); h[8] = 1.
std::array<double, 9> Perspective(const std::array<Point, 4>& from, const std::array<Point, 4>& to) {
  double a[8][9] = {};
  for (int i = 0; i < 4; ++i) {
    const Point& f = from[static_cast<size_t>(i)];
    const Point& t = to[static_cast<size_t>(i)];
    double* r0 = a[i];
    double* r1 = a[i + 4];
    r0[0] = f.x, r0[1] = f.y, r0[2] = 1, r0[6] = -f.x * t.x, r0[7] = -f.y * t.x, r0[8] = t.x;
    r1[3] = f.x, r1[4] = f.y, r1[5] = 1, r1[6] = -f.x * t.y, r1[7] = -f.y * t.y, r1[8] = t.y;
  }
  for (int c = 0; c < 8; ++c) {
    int pivot = c;
    for (int r = c + 1; r < 8; ++r) {
      if (std::abs(a[r][c]) > std::abs(a[pivot][c])) pivot = r;
    }
    std::swap(a[c], a[pivot]);
    if (std::abs(a[c][c]) < 1e-12) return {1, 0, 0, 0, 1, 0, 0, 0, 1};  // degenerate: identity
    for (int r = 0; r < 8; ++r) {
      if (r == c) continue;
      const double k = a[r][c] / a[c][c];
      for (int k2 = c; k2 < 9; ++k2) a[r][k2] -= k * a[c][k2];
    }
  }
  std::array<double, 9> h{};
  for (int i = 0; i < 8; ++i) h[static_cast<size_t>(i)] = a[i][8] / a[i][i];
  h[8] = 1;
  return h;
}

}  // namespace

double Distance(const Point& a, const Point& b) {
  return std::hypot(a.x - b.x, a.y - b.y);
}

// cv2.resize INTER_LINEAR of an 8-bit 3-channel image (pixel centres at
// half-integers, edges clamped), rounded back to 8 bits.
std::vector<uint8_t> Resize(const uint8_t* src, int sw, int sh, int dw, int dh) {
  std::vector<uint8_t> out(static_cast<size_t>(dw) * static_cast<size_t>(dh) * 3);
  std::vector<int> xs(static_cast<size_t>(dw));
  std::vector<float> fx(static_cast<size_t>(dw));
  const double sx = static_cast<double>(sw) / dw, sy = static_cast<double>(sh) / dh;
  for (int x = 0; x < dw; ++x) {
    xs[static_cast<size_t>(x)] = SourceIndex(x, sx, sw, fx[static_cast<size_t>(x)]);
  }
  for (int y = 0; y < dh; ++y) {
    float wy = 0;
    const int j = SourceIndex(y, sy, sh, wy);
    const uint8_t* r0 = src + static_cast<size_t>(j) * static_cast<size_t>(sw) * 3;
    const uint8_t* r1 = src + static_cast<size_t>(std::min(j + 1, sh - 1)) * static_cast<size_t>(sw) * 3;
    uint8_t* o = out.data() + static_cast<size_t>(y) * static_cast<size_t>(dw) * 3;
    for (int x = 0; x < dw; ++x) {
      const size_t i0 = static_cast<size_t>(xs[static_cast<size_t>(x)]) * 3;
      const size_t i1 = static_cast<size_t>(std::min(xs[static_cast<size_t>(x)] + 1, sw - 1)) * 3;
      const float wx = fx[static_cast<size_t>(x)];
      for (size_t c = 0; c < 3; ++c) {
        const float top = r0[i0 + c] + (r0[i1 + c] - r0[i0 + c]) * wx;
        const float bottom = r1[i0 + c] + (r1[i1 + c] - r1[i0 + c]) * wx;
        o[static_cast<size_t>(x) * 3 + c] = static_cast<uint8_t>(std::lround(top + (bottom - top) * wy));
      }
    }
  }
  return out;
}

// Writes an 8-bit image as planar floats (pixel / 255 - mean) / std into a
// [3, height, stride] plane (the columns past `width` are left as they are).
void ToPlanes(const uint8_t* src, int width, int height, float* out, int stride, const std::array<float, 3>& mean,
              const std::array<float, 3>& std) {
  const size_t plane = static_cast<size_t>(height) * static_cast<size_t>(stride);
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      const uint8_t* p = src + (static_cast<size_t>(y) * static_cast<size_t>(width) + static_cast<size_t>(x)) * 3;
      for (size_t c = 0; c < 3; ++c) {
        out[c * plane + static_cast<size_t>(y) * static_cast<size_t>(stride) + static_cast<size_t>(x)] =
            (static_cast<float>(p[c]) / 255.f - mean[c]) / std[c];
      }
    }
  }
}

// get_rotate_crop_image: the box straightened into an image of its own
// (bilinear, edges replicated); turned 90 degrees counter-clockwise when it
// is at least 1.5 times as tall as wide.
std::pair<int, int> CropSize(const std::array<Point, 4>& box) {
  return {std::max(1, static_cast<int>(std::max(Distance(box[0], box[1]), Distance(box[2], box[3])))),
          std::max(1, static_cast<int>(std::max(Distance(box[0], box[3]), Distance(box[1], box[2]))))};
}

Image CropBox(const uint8_t* src, int sw, int sh, const std::array<Point, 4>& box,
              const std::array<Point, 4>* upright_of) {
  const auto [w, h] = CropSize(box);
  const std::array<Point, 4> straight = {Point{0, 0}, Point{static_cast<double>(w), 0},
                                         Point{static_cast<double>(w), static_cast<double>(h)},
                                         Point{0, static_cast<double>(h)}};
  const auto m = Perspective(straight, box);  // crop pixel -> source pixel
  Image out;
  out.width = w;
  out.height = h;
  out.pixels.resize(static_cast<size_t>(w) * static_cast<size_t>(h) * 3);
  auto at = [&](int x, int y, size_t c) {
    x = std::clamp(x, 0, sw - 1);
    y = std::clamp(y, 0, sh - 1);
    return static_cast<float>(src[(static_cast<size_t>(y) * static_cast<size_t>(sw) + static_cast<size_t>(x)) * 3 + c]);
  };
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) {
      const double d = m[6] * x + m[7] * y + m[8];
      const double u = (m[0] * x + m[1] * y + m[2]) / d;
      const double v = (m[3] * x + m[4] * y + m[5]) / d;
      const int x0 = static_cast<int>(std::floor(u)), y0 = static_cast<int>(std::floor(v));
      const float fx = static_cast<float>(u - x0), fy = static_cast<float>(v - y0);
      for (size_t c = 0; c < 3; ++c) {
        const float top = at(x0, y0, c) + (at(x0 + 1, y0, c) - at(x0, y0, c)) * fx;
        const float bottom = at(x0, y0 + 1, c) + (at(x0 + 1, y0 + 1, c) - at(x0, y0 + 1, c)) * fx;
        out.pixels[(static_cast<size_t>(y) * static_cast<size_t>(w) + static_cast<size_t>(x)) * 3 + c] =
            static_cast<uint8_t>(std::clamp(std::lround(top + (bottom - top) * fy), 0L, 255L));
      }
    }
  }
  const auto [uw, uh] = upright_of ? CropSize(*upright_of) : std::pair<int, int>{w, h};
  if (uh >= 1.5 * uw) {
    Image turned;
    turned.width = h;
    turned.height = w;
    turned.pixels.resize(out.pixels.size());
    for (int i = 0; i < w; ++i) {    // rows of the turned image
      for (int j = 0; j < h; ++j) {  // its columns
        const uint8_t* p =
            &out.pixels[(static_cast<size_t>(j) * static_cast<size_t>(w) + static_cast<size_t>(w - 1 - i)) * 3];
        std::memcpy(&turned.pixels[(static_cast<size_t>(i) * static_cast<size_t>(h) + static_cast<size_t>(j)) * 3], p,
                    3);
      }
    }
    return turned;
  }
  return out;
}

MinRect MinAreaRect(std::vector<Point> points) {
  MinRect r;
  const std::vector<Point> hull = ConvexHull(std::move(points));
  if (hull.empty()) return r;
  if (hull.size() < 3) {
    const Point a = hull.front(), b = hull.back();
    r.corners = {a, b, b, a};
    r.short_side = 0;
    return r;
  }
  double best = -1;
  for (size_t i = 0; i < hull.size(); ++i) {
    const Point& a = hull[i];
    const Point& b = hull[(i + 1) % hull.size()];
    const double len = Distance(a, b);
    if (len == 0) continue;
    const double ux = (b.x - a.x) / len, uy = (b.y - a.y) / len;
    double min_u = 1e300, max_u = -1e300, min_v = 1e300, max_v = -1e300;
    for (const Point& p : hull) {
      const double u = (p.x - a.x) * ux + (p.y - a.y) * uy;
      const double v = -(p.x - a.x) * uy + (p.y - a.y) * ux;
      min_u = std::min(min_u, u), max_u = std::max(max_u, u);
      min_v = std::min(min_v, v), max_v = std::max(max_v, v);
    }
    const double area = (max_u - min_u) * (max_v - min_v);
    if (best < 0 || area < best) {
      best = area;
      auto corner = [&](double u, double v) { return Point{a.x + u * ux - v * uy, a.y + u * uy + v * ux}; };
      r.corners = {corner(min_u, min_v), corner(max_u, min_v), corner(max_u, max_v), corner(min_u, max_v)};
      r.short_side = std::min(max_u - min_u, max_v - min_v);
    }
  }
  return r;
}

std::vector<TextBox> DetectBoxes(const float* prob, int width, int height, int dest_width, int dest_height,
                                 const DbOptions& o) {
  const size_t count = static_cast<size_t>(width) * static_cast<size_t>(height);
  std::vector<uint8_t> mask(count);
  for (size_t i = 0; i < count; ++i) mask[i] = prob[i] > o.threshold;
  if (o.dilate) {
    // cv2.dilate with a 2x2 kernel: a pixel is set when it, its left, upper
    // or upper-left neighbour is.
    std::vector<uint8_t> d(count);
    for (int y = 0; y < height; ++y) {
      for (int x = 0; x < width; ++x) {
        auto at = [&](int xx, int yy) {
          return xx >= 0 && yy >= 0 &&
                 mask[static_cast<size_t>(yy) * static_cast<size_t>(width) + static_cast<size_t>(xx)];
        };
        d[static_cast<size_t>(y) * static_cast<size_t>(width) + static_cast<size_t>(x)] =
            at(x, y) || at(x - 1, y) || at(x, y - 1) || at(x - 1, y - 1);
      }
    }
    mask.swap(d);
  }
  // 8-connected regions (their outer contours are what cv2.findContours
  // finds; a region's minimum-area rectangle is that of its pixels).
  std::vector<int32_t> label(count, -1);
  std::vector<TextBox> boxes;
  std::vector<std::pair<int, int>> stack;
  int regions = 0;
  for (int y0 = 0; y0 < height && regions < o.max_candidates; ++y0) {
    for (int x0 = 0; x0 < width && regions < o.max_candidates; ++x0) {
      const size_t i0 = static_cast<size_t>(y0) * static_cast<size_t>(width) + static_cast<size_t>(x0);
      if (!mask[i0] || label[i0] >= 0) continue;
      std::vector<Point> pixels;
      label[i0] = regions;
      stack.push_back({x0, y0});
      while (!stack.empty()) {
        const auto [x, y] = stack.back();
        stack.pop_back();
        pixels.push_back({static_cast<double>(x), static_cast<double>(y)});
        for (int dy = -1; dy <= 1; ++dy) {
          for (int dx = -1; dx <= 1; ++dx) {
            const int xx = x + dx, yy = y + dy;
            if (xx < 0 || yy < 0 || xx >= width || yy >= height) continue;
            const size_t j = static_cast<size_t>(yy) * static_cast<size_t>(width) + static_cast<size_t>(xx);
            if (mask[j] && label[j] < 0) {
              label[j] = regions;
              stack.push_back({xx, yy});
            }
          }
        }
      }
      ++regions;
      const MinRect r = MinAreaRect(std::move(pixels));
      if (r.short_side < 3) continue;
      const std::array<Point, 4> box = MiniBoxOrder(r.corners);
      const float score = BoxScore(prob, width, height, box);
      if (score < o.box_threshold) continue;
      // Unclip: the box grown on every side by area x ratio / perimeter
      // (an offset with round joins, whose minimum-area rectangle this is),
      // from corners on whole pixels.
      std::array<Point, 4> whole;
      for (size_t k = 0; k < 4; ++k) whole[k] = {std::trunc(box[k].x), std::trunc(box[k].y)};
      double area = 0, perimeter = 0;
      for (size_t k = 0; k < 4; ++k) {
        const Point& a = whole[k];
        const Point& b = whole[(k + 1) % 4];
        area += a.x * b.y - b.x * a.y;
        perimeter += Distance(a, b);
      }
      area = std::abs(area) / 2;
      if (perimeter <= 0) continue;
      const double grow = area * o.unclip_ratio / perimeter;
      MinRect g = MinAreaRect(std::vector<Point>(whole.begin(), whole.end()));
      Point centre{0, 0};
      for (const Point& p : g.corners) centre.x += p.x / 4, centre.y += p.y / 4;
      const Point e0{g.corners[1].x - g.corners[0].x, g.corners[1].y - g.corners[0].y};
      const Point e1{g.corners[3].x - g.corners[0].x, g.corners[3].y - g.corners[0].y};
      const double l0 = std::hypot(e0.x, e0.y), l1 = std::hypot(e1.x, e1.y);
      if (l0 == 0 || l1 == 0) continue;
      std::array<Point, 4> grown;
      for (size_t k = 0; k < 4; ++k) {
        const Point& p = g.corners[k];
        const double s0 = ((p.x - centre.x) * e0.x + (p.y - centre.y) * e0.y) >= 0 ? 1 : -1;
        const double s1 = ((p.x - centre.x) * e1.x + (p.y - centre.y) * e1.y) >= 0 ? 1 : -1;
        grown[k] = {p.x + s0 * grow * e0.x / l0 + s1 * grow * e1.x / l1,
                    p.y + s0 * grow * e0.y / l0 + s1 * grow * e1.y / l1};
      }
      if (std::min(l0, l1) + 2 * grow < 3 + 2) continue;
      std::array<Point, 4> core = box;  // the text's own rectangle, before unclipping
      for (Point& p : core) {
        p.x = std::clamp(p.x / width * dest_width, 0.0, static_cast<double>(dest_width));
        p.y = std::clamp(p.y / height * dest_height, 0.0, static_cast<double>(dest_height));
      }
      std::array<Point, 4> out = MiniBoxOrder(grown);
      for (Point& p : out) {
        p.x = std::clamp(std::nearbyint(p.x / width * dest_width), 0.0, static_cast<double>(dest_width));
        p.y = std::clamp(std::nearbyint(p.y / height * dest_height), 0.0, static_cast<double>(dest_height));
      }
      // RapidOCR's filter: clockwise, inside the image, wider and taller than 3.
      out = ClockwiseOrder(out);
      for (Point& p : out) {
        p.x = std::clamp(std::trunc(p.x), 0.0, static_cast<double>(dest_width - 1));
        p.y = std::clamp(std::trunc(p.y), 0.0, static_cast<double>(dest_height - 1));
      }
      if (static_cast<int>(Distance(out[0], out[1])) <= 3 || static_cast<int>(Distance(out[0], out[3])) <= 3) continue;
      boxes.push_back({out, score, core});
    }
  }
  // Reading order: by the top-left corner's y, then x; boxes whose tops lie
  // within 10 pixels are ordered left to right.
  std::stable_sort(boxes.begin(), boxes.end(), [](const TextBox& a, const TextBox& b) {
    return a.corners[0].y < b.corners[0].y || (a.corners[0].y == b.corners[0].y && a.corners[0].x < b.corners[0].x);
  });
  for (size_t i = 0; i + 1 < boxes.size(); ++i) {
    for (size_t j = i + 1; j-- > 0;) {
      if (std::abs(boxes[j + 1].corners[0].y - boxes[j].corners[0].y) < 10 &&
          boxes[j + 1].corners[0].x < boxes[j].corners[0].x) {
        std::swap(boxes[j], boxes[j + 1]);
      } else {
        break;
      }
    }
  }
  return boxes;
}

namespace {

// A box's extent on the page's axes and its own height.
struct Extent {
  double x0, x1, y0, y1, height;
  bool upright;
};

Extent ExtentOf(const TextBox& b) {
  Extent e{b.corners[0].x, b.corners[0].x, b.corners[0].y, b.corners[0].y, 0, false};
  for (const Point& p : b.corners) {
    e.x0 = std::min(e.x0, p.x);
    e.x1 = std::max(e.x1, p.x);
    e.y0 = std::min(e.y0, p.y);
    e.y1 = std::max(e.y1, p.y);
  }
  const double w = (Distance(b.corners[0], b.corners[1]) + Distance(b.corners[3], b.corners[2])) / 2;
  e.height = (Distance(b.corners[0], b.corners[3]) + Distance(b.corners[1], b.corners[2])) / 2;
  e.upright = e.height > 2 * w;
  return e;
}

// The box's text before it was grown (its corners when it has no core of its own).
const std::array<Point, 4>& CoreOf(const TextBox& b) {
  for (const Point& p : b.core) {
    if (p.x != 0 || p.y != 0) return b.core;
  }
  return b.corners;
}

// A quadrilateral's area (shoelace).
double Area(const std::array<Point, 4>& c) {
  double twice = 0;
  for (size_t k = 0; k < 4; ++k) twice += c[k].x * c[(k + 1) % 4].y - c[(k + 1) % 4].x * c[k].y;
  return std::abs(twice) / 2;
}

bool SameLine(const Extent& a, const Extent& b, double max_gap) {
  if (a.upright || b.upright || a.height <= 0 || b.height <= 0) return false;
  if (std::max(a.height, b.height) > 1.6 * std::min(a.height, b.height)) return false;
  const double overlap = std::min(a.y1, b.y1) - std::max(a.y0, b.y0);
  if (overlap < 0.5 * std::min(a.y1 - a.y0, b.y1 - b.y0)) return false;
  const double gap = std::max(b.x0 - a.x1, a.x0 - b.x1);
  return gap <= max_gap * std::max(a.height, b.height);
}

size_t Root(std::vector<size_t>& parent, size_t i) {
  while (parent[i] != i) i = parent[i] = parent[parent[i]];
  return i;
}

// The median of a non-empty `v`.
double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// Rows: top to bottom by each row's first box's top (a box whose middle lies
// within that box's height -- at most 1.5 times the boxes' median height, so
// that a tall box does not gather every line beside it -- is on its row),
// each row left to right.
void RowOrder(const std::vector<Extent>& ext, std::vector<size_t> ids, std::vector<size_t>& out) {
  if (ids.empty()) return;
  std::stable_sort(ids.begin(), ids.end(), [&](size_t a, size_t b) { return ext[a].y0 < ext[b].y0; });
  std::vector<double> heights;
  for (size_t i : ids) heights.push_back(ext[i].height);
  const double band = 1.5 * Median(std::move(heights));
  std::vector<size_t> row;
  for (size_t k = 0; k < ids.size();) {
    const Extent& first = ext[ids[k]];
    const double bottom = std::min(first.y1, first.y0 + band);
    row.clear();
    for (; k < ids.size(); ++k) {
      const Extent& e = ext[ids[k]];
      if (!row.empty() && (e.y0 + e.y1) / 2 > bottom) break;
      row.push_back(ids[k]);
    }
    std::stable_sort(row.begin(), row.end(), [&](size_t a, size_t b) { return ext[a].x0 < ext[b].x0; });
    out.insert(out.end(), row.begin(), row.end());
  }
}

// The widest gap in the projection of `ids` on one axis (x or y): where it
// starts and ends; {0, 0} when the boxes leave none.
std::pair<double, double> WidestGap(const std::vector<Extent>& ext, std::vector<size_t> ids, bool on_x) {
  auto lo = [&](size_t i) { return on_x ? ext[i].x0 : ext[i].y0; };
  auto hi = [&](size_t i) { return on_x ? ext[i].x1 : ext[i].y1; };
  std::sort(ids.begin(), ids.end(), [&](size_t a, size_t b) { return lo(a) < lo(b); });
  std::pair<double, double> best{0, 0};
  double reach = hi(ids[0]);
  for (size_t k = 1; k < ids.size(); ++k) {
    if (lo(ids[k]) > reach && lo(ids[k]) - reach > best.second - best.first) best = {reach, lo(ids[k])};
    reach = std::max(reach, hi(ids[k]));
  }
  return best;
}

// Whether boxes side by side are columns of running text (read one to its
// end before the next) rather than the cells of a table's rows: at least
// three lines each, lines at least six times as long as they are high.
bool TextColumn(const std::vector<Extent>& ext, const std::vector<size_t>& ids) {
  if (ids.size() < 3) return false;
  std::vector<double> ratio;
  for (size_t i : ids) ratio.push_back((ext[i].x1 - ext[i].x0) / std::max(1.0, ext[i].height));
  return Median(std::move(ratio)) >= 6;
}

// Reading order, XY-cut style: columns of running text apart (a gutter at
// least twice the lines' height wide) are read left to right, each to its
// end; otherwise the boxes split at their widest horizontal gap, top part
// first; what splits no more is read in rows.
void ReadingOrder(const std::vector<Extent>& ext, std::vector<size_t> ids, std::vector<size_t>& out) {
  if (ids.size() >= 6) {
    std::vector<double> heights;
    for (size_t i : ids) heights.push_back(ext[i].height);
    const double line = Median(std::move(heights));
    const auto [x0, x1] = WidestGap(ext, ids, /*on_x=*/true);
    if (x1 - x0 >= 2 * line) {
      std::vector<size_t> left, right;
      for (size_t i : ids) (ext[i].x1 <= x0 ? left : right).push_back(i);
      if (TextColumn(ext, left) && TextColumn(ext, right)) {
        ReadingOrder(ext, std::move(left), out);
        ReadingOrder(ext, std::move(right), out);
        return;
      }
    }
    const auto [y0, y1] = WidestGap(ext, ids, /*on_x=*/false);
    if (y1 > y0) {
      std::vector<size_t> top, bottom;
      for (size_t i : ids) (ext[i].y1 <= y0 ? top : bottom).push_back(i);
      ReadingOrder(ext, std::move(top), out);
      ReadingOrder(ext, std::move(bottom), out);
      return;
    }
  }
  RowOrder(ext, std::move(ids), out);
}

}  // namespace

std::vector<TextBox> JoinLines(std::vector<TextBox> boxes, double max_gap) {
  const size_t n = boxes.size();
  if (max_gap > 0 && n > 1) {
    std::vector<Extent> ext;
    ext.reserve(n);
    for (const TextBox& b : boxes) ext.push_back(ExtentOf(b));
    std::vector<size_t> parent(n);
    std::iota(parent.begin(), parent.end(), size_t{0});
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = i + 1; j < n; ++j) {
        if (SameLine(ext[i], ext[j], max_gap)) parent[Root(parent, i)] = Root(parent, j);
      }
    }
    std::vector<std::vector<size_t>> groups(n);
    for (size_t i = 0; i < n; ++i) groups[Root(parent, i)].push_back(i);
    std::vector<TextBox> joined;
    for (const auto& g : groups) {
      if (g.empty()) continue;
      if (g.size() == 1) {
        joined.push_back(boxes[g[0]]);
        continue;
      }
      std::vector<Point> points, cores;
      double score = 0;
      for (size_t i : g) {
        points.insert(points.end(), boxes[i].corners.begin(), boxes[i].corners.end());
        const std::array<Point, 4>& c = CoreOf(boxes[i]);
        cores.insert(cores.end(), c.begin(), c.end());
        score += boxes[i].score;
      }
      joined.push_back({ClockwiseOrder(MinAreaRect(std::move(points)).corners),
                        static_cast<float>(score / static_cast<double>(g.size())),
                        ClockwiseOrder(MinAreaRect(std::move(cores)).corners)});
    }
    boxes = std::move(joined);
  }
  // A box whose text lies wholly inside a larger box's text (each corner of its core within the
  // other's core) is the same text found twice: DB finds a letter whose inside it binarised apart
  // from its line ("gRPC" read as the line and a "C"). The larger box holds it already. Cores, not
  // the grown boxes: small text beside a line, in the margin the line was grown by, is text of its own.
  std::vector<double> area(boxes.size());
  for (size_t i = 0; i < boxes.size(); ++i) area[i] = Area(CoreOf(boxes[i]));
  std::vector<bool> inside(boxes.size(), false);
  for (size_t i = 0; i < boxes.size(); ++i) {
    // Its corners pulled in by a sixth of its shorter side: a letter as tall as the line's capitals
    // may reach a pixel past the line's own rectangle.
    std::array<Point, 4> small = CoreOf(boxes[i]);
    Point centre{0, 0};
    for (const Point& p : small) centre.x += p.x / 4, centre.y += p.y / 4;
    const double shorter = std::min(Distance(small[0], small[1]), Distance(small[0], small[3]));
    for (Point& p : small) {
      const double d = Distance(p, centre);
      if (d > 0)
        p = {p.x + (centre.x - p.x) * std::min(1.0, shorter / 6 / d),
             p.y + (centre.y - p.y) * std::min(1.0, shorter / 6 / d)};
    }
    for (size_t j = 0; j < boxes.size() && !inside[i]; ++j) {
      if (i == j || inside[j] || area[j] <= area[i]) continue;
      const std::array<Point, 4>& large = CoreOf(boxes[j]);
      inside[i] = std::all_of(small.begin(), small.end(), [&](const Point& p) { return InsideOrOn(large, p.x, p.y); });
    }
  }
  std::vector<TextBox> kept;
  kept.reserve(boxes.size());
  for (size_t i = 0; i < boxes.size(); ++i) {
    if (!inside[i]) kept.push_back(boxes[i]);
  }
  boxes = std::move(kept);
  std::vector<Extent> ext;
  ext.reserve(boxes.size());
  for (const TextBox& b : boxes) ext.push_back(ExtentOf(b));
  std::vector<size_t> all(boxes.size());
  std::iota(all.begin(), all.end(), size_t{0});
  std::vector<size_t> order;
  order.reserve(boxes.size());
  ReadingOrder(ext, std::move(all), order);
  std::vector<TextBox> out;
  out.reserve(boxes.size());
  for (size_t i : order) out.push_back(boxes[i]);
  return out;
}

std::array<Point, 4> ExpandBox(const std::array<Point, 4>& box, double margin) {
  const double w = Distance(box[0], box[1]), h = Distance(box[0], box[3]);
  if (w <= 0 || h <= 0 || margin <= 0) return box;
  const double m = margin * std::min(w, h);
  const Point ux{(box[1].x - box[0].x) / w * m, (box[1].y - box[0].y) / w * m};
  const Point uy{(box[3].x - box[0].x) / h * m, (box[3].y - box[0].y) / h * m};
  return {Point{box[0].x - ux.x - uy.x, box[0].y - ux.y - uy.y}, Point{box[1].x + ux.x - uy.x, box[1].y + ux.y - uy.y},
          Point{box[2].x + ux.x + uy.x, box[2].y + ux.y + uy.y}, Point{box[3].x - ux.x + uy.x, box[3].y - ux.y + uy.y}};
}

LineGroups PackLines(const std::vector<int>& widths, int groups, int step, int free_width, double max_stretch) {
  groups = std::max(groups, 1);
  step = std::max(step, 1);
  LineGroups out;
  out.group_of.assign(widths.size(), 0);
  out.width.assign(static_cast<size_t>(groups), step);
  out.count.assign(static_cast<size_t>(groups), 0);
  if (widths.empty()) return out;
  // The distinct padded widths, narrowest first, with their lines.
  struct Bin {
    int64_t padded = 0, lines = 0;
  };
  std::vector<std::pair<int64_t, int64_t>> sorted;  // (padded, own width)
  for (int w : widths) {
    const int64_t own = std::clamp<int64_t>(w, 1, int64_t{1} << 20);
    sorted.emplace_back((own + step - 1) / step * step, own);
  }
  std::sort(sorted.begin(), sorted.end());
  std::vector<Bin> bins;
  for (const auto& line : sorted) {
    if (bins.empty() || bins.back().padded != line.first) bins.push_back({line.first, 0});
    ++bins.back().lines;
  }
  const size_t d = bins.size(), k = std::min(static_cast<size_t>(groups), d);
  std::vector<int64_t> before(d + 1, 0);  // lines in bins [0, i)
  for (size_t i = 0; i < d; ++i) before[i + 1] = before[i] + bins[i].lines;
  // A line's bound grows with its width, and the lines (sorted) of bins
  // [a, b] are lines [before[a], before[b + 1]): those a group padded to
  // bins[b].padded pads past their bounds are the ones before past[b].
  auto bound = [&](size_t line) {
    return std::max<double>(free_width, max_stretch * static_cast<double>(sorted[line].second));
  };
  std::vector<int64_t> past(d, 0);
  for (size_t b = 0, m = 0; b < d; ++b) {
    while (m < sorted.size() && bound(m) < static_cast<double>(bins[b].padded)) ++m;
    past[b] = static_cast<int64_t>(m);
  }
  // A group's cost: (lines padded past their bound, padded width in all),
  // compared in that order.
  auto cost = [&](size_t a, size_t b) {
    const int64_t over = std::max<int64_t>(0, std::min(past[b], before[b + 1]) - before[a]);
    return std::pair<int64_t, int64_t>{over, (before[b + 1] - before[a]) * bins[b].padded};
  };
  using Cost = std::pair<int64_t, int64_t>;
  constexpr Cost kNone{std::numeric_limits<int64_t>::max(), 0};
  // best[j][b]: bins [0, b] in j + 1 groups; from[j][b]: where its last group starts.
  std::vector<std::vector<Cost>> best(k, std::vector<Cost>(d, kNone));
  std::vector<std::vector<size_t>> from(k, std::vector<size_t>(d, 0));
  for (size_t b = 0; b < d; ++b) best[0][b] = cost(0, b);
  for (size_t j = 1; j < k; ++j) {
    for (size_t b = j; b < d; ++b) {
      for (size_t a = j; a <= b; ++a) {
        const Cost& left = best[j - 1][a - 1];
        if (left == kNone) continue;
        const Cost c = cost(a, b);
        const Cost total{left.first + c.first, left.second + c.second};
        if (total < best[j][b]) {
          best[j][b] = total;
          from[j][b] = a;
        }
      }
    }
  }
  // Bins [start[g], start[g + 1]) form group g.
  std::vector<size_t> start(k + 1, d);
  size_t end = d - 1;
  for (size_t j = k; j-- > 0;) {
    start[j] = j == 0 ? 0 : from[j][end];
    if (j > 0) end = start[j] - 1;
  }
  std::vector<int> group_of_bin(d, 0);
  for (size_t g = 0; g < k; ++g) {
    out.width[g] = static_cast<int>(bins[start[g + 1] - 1].padded);
    for (size_t i = start[g]; i < start[g + 1]; ++i) group_of_bin[i] = static_cast<int>(g);
  }
  for (size_t i = 0; i < widths.size(); ++i) {
    const int64_t own = std::clamp<int64_t>(widths[i], 1, int64_t{1} << 20);
    const int64_t padded = (own + step - 1) / step * step;
    const size_t bin = static_cast<size_t>(
        std::lower_bound(bins.begin(), bins.end(), padded, [](const Bin& x, int64_t v) { return x.padded < v; }) -
        bins.begin());
    out.group_of[i] = group_of_bin[bin];
    ++out.count[static_cast<size_t>(group_of_bin[bin])];
  }
  return out;
}

Decoded CtcDecode(const float* p, int64_t steps, int64_t classes, const std::vector<std::string>& characters) {
  Decoded d;
  double sum = 0;
  int64_t kept = 0, previous = -1;
  for (int64_t t = 0; t < steps; ++t) {
    const float* row = p + t * classes;
    const int64_t best = std::max_element(row, row + classes) - row;
    if (best != 0 && best != previous) {
      d.text += best <= static_cast<int64_t>(characters.size()) ? characters[static_cast<size_t>(best - 1)] : " ";
      sum += row[best];
      ++kept;
    }
    previous = best;
  }
  d.confidence = kept ? static_cast<float>(sum / static_cast<double>(kept)) : 0.f;
  return d;
}

}  // namespace quern::ocr
