#include "backends/stages/ocr_stages.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <numeric>

#include "pipeline/image.h"

namespace quern::ocr {
namespace {

// ---------------------------------------------------------------- geometry

double Cross(const Point& o, const Point& a, const Point& b) {
  return (a.x - o.x) * (b.y - o.y) - (a.y - o.y) * (b.x - o.x);
}

double Distance(const Point& a, const Point& b) {
  return std::hypot(a.x - b.x, a.y - b.y);
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

// get_rotate_crop_image: the box straightened into an image of its own
// (bilinear, edges replicated); turned 90 degrees counter-clockwise when it
// is at least 1.5 times as tall as wide.
Image CropBox(const uint8_t* src, int sw, int sh, const std::array<Point, 4>& box) {
  const int w = std::max(1, static_cast<int>(std::max(Distance(box[0], box[1]), Distance(box[2], box[3]))));
  const int h = std::max(1, static_cast<int>(std::max(Distance(box[0], box[3]), Distance(box[1], box[2]))));
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
  if (h >= 1.5 * w) {
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

// ---------------------------------------------------------------- stages

constexpr std::array<float, 3> kDetMean = {0.485f, 0.456f, 0.406f};
constexpr std::array<float, 3> kDetStd = {0.229f, 0.224f, 0.225f};
constexpr std::array<float, 3> kHalf = {0.5f, 0.5f, 0.5f};
constexpr int kLineHeight = 48;
constexpr int kClassifierWidth = 192;
// Bounds that keep any request's memory in check (a stage can be called on
// its own, with any tensors): the image as letterboxed, the detector's
// longest side (larger images are scaled down to it), the lines per image,
// a line's width at height 48, the straightened crops of one image and its
// lines at height 48.
constexpr int64_t kMaxPagePixels = 64'000'000;
constexpr int kMaxDetectorSide = 4096;
constexpr int64_t kMaxLines = 1000;
constexpr int kMaxLineWidth = 4096;
constexpr int64_t kMaxCropPixels = 16'000'000;        // all crops of one image
constexpr int64_t kMaxLineBytes = int64_t{64} << 20;  // one image's lines at height 48, 8-bit

Result<float> FloatParameter(const ModelConfig& c, const std::string& key, float fallback, float lo, float hi) {
  auto it = c.parameters.find(key);
  if (it == c.parameters.end()) return fallback;
  float v = 0;
  const auto [ptr, ec] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), v);
  if (ec != std::errc() || ptr != it->second.data() + it->second.size() || !(v >= lo && v <= hi)) {
    return Err(InvalidArgument("model '" + c.name + "': parameter " + key + " must be a number in [" +
                               std::to_string(lo) + ", " + std::to_string(hi) + "], got \"" + it->second + "\""));
  }
  return v;
}

Status WrongInput(const std::string& model, const std::string& what) {
  return InvalidArgument("model '" + model + "': " + what);
}

class DetectionInput final : public Model {
 public:
  DetectionInput(std::string name, int limit_side) : name_(std::move(name)), limit_side_(limit_side) {}
  Status Execute(const std::vector<NamedTensor>& inputs, int64_t, std::vector<NamedTensor>& outputs) override {
    QUERN_ASSIGN_OR_RETURN(auto images, inputs[0].tensor.Strings());
    if (images.size() != 1) return WrongInput(name_, "expects one encoded image");
    DecodeOptions decode;
    decode.max_pixels = 40'000'000;
    auto decoded = DecodeImage(images[0], decode);
    if (!decoded) return WrongInput(name_, "input 'image': " + decoded.error().message());
    const Image& rgb = decoded->image;
    // Very flat or very small images get black rows above and below
    // (RapidOCR's letterbox: height at least twice max(width / 8, 30)).
    int pad = 0;
    if (rgb.height <= 30 || rgb.width > 8 * rgb.height) {
      const int new_h = std::max(rgb.width / 8, 30) * 2;
      pad = std::abs(new_h - rgb.height) / 2;
    }
    const int w = rgb.width, h = rgb.height + 2 * pad;
    if (static_cast<int64_t>(w) * h > kMaxPagePixels) {
      return WrongInput(name_, "input 'image': a " + std::to_string(rgb.width) + " x " + std::to_string(rgb.height) +
                                   " image is too long and flat to read (at most " + std::to_string(kMaxPagePixels) +
                                   " pixels once padded to a height of a quarter of its width)");
    }
    Tensor pixels = Tensor::Allocate(DataType::kUint8, {h, w, 3}, static_cast<size_t>(w) * static_cast<size_t>(h) * 3);
    auto* bgr = reinterpret_cast<uint8_t*>(pixels.mutable_data());
    for (int y = 0; y < rgb.height; ++y) {
      const uint8_t* s = rgb.pixels.data() + static_cast<size_t>(y) * static_cast<size_t>(w) * 3;
      uint8_t* d = bgr + static_cast<size_t>(y + pad) * static_cast<size_t>(w) * 3;
      for (int x = 0; x < w; ++x) {
        d[3 * x] = s[3 * x + 2];
        d[3 * x + 1] = s[3 * x + 1];
        d[3 * x + 2] = s[3 * x];
      }
    }
    // The shortest side scaled up to limit_side (never down), each side
    // then rounded to a multiple of 32 (halves to even, as Python rounds).
    double ratio = std::min(w, h) < limit_side_ ? static_cast<double>(limit_side_) / std::min(w, h) : 1.0;
    ratio = std::min(ratio, static_cast<double>(kMaxDetectorSide) / std::max(w, h));
    const int rw = static_cast<int>(std::nearbyint(static_cast<int>(w * ratio) / 32.0)) * 32;
    const int rh = static_cast<int>(std::nearbyint(static_cast<int>(h * ratio) / 32.0)) * 32;
    if (rw <= 0 || rh <= 0) return WrongInput(name_, "the image is too small to look for text in");
    const std::vector<uint8_t> resized = Resize(bgr, w, h, rw, rh);
    Tensor det = Tensor::Allocate(DataType::kFp32, {1, 3, rh, rw},
                                  static_cast<size_t>(rw) * static_cast<size_t>(rh) * 3 * sizeof(float));
    ToPlanes(resized.data(), rw, rh, reinterpret_cast<float*>(det.mutable_data()), rw, kDetMean, kDetStd);
    const std::vector<float> geometry = {static_cast<float>(w), static_cast<float>(h), static_cast<float>(pad)};
    outputs.push_back({"detector_input", std::move(det)});
    outputs.push_back({"pixels", std::move(pixels)});
    outputs.push_back({"geometry", Tensor::From<float>(DataType::kFp32, {3}, geometry)});
    return Status::Ok();
  }

 private:
  std::string name_;
  int limit_side_;
};

Result<std::array<float, 3>> Geometry(const std::string& model, const Tensor& t) {
  auto g = t.values<float>();
  if (g.size() != 3 || !(g[0] >= 1 && g[1] >= 1 && g[2] >= 0 && g[0] < 1e6 && g[1] < 1e6 && g[2] < 1e6)) {
    return Err(WrongInput(model, "input 'geometry' must be [width, height, pad] of an image"));
  }
  return std::array<float, 3>{g[0], g[1], g[2]};
}

class DetectionBoxes final : public Model {
 public:
  DetectionBoxes(std::string name, DbOptions options) : name_(std::move(name)), options_(options) {}
  Status Execute(const std::vector<NamedTensor>& inputs, int64_t, std::vector<NamedTensor>& outputs) override {
    const Tensor& prob = inputs[0].tensor;
    QUERN_ASSIGN_OR_RETURN(auto g, Geometry(name_, inputs[1].tensor));
    const Shape& s = prob.shape();  // [1, 1, H, W]
    if (s[0] != 1 || s[2] < 1 || s[3] < 1) return WrongInput(name_, "input 'probability' must be one map");
    const auto boxes = DetectBoxes(prob.values<float>().data(), static_cast<int>(s[3]), static_cast<int>(s[2]),
                                   static_cast<int>(g[0]), static_cast<int>(g[1]), options_);
    const int64_t n = static_cast<int64_t>(boxes.size());
    std::vector<float> corners, scores;
    for (const auto& b : boxes) {
      for (const Point& p : b.corners) {
        corners.push_back(static_cast<float>(p.x));
        corners.push_back(static_cast<float>(p.y));
      }
      scores.push_back(b.score);
    }
    outputs.push_back({"boxes", Tensor::From<float>(DataType::kFp32, {n, 4, 2}, corners)});
    outputs.push_back({"box_scores", Tensor::From<float>(DataType::kFp32, {n}, scores)});
    return Status::Ok();
  }

 private:
  std::string name_;
  DbOptions options_;
};

class Crop final : public Model {
 public:
  explicit Crop(std::string name) : name_(std::move(name)) {}
  Status Execute(const std::vector<NamedTensor>& inputs, int64_t, std::vector<NamedTensor>& outputs) override {
    const Tensor& pixels = inputs[0].tensor;
    const Tensor& boxes = inputs[1].tensor;
    const int sh = static_cast<int>(pixels.shape()[0]), sw = static_cast<int>(pixels.shape()[1]);
    if (sw < 1 || sh < 1) return WrongInput(name_, "input 'pixels' holds no image");
    const int64_t n = boxes.shape()[0];
    if (n > kMaxLines) {
      return WrongInput(name_,
                        "input 'boxes' holds " + std::to_string(n) + " boxes; at most " + std::to_string(kMaxLines));
    }
    const auto* src = reinterpret_cast<const uint8_t*>(pixels.data());
    auto corners = boxes.values<float>();
    std::vector<Image> crops;
    double crop_pixels = 0;
    for (int64_t i = 0; i < n; ++i) {
      std::array<Point, 4> box;
      for (size_t k = 0; k < 4; ++k) {
        box[k] = {corners[static_cast<size_t>(i) * 8 + 2 * k], corners[static_cast<size_t>(i) * 8 + 2 * k + 1]};
        if (!std::isfinite(box[k].x) || !std::isfinite(box[k].y) || std::abs(box[k].x) > 1e6 ||
            std::abs(box[k].y) > 1e6) {
          return WrongInput(name_, "input 'boxes' holds a corner that is not a pixel position");
        }
      }
      const double cw = std::max(Distance(box[0], box[1]), Distance(box[2], box[3]));
      const double ch = std::max(Distance(box[0], box[3]), Distance(box[1], box[2]));
      crop_pixels += cw * ch;
      if (crop_pixels > static_cast<double>(kMaxCropPixels)) {
        return WrongInput(
            name_, "input 'boxes' would cut crops of more than " + std::to_string(kMaxCropPixels) + " pixels in all");
      }
      crops.push_back(CropBox(src, sw, sh, box));
    }
    // Each line at height 48, its aspect kept (at most kMaxLineWidth wide),
    // as 8-bit pixels: ocr_lines turns and normalises them.
    int width = 1;
    std::vector<int> widths;
    for (const Image& c : crops) {
      const double ratio = static_cast<double>(c.width) / c.height;
      widths.push_back(std::clamp(static_cast<int>(std::ceil(kLineHeight * ratio)), 1, kMaxLineWidth));
      width = std::max(width, widths.back());
    }
    const size_t cls_plane = static_cast<size_t>(kLineHeight) * kClassifierWidth * 3;
    const size_t line_bytes = static_cast<size_t>(kLineHeight) * static_cast<size_t>(width) * 3;
    if (static_cast<double>(n) * static_cast<double>(line_bytes) > static_cast<double>(kMaxLineBytes)) {
      return WrongInput(name_, std::to_string(n) + " lines up to " + std::to_string(width) +
                                   " pixels wide are more than one image may hold (" +
                                   std::to_string(kMaxLineBytes >> 20) + " MiB at height 48)");
    }
    Tensor cls = Tensor::Allocate(DataType::kFp32, {n, 3, kLineHeight, kClassifierWidth},
                                  static_cast<size_t>(n) * cls_plane * sizeof(float));
    Tensor lines = Tensor::Allocate(DataType::kUint8, {n, kLineHeight, width, 3}, static_cast<size_t>(n) * line_bytes);
    auto* cls_out = reinterpret_cast<float*>(cls.mutable_data());
    auto* line_out = reinterpret_cast<uint8_t*>(lines.mutable_data());
    for (int64_t i = 0; i < n; ++i) {
      const Image& c = crops[static_cast<size_t>(i)];
      const int lw = widths[static_cast<size_t>(i)];
      const int cw = std::min(lw, kClassifierWidth);
      const auto small = Resize(c.pixels.data(), c.width, c.height, cw, kLineHeight);
      ToPlanes(small.data(), cw, kLineHeight, cls_out + static_cast<size_t>(i) * cls_plane, kClassifierWidth, kHalf,
               kHalf);
      const auto line = Resize(c.pixels.data(), c.width, c.height, lw, kLineHeight);
      uint8_t* row0 = line_out + static_cast<size_t>(i) * line_bytes;
      for (int y = 0; y < kLineHeight; ++y) {
        std::memcpy(row0 + static_cast<size_t>(y) * static_cast<size_t>(width) * 3,
                    line.data() + static_cast<size_t>(y) * static_cast<size_t>(lw) * 3, static_cast<size_t>(lw) * 3);
      }
    }
    std::vector<int32_t> w32(widths.begin(), widths.end());
    outputs.push_back({"classifier_input", std::move(cls)});
    outputs.push_back({"lines", std::move(lines)});
    outputs.push_back({"widths", Tensor::From<int32_t>(DataType::kInt32, {n}, w32)});
    return Status::Ok();
  }

 private:
  std::string name_;
};

// The recogniser's inputs by width: a line goes to the narrowest width that
// holds it (the rest padded with zeros, as PaddleOCR pads), so that lines of
// every request meet in batches of one shape; lines wider than the widest
// bucket go together at their own widest width.
constexpr std::array<int, 5> kLineBuckets = {96, 192, 320, 640, 1280};
constexpr size_t kBuckets = kLineBuckets.size() + 1;  // and the wide ones

std::string BucketName(const std::string& prefix, size_t b) {
  return prefix + (b < kLineBuckets.size() ? std::to_string(kLineBuckets[b]) : std::string("wide"));
}

class Lines final : public Model {
 public:
  Lines(std::string name, float threshold) : name_(std::move(name)), threshold_(threshold) {}
  Status Execute(const std::vector<NamedTensor>& inputs, int64_t, std::vector<NamedTensor>& outputs) override {
    const Tensor& lines = inputs[0].tensor;  // [N, 48, W, 3] 8-bit
    auto widths = inputs[1].tensor.values<int32_t>();
    auto direction = inputs[2].tensor.values<float>();  // [N, 2]: 0 and 180 degrees
    const int64_t n = lines.shape()[0], h = lines.shape()[1], w = lines.shape()[2];
    if (static_cast<int64_t>(widths.size()) != n || static_cast<int64_t>(direction.size()) != 2 * n) {
      return WrongInput(name_, "inputs 'widths' and 'direction' must have one row per line");
    }
    if (n > 0 && w < 1) return WrongInput(name_, "input 'lines' has lines of no width");
    std::vector<int64_t> count(kBuckets, 0);
    std::vector<std::pair<int32_t, int32_t>> place(static_cast<size_t>(n));
    int64_t wide = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t lw = std::clamp<int64_t>(widths[static_cast<size_t>(i)], 1, w);
      size_t b = 0;
      while (b < kLineBuckets.size() && lw > kLineBuckets[b]) ++b;
      if (b == kLineBuckets.size()) wide = std::max(wide, (lw + 31) / 32 * 32);
      place[static_cast<size_t>(i)] = {static_cast<int32_t>(b), static_cast<int32_t>(count[b]++)};
    }
    std::vector<Tensor> out(kBuckets);
    for (size_t b = 0; b < kBuckets; ++b) {
      const int64_t bw = b < kLineBuckets.size() ? kLineBuckets[b] : std::max<int64_t>(wide, 32);
      out[b] = Tensor::Allocate(DataType::kFp32, {count[b], 3, h, bw},
                                static_cast<size_t>(count[b] * 3 * h * bw) * sizeof(float));
    }
    const auto* src = reinterpret_cast<const uint8_t*>(lines.data());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t lw = std::clamp<int64_t>(widths[static_cast<size_t>(i)], 1, w);
      const float p0 = direction[static_cast<size_t>(2 * i)], p180 = direction[static_cast<size_t>(2 * i + 1)];
      const bool turn = p180 > threshold_ && p180 > p0;  // upside down: turned 180 degrees within its width
      const auto [b, row] = place[static_cast<size_t>(i)];
      Tensor& t = out[static_cast<size_t>(b)];
      const int64_t bw = t.shape()[3];
      float* dst = reinterpret_cast<float*>(t.mutable_data()) + row * 3 * h * bw;
      const uint8_t* line = src + i * h * w * 3;
      for (int64_t y = 0; y < h; ++y) {
        for (int64_t x = 0; x < lw; ++x) {
          const uint8_t* px = line + ((turn ? h - 1 - y : y) * w + (turn ? lw - 1 - x : x)) * 3;
          for (int64_t c = 0; c < 3; ++c) dst[(c * h + y) * bw + x] = static_cast<float>(px[c]) / 127.5f - 1.f;
        }
      }
    }
    std::vector<int32_t> order;
    for (const auto& [b, row] : place) {
      order.push_back(b);
      order.push_back(row);
    }
    for (size_t b = 0; b < kBuckets; ++b) outputs.push_back({BucketName("lines_", b), std::move(out[b])});
    outputs.push_back({"order", Tensor::From<int32_t>(DataType::kInt32, {n, 2}, order)});
    return Status::Ok();
  }

 private:
  std::string name_;
  float threshold_;
};

class Text final : public Model {
 public:
  Text(std::string name, std::shared_ptr<const std::vector<std::string>> characters, float min_confidence)
      : name_(std::move(name)), characters_(std::move(characters)), min_confidence_(min_confidence) {}
  Status Execute(const std::vector<NamedTensor>& inputs, int64_t, std::vector<NamedTensor>& outputs) override {
    // inputs: probabilities_<bucket> [N_b, T_b, C] for each bucket, order [N, 2], boxes [N, 4, 2], geometry
    const Tensor& order = inputs[kBuckets].tensor;
    const Tensor& boxes = inputs[kBuckets + 1].tensor;
    QUERN_ASSIGN_OR_RETURN(auto g, Geometry(name_, inputs[kBuckets + 2].tensor));
    const int64_t n = order.shape()[0];
    if (boxes.shape()[0] != n) return WrongInput(name_, "inputs 'order' and 'boxes' differ in lines");
    const int64_t classes = static_cast<int64_t>(characters_->size()) + 2;
    for (size_t b = 0; b < kBuckets; ++b) {
      const Shape& s = inputs[b].tensor.shape();
      if (s[0] > 0 && s[2] != classes) {
        return WrongInput(name_, "input '" + inputs[b].name + "': the recogniser gives " + std::to_string(s[2]) +
                                     " classes; the dictionary has " + std::to_string(characters_->size()) +
                                     " characters (+ blank and space = " + std::to_string(classes) + ")");
      }
    }
    std::vector<std::string> text;
    std::vector<float> confidence, kept_boxes;
    auto corners = boxes.values<float>();
    auto where = order.values<int32_t>();
    for (int64_t i = 0; i < n; ++i) {
      const int32_t b = where[static_cast<size_t>(2 * i)], row = where[static_cast<size_t>(2 * i + 1)];
      if (b < 0 || static_cast<size_t>(b) >= kBuckets || row < 0 ||
          row >= inputs[static_cast<size_t>(b)].tensor.shape()[0]) {
        return WrongInput(name_, "input 'order' names line " + std::to_string(i) + "'s place wrongly");
      }
      const Tensor& p = inputs[static_cast<size_t>(b)].tensor;
      const int64_t steps = p.shape()[1];
      Decoded d = CtcDecode(p.values<float>().data() + row * steps * classes, steps, classes, *characters_);
      if (d.confidence < min_confidence_) continue;
      text.push_back(std::move(d.text));
      confidence.push_back(d.confidence);
      for (size_t k = 0; k < 8; ++k) {
        const float v = corners[static_cast<size_t>(i) * 8 + k];
        kept_boxes.push_back(k % 2 ? v - g[2] : v);  // y back above the letterbox rows
      }
    }
    const int64_t kept = static_cast<int64_t>(text.size());
    outputs.push_back({"text", Tensor::FromStrings({kept}, text)});
    outputs.push_back({"confidence", Tensor::From<float>(DataType::kFp32, {kept}, confidence)});
    outputs.push_back({"text_boxes", Tensor::From<float>(DataType::kFp32, {kept, 4, 2}, kept_boxes)});
    return Status::Ok();
  }

 private:
  std::string name_;
  std::shared_ptr<const std::vector<std::string>> characters_;
  float min_confidence_;
};

TensorConfig T(std::string name, DataType type, Shape dims) {
  TensorConfig t;
  t.name = std::move(name);
  t.dtype = type;
  t.dims = std::move(dims);
  return t;
}

// Fills in the stage's inputs and outputs, or checks those the
// configuration lists against them.
Status Declare(ModelConfig& c, const std::string& stage, std::vector<TensorConfig> inputs,
               std::vector<TensorConfig> outputs) {
  auto same = [](const std::vector<TensorConfig>& a, const std::vector<TensorConfig>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i].name != b[i].name || a[i].dtype != b[i].dtype || a[i].dims != b[i].dims) return false;
    }
    return true;
  };
  if (c.max_batch_size != 0) {
    return InvalidArgument("model '" + c.name + "': stage " + stage +
                           " takes one image per request (max_batch_size 0)");
  }
  if ((!c.inputs.empty() && !same(c.inputs, inputs)) || (!c.outputs.empty() && !same(c.outputs, outputs))) {
    std::string want;
    for (const auto& t : inputs) want += " " + t.name;
    want += " ->";
    for (const auto& t : outputs) want += " " + t.name;
    return InvalidArgument("model '" + c.name + "': stage " + stage +
                           " has its own inputs and outputs (leave them out of config.pbtxt):" + want);
  }
  c.inputs = std::move(inputs);
  c.outputs = std::move(outputs);
  return Status::Ok();
}

}  // namespace

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
      boxes.push_back({out, score});
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

Result<std::function<std::unique_ptr<Model>()>> MakeStage(const std::string& stage, ModelConfig& c,
                                                          const std::filesystem::path& model_dir) {
  const std::string name = c.name;
  using Factory = std::function<std::unique_ptr<Model>()>;
  if (stage == "ocr_detection_input") {
    QUERN_RETURN_IF_ERROR(Declare(c, stage, {T("image", DataType::kBytes, {1})},
                                  {T("detector_input", DataType::kFp32, {1, 3, -1, -1}),
                                   T("pixels", DataType::kUint8, {-1, -1, 3}), T("geometry", DataType::kFp32, {3})}));
    QUERN_ASSIGN_OR_RETURN(float side, FloatParameter(c, "quern.ocr.limit_side_len", 736, 32, 4096));
    return Factory([name, side] { return std::make_unique<DetectionInput>(name, static_cast<int>(side)); });
  }
  if (stage == "ocr_detection_boxes") {
    QUERN_RETURN_IF_ERROR(
        Declare(c, stage, {T("probability", DataType::kFp32, {1, 1, -1, -1}), T("geometry", DataType::kFp32, {3})},
                {T("boxes", DataType::kFp32, {-1, 4, 2}), T("box_scores", DataType::kFp32, {-1})}));
    DbOptions o;
    QUERN_ASSIGN_OR_RETURN(o.threshold, FloatParameter(c, "quern.ocr.threshold", 0.3f, 0, 1));
    QUERN_ASSIGN_OR_RETURN(o.box_threshold, FloatParameter(c, "quern.ocr.box_threshold", 0.5f, 0, 1));
    QUERN_ASSIGN_OR_RETURN(o.unclip_ratio, FloatParameter(c, "quern.ocr.unclip_ratio", 1.6f, 0, 10));
    return Factory([name, o] { return std::make_unique<DetectionBoxes>(name, o); });
  }
  if (stage == "ocr_crop") {
    QUERN_RETURN_IF_ERROR(
        Declare(c, stage, {T("pixels", DataType::kUint8, {-1, -1, 3}), T("boxes", DataType::kFp32, {-1, 4, 2})},
                {T("classifier_input", DataType::kFp32, {-1, 3, kLineHeight, kClassifierWidth}),
                 T("lines", DataType::kUint8, {-1, kLineHeight, -1, 3}), T("widths", DataType::kInt32, {-1})}));
    return Factory([name] { return std::make_unique<Crop>(name); });
  }
  if (stage == "ocr_lines") {
    std::vector<TensorConfig> out;
    for (size_t b = 0; b < kBuckets; ++b) {
      out.push_back(T(BucketName("lines_", b), DataType::kFp32,
                      {-1, 3, kLineHeight, b < kLineBuckets.size() ? kLineBuckets[b] : -1}));
    }
    out.push_back(T("order", DataType::kInt32, {-1, 2}));
    QUERN_RETURN_IF_ERROR(Declare(c, stage,
                                  {T("lines", DataType::kUint8, {-1, kLineHeight, -1, 3}),
                                   T("widths", DataType::kInt32, {-1}), T("direction", DataType::kFp32, {-1, 2})},
                                  std::move(out)));
    QUERN_ASSIGN_OR_RETURN(float threshold, FloatParameter(c, "quern.ocr.direction_threshold", 0.9f, 0, 1));
    return Factory([name, threshold] { return std::make_unique<Lines>(name, threshold); });
  }
  if (stage == "ocr_text") {
    std::vector<TensorConfig> text_in;
    for (size_t b = 0; b < kBuckets; ++b)
      text_in.push_back(T(BucketName("probabilities_", b), DataType::kFp32, {-1, -1, -1}));
    text_in.push_back(T("order", DataType::kInt32, {-1, 2}));
    text_in.push_back(T("boxes", DataType::kFp32, {-1, 4, 2}));
    text_in.push_back(T("geometry", DataType::kFp32, {3}));
    QUERN_RETURN_IF_ERROR(Declare(c, stage, std::move(text_in),
                                  {T("text", DataType::kBytes, {-1}), T("confidence", DataType::kFp32, {-1}),
                                   T("text_boxes", DataType::kFp32, {-1, 4, 2})}));
    QUERN_ASSIGN_OR_RETURN(float min_confidence, FloatParameter(c, "quern.ocr.min_confidence", 0.5f, 0, 1));
    auto it = c.parameters.find("quern.ocr.dictionary");
    if (it == c.parameters.end() || it->second.empty() || it->second.find('/') != std::string::npos ||
        it->second == "." || it->second == "..") {
      return Err(InvalidArgument("model '" + name +
                                 "': stage ocr_text needs parameter quern.ocr.dictionary, a file beside config.pbtxt "
                                 "(one character per line)"));
    }
    const std::filesystem::path file = model_dir / it->second;
    std::ifstream in(file, std::ios::binary);
    if (!in) return Err(NotFound("model '" + name + "': cannot read the dictionary " + file.string()));
    auto characters = std::make_shared<std::vector<std::string>>();
    std::string line;
    while (characters->size() <= 1'000'000 && std::getline(in, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      characters->push_back(line);
    }
    if (characters->empty() || characters->size() > 1'000'000) {
      return Err(
          InvalidArgument("model '" + name + "': the dictionary " + file.string() + " must hold 1 to 1000000 lines"));
    }
    std::shared_ptr<const std::vector<std::string>> shared = std::move(characters);
    return Factory([name, shared, min_confidence] { return std::make_unique<Text>(name, shared, min_confidence); });
  }
  return Err(InvalidArgument("model '" + name + "': unknown quern.stage '" + stage +
                             "' (ocr_detection_input, ocr_detection_boxes, ocr_crop, ocr_lines, ocr_text)"));
}

}  // namespace quern::ocr
