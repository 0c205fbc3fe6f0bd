#include "frontends/vision/vision_handler.h"

#include <rapidjson/document.h>
#include <rapidjson/error/en.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <random>

#include "auth/api_keys.h"
#include "core/cpus.h"
#include "core/json.h"
#include "frontends/http/http_util.h"
#include "frontends/vision/multipart.h"

namespace quern {
namespace {

using Writer = rapidjson::Writer<rapidjson::StringBuffer>;

std::string Path(const std::string& target) {
  return target.substr(0, target.find('?'));
}

// The key a request presents in a header or in the api_key query parameter.
std::string RequestKey(const HttpRequest& r) {
  std::string_view key = PresentedKey(r.Header("authorization"), r.Header("x-api-key"));
  if (!key.empty()) return std::string(key);
  const size_t q = r.target.find('?');
  if (q == std::string::npos) return {};
  std::string_view query(r.target);
  query.remove_prefix(q + 1);
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view pair = query.substr(0, amp);
    if (pair.starts_with("api_key=")) return PercentDecode(pair.substr(8));
    if (amp == std::string_view::npos) break;
    query.remove_prefix(amp + 1);
  }
  return {};
}

std::string TimestampUtc(int64_t wall_ns) {
  const std::time_t now = static_cast<std::time_t>(wall_ns / 1'000'000'000);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%a, %d %b %Y %H:%M:%S GMT", &tm);
  return buf;
}

std::string RequestId() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  const uint64_t a = rng(), b = rng();
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%08x-%04x-4%03x-%04x-%012llx", static_cast<unsigned>(a >> 32),
                static_cast<unsigned>((a >> 16) & 0xFFFF), static_cast<unsigned>(a & 0xFFF),
                static_cast<unsigned>(0x8000 | ((b >> 48) & 0x3FFF)),
                static_cast<unsigned long long>(b & 0xFFFFFFFFFFFFull));
  return buf;
}

// RFC 4648 base64 (standard alphabet; padding optional; whitespace skipped).
Result<std::string> Base64Decode(std::string_view in) {
  static const auto table = [] {
    std::array<int8_t, 256> t{};
    t.fill(-1);
    const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int i = 0; i < 64; ++i) t[static_cast<unsigned char>(a[i])] = static_cast<int8_t>(i);
    t['-'] = 62;  // URL-safe alphabet too
    t['_'] = 63;
    return t;
  }();
  std::string out;
  out.reserve(in.size() / 4 * 3);
  uint32_t acc = 0;
  int bits = 0;
  size_t i = 0;
  for (; i < in.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(in[i]);
    if (c == '=') break;
    if (c == ' ' || c == '\n' || c == '\r' || c == '\t') continue;
    const int v = table[c];
    if (v < 0) {
      return std::unexpected(InvalidArgument("'image' is not valid base64 (character " + std::to_string(i) + ")"));
    }
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  for (; i < in.size(); ++i) {
    if (in[i] != '=' && in[i] != '\n' && in[i] != '\r') {
      return std::unexpected(InvalidArgument("'image' is not valid base64 (data after the padding)"));
    }
  }
  return out;
}

HttpResponse Json(int status, std::string body) {
  HttpResponse r;
  r.status = status;
  r.body = std::move(body);
  return r;
}

HttpResponse JsonError(int status, const std::string& message) {
  rapidjson::StringBuffer sb;
  Writer w(sb);
  w.StartObject();
  w.Key("error");
  w.String(message.c_str(), static_cast<rapidjson::SizeType>(message.size()));
  w.EndObject();
  return Json(status, sb.GetString());
}

void String(Writer& w, std::string_view s) {
  w.String(s.data(), static_cast<rapidjson::SizeType>(s.size()));
}

// A box's corners as CodeProject.AI writes them: whole pixels of the image.
void WriteBox(Writer& w, const Detection& box) {
  w.Key("x_min");
  w.Int(static_cast<int>(std::lround(box.x_min)));
  w.Key("y_min");
  w.Int(static_cast<int>(std::lround(box.y_min)));
  w.Key("x_max");
  w.Int(static_cast<int>(std::lround(box.x_max)));
  w.Key("y_max");
  w.Int(static_cast<int>(std::lround(box.y_max)));
}

}  // namespace

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

VisionHandler::VisionHandler(VisionService* service, VisionOptions options)
    : service_(service), options_(std::move(options)) {
  char host[256] = {};
  hostname_ = gethostname(host, sizeof(host) - 1) == 0 ? host : "quern";
}

VisionHandler::~VisionHandler() {
  MutexLock lock(pending_mu_);
  pending_cv_.WaitFor(lock, std::chrono::seconds(30), [this]() QUERN_REQUIRES(pending_mu_) { return pending_ == 0; });
}

bool VisionHandler::Handles(std::string_view target) {
  return target.starts_with("/v1/") || target.starts_with("/predict/") || target == "/predict";
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

void VisionHandler::Handle(HttpRequest&& request, HttpDone done) {
  const std::string path = Path(request.target);
  auto job = std::make_shared<Job>();
  job->received_ns = service_->clock().NowNs();
  // A key in a header or the query; CodeProject.AI forms may carry one in a
  // field instead (checked with the form below).
  const std::string header_key = RequestKey(request);
  const bool ocr = path == "/v1/vision/ocr" || path == "/v1/image/ocr";

  if (path.starts_with("/predict")) {
    job->kind = Job::Kind::kPredict;  // its key was checked with the head
    const std::string model = path.size() > 9 ? PercentDecode(path.substr(9)) : "";
    if (request.method != "POST")
      return done(JsonError(405, "use POST /predict/{model} with {\"image\": \"<base64>\"}"));
    if (model.empty() || model.find('/') != std::string::npos) {
      return done(JsonError(404, "no such route; use POST /predict/{model}"));
    }
    rapidjson::Document doc;
    if (JsonParseError e; !ParseJson(doc, request.body.data(), request.body.size(), e)) {
      return done(JsonError(400, "model '" + model + "': the body is not valid JSON (" + e.message + " at offset " +
                                     std::to_string(e.offset) + "); expected {\"image\": \"<base64>\"}"));
    }
    if (!doc.IsObject()) {
      return done(JsonError(400, "model '" + model + "': the body must be a JSON object {\"image\": \"<base64>\"}"));
    }
    auto it = doc.FindMember("image");
    if (it == doc.MemberEnd() || !it->value.IsString()) {
      return done(JsonError(400, "model '" + model + "': field 'image' (a base64 string) is missing"));
    }
    std::string_view b64(it->value.GetString(), it->value.GetStringLength());
    if (b64.starts_with("data:")) b64.remove_prefix(std::min(b64.size(), b64.find(',') + 1));  // data URL
    auto bytes = Base64Decode(b64);
    if (!bytes) return done(JsonError(400, "model '" + model + "': " + bytes.error().message()));
    auto m = service_->Model(model);
    if (!m) return done(JsonError(HttpStatusFor(m.error()), m.error().message()));
    if ((*m)->task != VisionTask::kClassification) {
      return done(JsonError(
          400, "model '" + model + "' is a detection model; /predict classifies. Use POST /v1/vision/custom/" + model));
    }
    job->image_storage = std::move(*bytes);
    job->image = job->image_storage;
    job->request = std::move(request);
    job->done = std::move(done);
    return Submit(std::move(job), std::move(*m));
  }

  // CodeProject.AI routes.
  job->request = std::move(request);
  job->done = std::move(done);
  // A key in the head was checked with it (CheckHead); a form route whose
  // head has none takes its key from the form, below.
  if (path == "/v1/status/ping") {
    return Respond(job, Json(200, "{\"success\":true}"));
  }
  // Blue Iris lists the custom models with GET as well as POST.
  const bool list = path == "/v1/vision/custom/list" || path == "/v1/vision/face/list";
  if (job->request.method != "POST" && !(list && job->request.method == "GET")) {
    return Fail(job, InvalidArgument(job->request.method + " " + path + ": vision routes take POST"));
  }
  // The face list needs no form: a GET, or a POST without one.
  if (path == "/v1/vision/face/list" &&
      (job->request.method == "GET" || !job->request.Header("content-type").starts_with("multipart/"))) {
    if (options_.authorize && header_key.empty()) {
      if (Status st = AuthorizeCpai(header_key); !st.ok()) return Fail(job, st);
    }
    job->command = "list";
    return HandleFaces(job, {}, "");
  }
  if (list && path == "/v1/vision/custom/list") {
    job->command = "list";
    rapidjson::StringBuffer sb;
    Writer w(sb);
    w.StartObject();
    w.Key("success");
    w.Bool(true);
    w.Key("models");
    w.StartArray();
    for (const auto& name : service_->DetectionModels()) String(w, name);
    w.EndArray();
    w.Key("moduleId");
    w.String("quern");
    w.Key("command");
    w.String("list");
    w.EndObject();
    return Respond(job, Json(200, sb.GetString()));
  }
  std::string model;
  if (path == "/v1/vision/detection") {
    model = DefaultDetectionModel();  // none: answered after the key check
  } else if (path == "/v1/vision/scene") {
    model = options_.scene_model;  // none: answered after the key check
    job->command = "scene";
  } else if (path == "/v1/vision/face") {
    model = options_.face_model.empty() ? FirstDetectionModel(/*faces=*/true) : options_.face_model;
    job->command = "face";
  } else if (path == "/v1/vision/face/register" || path == "/v1/vision/face/recognize" ||
             path == "/v1/vision/face/match" || path == "/v1/vision/face/list" || path == "/v1/vision/face/delete") {
    model = options_.face_model.empty() ? FirstDetectionModel(/*faces=*/true) : options_.face_model;
    job->command = path.substr(16);
  } else if (path.starts_with("/v1/vision/custom/") && path.size() > 18) {
    model = PercentDecode(path.substr(18));
    job->command = "custom";
  } else if (ocr) {
    model = options_.ocr_model;
    job->command = "ocr";
  } else {
    return Fail(job, NotFound("no vision route " + path +
                              " (routes: /v1/vision/detection, /v1/vision/custom/{model}, /v1/vision/custom/list, "
                              "/v1/vision/scene, /v1/vision/face, /v1/vision/face/{register,recognize,match,list,"
                              "delete}, /v1/vision/ocr, /v1/status/ping)"));
  }
  auto boundary = MultipartBoundary(job->request.Header("content-type"));
  if (!boundary) return Fail(job, boundary.error());
  auto parts = ParseMultipart(job->request.body, *boundary);
  if (!parts) return Fail(job, parts.error());
  const FormPart* image = nullptr;
  for (const auto& p : *parts) {
    // CodeProject.AI's OCR module names its file "upload".
    if ((p.name == "image" || (job->command == "ocr" && p.name == "upload")) && !image) image = &p;
    if (p.name == "min_confidence") job->min_confidence = ParseMinConfidence(p.data);
  }
  if (options_.authorize && header_key.empty()) {
    std::string_view field_key;
    for (const auto& p : *parts) {
      if (p.name == "api_key") field_key = p.data;
    }
    if (Status st = AuthorizeCpai(field_key); !st.ok()) return Fail(job, st);
  }
  if (job->command == "ocr") {
    if (!image) return Fail(job, InvalidArgument("no image was sent: expected a multipart form field named 'upload'"));
    if (image->data.empty()) return Fail(job, InvalidArgument("the 'upload' field is empty (0 bytes)"));
    return HandleOcr(job, image->data);
  }
  if (job->command != "detect" && job->command != "custom" && job->command != "scene" && job->command != "face") {
    return HandleFaces(job, *parts, model);
  }
  if (model.empty() && job->command == "face") {
    return Fail(job, Unavailable("no face model is loaded (a detection model with quern.detection.format "
                                 "centerface, such as examples/models/faces, or --face-model)"));
  }
  if (model.empty() && job->command == "scene") {
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
  if (job->command == "scene" && (*m)->task != VisionTask::kClassification) {
    return Fail(job, InvalidArgument("the scene model '" + model +
                                     "' is not a classification model (--scene-model needs quern.task: "
                                     "classification)"));
  }
  if (job->command != "scene" && (*m)->task != VisionTask::kDetection) {
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

Status VisionHandler::AuthorizeCpai(std::string_view key) const {
  Status st = options_.authorize(key);
  if (st.code() != StatusCode::kUnauthenticated) return st;
  // In the words of CodeProject.AI's clients, which send an api_key field.
  return Unauthenticated(key.empty() ? "this server requires an api_key (a form field, the api_key query parameter, "
                                       "or Authorization: Bearer <key>)"
                                     : "the api_key is not valid");
}

bool VisionHandler::IsFormRoute(std::string_view method, std::string_view path) {
  return method == "POST" &&
         (path == "/v1/vision/ocr" || path == "/v1/image/ocr" || path == "/v1/vision/detection" ||
          path == "/v1/vision/scene" || path == "/v1/vision/face" || path.starts_with("/v1/vision/face/") ||
          (path.starts_with("/v1/vision/custom/") && path != "/v1/vision/custom/list"));
}

std::optional<HttpResponse> VisionHandler::CheckHead(const HttpRequest& head) {
  const std::string path = Path(head.target);
  if (options_.authorize && path != "/v1/status/ping") {
    // The key, before any byte of the body is read or decoded.
    const std::string key = RequestKey(head);
    const bool form_key = key.empty() && IsFormRoute(head.method, path);
    Status st;
    if (!form_key) {
      st = path.starts_with("/predict") ? options_.authorize(key) : AuthorizeCpai(key);
    } else if (const auto encoding = head.Header("content-encoding");
               !encoding.empty() && encoding != "identity" && encoding != "Identity") {
      // A form's key is read from the body, which is never inflated for a
      // caller not known yet.
      st = Unauthenticated("a compressed body must carry its api_key in a header or the query");
    }
    if (!st.ok()) {
      if (path.starts_with("/predict")) return JsonError(AuthHttpStatus(st), st.message());
      Job job;
      job.received_ns = service_->clock().NowNs();
      return CpaiError(job, st, nullptr);
    }
    if (form_key) return std::nullopt;  // admitted once its key is known
  }
  if (head.method != "POST") return std::nullopt;
  Job job;
  if (path.starts_with("/predict/")) {
    job.kind = Job::Kind::kPredict;
  } else if (path.starts_with("/v1/vision/custom/") && path != "/v1/vision/custom/list") {
    job.command = "custom";
  } else if (path == "/v1/vision/scene") {
    job.command = "scene";
  } else if (path == "/v1/vision/ocr" || path == "/v1/image/ocr") {
    job.command = "ocr";
  } else if (path == "/v1/vision/face") {
    if (options_.face_model.empty()) return std::nullopt;  // found per request; admitted there
    job.command = "face";
  } else if (path != "/v1/vision/detection") {
    return std::nullopt;
  }
  int64_t body = 0;
  const std::string_view length = head.Header("content-length");
  (void)std::from_chars(length.data(), length.data() + length.size(), body);
  // The model's queue too, when the route names the model.
  std::string model = job.kind == Job::Kind::kPredict ? PercentDecode(path.substr(9))
                      : job.command == "custom"       ? PercentDecode(path.substr(18))
                      : job.command == "scene"        ? options_.scene_model
                      : job.command == "face"         ? options_.face_model
                      : job.command == "ocr"          ? options_.ocr_model
                                                      : options_.detection_model;
  if (model.empty() && job.kind != Job::Kind::kPredict && job.command == "detect") {
    MutexLock lock(models_mu_);
    model = last_default_model_;  // as the last detection request found it
  }
  Status st = service_->CheckAdmission(model, body);
  if (st.ok()) return std::nullopt;
  job.received_ns = service_->clock().NowNs();
  return Refusal(job, st);
}

void VisionHandler::Submit(std::shared_ptr<Job> job, std::shared_ptr<const VisionModel> model) {
  VisionRequest r;
  r.model = std::move(model);
  r.image = job->image;
  r.owner = job;  // the body (or the decoded base64) the image is viewed in
  r.held_bytes = static_cast<int64_t>(job->request.body.size() + job->image_storage.size());
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

void VisionHandler::HandleOcr(const std::shared_ptr<Job>& job, std::string_view image) {
  // Admitted like every image (the service's capacity and memory bound,
  // the model's queue); the model decodes it itself.
  EncodedImageRequest r;
  r.model = options_.ocr_model;
  r.image = image;
  r.owner = job;  // the body the image is viewed in
  r.held_bytes = static_cast<int64_t>(job->request.body.size());
  r.cancel = job->request.cancel;
  BeginPending();
  EncodedImageCallback answer = [this, job](InferResponse&& resp, const VisionTimings& t) {
    const Tensor* text = resp.FindOutput("text");
    const Tensor* confidence = resp.FindOutput("confidence");
    const Tensor* boxes = resp.FindOutput("boxes");
    Result<std::vector<std::string_view>> lines = Err(Internal("no output 'text'"));
    if (resp.status.ok() && text) lines = text->Strings();
    if (resp.status.ok() && (!lines || !confidence || !boxes || confidence->dtype() != DataType::kFp32 ||
                             boxes->dtype() != DataType::kFp32 || confidence->element_count() != ssize(*lines) ||
                             boxes->element_count() != 8 * ssize(*lines))) {
      resp.status = Internal("model '" + options_.ocr_model +
                             "' did not answer as an OCR model: outputs 'text' (BYTES [N]), 'confidence' (FP32 [N]) "
                             "and 'boxes' (FP32 [N, 4, 2])");
    }
    if (!resp.status.ok()) {
      service_->CountFailure();
      Respond(job, CpaiError(*job, resp.status, &t));
    } else {
      rapidjson::StringBuffer sb;
      Writer w(sb);
      w.StartObject();
      w.Key("success");
      w.Bool(true);
      w.Key("predictions");
      w.StartArray();
      auto c = confidence->values<float>();
      auto b = boxes->values<float>();
      for (size_t i = 0; i < lines->size(); ++i) {
        float x0 = b[8 * i], y0 = b[8 * i + 1], x1 = x0, y1 = y0;
        for (size_t k = 1; k < 4; ++k) {
          x0 = std::min(x0, b[8 * i + 2 * k]), x1 = std::max(x1, b[8 * i + 2 * k]);
          y0 = std::min(y0, b[8 * i + 2 * k + 1]), y1 = std::max(y1, b[8 * i + 2 * k + 1]);
        }
        w.StartObject();
        w.Key("label");
        String(w, (*lines)[i]);
        w.Key("confidence");
        w.Double(c[i]);
        w.Key("x_min");
        w.Int(static_cast<int>(x0));
        w.Key("y_min");
        w.Int(static_cast<int>(y0));
        w.Key("x_max");
        w.Int(static_cast<int>(x1));
        w.Key("y_max");
        w.Int(static_cast<int>(y1));
        w.EndObject();
      }
      w.EndArray();
      w.Key("count");
      w.Uint64(lines->size());
      w.Key("message");
      String(w, lines->size() == 1 ? std::string("1 text found")
                                   : std::to_string(lines->size()) + " pieces of text found");
      WriteCpaiMeta(w, *job, &t);
      w.EndObject();
      Respond(job, Json(200, sb.GetString()));
    }
    EndPending();
  };
  if (Status st = service_->SubmitEncoded(std::move(r), answer); !st.ok()) {
    EndPending();
    if (st.code() == StatusCode::kUnavailable) return Respond(job, Refusal(*job, st));  // counted as a refusal
    Fail(job, st);
  }
}

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

void VisionHandler::HandleFaces(const std::shared_ptr<Job>& job, const std::vector<FormPart>& parts,
                                const std::string& face_model) {
  const std::string& command = job->command;
  if (!options_.faces) {
    return Fail(job, Unavailable("face recognition is off on this server (it needs a face descriptor model, e.g. "
                                 "examples/models/face_descriptor)"));
  }
  const auto field = [&parts](std::string_view name) -> const FormPart* {
    for (const auto& p : parts) {
      if (p.name == name) return &p;
    }
    return nullptr;
  };
  const auto respond = [this, &job](const std::function<void(Writer&)>& fields) {
    rapidjson::StringBuffer sb;
    Writer w(sb);
    w.StartObject();
    w.Key("success");
    w.Bool(true);
    fields(w);
    WriteCpaiMeta(w, *job, nullptr);
    w.EndObject();
    Respond(job, Json(200, sb.GetString()));
  };
  if (command == "list") {
    const std::vector<std::string> users = options_.faces->Users();
    return respond([&users](Writer& w) {
      w.Key("faces");
      w.StartArray();
      for (const auto& u : users) String(w, u);
      w.EndArray();
    });
  }
  auto face_job = std::make_shared<FaceJob>();
  face_job->job = job;
  if (command == "register" || command == "delete") {
    const FormPart* userid = field("userid");
    if (!userid) return Fail(job, InvalidArgument("no userid was sent: expected a form field named 'userid'"));
    face_job->userid = std::string(userid->data);
    if (Status st = FaceGallery::CheckUserId(face_job->userid); !st.ok()) return Fail(job, st);
  }
  if (command == "delete") {
    if (Status st = options_.faces->Delete(face_job->userid); !st.ok()) return Fail(job, st);
    return respond([](Writer& w) {
      w.Key("message");
      w.String("face deleted");
    });
  }

  // register, recognize and match: find the faces, then describe them.
  if (command == "register") {
    constexpr size_t kMaxImages = 16;
    for (const auto& p : parts) {
      const bool numbered = p.name.size() > 5 && p.name.starts_with("image") &&
                            std::all_of(p.name.begin() + 5, p.name.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (p.name != "image" && !numbered) continue;
      if (std::find(face_job->fields.begin(), face_job->fields.end(), p.name) != face_job->fields.end()) continue;
      if (face_job->fields.size() == kMaxImages) {
        return Fail(job, InvalidArgument("register takes at most " + std::to_string(kMaxImages) + " images"));
      }
      face_job->fields.push_back(p.name);
    }
  } else if (command == "recognize") {
    face_job->fields = {"image"};
    if (const FormPart* c = field("min_confidence")) {
      face_job->threshold = ParseMinConfidence(c->data, kDefaultFaceMatchConfidence);
    }
  } else {  // match
    face_job->fields = {"image1", "image2"};
  }
  if (face_job->fields.empty()) {
    return Fail(job, InvalidArgument("no image was sent: expected form fields named 'image' or 'image1'.."));
  }
  for (const auto& name : face_job->fields) {
    const FormPart* p = field(name);
    if (!p)
      return Fail(job, InvalidArgument("no image was sent in '" + name + "': expected a form field of that name"));
    if (p->data.empty()) return Fail(job, InvalidArgument("the '" + name + "' field is empty (0 bytes)"));
  }
  if (face_model.empty()) {
    return Fail(job, Unavailable("no face model is loaded (a detection model with quern.detection.format "
                                 "centerface, such as examples/models/faces, or --face-model)"));
  }
  std::string descriptor_name = options_.face_descriptor_model;
  if (descriptor_name.empty()) {
    auto names = service_->Models(VisionTask::kEmbedding);
    if (!names.empty()) descriptor_name = names.front();
  }
  if (descriptor_name.empty()) {
    return Fail(job, Unavailable("no face descriptor model is loaded (a model with quern.task embedding, such as "
                                 "examples/models/face_descriptor, or --face-descriptor-model)"));
  }
  auto detector = service_->Model(face_model);
  if (!detector) return Fail(job, detector.error());
  if ((*detector)->task != VisionTask::kDetection) {
    return Fail(job, InvalidArgument("the face model '" + face_model + "' is not a detection model"));
  }
  auto descriptor = service_->Model(descriptor_name);
  if (!descriptor) return Fail(job, descriptor.error());
  if ((*descriptor)->task != VisionTask::kEmbedding) {
    return Fail(job, InvalidArgument("the face descriptor model '" + descriptor_name +
                                     "' is not an embedding model (quern.task: embedding)"));
  }
  {
    MutexLock lock(face_job->mu);
    face_job->results.resize(face_job->fields.size());
    face_job->remaining = face_job->fields.size();
  }
  for (size_t i = 0; i < face_job->fields.size(); ++i) {
    VisionRequest r;
    r.model = *detector;
    r.image = field(face_job->fields[i])->data;
    r.owner = job;  // the body the images are viewed in
    // The body, shared out among the images that view it.
    r.held_bytes = static_cast<int64_t>(job->request.body.size() / face_job->fields.size());
    r.cancel = job->request.cancel;
    r.descriptor = *descriptor;
    // Recognition describes every face it finds (up to a batch); the others
    // the most confident face of each image.
    r.max_described = command == "recognize" ? (*descriptor)->max_batch_size : 1;
    Status st = SubmitCounted(std::move(r), [this, face_job, i](VisionResult&& result) {
      if (face_job->Done(i, std::move(result))) FinishFaces(*face_job);
    });
    if (!st.ok()) {
      // The rest are not sent: the answer is this refusal.
      for (size_t j = i; j < face_job->fields.size(); ++j) {
        VisionResult refused;
        refused.status = st;
        if (face_job->Done(j, std::move(refused))) FinishFaces(*face_job);
      }
      return;
    }
  }
}

void VisionHandler::FinishFaces(FaceJob& f) {
  const std::shared_ptr<Job>& job = f.job;
  std::vector<VisionResult> results;
  {
    MutexLock lock(f.mu);
    results = std::move(f.results);
  }
  for (size_t i = 0; i < results.size(); ++i) {
    const Status& st = results[i].status;
    if (st.ok()) continue;
    // Refused, or failed in the service (which counted the failure).
    if (st.code() == StatusCode::kUnavailable) return Respond(job, Refusal(*job, st));
    return Respond(job, CpaiError(*job, Status(st.code(), f.fields[i] + ": " + st.message()), nullptr));
  }
  // The most confident face of each image (boxes come best first).
  const auto best_face = [&](size_t i) -> const std::vector<float>* {
    const auto& d = results[i].detections;
    return d.empty() || d.front().embedding.empty() ? nullptr : &d.front().embedding;
  };
  rapidjson::StringBuffer sb;
  Writer w(sb);
  w.StartObject();
  w.Key("success");
  w.Bool(true);
  if (job->command == "register" || job->command == "match") {
    std::vector<std::vector<float>> faces;
    for (size_t i = 0; i < results.size(); ++i) {
      const std::vector<float>* face = best_face(i);
      if (!face) return Fail(job, InvalidArgument("no face was found in '" + f.fields[i] + "'"));
      faces.push_back(*face);
    }
    if (job->command == "register") {
      if (Status st = options_.faces->Register(f.userid, faces); !st.ok()) return Fail(job, st);
      w.Key("message");
      w.String("face added");
    } else {
      w.Key("similarity");
      w.Double(FaceGallery::Similarity(faces[0], faces[1]));
    }
  } else {  // recognize
    std::vector<std::string> names;
    const std::shared_ptr<const FaceSet> registered = options_.faces->Current();  // one look at the store
    w.Key("predictions");
    w.StartArray();
    for (const auto& d : results[0].detections) {
      if (d.embedding.empty()) break;  // beyond the faces described
      const auto closest = registered->Closest(d.embedding);
      const bool known = closest && closest->similarity >= f.threshold;
      names.push_back(known ? closest->userid : "unknown");
      w.StartObject();
      w.Key("userid");
      String(w, names.back());
      w.Key("confidence");
      w.Double(known ? closest->similarity : 0.0);
      WriteBox(w, d.box);
      w.EndObject();
    }
    w.EndArray();
    w.Key("count");
    w.Int(static_cast<int>(names.size()));
    std::string message = names.empty() ? "No faces found" : "Found ";
    for (size_t i = 0; i < names.size(); ++i) message += (i ? ", " : "") + names[i];
    w.Key("message");
    String(w, message);
  }
  WriteCpaiMeta(w, *job, &results[0].timings);
  w.EndObject();
  Respond(job, Json(200, sb.GetString()));
}

void VisionHandler::Answer(const std::shared_ptr<Job>& job, VisionResult&& r) {
  const VisionTimings& t = r.timings;
  if (!r.status.ok()) {
    if (job->kind == Job::Kind::kPredict) {
      return Respond(job, JsonError(r.status.code() == StatusCode::kCancelled ? 499 : HttpStatusFor(r.status),
                                    r.status.message()));
    }
    return Respond(job, CpaiError(*job, r.status, &t));
  }
  rapidjson::StringBuffer sb;
  Writer w(sb);
  if (job->kind == Job::Kind::kPredict) {
    w.StartObject();
    w.Key("predictions");
    w.StartArray();
    for (const auto& c : r.classes) {
      w.StartObject();
      w.Key("class_id");
      w.Int(c.class_id);
      w.Key("label");
      String(w, c.label);
      w.Key("confidence");
      w.Double(c.confidence);
      w.EndObject();
    }
    w.EndArray();
    w.Key("inference_time_ms");
    w.Double(static_cast<double>(t.infer_ns) / 1e6);
    w.EndObject();
  } else if (job->command == "scene") {
    // DeepStack / CodeProject.AI scene: the best class.
    w.StartObject();
    w.Key("success");
    w.Bool(true);
    w.Key("label");
    if (r.classes.empty()) {
      w.Null();
    } else {
      String(w, r.classes.front().label);
    }
    w.Key("confidence");
    w.Double(r.classes.empty() ? 0.0 : r.classes.front().confidence);
    w.Key("message");
    String(w, r.classes.empty() ? std::string("No scene found") : "Found " + r.classes.front().label);
    w.Key("error");
    w.Null();
    WriteCpaiMeta(w, *job, &t);
    w.EndObject();
  } else {
    std::vector<std::string_view> names;  // distinct labels found, for the message
    // Detections come best first: the first max_predictions are the most confident.
    if (options_.max_predictions > 0 && r.detections.size() > static_cast<size_t>(options_.max_predictions)) {
      r.detections.resize(static_cast<size_t>(options_.max_predictions));
    }
    w.StartObject();
    w.Key("success");
    w.Bool(true);
    w.Key("predictions");
    w.StartArray();
    for (const auto& d : r.detections) {
      if (std::find(names.begin(), names.end(), d.label) == names.end()) names.push_back(d.label);
      w.StartObject();
      w.Key("label");
      String(w, d.label);
      w.Key("confidence");
      w.Double(d.box.confidence);
      WriteBox(w, d.box);
      w.EndObject();
    }
    w.EndArray();
    w.Key("count");
    w.Int(static_cast<int>(r.detections.size()));
    w.Key("message");
    std::string message = r.detections.empty() ? "No objects found" : "Found ";
    for (size_t i = 0; i < names.size(); ++i) {
      if (i) message += ", ";
      message += names[i];
    }
    String(w, message);
    w.Key("error");
    w.Null();
    WriteCpaiMeta(w, *job, &t);
    w.EndObject();
  }
  HttpResponse response = Json(200, sb.GetString());
  if (r.timed) {
    char timing[160];
    std::snprintf(timing, sizeof(timing),
                  "decode;dur=%.3f, resize;dur=%.3f, queue;dur=%.3f, infer;dur=%.3f, post;dur=%.3f",
                  static_cast<double>(t.decode_ns) / 1e6, static_cast<double>(t.resize_ns) / 1e6,
                  static_cast<double>(t.queue_ns) / 1e6, static_cast<double>(t.infer_ns) / 1e6,
                  static_cast<double>(t.post_ns) / 1e6);
    response.headers.emplace_back("Server-Timing", timing);
  }
  Respond(job, std::move(response));
}

void VisionHandler::Fail(const std::shared_ptr<Job>& job, const Status& status) {
  service_->CountFailure();
  if (job->kind == Job::Kind::kPredict) return Respond(job, JsonError(HttpStatusFor(status), status.message()));
  Respond(job, CpaiError(*job, status, nullptr));
}

// CodeProject.AI's answer to a request that failed: 200, success false.
HttpResponse VisionHandler::CpaiError(const Job& job, const Status& status, const VisionTimings* timings) const {
  rapidjson::StringBuffer sb;
  Writer w(sb);
  w.StartObject();
  w.Key("success");
  w.Bool(false);
  w.Key("predictions");
  w.StartArray();
  w.EndArray();
  w.Key("count");
  w.Int(0);
  w.Key("message");
  w.String("");
  w.Key("error");
  String(w, status.message());
  WriteCpaiMeta(w, job, timings);
  w.EndObject();
  return Json(200, sb.GetString());
}

// CodeProject.AI's fields that every detection answer carries, written into
// the open object `w`.
void VisionHandler::WriteCpaiMeta(Writer& w, const Job& job, const VisionTimings* timings) const {
  const int64_t now = service_->clock().NowNs();
  w.Key("command");
  String(w, job.command);
  w.Key("moduleId");
  w.String("quern");
  w.Key("moduleName");
  w.String("Quern");
  w.Key("executionProvider");
  w.String("CPU");
  w.Key("canUseGPU");
  w.Bool(false);
  w.Key("inferenceMs");
  w.Int64(timings ? timings->infer_ns / 1'000'000 : 0);
  w.Key("processMs");
  w.Int64(timings && timings->stage_start_ns > 0 ? (now - timings->stage_start_ns) / 1'000'000 : 0);
  w.Key("analysisRoundTripMs");
  w.Int64((now - job.received_ns) / 1'000'000);
  w.Key("processedBy");
  String(w, hostname_);
  w.Key("timestampUTC");
  String(w, TimestampUtc(service_->clock().WallNs()));
  w.Key("requestId");
  String(w, RequestId());
}

void VisionHandler::Respond(const std::shared_ptr<Job>& job, HttpResponse response) {
  HttpDone done = std::move(job->done);
  if (done) done(std::move(response));
}

}  // namespace quern
