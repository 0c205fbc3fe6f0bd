// Vision routes on the HTTP server: the CodeProject.AI / DeepStack detection
// API that Blue Iris, Agent DVR and Home Assistant call, and /predict for
// classification.
//
//   POST /v1/vision/detection        multipart: image (file), min_confidence (0-1, default 0.4), api_key
//   POST /v1/vision/custom/{model}   the same for any detection model
//   GET or POST /v1/vision/custom/list   {success, models: [...]}
//   POST /v1/vision/scene            multipart: image → {success, label, confidence} (--scene-model)
//   POST /v1/vision/face             multipart: image → faces, as detection answers them (--face-model)
//   POST /v1/vision/face/register    form: userid, files under any name → the faces are registered
//   POST /v1/vision/face/recognize   form: image (else the first file), min_confidence (default 0.67) → faces
//                                    with their userid ("unknown" below the threshold)
//   POST /v1/vision/face/match       multipart: image1, image2 → similarity of their faces
//   POST /v1/vision/face/list        {success, faces: [userid, ...]} (GET too)
//   POST /v1/vision/face/delete      form: userid
//   (every form: multipart/form-data or application/x-www-form-urlencoded)
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
// Thread safety: the routes may be called from any number of threads.
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
#include "frontends/http/router.h"
#include "frontends/vision/multipart.h"
#include "pipeline/face_gallery.h"
#include "pipeline/face_service.h"
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

class VisionHandler {
 public:
  // `service` must outlive the handler.
  VisionHandler(VisionService* service, VisionOptions options);
  // Waits (up to 30 s) for the answers of images handed to the service.
  ~VisionHandler();
  VisionHandler(const VisionHandler&) = delete;
  VisionHandler& operator=(const VisionHandler&) = delete;

  // Declares the routes above on `router` (which must not outlive the
  // handler), with the scopes /v1 (CodeProject.AI: keys also as the api_key
  // query parameter or form field, errors as 200 with success false) and
  // /predict. The image routes' head checks refuse, before the body is
  // read, a request the service is too full for (by count or by memory) or
  // whose model's queue is full.
  Status AddRoutes(Router& router);

 private:
  struct Job;
  // The routes' handlers. Form: a CodeProject.AI form route (`command`:
  // detect, custom, scene, face, register, recognize, match, delete, list,
  // ocr) on `model`.
  void Form(const std::string& command, const std::string& model, HttpRequest&& request, const RouteMatch& match,
            HttpDone done);
  void CustomList(HttpRequest&& request, HttpDone done);
  void Predict(HttpRequest&& request, const RouteMatch& match, HttpDone done);
  // The image routes' head check: the service's room and `model`'s queue.
  std::optional<HttpResponse> Admission(const HttpRequest& head, const std::string& command,
                                        const std::string& model) const;
  // A refused key's answer: /predict's {"error"}, or CodeProject.AI's.
  // `head` names the route, whose command the answer gives.
  HttpResponse KeyRefusal(const HttpRequest& head, const Status& status, KeyProblem problem, bool predict) const;
  // The command a CodeProject.AI route's answers name ("detect", "custom",
  // "list", "register", ...), from the request's path.
  static std::string CommandOf(std::string_view target);
  // A refused key in the words of CodeProject.AI's clients.
  static Status CpaiKeyWords(const Status& status, KeyProblem problem);
  std::shared_ptr<Job> NewJob(HttpRequest&& request, HttpDone done) const;
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
  // The face routes, over the job's form.
  void HandleFaces(const std::shared_ptr<Job>& job, const std::string& face_model);
  // /v1/vision/ocr: the image to options_.ocr_model through the vision
  // service (admitted like every image; the model decodes it),
  // its lines answered as CodeProject.AI's OCR module answers them.
  void HandleOcr(const std::shared_ptr<Job>& job, std::string_view image);
  // Counts work handed to the service or the engine whose answer is still
  // to come (the destructor waits for it).
  void BeginPending();
  void EndPending();
  // A face request's answer.
  void AnswerFaces(const std::shared_ptr<Job>& job, FaceResult&& result);

  VisionService* service_;
  VisionOptions options_;
  FaceService faces_;  // over service_ and options_.faces
  std::string hostname_;

  Mutex models_mu_;
  std::string last_default_model_ QUERN_GUARDED_BY(models_mu_);  // DefaultDetectionModel's last answer

  Mutex pending_mu_;
  CondVar pending_cv_;
  int64_t pending_ QUERN_GUARDED_BY(pending_mu_) = 0;  // images with the service, answer not yet written
};

}  // namespace quern
