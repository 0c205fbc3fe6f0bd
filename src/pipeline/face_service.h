// FaceService: face recognition over the vision service and a face gallery.
// Registering, recognising and matching each find the faces of their
// images with a face detection model and describe them with an embedding
// model, every image admitted and bounded by the vision service like any
// other; the gallery holds the registered faces.
//
//   Register   each image's most confident face is added to the user
//   Recognize  every face found (up to the descriptor's batch), each with
//              the user of its closest registered face, or "unknown" below
//              the threshold
//   Match      the cosine similarity of two images' most confident faces
//
// Front ends parse their requests and write their answers; the workflow is
// here. Thread safety: Submit may be called from any number of threads; the
// callback runs once, on a vision stage thread (or the caller's, for a
// refusal of its first image).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "pipeline/face_gallery.h"
#include "pipeline/vision_service.h"

namespace quern {

// Recognition's default threshold (DeepStack's and CodeProject.AI's): a face
// whose closest registered face is less similar is "unknown".
inline constexpr float kDefaultFaceMatchConfidence = 0.67f;

struct FaceImage {
  std::string name;        // what the caller calls it ("image1"): named in errors
  std::string_view bytes;  // encoded; kept alive by FaceRequest::owner
};

struct FaceRequest {
  enum class Kind { kRegister, kRecognize, kMatch };
  Kind kind = Kind::kRecognize;
  std::string face_model;                         // the face detection model
  std::string userid;                             // register: checked by FaceGallery::CheckUserId
  float threshold = kDefaultFaceMatchConfidence;  // recognize
  // Register: 1 to kMaxRegisterImages; recognize: 1; match: 2.
  std::vector<FaceImage> images;
  std::shared_ptr<const void> owner;  // keeps the images' bytes alive
  int64_t held_bytes = 0;             // what the caller holds for them all (its body)
  std::shared_ptr<CancellationToken> cancel;
};
inline constexpr size_t kMaxRegisterImages = 16;

struct RecognizedFace {
  std::string userid;     // "unknown" below the threshold
  double confidence = 0;  // the similarity to that user's closest face; 0 for unknown
  Detection box;
};

struct FaceResult {
  // Not OK: UNAVAILABLE when an image was refused (the service is full), or
  // the error, naming the image it came from ("image2: ...").
  Status status;
  // The vision service counted the failure already (an image it refused or
  // failed), as opposed to one found here (no face, the gallery's refusal).
  bool counted = false;
  std::vector<RecognizedFace> faces;  // recognize
  double similarity = 0;              // match
  VisionTimings timings;              // the first image's
};
using FaceCallback = std::function<void(FaceResult&&)>;

class FaceService {
 public:
  // `service` and `gallery` must outlive the face service; null `gallery`:
  // face recognition is off (Submit says so). `descriptor_model`: the
  // embedding model, "" = the first with quern.task embedding.
  FaceService(VisionService* service, FaceGallery* gallery, std::string descriptor_model);

  // Checks the request and its models, then hands its images to the vision
  // service: an error found before any image is sent is returned (and
  // `done` dropped); otherwise `done` gets the result, exactly once.
  Status Submit(FaceRequest request, FaceCallback done);

  // OK, or UNAVAILABLE saying that face recognition is off on this server.
  Status Available() const;

  // The registered users, and deleting one (the gallery's words); both
  // UNAVAILABLE while face recognition is off.
  Result<std::vector<std::string>> Users();
  Status Delete(const std::string& userid);

 private:
  struct Run;
  // Every image answered: register, recognise or match, and answer.
  void Finish(Run& run);

  VisionService* service_;
  FaceGallery* gallery_;
  const std::string descriptor_model_;
};

}  // namespace quern
