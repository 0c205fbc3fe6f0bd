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
  std::string image_storage;  // decoded base64 (/predict)
  std::string_view image;
  float min_confidence = kDefaultMinConfidence;
  int64_t received_ns = 0;  // the service's clock
};

// One face recognition request: its images, each with the vision service,
// and their results as they come.
struct VisionHandler::FaceJob {
  std::shared_ptr<Job> job;
  std::string userid;                             // register
  float threshold = kDefaultFaceMatchConfidence;  // recognize
  std::vector<std::string> fields;                // the image fields, in form order
  Mutex mu;
  std::vector<VisionResult> results QUERN_GUARDED_BY(mu);  // by field
  size_t remaining QUERN_GUARDED_BY(mu) = 0;
  // Records field i's result; true for the last one.
  bool Done(size_t i, VisionResult&& r) {
    MutexLock lock(mu);
    results[i] = std::move(r);
    return --remaining == 0;
  }
};

}  // namespace quern
