// A model's vision pipeline, read from its configuration's parameters:
//
//   parameters { key: "quern.task" value { string_value: "detection" } }   # or "classification"
//   parameters { key: "quern.image.resize" value { string_value: "letterbox" } }
//
// Keys (all optional; a model with any quern.task / quern.image.* key is a
// vision model):
//   quern.task                      classification | detection | embedding (default:
//                                   detection when quern.detection.format is set)
//   quern.image.input               the image input (default: the only input)
//   quern.image.size                WxH when the input's dims are not fixed
//   quern.image.resize              stretch | letterbox | center_crop (default stretch;
//                                   letterbox for detection)
//   quern.image.pad_value           0-255 (default 114)
//   quern.image.resize_shortest     center_crop: shortest side before the crop
//   quern.image.channels            RGB | BGR (default RGB)
//   quern.image.layout              NCHW | NHWC (default: from the input's dims)
//   quern.image.scale               pixel multiplier for float inputs (default 1/255)
//   quern.image.mean, quern.image.std   three comma-separated numbers
//   quern.classification.softmax    auto | true | false (default auto)
//   quern.classification.top_k      default 5
//   quern.detection.format          yolov5 | yolov8 | detr | centerface
//   quern.detection.box             cxcywh | xyxy (default cxcywh)
//   quern.detection.normalized      true | false (default: true for detr)
//   quern.detection.activation      none | sigmoid | softmax (default: none; softmax for detr)
//   quern.detection.nms             true | false (default: true; false for detr)
//   quern.detection.iou_threshold   default 0.45 (0.3 for centerface)
//   quern.detection.max_detections  default 100
//   quern.embedding.output          the output holding the descriptor (default: the
//                                   first output); an embedding model describes an
//                                   image (a face crop) with one vector
// Class labels come from the `label_filename` of the model's first output
// that has one (a file beside config.pbtxt, one label per line, as in Triton).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "image/image.h"
#include "pipeline/postprocess.h"
#include "quern/engine.h"

namespace quern {

enum class VisionTask { kClassification, kDetection, kEmbedding };

struct VisionModel {
  std::string name;
  int64_t version = 0;
  VisionTask task = VisionTask::kClassification;
  std::string input_name;
  Shape input_shape;       // of one request: the batch dimension of 1 included when the model batches
  int max_batch_size = 0;  // the configuration's: rows one request may hold
  int instances = 0;       // the loaded model's instances (groups as placed); 0 = not known
  ImageSpec image;
  SoftmaxMode softmax = SoftmaxMode::kAuto;
  int top_k = 5;
  DetectionSpec detection;
  std::string embedding_output;  // kEmbedding
  std::vector<std::string> labels;

  const std::string& Label(int class_id) const;
};

// True when the configuration declares a vision pipeline.
bool IsVisionModel(const ModelConfig& config);

// Reads the pipeline of a loaded model; `model_dir` holds its label file.
// Errors name the model, the parameter and what was expected.
Result<VisionModel> VisionModelFromStatus(const ModelStatus& status, const std::filesystem::path& model_dir);

}  // namespace quern
