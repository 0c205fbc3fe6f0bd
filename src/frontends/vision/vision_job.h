// The request a vision route is answering (internal to src/frontends/vision).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/mutex.h"
#include "frontends/vision/vision_handler.h"

namespace quern {

struct VisionHandler::Job {
  enum class Kind { kCpai, kPredict };
  Kind kind = Kind::kCpai;
  std::string command = "detect";
  HttpRequest request;  // owns the body the image is viewed in
  HttpDone done;
  quern::Form form;           // a form route's fields (views into request.body or its own buffer)
  std::string image_storage;  // decoded base64 (/predict)
  std::string_view image;
  float min_confidence = kDefaultMinConfidence;
  int64_t received_ns = 0;  // the service's clock
};

}  // namespace quern
