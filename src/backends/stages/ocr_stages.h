// Built-in OCR stages: the steps around the PP-OCR models that an `ocr`
// ensemble chains (backend "quern", parameter quern.stage), following the
// published PaddleOCR / RapidOCR algorithm and defaults:
//
//   ocr_detection_input  encoded image (BYTES) -> the text detector's input
//                        (shortest side scaled to 736, sides multiples of
//                        32, BGR, ImageNet mean/std), the image as BGR
//                        pixels (very flat or small images letterboxed
//                        with black rows) and its geometry
//   ocr_detection_boxes  the detector's probability map -> text boxes (DB:
//                        binarise at 0.3, dilate 2x2, connected regions,
//                        minimum-area rectangles, mean probability >= 0.5,
//                        unclip by area x 1.6 / perimeter), in the image's
//                        pixels, top to bottom and left to right
//   ocr_crop             pixels + boxes -> one straightened crop per box
//                        (perspective warp; tall ones turned 90 degrees) as
//                        the direction classifier's input (48 x 192) and as
//                        a line of height 48, its aspect kept (8-bit)
//   ocr_lines            lines + classifier output -> the recogniser's
//                        inputs: lines the classifier finds upside down
//                        (180 degrees, p > 0.9) turned, every line in the
//                        narrowest of the widths 96, 192, 320, 640, 1280
//                        that holds it (padded), or with the wider ones, so
//                        that lines of every request batch together; and
//                        where each line went
//   ocr_text             recogniser outputs -> text by CTC greedy decoding
//                        over a dictionary (PaddleOCR's ppocr_keys_v1.txt:
//                        blank first, space last), confidence = mean of the
//                        kept characters' probabilities, lines below 0.5
//                        dropped; boxes moved back to the source image
//
// Each stage is a Model (max_batch_size 0: one image per request) whose
// inputs and outputs the backend fills into the configuration; the
// algorithms are in image/ocr.h.
#pragma once

#include <array>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "quern/model.h"

namespace quern::ocr {

// The stage `stage` for `config` (its inputs, outputs and max_batch_size are
// filled in; `model_dir` holds files it reads, such as the dictionary), or
// an error naming the model and the stage.
Result<std::function<std::unique_ptr<Model>()>> MakeStage(const std::string& stage, ModelConfig& config,
                                                          const std::filesystem::path& model_dir);

}  // namespace quern::ocr
