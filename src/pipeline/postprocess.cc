#include "pipeline/postprocess.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/half.h"

namespace quern {

Result<std::vector<float>> OutputAsFloats(const NamedTensor& t) {
  const size_t n = static_cast<size_t>(ElementCount(t.tensor.shape()));
  std::vector<float> out(n);
  const auto* p = t.tensor.data();
  switch (t.tensor.dtype()) {
    case DataType::kFp32: std::memcpy(out.data(), p, n * 4); break;
    case DataType::kFp16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + i * 2, 2);
        out[i] = HalfToFloat(h);
      }
      break;
    case DataType::kFp64:
      for (size_t i = 0; i < n; ++i) {
        double d;
        std::memcpy(&d, p + i * 8, 8);
        out[i] = static_cast<float>(d);
      }
      break;
    case DataType::kInt64:
      for (size_t i = 0; i < n; ++i) {
        int64_t v;
        std::memcpy(&v, p + i * 8, 8);
        out[i] = static_cast<float>(v);
      }
      break;
    case DataType::kInt32:
      for (size_t i = 0; i < n; ++i) {
        int32_t v;
        std::memcpy(&v, p + i * 4, 4);
        out[i] = static_cast<float>(v);
      }
      break;
    default:
      return std::unexpected(InvalidArgument("output '" + t.name + "' has datatype " +
                                             std::string(DataTypeName(t.tensor.dtype())) +
                                             "; a detection or classification output must be numeric"));
  }
  return out;
}

namespace {

Result<std::vector<float>> AsFloats(const NamedTensor& t) {
  return OutputAsFloats(t);
}

// A numeric output's values as floats, read in place when the tensor holds
// aligned FP32 (no copy of a 25200 x 85 output), else converted.
struct Floats {
  const float* data = nullptr;
  std::vector<float> converted;
};

Result<Floats> ViewFloats(const NamedTensor& t) {
  Floats f;
  const size_t n = static_cast<size_t>(ElementCount(t.tensor.shape()));
  if (t.tensor.dtype() == DataType::kFp32 && reinterpret_cast<uintptr_t>(t.tensor.data()) % alignof(float) == 0 &&
      t.tensor.byte_size() >= n * sizeof(float)) {
    f.data = reinterpret_cast<const float*>(t.tensor.data());
    return f;
  }
  QUERN_ASSIGN_OR_RETURN(f.converted, OutputAsFloats(t));
  f.data = f.converted.data();
  return f;
}

// The shape without a leading batch dimension of 1.
Shape ItemShape(const Shape& s, size_t rank) {
  if (s.size() == rank + 1 && s[0] == 1) return Shape(s.begin() + 1, s.end());
  return s;
}

float Sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}

void SoftmaxInPlace(float* v, size_t n) {
  if (n == 0) return;
  const float m = *std::max_element(v, v + n);
  float sum = 0;
  for (size_t i = 0; i < n; ++i) sum += (v[i] = std::exp(v[i] - m));
  for (size_t i = 0; i < n; ++i) v[i] /= sum;
}

Detection BoxFrom(float a, float b, float c, float d, const DetectionSpec& spec, int w, int h) {
  if (spec.normalized) {
    a *= static_cast<float>(w), c *= static_cast<float>(w);
    b *= static_cast<float>(h), d *= static_cast<float>(h);
  }
  Detection det;
  if (spec.box == BoxEncoding::kCxCyWh) {
    det.x_min = a - c / 2, det.x_max = a + c / 2, det.y_min = b - d / 2, det.y_max = b + d / 2;
  } else {
    det.x_min = a, det.y_min = b, det.x_max = c, det.y_max = d;
  }
  return det;
}

std::string ShapeOf(const NamedTensor& t) {
  return "output '" + t.name + "' has shape " + ShapeToString(t.tensor.shape());
}

}  // namespace

std::vector<Classification> TopK(const std::vector<float>& scores, int k, SoftmaxMode softmax,
                                 const std::vector<std::string>& labels) {
  std::vector<float> p = scores;
  bool apply = softmax == SoftmaxMode::kAlways;
  if (softmax == SoftmaxMode::kAuto) {
    double sum = 0;
    bool in_range = true;
    for (float v : p) {
      sum += v;
      in_range = in_range && v >= 0.0f && v <= 1.0f;
    }
    apply = !(in_range && std::abs(sum - 1.0) < 1e-3);
  }
  if (apply) SoftmaxInPlace(p.data(), p.size());
  std::vector<int> idx(p.size());
  std::iota(idx.begin(), idx.end(), 0);
  const size_t n = std::min(idx.size(), static_cast<size_t>(std::max(k, 0)));
  std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(n), idx.end(), [&](int a, int b) {
    return p[static_cast<size_t>(a)] > p[static_cast<size_t>(b)] ||
           (p[static_cast<size_t>(a)] == p[static_cast<size_t>(b)] && a < b);
  });
  std::vector<Classification> out;
  for (size_t i = 0; i < n; ++i) {
    const int id = idx[i];
    out.push_back({id, static_cast<size_t>(id) < labels.size() ? labels[static_cast<size_t>(id)] : std::to_string(id),
                   p[static_cast<size_t>(id)]});
  }
  return out;
}

float IntersectionOverUnion(const Detection& a, const Detection& b) {
  const float iw = std::min(a.x_max, b.x_max) - std::max(a.x_min, b.x_min);
  const float ih = std::min(a.y_max, b.y_max) - std::max(a.y_min, b.y_min);
  if (iw <= 0 || ih <= 0) return 0;
  const float inter = iw * ih;
  const float area_a = (a.x_max - a.x_min) * (a.y_max - a.y_min), area_b = (b.x_max - b.x_min) * (b.y_max - b.y_min);
  return inter / (area_a + area_b - inter);
}

std::vector<Detection> NonMaxSuppression(std::vector<Detection> boxes, float iou_threshold, int max_detections) {
  std::stable_sort(boxes.begin(), boxes.end(),
                   [](const Detection& a, const Detection& b) { return a.confidence > b.confidence; });
  std::vector<Detection> kept;
  for (const auto& b : boxes) {
    if (static_cast<int>(kept.size()) >= max_detections) break;
    bool suppressed = false;
    for (const auto& k : kept) {
      if (k.class_id == b.class_id && IntersectionOverUnion(k, b) > iou_threshold) {
        suppressed = true;
        break;
      }
    }
    if (!suppressed) kept.push_back(b);
  }
  return kept;
}

namespace {

// A raw score as the spec says to read it (sigmoid, or as it is).
float Activate(const DetectionSpec& spec, float v) {
  return spec.activation == ScoreActivation::kSigmoid ? Sigmoid(v) : v;
}

// The arguments every layout's decoder takes: the model's outputs, how to
// read them, and where the found boxes go.
struct DecodeInput {
  const std::vector<NamedTensor>& outputs;
  const DetectionSpec& spec;
  float min_confidence;
  int input_width, input_height;
};

// YOLOv5 [1, boxes, 5 + classes] and YOLOv8 [1, 4 + classes, boxes].
Status DecodeYolo(const DecodeInput& in, std::vector<Detection>& found) {
  const std::vector<NamedTensor>& outputs = in.outputs;
  const DetectionSpec& spec = in.spec;
  const float min_confidence = in.min_confidence;
  const int input_width = in.input_width, input_height = in.input_height;
  auto activate = [&](float v) { return Activate(spec, v); };
  if (outputs.empty()) return InvalidArgument("the detection model returned no output");
  const NamedTensor& out = outputs[0];
  const Shape s = ItemShape(out.tensor.shape(), 2);
  const bool v5 = spec.format == DetectionFormat::kYoloV5;
  if (s.size() != 2 || (v5 ? s[1] < 6 : s[0] < 5)) {
    return InvalidArgument(ShapeOf(out) + (v5 ? "; the YOLOv5 layout is [1, boxes, 5 + classes]"
                                              : "; the YOLOv8 layout is [1, 4 + classes, boxes]"));
  }
  QUERN_ASSIGN_OR_RETURN(Floats f, ViewFloats(out));
  const float* v = f.data;
  const size_t boxes = static_cast<size_t>(v5 ? s[0] : s[1]);
  const size_t classes = static_cast<size_t>(v5 ? s[1] - 5 : s[0] - 4);
  const bool softmax = spec.activation == ScoreActivation::kSoftmax;
  std::vector<float> scratch(softmax ? classes : 0);
  // The best class of `n` scores `stride` apart: its index and its score
  // (activated). Sigmoid is monotonic: the best raw score wins.
  auto best_class = [&](const float* first, size_t stride, size_t& best) {
    best = 0;
    float top = -INFINITY;
    if (softmax) {
      for (size_t c = 0; c < classes; ++c) scratch[c] = first[c * stride];
      SoftmaxInPlace(scratch.data(), classes);
      first = scratch.data();
      stride = 1;
    }
    for (size_t c = 0; c < classes; ++c) {
      if (first[c * stride] > top) top = first[c * stride], best = c;
    }
    return top == -INFINITY ? top : activate(top);
  };
  if (v5) {
    // YOLOv5's own order: a box whose objectness is under the threshold
    // is no candidate, and its class scores are never read.
    const size_t stride = static_cast<size_t>(s[1]);
    for (size_t i = 0; i < boxes; ++i) {
      const float* row = v + i * stride;
      const float objectness = activate(row[4]);
      if (!(objectness >= min_confidence)) continue;
      size_t best = 0;
      const float score = best_class(row + 5, 1, best) * objectness;
      if (!(score >= min_confidence)) continue;
      Detection d = BoxFrom(row[0], row[1], row[2], row[3], spec, input_width, input_height);
      d.class_id = static_cast<int>(best);
      d.confidence = score;
      found.push_back(d);
    }
  } else if (softmax) {
    for (size_t i = 0; i < boxes; ++i) {
      size_t best = 0;
      const float score = best_class(v + 4 * boxes + i, boxes, best);
      if (!(score >= min_confidence)) continue;
      Detection d = BoxFrom(v[i], v[boxes + i], v[2 * boxes + i], v[3 * boxes + i], spec, input_width, input_height);
      d.class_id = static_cast<int>(best);
      d.confidence = score;
      found.push_back(d);
    }
  } else {
    // Class rows are contiguous: the best class of every box in one pass
    // per class (vectorised), then the threshold.
    std::vector<float> top(boxes, -INFINITY);
    std::vector<int32_t> best(boxes, 0);
    for (size_t c = 0; c < classes; ++c) {
      const float* r = v + (4 + c) * boxes;
      const auto id = static_cast<int32_t>(c);
      for (size_t i = 0; i < boxes; ++i) {
        const bool better = r[i] > top[i];
        top[i] = better ? r[i] : top[i];
        best[i] = better ? id : best[i];
      }
    }
    for (size_t i = 0; i < boxes; ++i) {
      if (top[i] == -INFINITY) continue;
      const float score = activate(top[i]);
      if (!(score >= min_confidence)) continue;
      Detection d = BoxFrom(v[i], v[boxes + i], v[2 * boxes + i], v[3 * boxes + i], spec, input_width, input_height);
      d.class_id = best[i];
      d.confidence = score;
      found.push_back(d);
    }
  }
  return Status::Ok();
}

// CenterFace: a heatmap, log sizes and offsets on one grid.
Status DecodeCenterFace(const DecodeInput& in, std::vector<Detection>& found) {
  const std::vector<NamedTensor>& outputs = in.outputs;
  const DetectionSpec& spec = in.spec;
  const float min_confidence = in.min_confidence;
  const int input_width = in.input_width, input_height = in.input_height;
  auto activate = [&](float v) { return Activate(spec, v); };
  constexpr const char* kLayout =
      "the CenterFace layout is heatmap [1, 1, h, w], log size [1, 2, h, w] and offset [1, 2, h, w], in this order";
  if (outputs.size() < 3) {
    return InvalidArgument(std::string(kLayout) + "; the model has " + std::to_string(outputs.size()) + " outputs");
  }
  const Shape hs = ItemShape(outputs[0].tensor.shape(), 3);
  if (hs.size() != 3 || hs[0] != 1 || hs[1] < 1 || hs[2] < 1) {
    return InvalidArgument(ShapeOf(outputs[0]) + "; " + kLayout);
  }
  for (int i : {1, 2}) {
    const Shape t = ItemShape(outputs[static_cast<size_t>(i)].tensor.shape(), 3);
    if (t != Shape{2, hs[1], hs[2]}) {
      return InvalidArgument(ShapeOf(outputs[static_cast<size_t>(i)]) + "; " + kLayout);
    }
  }
  const size_t h = static_cast<size_t>(hs[1]), w = static_cast<size_t>(hs[2]), cells = h * w;
  const float stride_y = static_cast<float>(input_height) / static_cast<float>(h);
  const float stride_x = static_cast<float>(input_width) / static_cast<float>(w);
  QUERN_ASSIGN_OR_RETURN(Floats heat, ViewFloats(outputs[0]));
  QUERN_ASSIGN_OR_RETURN(Floats size, ViewFloats(outputs[1]));
  QUERN_ASSIGN_OR_RETURN(Floats offset, ViewFloats(outputs[2]));
  for (size_t y = 0; y < h; ++y) {
    for (size_t x = 0; x < w; ++x) {
      const size_t c = y * w + x;
      const float score = activate(heat.data[c]);
      if (!(score >= min_confidence)) continue;
      const float bh = std::exp(size.data[c]) * stride_y, bw = std::exp(size.data[cells + c]) * stride_x;
      const float cy = (static_cast<float>(y) + offset.data[c] + 0.5f) * stride_y;
      const float cx = (static_cast<float>(x) + offset.data[cells + c] + 0.5f) * stride_x;
      Detection d;
      d.class_id = 0;
      d.confidence = score;
      d.x_min = cx - bw / 2, d.x_max = cx + bw / 2, d.y_min = cy - bh / 2, d.y_max = cy + bh / 2;
      found.push_back(d);
    }
  }
  return Status::Ok();
}

// DETR: boxes per query, with class scores or with labels and scores.
Status DecodeDetr(const DecodeInput& in, std::vector<Detection>& found) {
  const std::vector<NamedTensor>& outputs = in.outputs;
  const DetectionSpec& spec = in.spec;
  const float min_confidence = in.min_confidence;
  const int input_width = in.input_width, input_height = in.input_height;
  auto activate = [&](float v) { return Activate(spec, v); };
  const NamedTensor *boxes = nullptr, *scores = nullptr, *labels = nullptr;
  for (const auto& o : outputs) {
    const Shape& sh = o.tensor.shape();
    const bool integer = o.tensor.dtype() == DataType::kInt64 || o.tensor.dtype() == DataType::kInt32;
    if (!boxes && sh.size() >= 2 && sh.back() == 4 && !integer) {
      boxes = &o;
    } else if (integer) {
      labels = &o;
    } else if (!scores) {
      scores = &o;
    }
  }
  if (!boxes || !scores) {
    return InvalidArgument(
        "the DETR layout needs a boxes output [1, queries, 4] and a scores output ([1, queries, classes] or "
        "[1, queries] with labels [1, queries]); the model has " +
        std::to_string(outputs.size()) + " outputs");
  }
  const Shape bs = ItemShape(boxes->tensor.shape(), 2);
  if (bs.size() != 2 || bs[1] != 4) {
    return InvalidArgument(ShapeOf(*boxes) + "; DETR boxes are [1, queries, 4]");
  }
  const size_t q = static_cast<size_t>(bs[0]);
  QUERN_ASSIGN_OR_RETURN(std::vector<float> bv, AsFloats(*boxes));
  QUERN_ASSIGN_OR_RETURN(std::vector<float> sv, AsFloats(*scores));
  std::vector<float> lv;
  size_t classes = 0;
  if (labels) {
    QUERN_ASSIGN_OR_RETURN(lv, AsFloats(*labels));
    if (lv.size() != q || sv.size() != q) {
      return InvalidArgument(ShapeOf(*scores) + " and " + ShapeOf(*labels) + "; with " + std::to_string(q) +
                             " boxes both must be [1, " + std::to_string(q) + "]");
    }
  } else {
    const Shape ss = ItemShape(scores->tensor.shape(), 2);
    if (ss.size() != 2 || static_cast<size_t>(ss[0]) != q || ss[1] < 1) {
      return InvalidArgument(ShapeOf(*scores) + "; with " + std::to_string(q) + " boxes the class scores must be [1, " +
                             std::to_string(q) + ", classes]");
    }
    classes = static_cast<size_t>(ss[1]);
  }
  for (size_t i = 0; i < q; ++i) {
    size_t best = 0;
    float score;
    if (labels) {
      best = static_cast<size_t>(std::max(0.0f, lv[i]));
      score = activate(sv[i]);
    } else {
      float* row = &sv[i * classes];
      size_t usable = classes;
      if (spec.activation == ScoreActivation::kSoftmax) {
        SoftmaxInPlace(row, classes);
        if (classes > 1) usable = classes - 1;  // drop "no object"
      }
      score = -INFINITY;
      for (size_t c = 0; c < usable; ++c) {
        const float sc = activate(row[c]);
        if (sc > score) score = sc, best = c;
      }
    }
    if (!(score >= min_confidence)) continue;
    Detection d = BoxFrom(bv[i * 4], bv[i * 4 + 1], bv[i * 4 + 2], bv[i * 4 + 3], spec, input_width, input_height);
    d.class_id = static_cast<int>(best);
    d.confidence = score;
    found.push_back(d);
  }
  return Status::Ok();
}

}  // namespace

Result<std::vector<Detection>> DecodeDetections(const std::vector<NamedTensor>& outputs, const DetectionSpec& spec,
                                                float min_confidence, int input_width, int input_height) {
  std::vector<Detection> found;
  const DecodeInput in{outputs, spec, min_confidence, input_width, input_height};
  if (spec.format == DetectionFormat::kYoloV5 || spec.format == DetectionFormat::kYoloV8) {
    QUERN_RETURN_IF_ERROR(DecodeYolo(in, found));
  } else if (spec.format == DetectionFormat::kCenterFace) {
    QUERN_RETURN_IF_ERROR(DecodeCenterFace(in, found));
  } else {
    QUERN_RETURN_IF_ERROR(DecodeDetr(in, found));
  }
  if (spec.nms) return NonMaxSuppression(std::move(found), spec.iou_threshold, spec.max_detections);
  std::stable_sort(found.begin(), found.end(),
                   [](const Detection& a, const Detection& b) { return a.confidence > b.confidence; });
  if (static_cast<int>(found.size()) > spec.max_detections) found.resize(static_cast<size_t>(spec.max_detections));
  return found;
}

Detection MapToSource(const Detection& d, const ImageTransform& t) {
  Detection out = d;
  const auto w = static_cast<double>(t.source_width), h = static_cast<double>(t.source_height);
  out.x_min = static_cast<float>(std::clamp(t.ToSourceX(d.x_min), 0.0, w));
  out.x_max = static_cast<float>(std::clamp(t.ToSourceX(d.x_max), 0.0, w));
  out.y_min = static_cast<float>(std::clamp(t.ToSourceY(d.y_min), 0.0, h));
  out.y_max = static_cast<float>(std::clamp(t.ToSourceY(d.y_max), 0.0, h));
  return out;
}

}  // namespace quern
