#include "backends/stages/ocr_stages.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <numeric>

#include "image/image.h"
#include "image/ocr.h"

namespace quern::ocr {
namespace {

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
  DetectionBoxes(std::string name, DbOptions options, float join_gap)
      : name_(std::move(name)), options_(options), join_gap_(join_gap) {}
  Status Execute(const std::vector<NamedTensor>& inputs, int64_t, std::vector<NamedTensor>& outputs) override {
    const Tensor& prob = inputs[0].tensor;
    QUERN_ASSIGN_OR_RETURN(auto g, Geometry(name_, inputs[1].tensor));
    const Shape& s = prob.shape();  // [1, 1, H, W]
    if (s[0] != 1 || s[2] < 1 || s[3] < 1) return WrongInput(name_, "input 'probability' must be one map");
    auto boxes = DetectBoxes(prob.values<float>().data(), static_cast<int>(s[3]), static_cast<int>(s[2]),
                             static_cast<int>(g[0]), static_cast<int>(g[1]), options_);
    if (join_gap_ > 0) boxes = JoinLines(std::move(boxes), join_gap_);
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
  float join_gap_;  // 0: the detector's boxes as they are, in RapidOCR's order
};

// `image` less `inset` pixels on every side (itself when that would leave
// less than a pixel).
Image Inset(const Image& image, int inset) {
  if (inset <= 0 || image.width <= 2 * inset || image.height <= 2 * inset) return image;
  Image out;
  out.width = image.width - 2 * inset;
  out.height = image.height - 2 * inset;
  out.pixels.resize(static_cast<size_t>(out.width) * static_cast<size_t>(out.height) * 3);
  for (int y = 0; y < out.height; ++y) {
    std::memcpy(
        &out.pixels[static_cast<size_t>(y) * static_cast<size_t>(out.width) * 3],
        &image.pixels[(static_cast<size_t>(y + inset) * static_cast<size_t>(image.width) + static_cast<size_t>(inset)) *
                      3],
        static_cast<size_t>(out.width) * 3);
  }
  return out;
}

class Crop final : public Model {
 public:
  Crop(std::string name, float margin) : name_(std::move(name)), margin_(margin) {}
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
    std::vector<int> insets;
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
      // The margin each side, in the crop's pixels (the crop keeps the box's scale).
      insets.push_back(
          static_cast<int>(std::lround(margin_ * std::min(Distance(box[0], box[1]), Distance(box[0], box[3])))));
      const std::array<Point, 4> grown = ExpandBox(box, margin_);
      // What CropBox will allocate (a side of no length still takes a pixel).
      const auto [cw, ch] = CropSize(grown);
      crop_pixels += static_cast<double>(cw) * static_cast<double>(ch);
      if (crop_pixels > static_cast<double>(kMaxCropPixels)) {
        return WrongInput(
            name_, "input 'boxes' would cut crops of more than " + std::to_string(kMaxCropPixels) + " pixels in all");
      }
      crops.push_back(CropBox(src, sw, sh, grown, &box));
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
      // The direction classifier sees the box itself: its margin misleads it on short words.
      const int inset = insets[static_cast<size_t>(i)];
      const Image inset_copy = inset > 0 ? Inset(c, inset) : Image{};
      const Image& inner = inset > 0 ? inset_copy : c;
      const auto small = Resize(inner.pixels.data(), inner.width, inner.height, cw, kLineHeight);
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
  float margin_;  // each side, times the box's height
};

// The recogniser's inputs: an image's lines in kLineGroups groups, each
// padded (with zeros, as PaddleOCR pads) to its widest line rounded up to 8,
// the groups chosen to pad as little as they can (PackLines): a line costs
// the recogniser in proportion to its padded width. A line is padded to at
// most 96 or 1.5 times its width where the groups allow (PP-OCRv4 reads
// "CORNER BAKERY", 410 px at height 48, right padded to 640 and as
// "CORNERBAKERY" padded to 960).
constexpr size_t kLineGroups = 12;
constexpr int kLineGroupStep = 8;
constexpr int kLineFreeWidth = 96;
constexpr double kLineMaxStretch = 1.5;

std::string GroupName(const std::string& prefix, size_t g) {
  return prefix + std::to_string(g);
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
    std::vector<int> held(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      // PackLines holds widths to 2^20 too: a group is never narrower than its lines.
      held[static_cast<size_t>(i)] =
          static_cast<int>(std::clamp<int64_t>(widths[static_cast<size_t>(i)], 1, std::min<int64_t>(w, 1 << 20)));
    }
    const LineGroups groups = PackLines(held, kLineGroups, kLineGroupStep, kLineFreeWidth, kLineMaxStretch);
    std::vector<std::pair<int32_t, int32_t>> place(static_cast<size_t>(n));
    std::vector<int64_t> rows(kLineGroups, 0);
    for (size_t i = 0; i < place.size(); ++i) {
      const size_t g = static_cast<size_t>(groups.group_of[i]);
      place[i] = {static_cast<int32_t>(g), static_cast<int32_t>(rows[g]++)};
    }
    std::vector<Tensor> out(kLineGroups);
    for (size_t g = 0; g < kLineGroups; ++g) {
      const int64_t gw = groups.width[g];
      out[g] = Tensor::Allocate(DataType::kFp32, {rows[g], 3, h, gw},
                                static_cast<size_t>(rows[g] * 3 * h * gw) * sizeof(float));
    }
    const auto* src = reinterpret_cast<const uint8_t*>(lines.data());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t lw = held[static_cast<size_t>(i)];
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
    for (size_t g = 0; g < kLineGroups; ++g) outputs.push_back({GroupName("lines_", g), std::move(out[g])});
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
    // inputs: probabilities_<g> [N_g, T_g, C] for each group, order [N, 2], boxes [N, 4, 2], geometry
    const Tensor& order = inputs[kLineGroups].tensor;
    const Tensor& boxes = inputs[kLineGroups + 1].tensor;
    QUERN_ASSIGN_OR_RETURN(auto g, Geometry(name_, inputs[kLineGroups + 2].tensor));
    const int64_t n = order.shape()[0];
    if (boxes.shape()[0] != n) return WrongInput(name_, "inputs 'order' and 'boxes' differ in lines");
    const int64_t classes = static_cast<int64_t>(characters_->size()) + 2;
    for (size_t b = 0; b < kLineGroups; ++b) {
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
      if (b < 0 || static_cast<size_t>(b) >= kLineGroups || row < 0 ||
          row >= inputs[static_cast<size_t>(b)].tensor.shape()[0]) {
        return WrongInput(name_, "input 'order' names line " + std::to_string(i) + "'s place wrongly");
      }
      const Tensor& p = inputs[static_cast<size_t>(b)].tensor;
      const int64_t steps = p.shape()[1];
      Decoded d = CtcDecode(p.values<float>().data() + row * steps * classes, steps, classes, *characters_);
      if (d.confidence < min_confidence_) continue;
      // Blank margins around a line read as spaces at its ends.
      d.text.erase(0, d.text.find_first_not_of(' '));
      d.text.erase(d.text.find_last_not_of(' ') + 1);
      if (d.text.empty()) continue;
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
    QUERN_ASSIGN_OR_RETURN(float join_gap, FloatParameter(c, "quern.ocr.join_gap", 0, 0, 100));
    return Factory([name, o, join_gap] { return std::make_unique<DetectionBoxes>(name, o, join_gap); });
  }
  if (stage == "ocr_crop") {
    QUERN_RETURN_IF_ERROR(
        Declare(c, stage, {T("pixels", DataType::kUint8, {-1, -1, 3}), T("boxes", DataType::kFp32, {-1, 4, 2})},
                {T("classifier_input", DataType::kFp32, {-1, 3, kLineHeight, kClassifierWidth}),
                 T("lines", DataType::kUint8, {-1, kLineHeight, -1, 3}), T("widths", DataType::kInt32, {-1})}));
    QUERN_ASSIGN_OR_RETURN(float margin, FloatParameter(c, "quern.ocr.crop_margin", 0, 0, 2));
    return Factory([name, margin] { return std::make_unique<Crop>(name, margin); });
  }
  if (stage == "ocr_lines") {
    std::vector<TensorConfig> out;
    for (size_t g = 0; g < kLineGroups; ++g)
      out.push_back(T(GroupName("lines_", g), DataType::kFp32, {-1, 3, kLineHeight, -1}));
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
    for (size_t b = 0; b < kLineGroups; ++b)
      text_in.push_back(T(GroupName("probabilities_", b), DataType::kFp32, {-1, -1, -1}));
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
