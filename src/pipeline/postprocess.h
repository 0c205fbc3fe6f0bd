// Post-processing for vision models: classification (softmax, top-k,
// labels) and object detection (YOLOv5, YOLOv8/YOLO11 and DETR output
// layouts, class-wise non-maximum suppression, boxes mapped back to the
// source image). Pure functions; thread-safe.
#pragma once

#include <string>
#include <vector>

#include "image/image.h"
#include "quern/status.h"
#include "quern/tensor.h"

namespace quern {

// A numeric output's values as floats (FP32, FP16, FP64, INT32, INT64);
// InvalidArgument naming the output otherwise.
Result<std::vector<float>> OutputAsFloats(const NamedTensor& output);

// ---------------------------------------------------------------- classification

enum class SoftmaxMode {
  kAuto,  // apply it unless the scores already are probabilities (in [0,1], summing to 1)
  kAlways,
  kNever,
};

struct Classification {
  int class_id = 0;
  std::string label;  // labels[class_id], or the id as text when there is no label file
  float confidence = 0;
};

// The k best classes of one item's scores, best first (ties: lower id first).
std::vector<Classification> TopK(const std::vector<float>& scores, int k, SoftmaxMode softmax,
                                 const std::vector<std::string>& labels);

// ---------------------------------------------------------------- detection

enum class DetectionFormat {
  kYoloV5,      // one output [1, boxes, 5 + classes]: cx, cy, w, h, objectness, class scores
  kYoloV8,      // one output [1, 4 + classes, boxes]: cx, cy, w, h, class scores (YOLOv8, YOLO11)
  kDetr,        // boxes [1, queries, 4] and class scores [1, queries, classes(+1)],
                // or labels [1, queries] + scores [1, queries] + boxes (RT-DETR exports)
  kCenterFace,  // heatmap [1, 1, h, w], log size [1, 2, h, w] (height, width),
                // offset [1, 2, h, w] (y, x), in this order (landmarks after
                // them are not read): one class; a cell (x, y) scoring over the
                // threshold is a box centred at (x + 0.5 + offset x) * stride,
                // exp(log size) * stride wide and high, stride = input / h
};
enum class BoxEncoding { kCxCyWh, kXyXy };
enum class ScoreActivation { kNone, kSigmoid, kSoftmax };

struct DetectionSpec {
  DetectionFormat format = DetectionFormat::kYoloV8;
  BoxEncoding box = BoxEncoding::kCxCyWh;
  // Box coordinates in [0, 1] of the model input (DETR) instead of pixels.
  bool normalized = false;
  // Turns raw class outputs into scores. kSoftmax over the class axis; with
  // DETR the last class is "no object" and is dropped after the softmax.
  ScoreActivation activation = ScoreActivation::kNone;
  bool nms = true;
  float iou_threshold = 0.45f;
  int max_detections = 100;
};

struct Detection {
  int class_id = 0;
  float confidence = 0;
  float x_min = 0, y_min = 0, x_max = 0, y_max = 0;
};

// Decodes one item's outputs (batch dimension of 1, or none) into boxes in
// the model input's pixel coordinates, keeping those with confidence >=
// min_confidence, then applies class-wise NMS (when spec.nms) and
// max_detections (best first). An output of the wrong shape is an
// InvalidArgument naming it and the expected layout.
//
// A box's class is the first of its best (activated) class scores. Its
// confidence: YOLOv5, as YOLOv5's own NMS has it: a box whose (activated)
// objectness is under min_confidence is no candidate, otherwise best class
// score x objectness; YOLOv8 and DETR: the best class score. Only what that
// needs is read: a YOLOv5 box under the threshold costs one load, and a
// FP32 output is read where it lies (no copy).
Result<std::vector<Detection>> DecodeDetections(const std::vector<NamedTensor>& outputs, const DetectionSpec& spec,
                                                float min_confidence, int input_width, int input_height);

// Class-wise non-maximum suppression: keeps, for each class, boxes in
// descending confidence that overlap no kept box of that class by more than
// iou_threshold; the result is sorted by confidence and cut to max_detections.
std::vector<Detection> NonMaxSuppression(std::vector<Detection> boxes, float iou_threshold, int max_detections);

float IntersectionOverUnion(const Detection& a, const Detection& b);

// Maps a box from model-input pixels to source-image pixels and clips it to
// the image.
Detection MapToSource(const Detection& d, const ImageTransform& t);

}  // namespace quern
