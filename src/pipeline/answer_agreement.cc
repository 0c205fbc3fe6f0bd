#include "pipeline/answer_agreement.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include "pipeline/postprocess.h"
#include "pipeline/vision_model.h"

namespace quern {
namespace {

// A box counts from this confidence; its match may have slipped to kMatchFrom.
constexpr float kCountFrom = 0.3f;
constexpr float kMatchFrom = 0.2f;
constexpr float kSameBoxIou = 0.9f;

// A box's class: its label, or its number when the model has no label for it.
std::string ClassOf(const VisionModel& m, const Detection& d) {
  const std::string& label = m.Label(d.class_id);
  return label.empty() ? std::to_string(d.class_id) : label;
}

std::string Named(const VisionModel& m, const Detection& d) {
  return m.Label(d.class_id).empty() ? "class " + ClassOf(m, d) : "'" + ClassOf(m, d) + "'";
}

// The first box of `want` (at kCountFrom or more) that `have` lacks, described; "" when none.
std::string Unmatched(const VisionModel& m, const std::vector<Detection>& want, const std::vector<Detection>& have,
                      const char* found_by, const char* missing_from) {
  for (const Detection& w : want) {
    if (w.confidence < kCountFrom) continue;
    float best = 0;
    for (const Detection& h : have) {
      if (h.class_id == w.class_id) best = std::max(best, IntersectionOverUnion(w, h));
    }
    if (best < kSameBoxIou) {
      char buf[200];
      std::snprintf(buf, sizeof buf, " (%.2f) at %.0f,%.0f-%.0f,%.0f found by %s: %s's best IoU for it is %.2f",
                    w.confidence, w.x_min, w.y_min, w.x_max, w.y_max, found_by, missing_from, best);
      return "a box of " + Named(m, w) + buf;
    }
  }
  return "";
}

}  // namespace

AnswerAgreement CompareVisionAnswers(const ModelConfig& config, const std::filesystem::path& model_dir,
                                     const std::vector<NamedTensor>& reference,
                                     const std::vector<NamedTensor>& candidate) {
  if (!IsVisionModel(config)) return {};
  ModelStatus status;
  status.name = config.name;
  status.config = config;
  auto vision = VisionModelFromStatus(status, model_dir);
  if (!vision || vision->task != VisionTask::kDetection) return {};
  const VisionModel& m = *vision;
  auto decode = [&](const std::vector<NamedTensor>& outputs, float from) {
    return DecodeDetections(outputs, m.detection, from, m.image.width, m.image.height);
  };
  auto ref = decode(reference, kMatchFrom);
  if (!ref) return {true, "boxes not compared: ONNX Runtime's outputs do not read as one image's boxes"};
  auto got = decode(candidate, kMatchFrom);
  if (!got) return {false, "its outputs do not read as boxes: " + got.error().message()};
  std::string differ = Unmatched(m, *ref, *got, "ONNX Runtime", "this runtime");
  if (differ.empty()) differ = Unmatched(m, *got, *ref, "this runtime", "ONNX Runtime");
  if (!differ.empty()) return {false, differ};
  // The boxes' classes, the first kNamed by name (a crowded image's list stays short).
  constexpr int kNamed = 8;
  std::string names;
  int counted = 0;
  for (const Detection& d : *ref) {
    if (d.confidence < kCountFrom || ++counted > kNamed) continue;
    names += (names.empty() ? "" : ", ") + ClassOf(m, d);
  }
  if (counted == 0) return {true, "no box at confidence >= 0.3 on it"};
  if (counted > kNamed) names += ", ...";
  return {true,
          "its " + std::to_string(counted) + (counted == 1 ? " box" : " boxes") + " at IoU >= 0.9 (" + names + ")"};
}

}  // namespace quern
