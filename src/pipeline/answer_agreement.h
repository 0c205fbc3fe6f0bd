// Whether another runtime's answers mean what the reference runtime's mean, for a model with a
// vision pipeline (pipeline/vision_model.h): backend "auto" asks it of every candidate runtime
// (EngineOptions::compare_answers; `quern serve` wires it), beside its check of the numbers.
//
// A detector (quern.detection.format): both runtimes' outputs for the check input are decoded as
// the detection routes decode them (the model's box format, activation, NMS); every box the
// reference finds at confidence >= 0.3 must be found by the candidate at >= 0.2 with the same
// class at IoU >= 0.9, and every box the candidate finds at >= 0.3 must be the reference's in the
// same way (the margin keeps a box whose confidence moves across a threshold from counting as
// lost). Agreement says how many boxes were compared ("its 3 boxes at IoU >= 0.9 (dog, truck,
// bicycle)", eight classes named at most; "no box at confidence >= 0.3" when the check input has
// none, as a made-up input usually has: then only the numbers were compared; "boxes not compared"
// when ONNX Runtime's outputs do not read as one image's boxes). Disagreement names the box, its
// class and confidence, and the best IoU the other runtime has for it.
//
// Other models (classifiers, embeddings, models without a vision pipeline): agreement, with no
// detail; the numbers decide. So does a configuration whose vision parameters do not read (the
// load's own check refuses it, naming the parameter).
// Thread-compatible: pure function of its arguments and the model's label file.
#pragma once

#include <filesystem>
#include <vector>

#include "quern/engine.h"

namespace quern {

AnswerAgreement CompareVisionAnswers(const ModelConfig& config, const std::filesystem::path& model_dir,
                                     const std::vector<NamedTensor>& reference,
                                     const std::vector<NamedTensor>& candidate);

}  // namespace quern
