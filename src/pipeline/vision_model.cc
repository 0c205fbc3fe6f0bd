#include "pipeline/vision_model.h"

#include <charconv>
#include <filesystem>
#include <fstream>
#include <set>

#include "core/repository.h"

namespace quern {
namespace {

class Params {
 public:
  Params(const ModelConfig& c) : c_(c) {}

  const std::string* Get(const std::string& key) const {
    known_.insert(key);
    auto it = c_.parameters.find(key);
    return it == c_.parameters.end() ? nullptr : &it->second;
  }

  Status Error(const std::string& key, const std::string& value, const std::string& expected) const {
    return InvalidArgument("model '" + c_.name + "': parameter " + key + " is '" + value + "', expected " + expected);
  }

  template <typename E>
  Status Choice(const std::string& key, std::initializer_list<std::pair<const char*, E>> choices, E* out) const {
    const std::string* v = Get(key);
    if (!v) return Status::Ok();
    std::string names;
    for (const auto& [name, value] : choices) {
      if (*v == name) {
        *out = value;
        return Status::Ok();
      }
      names += (names.empty() ? "" : " | ") + std::string(name);
    }
    return Error(key, *v, names);
  }

  Status Float(const std::string& key, float* out, float lo, float hi) const {
    const std::string* v = Get(key);
    if (!v) return Status::Ok();
    float f = 0;
    auto [p, ec] = std::from_chars(v->data(), v->data() + v->size(), f);
    if (ec != std::errc() || p != v->data() + v->size() || !(f >= lo && f <= hi)) {
      return Error(key, *v, "a number in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    *out = f;
    return Status::Ok();
  }

  Status Int(const std::string& key, int* out, int lo, int hi) const {
    const std::string* v = Get(key);
    if (!v) return Status::Ok();
    int i = 0;
    auto [p, ec] = std::from_chars(v->data(), v->data() + v->size(), i);
    if (ec != std::errc() || p != v->data() + v->size() || i < lo || i > hi) {
      return Error(key, *v, "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    *out = i;
    return Status::Ok();
  }

  Status Bool(const std::string& key, bool* out) const {
    return Choice<bool>(key, {{"true", true}, {"false", false}}, out);
  }

  Status Triple(const std::string& key, std::array<float, 3>* out) const {
    const std::string* v = Get(key);
    if (!v) return Status::Ok();
    std::array<float, 3> t{};
    const char* p = v->data();
    const char* end = v->data() + v->size();
    for (size_t i = 0; i < 3; ++i) {
      while (p < end && *p == ' ') ++p;
      auto [q, ec] = std::from_chars(p, end, t[i]);
      if (ec != std::errc()) return Error(key, *v, "three comma-separated numbers");
      p = q;
      while (p < end && *p == ' ') ++p;
      if (i < 2) {
        if (p == end || *p != ',') return Error(key, *v, "three comma-separated numbers");
        ++p;
      }
    }
    if (p != end) return Error(key, *v, "three comma-separated numbers");
    *out = t;
    return Status::Ok();
  }

  // Every quern.* vision parameter of the model was read by a Get: a
  // misspelt one fails the load instead of being ignored.
  Status CheckAllKnown() const {
    for (const auto& [k, v] : c_.parameters) {
      if (IsVisionKey(k) && !known_.contains(k)) {
        return InvalidArgument("model '" + c_.name + "': unknown parameter " + k);
      }
    }
    return Status::Ok();
  }

  static bool IsVisionKey(const std::string& k) {
    return k == "quern.task" || k.starts_with("quern.image.") || k.starts_with("quern.detection.") ||
           k.starts_with("quern.classification.") || k.starts_with("quern.embedding.");
  }

 private:
  const ModelConfig& c_;
  mutable std::set<std::string> known_;
};

}  // namespace

const std::string& VisionModel::Label(int class_id) const {
  static const std::string kNone;
  return class_id >= 0 && static_cast<size_t>(class_id) < labels.size() ? labels[static_cast<size_t>(class_id)] : kNone;
}

bool IsVisionModel(const ModelConfig& config) {
  for (const auto& [k, v] : config.parameters) {
    if (Params::IsVisionKey(k)) return true;
  }
  return false;
}

Result<VisionModel> VisionModelFromStatus(const ModelStatus& status, const std::filesystem::path& model_dir) {
  const ModelConfig& c = status.config;
  const Params p(c);
  VisionModel m;
  m.name = status.name;
  m.version = status.version;
  const std::string where = "model '" + c.name + "'";

  m.task = p.Get("quern.detection.format") ? VisionTask::kDetection : VisionTask::kClassification;
  QUERN_RETURN_IF_ERROR(p.Choice<VisionTask>("quern.task",
                                             {{"classification", VisionTask::kClassification},
                                              {"detection", VisionTask::kDetection},
                                              {"embedding", VisionTask::kEmbedding}},
                                             &m.task));

  // The image input and its geometry.
  const TensorConfig* input = nullptr;
  if (const std::string* name = p.Get("quern.image.input")) {
    input = c.FindInput(*name);
    if (!input)
      return std::unexpected(
          InvalidArgument(where + ": quern.image.input names '" + *name + "', which is not an input"));
  } else if (c.inputs.size() == 1) {
    input = &c.inputs[0];
  } else {
    return std::unexpected(InvalidArgument(where + " has " + std::to_string(c.inputs.size()) +
                                           " inputs; name the image input with parameter quern.image.input"));
  }
  m.input_name = input->name;
  Shape dims = input->dims;
  const bool batched = c.max_batch_size > 0;
  if (!batched && dims.size() == 4 && (dims[0] == 1 || dims[0] == -1)) dims.erase(dims.begin());
  if (dims.size() != 3 || !(dims[0] == 3 || dims[2] == 3)) {
    return std::unexpected(InvalidArgument(where + ": image input '" + input->name + "' has dims " +
                                           ShapeToString(input->dims) +
                                           "; expected [3, height, width] or [height, width, 3] (after the batch "
                                           "dimension)"));
  }
  m.image.layout = dims[0] == 3 ? TensorLayout::kNchw : TensorLayout::kNhwc;
  QUERN_RETURN_IF_ERROR(p.Choice<TensorLayout>(
      "quern.image.layout", {{"NCHW", TensorLayout::kNchw}, {"NHWC", TensorLayout::kNhwc}}, &m.image.layout));
  int64_t h = m.image.layout == TensorLayout::kNchw ? dims[1] : dims[0];
  int64_t w = m.image.layout == TensorLayout::kNchw ? dims[2] : dims[1];
  if (const std::string* size = p.Get("quern.image.size")) {
    const auto x = size->find('x');
    int sw = 0, sh = 0;
    if (x == std::string::npos || std::from_chars(size->data(), size->data() + x, sw).ec != std::errc() ||
        std::from_chars(size->data() + x + 1, size->data() + size->size(), sh).ec != std::errc() || sw < 1 || sh < 1 ||
        sw > 16384 || sh > 16384) {
      return std::unexpected(p.Error("quern.image.size", *size, "WIDTHxHEIGHT, e.g. 640x640"));
    }
    w = sw, h = sh;
  }
  if (w < 1 || h < 1) {
    return std::unexpected(InvalidArgument(where + ": image input '" + input->name + "' has dims " +
                                           ShapeToString(input->dims) +
                                           " without a fixed height and width; set parameter quern.image.size "
                                           "(e.g. 640x640)"));
  }
  m.image.width = static_cast<int>(w);
  m.image.height = static_cast<int>(h);
  m.input_shape = m.image.layout == TensorLayout::kNchw ? Shape{3, h, w} : Shape{h, w, 3};
  if (batched || input->dims.size() == 4) m.input_shape.insert(m.input_shape.begin(), 1);
  m.max_batch_size = c.max_batch_size;
  m.instances = c.instance_count;  // the groups' instances as placed (0: one per core, not known here)
  if (m.task == VisionTask::kEmbedding && m.input_shape.size() != 4) {
    return std::unexpected(InvalidArgument(where + ": an embedding model takes its crops in a batch; give it "
                                                   "max_batch_size (or a 4-dimensional image input)"));
  }
  m.image.dtype = input->dtype;
  if (m.image.dtype != DataType::kFp32 && m.image.dtype != DataType::kFp16 && m.image.dtype != DataType::kUint8) {
    return std::unexpected(InvalidArgument(where + ": image input '" + input->name + "' is " +
                                           std::string(DataTypeName(input->dtype)) +
                                           "; images can feed FP32, FP16 or UINT8 inputs"));
  }

  const bool detection = m.task == VisionTask::kDetection;
  m.image.resize = detection ? ResizeMode::kLetterbox : ResizeMode::kStretch;
  QUERN_RETURN_IF_ERROR(p.Choice<ResizeMode>("quern.image.resize",
                                             {{"stretch", ResizeMode::kStretch},
                                              {"letterbox", ResizeMode::kLetterbox},
                                              {"center_crop", ResizeMode::kCenterCrop}},
                                             &m.image.resize));
  int pad = m.image.pad_value;
  QUERN_RETURN_IF_ERROR(p.Int("quern.image.pad_value", &pad, 0, 255));
  m.image.pad_value = static_cast<uint8_t>(pad);
  QUERN_RETURN_IF_ERROR(p.Int("quern.image.resize_shortest", &m.image.resize_shortest, 1, 16384));
  QUERN_RETURN_IF_ERROR(p.Choice<ChannelOrder>(
      "quern.image.channels", {{"RGB", ChannelOrder::kRgb}, {"BGR", ChannelOrder::kBgr}}, &m.image.channels));
  QUERN_RETURN_IF_ERROR(p.Float("quern.image.scale", &m.image.scale, -1e6f, 1e6f));
  QUERN_RETURN_IF_ERROR(p.Triple("quern.image.mean", &m.image.mean));
  QUERN_RETURN_IF_ERROR(p.Triple("quern.image.std", &m.image.std));
  for (float s : m.image.std) {
    if (s == 0.0f) return std::unexpected(p.Error("quern.image.std", *p.Get("quern.image.std"), "no zero"));
  }

  QUERN_RETURN_IF_ERROR(p.Choice<SoftmaxMode>(
      "quern.classification.softmax",
      {{"auto", SoftmaxMode::kAuto}, {"true", SoftmaxMode::kAlways}, {"false", SoftmaxMode::kNever}}, &m.softmax));
  QUERN_RETURN_IF_ERROR(p.Int("quern.classification.top_k", &m.top_k, 1, 1000000));

  DetectionSpec& d = m.detection;
  QUERN_RETURN_IF_ERROR(p.Choice<DetectionFormat>("quern.detection.format",
                                                  {{"yolov5", DetectionFormat::kYoloV5},
                                                   {"yolov8", DetectionFormat::kYoloV8},
                                                   {"detr", DetectionFormat::kDetr},
                                                   {"centerface", DetectionFormat::kCenterFace}},
                                                  &d.format));
  if (d.format == DetectionFormat::kDetr) {
    d.normalized = true;
    d.activation = ScoreActivation::kSoftmax;
    d.nms = false;
  }
  if (d.format == DetectionFormat::kCenterFace) d.iou_threshold = 0.3f;  // CenterFace's own
  QUERN_RETURN_IF_ERROR(p.Choice<BoxEncoding>(
      "quern.detection.box", {{"cxcywh", BoxEncoding::kCxCyWh}, {"xyxy", BoxEncoding::kXyXy}}, &d.box));
  QUERN_RETURN_IF_ERROR(p.Bool("quern.detection.normalized", &d.normalized));
  QUERN_RETURN_IF_ERROR(p.Choice<ScoreActivation>("quern.detection.activation",
                                                  {{"none", ScoreActivation::kNone},
                                                   {"sigmoid", ScoreActivation::kSigmoid},
                                                   {"softmax", ScoreActivation::kSoftmax}},
                                                  &d.activation));
  QUERN_RETURN_IF_ERROR(p.Bool("quern.detection.nms", &d.nms));
  QUERN_RETURN_IF_ERROR(p.Float("quern.detection.iou_threshold", &d.iou_threshold, 0.0f, 1.0f));
  QUERN_RETURN_IF_ERROR(p.Int("quern.detection.max_detections", &d.max_detections, 1, 100000));

  if (const std::string* name = p.Get("quern.embedding.output")) {
    if (!c.FindOutput(*name)) {
      return std::unexpected(
          InvalidArgument(where + ": quern.embedding.output names '" + *name + "', which is not an output"));
    }
    m.embedding_output = *name;
  } else if (m.task == VisionTask::kEmbedding && !c.outputs.empty()) {
    m.embedding_output = c.outputs[0].name;
  }

  QUERN_RETURN_IF_ERROR(p.CheckAllKnown());

  for (const auto& o : c.outputs) {
    if (o.label_filename.empty()) continue;
    QUERN_ASSIGN_OR_RETURN(m.labels,
                           ReadLabelFile(model_dir, o.label_filename, where + ": output '" + o.name + "' label file"));
    break;
  }
  return m;
}

}  // namespace quern
