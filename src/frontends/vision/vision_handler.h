// Vision routes on the HTTP server: the CodeProject.AI / DeepStack detection
// API that Blue Iris, Agent DVR and Home Assistant call, and /predict for
// classification.
//
//   POST /v1/vision/detection        multipart: image (file), min_confidence (0-1, default 0.4), api_key
//   POST /v1/vision/custom/{model}   the same for any detection model
//   GET or POST /v1/vision/custom/list   {success, models: [...]}
//   POST /v1/vision/scene            multipart: image → {success, label, confidence} (--scene-model)
//   POST /v1/vision/face             multipart: image → faces, as detection answers them (--face-model)
//   POST /v1/vision/face/register    multipart: userid, image (or image1..imageN) → the faces are registered
//   POST /v1/vision/face/recognize   multipart: image, min_confidence (default 0.67) → faces with their userid
//                                    ("unknown" below the threshold)
//   POST /v1/vision/face/match       multipart: image1, image2 → similarity of their faces
//   POST /v1/vision/face/list        {success, faces: [userid, ...]} (GET too)
//   POST /v1/vision/face/delete      multipart: userid
//   GET  /v1/status/ping             {success: true}
//   POST /predict/{model}            JSON {"image": "<base64>"} → top-5 classes
//
// CodeProject.AI routes answer errors as HTTP 200 with success:false and a
// clear `error` (what its clients expect); /predict answers with HTTP error
// codes and {"error": ...}. Answered images carry a Server-Timing header
// with their decode, resize, queue, infer and post durations (ms).
//
// Work: the I/O thread parses the form and hands the image to the vision
// service (src/pipeline/vision_service.h), which admits it or refuses it at
// once, and runs decoding, pre-processing, inference and post-processing;
// this handler writes the answer.
//
// Thread safety: Handle may be called from any number of threads.
#pragma once

#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "core/mutex.h"
#include "frontends/http/http_types.h"
#include "frontends/vision/multipart.h"
#include "pipeline/face_gallery.h"
#include "pipeline/vision_service.h"
#include "quern/engine.h"

namespace quern {

// min_confidence read the way CodeProject.AI reads it: surrounding
// whitespace ignored; empty, not a number or NaN gives the default 0.4 (not
// an error); a negative number counts as 0, one above 1 keeps nothing.
// /v1/vision/face/recognize reads its threshold the same way, with its own
// default (`fallback`).
inline constexpr float kDefaultMinConfidence = 0.4f;
float ParseMinConfidence(std::string_view field, float fallback = kDefaultMinConfidence);

struct VisionOptions {
  // The model behind /v1/vision/detection; "" = the first detection model
  // (by name) in the repository.
  std::string detection_model;
  // The classification model behind /v1/vision/scene; "" = none (the route
  // answers with an error saying so).
  std::string scene_model;
  // The face detection model behind /v1/vision/face; "" = the first
  // detection model (by name) in the CenterFace layout. /v1/vision/detection's
  // default skips such models.
  std::string face_model;
  // The most predictions one detection answer lists, the most confident
  // first (Frigate's DeepStack detector reads at most 20); 0 = all the
  // model keeps (its quern.detection.max_detections).
  int max_predictions = 0;
  // When set, every vision request but /v1/status/ping must present a key
  // this accepts (its error is the answer): from "Authorization: Bearer
  // <key>", "X-API-Key" or the api_key query parameter, checked by
  // CheckHead before any body byte is read; or, on CodeProject.AI form
  // routes whose head carries none and whose body is not compressed, the
  // api_key form field, checked by Handle before the form's image is used.
  std::function<Status(std::string_view key)> authorize;
  // Face recognition: the registered faces (null: the face recognition
  // routes answer that it is off) and the embedding model that describes
  // faces ("" = the first model with quern.task: embedding).
  FaceGallery* faces = nullptr;
  std::string face_descriptor_model;
  // The model behind /v1/vision/ocr (and CodeProject.AI's legacy
  // /v1/image/ocr): an encoded image in as BYTES "image", "text",
  // "confidence" and "boxes" (four corners per line) out, such as the
  // example ensemble `ocr`.
  std::string ocr_model = "ocr";
};

// Recognition's default threshold (DeepStack's and CodeProject.AI's): a face
// whose closest registered face is less similar is "unknown".
inline constexpr float kDefaultFaceMatchConfidence = 0.67f;

class VisionHandler {
 public:
  // `service` must outlive the handler.
  VisionHandler(VisionService* service, VisionOptions options);
  // Waits (up to 30 s) for the answers of images handed to the service.
  ~VisionHandler();
  VisionHandler(const VisionHandler&) = delete;
  VisionHandler& operator=(const VisionHandler&) = delete;

  // True for the paths this handler serves (/v1/..., /predict/...).
  static bool Handles(std::string_view target);

  // The request's head went through CheckHead first (a key in its head was
  // checked there and is not checked again).
  void Handle(HttpRequest&& request, HttpDone done);

  // Given a request's line and headers alone, before any body byte is read:
  // the refusal for a missing or wrong key (see VisionOptions::authorize),
  // else the refusal an image request would get because the service is full
  // (by count or by memory) or its model's queue is, or nothing. A form
  // route whose key is in its form is admitted in Handle, once the key is.
  std::optional<HttpResponse> CheckHead(const HttpRequest& head);

 private:
  // `authorize` with CodeProject.AI's words for a missing or wrong key.
  Status AuthorizeCpai(std::string_view key) const;
  // Routes whose key may come in a multipart form field.
  static bool IsFormRoute(std::string_view method, std::string_view path);
  struct Job;
  struct FaceJob;
  std::string DefaultDetectionModel();
  // The first detection model by name that detects faces (CenterFace layout),
  // or that does not; "" when there is none.
  std::string FirstDetectionModel(bool faces);
  void WriteCpaiMeta(rapidjson::Writer<rapidjson::StringBuffer>& w, const Job& job, const VisionTimings* timings) const;
  void Submit(std::shared_ptr<Job> job, std::shared_ptr<const VisionModel> model);
  // Hands an image to the service; `then` gets its result. Counted in
  // pending_ until `then` has run; a refusal is returned and `then` dropped.
  Status SubmitCounted(VisionRequest request, std::function<void(VisionResult&&)> then);
  HttpResponse Refusal(const Job& job, const Status& status) const;
  HttpResponse CpaiError(const Job& job, const Status& status, const VisionTimings* timings) const;
  void Answer(const std::shared_ptr<Job>& job, VisionResult&& result);
  // A request that failed before reaching the service.
  void Fail(const std::shared_ptr<Job>& job, const Status& status);
  void Respond(const std::shared_ptr<Job>& job, HttpResponse response);
  // /v1/vision/face/{register,recognize,match,list,delete}; `face_model`
  // finds the faces.
  void HandleFaces(const std::shared_ptr<Job>& job, const std::vector<FormPart>& parts, const std::string& face_model);
  // /v1/vision/ocr: the image to options_.ocr_model through the vision
  // service (admitted like every image; the model decodes it),
  // its lines answered as CodeProject.AI's OCR module answers them.
  void HandleOcr(const std::shared_ptr<Job>& job, std::string_view image);
  // Counts work handed to the service or the engine whose answer is still
  // to come (the destructor waits for it).
  void BeginPending();
  void EndPending();
  // Every image of a face request answered: the answer.
  void FinishFaces(FaceJob& face_job);

  VisionService* service_;
  VisionOptions options_;
  std::string hostname_;

  Mutex models_mu_;
  std::string last_default_model_ QUERN_GUARDED_BY(models_mu_);  // DefaultDetectionModel's last answer

  Mutex pending_mu_;
  CondVar pending_cv_;
  int64_t pending_ QUERN_GUARDED_BY(pending_mu_) = 0;  // images with the service, answer not yet written
};

}  // namespace quern
