#include "frontends/vision/vision_handler.h"

#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cmath>

#include "frontends/http/http_util.h"
#include "frontends/vision/multipart.h"
#include "frontends/vision/vision_job.h"
#include "frontends/vision/vision_json.h"

namespace quern {

using vision::Json;
using vision::JsonError;

float ParseMinConfidence(std::string_view field, float fallback) {
  const auto space = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\v' || c == '\f'; };
  while (!field.empty() && space(field.front())) field.remove_prefix(1);
  while (!field.empty() && space(field.back())) field.remove_suffix(1);
  if (field.empty() || field.size() > 64) return fallback;
  const std::string v(field);
  char* end = nullptr;
  const float f = std::strtof(v.c_str(), &end);
  if (end != v.c_str() + v.size() || std::isnan(f)) return fallback;
  return std::max(f, 0.0f);
}

VisionHandler::VisionHandler(VisionService* service, VisionOptions options)
    : service_(service), options_(std::move(options)), faces_(service, options_.faces, options_.face_descriptor_model) {
  char host[256] = {};
  hostname_ = gethostname(host, sizeof(host) - 1) == 0 ? host : "quern";
}

VisionHandler::~VisionHandler() {
  // A bound on the process's stop, in real time (and the service may be
  // gone already: nothing of it is read here).
  MutexLock lock(pending_mu_);
  pending_cv_.WaitFor(lock, RealClockInstance(), std::chrono::seconds(30),
                      [this]() QUERN_REQUIRES(pending_mu_) { return pending_ == 0; });
}

std::string VisionHandler::DefaultDetectionModel() {
  if (!options_.detection_model.empty()) return options_.detection_model;
  std::string name = FirstDetectionModel(/*faces=*/false);
  MutexLock lock(models_mu_);
  last_default_model_ = name;
  return name;
}

std::string VisionHandler::FirstDetectionModel(bool faces) {
  for (auto& n : service_->DetectionModels()) {
    auto m = service_->Model(n);
    if (m && ((*m)->detection.format == DetectionFormat::kCenterFace) == faces) return std::move(n);
  }
  return {};
}

Status VisionHandler::AddRoutes(Router& router) {
  using K = KeyPolicy;
  // A CodeProject.AI form route: `command` names it in the answer, `model`
  // finds its model when the request comes.
  auto form = [this](std::string command, std::function<std::string()> model) -> RouteHandler {
    return [this, command, model](HttpRequest&& r, const RouteMatch& m, HttpDone done) {
      Form(command, model(), std::move(r), m, std::move(done));
    };
  };
  auto admit = [this](std::string command, std::function<std::string(const RouteMatch&)> model) -> RouteHeadCheck {
    return [this, command, model](const HttpRequest& head, const RouteMatch& m) {
      return Admission(head, command, model(m));
    };
  };
  const auto named = [](const RouteMatch& m) { return m.param("model"); };
  const auto detection = [this](const RouteMatch&) {
    if (!options_.detection_model.empty()) return options_.detection_model;
    MutexLock lock(models_mu_);
    return last_default_model_;  // as the last detection request found it
  };
  const auto fixed = [](const std::string& name) { return [name](const RouteMatch&) { return name; }; };
  const auto face_model = [this] {
    return options_.face_model.empty() ? FirstDetectionModel(/*faces=*/true) : options_.face_model;
  };
  const auto ocr = [this](HttpRequest&& r, const RouteMatch& m, HttpDone done) {
    Form("ocr", options_.ocr_model, std::move(r), m, std::move(done));
  };
  const Route routes[] = {
      {"GET POST", "/v1/status/ping", K::kNone, false, nullptr,
       [](HttpRequest&&, const RouteMatch&, HttpDone done) { done(Json(200, "{\"success\":true}")); }},
      {"POST", "/v1/vision/detection", K::kUserOrForm, false, admit("detect", detection),
       form("detect", [this] { return DefaultDetectionModel(); })},
      {"POST", "/v1/vision/custom/{model}", K::kUserOrForm, false, admit("custom", named),
       [this](HttpRequest&& r, const RouteMatch& m, HttpDone done) {
         Form("custom", m.param("model"), std::move(r), m, std::move(done));
       }},
      // Blue Iris lists the custom models with GET as well as POST.
      {"GET POST", "/v1/vision/custom/list", K::kUser, false, nullptr,
       [this](HttpRequest&& r, const RouteMatch&, HttpDone done) { CustomList(std::move(r), std::move(done)); }},
      {"POST", "/v1/vision/scene", K::kUserOrForm, false, admit("scene", fixed(options_.scene_model)),
       form("scene", [this] { return options_.scene_model; })},
      {"POST", "/v1/vision/face", K::kUserOrForm, false,
       options_.face_model.empty() ? nullptr : admit("face", fixed(options_.face_model)),  // else found per request
       form("face", face_model)},
      {"POST", "/v1/vision/face/register", K::kUserOrForm, false, nullptr, form("register", face_model)},
      {"POST", "/v1/vision/face/recognize", K::kUserOrForm, false, nullptr, form("recognize", face_model)},
      {"POST", "/v1/vision/face/match", K::kUserOrForm, false, nullptr, form("match", face_model)},
      {"POST", "/v1/vision/face/delete", K::kUserOrForm, false, nullptr, form("delete", face_model)},
      {"POST", "/v1/vision/face/list", K::kUserOrForm, false, nullptr, form("list", face_model)},
      {"GET", "/v1/vision/face/list", K::kUser, false, nullptr, form("list", face_model)},
      {"POST", "/v1/vision/ocr", K::kUserOrForm, false, admit("ocr", fixed(options_.ocr_model)), ocr},
      {"POST", "/v1/image/ocr", K::kUserOrForm, false, admit("ocr", fixed(options_.ocr_model)), ocr},
      {"POST", "/predict/{model}", K::kUser, false, admit("predict", named),
       [this](HttpRequest&& r, const RouteMatch& m, HttpDone done) { Predict(std::move(r), m, std::move(done)); }},
  };
  for (const Route& r : routes) QUERN_RETURN_IF_ERROR(router.Add(r));
  // CodeProject.AI's routes: its clients send their key as api_key (a form
  // field or the query) and read errors as 200 with success false.
  RouteScope cpai;
  cpai.prefix = "v1";
  cpai.key = K::kUser;
  cpai.query_key = true;
  cpai.refuse = [this](const HttpRequest& head, const Status& st, KeyProblem problem) {
    return KeyRefusal(head, st, problem, /*predict=*/false);
  };
  cpai.unmatched = [this](HttpRequest&& r, std::string_view, HttpDone done) {
    auto job = NewJob(std::move(r), std::move(done));
    const std::string path = job->request.target.substr(0, job->request.target.find('?'));
    if (job->request.method != "POST") {
      return Fail(job, InvalidArgument(job->request.method + " " + path + ": vision routes take POST"));
    }
    Fail(job, NotFound("no vision route " + path +
                       " (routes: /v1/vision/detection, /v1/vision/custom/{model}, /v1/vision/custom/list, "
                       "/v1/vision/scene, /v1/vision/face, /v1/vision/face/{register,recognize,match,list,"
                       "delete}, /v1/vision/ocr, /v1/status/ping)"));
  };
  QUERN_RETURN_IF_ERROR(router.AddScope(std::move(cpai)));
  RouteScope predict;
  predict.prefix = "predict";
  predict.query_key = true;
  predict.refuse = [this](const HttpRequest& head, const Status& st, KeyProblem problem) {
    return KeyRefusal(head, st, problem, /*predict=*/true);
  };
  predict.unmatched = [](HttpRequest&&, std::string_view allowed, HttpDone done) {
    if (allowed.empty()) return done(JsonError(404, "no such route; use POST /predict/{model}"));
    HttpResponse resp = JsonError(405, "use POST /predict/{model} with {\"image\": \"<base64>\"}");
    resp.headers.emplace_back("Allow", std::string(allowed));
    done(std::move(resp));
  };
  return router.AddScope(std::move(predict));
}

std::shared_ptr<VisionHandler::Job> VisionHandler::NewJob(HttpRequest&& request, HttpDone done) const {
  auto job = std::make_shared<Job>();
  job->received_ns = service_->clock().NowNs();
  job->request = std::move(request);
  job->done = std::move(done);
  return job;
}

std::optional<HttpResponse> VisionHandler::Admission(const HttpRequest& head, const std::string& command,
                                                     const std::string& model) const {
  int64_t body = 0;
  const std::string_view length = head.Header("content-length");
  (void)std::from_chars(length.data(), length.data() + length.size(), body);
  Status st = service_->CheckAdmission(model, body);
  if (st.ok()) return std::nullopt;
  Job job;
  job.kind = command == "predict" ? Job::Kind::kPredict : Job::Kind::kCpai;
  job.command = command;
  job.received_ns = service_->clock().NowNs();
  return Refusal(job, st);
}

void VisionHandler::Form(const std::string& command, const std::string& model, HttpRequest&& request,
                         const RouteMatch& match, HttpDone done) {
  auto job = NewJob(std::move(request), std::move(done));
  job->command = command;
  // A form, multipart or url-encoded. The face list needs none: a GET, or
  // a POST with a body of another kind (ignored).
  const std::string_view content_type = job->request.Header("content-type");
  if (job->request.method == "POST" && (command != "list" || IsFormContentType(content_type))) {
    auto form = ParseForm(content_type, job->request.body);
    if (!form) return Fail(job, form.error());
    job->form = std::move(*form);
  }
  const FormPart* image = nullptr;
  std::string_view field_key;
  for (const auto& p : job->form.parts) {
    // CodeProject.AI's OCR module names its file "upload".
    if ((p.name == "image" || (command == "ocr" && p.name == "upload")) && !image) image = &p;
    if (p.name == "min_confidence") job->min_confidence = ParseMinConfidence(p.data);
    if (p.name == "api_key") field_key = p.data;
  }
  if (match.key_in_body()) {
    if (Status st = match.CheckKey(field_key); !st.ok()) {
      return Fail(job, CpaiKeyWords(st, field_key.empty() ? KeyProblem::kMissing : KeyProblem::kRefused));
    }
  }
  if (command == "ocr") {
    if (!image) return Fail(job, InvalidArgument("no image was sent: expected a multipart form field named 'upload'"));
    if (image->data.empty()) return Fail(job, InvalidArgument("the 'upload' field is empty (0 bytes)"));
    return HandleOcr(job, image->data);
  }
  if (command != "detect" && command != "custom" && command != "scene" && command != "face") {
    return HandleFaces(job, model);
  }
  if (model.empty() && command == "face") {
    return Fail(job, Unavailable("no face model is loaded (a detection model with quern.detection.format "
                                 "centerface, such as examples/models/faces, or --face-model)"));
  }
  if (model.empty() && command == "scene") {
    return Fail(job, Unavailable("no scene model is configured: start quern with --scene-model set to a "
                                 "classification model (quern.task: classification)"));
  }
  if (model.empty()) {
    return Fail(job, Unavailable("no detection model is loaded (set --detection-model, or give a model "
                                 "quern.task: detection)"));
  }
  if (!image) return Fail(job, InvalidArgument("no image was sent: expected a multipart form field named 'image'"));
  if (image->data.empty()) return Fail(job, InvalidArgument("the 'image' field is empty (0 bytes)"));
  job->image = image->data;
  auto m = service_->Model(model);
  if (!m) return Fail(job, m.error());
  if (command == "scene" && (*m)->task != VisionTask::kClassification) {
    return Fail(job, InvalidArgument("the scene model '" + model +
                                     "' is not a classification model (--scene-model needs quern.task: "
                                     "classification)"));
  }
  if (command != "scene" && (*m)->task != VisionTask::kDetection) {
    return Fail(job, InvalidArgument("model '" + model + "' is a classification model; use POST /predict/" + model));
  }
  Submit(std::move(job), std::move(*m));
}

HttpResponse VisionHandler::Refusal(const Job& job, const Status& status) const {
  if (job.kind == Job::Kind::kPredict) {
    HttpResponse r = JsonError(503, status.message());
    r.headers.emplace_back("Retry-After", "1");
    return r;
  }
  return CpaiError(job, status, nullptr);
}

void VisionHandler::Submit(std::shared_ptr<Job> job, std::shared_ptr<const VisionModel> model) {
  VisionRequest r;
  r.model = std::move(model);
  r.image = job->image;
  r.owner = job;  // the body (or the decoded base64) the image is viewed in
  r.held_bytes =
      static_cast<int64_t>(job->request.body.size() + job->image_storage.size() + job->form.decoded.capacity());
  r.min_confidence = job->min_confidence;
  r.cancel = job->request.cancel;
  Status st = SubmitCounted(std::move(r), [this, job](VisionResult&& result) { Answer(job, std::move(result)); });
  if (!st.ok()) Respond(job, Refusal(*job, st));
}

void VisionHandler::BeginPending() {
  MutexLock lock(pending_mu_);
  ++pending_;
}

void VisionHandler::EndPending() {
  MutexLock lock(pending_mu_);
  if (--pending_ == 0) pending_cv_.SignalAll();
}

Status VisionHandler::SubmitCounted(VisionRequest request, std::function<void(VisionResult&&)> then) {
  VisionCallback answer = [this, then = std::move(then)](VisionResult&& result) {
    then(std::move(result));
    EndPending();
  };
  BeginPending();
  Status st = service_->Submit(std::move(request), answer);
  if (!st.ok()) EndPending();
  return st;
}

void VisionHandler::Fail(const std::shared_ptr<Job>& job, const Status& status) {
  service_->CountFailure();
  if (job->kind == Job::Kind::kPredict) return Respond(job, JsonError(HttpStatusFor(status), status.message()));
  Respond(job, CpaiError(*job, status, nullptr));
}

void VisionHandler::Respond(const std::shared_ptr<Job>& job, HttpResponse response) {
  HttpDone done = std::move(job->done);
  if (done) done(std::move(response));
}

}  // namespace quern
