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

#include "core/cpus.h"
#include "core/json.h"
#include "frontends/http/kserve_handler.h"
#include "frontends/vision/multipart.h"
#include "metrics/text_format.h"
#include "server/api_keys.h"

namespace quern {
namespace {

using Writer = rapidjson::Writer<rapidjson::StringBuffer>;

int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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

std::string TimestampUtc() {
  const std::time_t now = std::time(nullptr);
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

}  // namespace

struct VisionHandler::Job {
  enum class Kind { kCpai, kPredict };
  Kind kind = Kind::kCpai;
  std::string command = "detect";
  HttpRequest request;  // owns the body the image is viewed in
  HttpDone done;
  std::string image_storage;  // decoded base64 (/predict)
  std::string_view image;
  std::shared_ptr<const VisionModel> model;
  float min_confidence = 0.4f;
  int64_t received_ns = 0;  // steady clock
  int64_t deadline_ns = 0;  // steady clock
  ImageTransform transform;
  bool admitted = false;       // holds an admission slot
  int64_t charged_bytes = 0;   // counted in in_flight_bytes_ while admitted
  int64_t stage_start_ns = 0;  // steady clock, when a stage thread took it
  // Stage durations: decode, resize (+ normalise), queue in the batcher,
  // compute of its batch, post-processing (until the response is written).
  int64_t decode_ns = 0, resize_ns = 0, queue_ns = 0, infer_ns = 0;
  int64_t post_start_ns = 0;  // steady clock, when post-processing began
};

VisionHandler::VisionHandler(Engine* engine, VisionOptions options) : engine_(engine), options_(std::move(options)) {
  char host[256] = {};
  hostname_ = gethostname(host, sizeof(host) - 1) == 0 ? host : "quern";
  int n = options_.stage_threads > 0 ? options_.stage_threads : UsableCores();
  options_.stage_threads = n;
  for (int i = 0; i < n; ++i)
    threads_.emplace_back([this] {
      NameThisThread("quern-vision");
      StageLoop();
    });
}

VisionHandler::~VisionHandler() {
  {
    std::unique_lock<std::mutex> lock(idle_mu_);
    idle_cv_.wait_for(lock, std::chrono::seconds(30), [this] { return in_flight_.load() == 0; });
  }
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    stopping_ = true;
  }
  pool_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

std::string RenderVisionPrometheus(const VisionStats& s) {
  std::string out;
  auto metric = [&out](const char* name, const char* type, const char* help, double value) {
    AppendMetric(out, name, type, help, value);
  };
  metric("quern_vision_requests_total", "counter", "Images admitted to the vision pipeline.",
         static_cast<double>(s.requests));
  metric("quern_vision_rejected_overload_total", "counter",
         "Vision requests refused at once because the queue was at capacity.",
         static_cast<double>(s.rejected_overload));
  metric("quern_vision_dropped_total", "counter",
         "Vision requests dropped before inference: client gone or timeout passed.", static_cast<double>(s.dropped));
  metric("quern_vision_failed_total", "counter", "Vision requests answered with an error.",
         static_cast<double>(s.failed));
  metric("quern_vision_in_flight", "gauge", "Images in the vision pipeline now.", static_cast<double>(s.in_flight));
  metric("quern_vision_queue_capacity", "gauge", "Images admitted at once.", static_cast<double>(s.capacity));
  metric("quern_vision_in_flight_bytes", "gauge",
         "Memory held by the images in the vision pipeline (request bodies and model inputs).",
         static_cast<double>(s.in_flight_bytes));
  metric("quern_vision_ms_per_image", "gauge", "Measured pipeline time per image behind the derived capacity.",
         s.ms_per_image);
  metric("quern_vision_timed_images_total", "counter",
         "Answered images whose stage durations are summed in quern_vision_stage_seconds_total.",
         static_cast<double>(s.timed_images));
  AppendMetricFamily(out, "quern_vision_stage_seconds_total", "counter",
                     "Time answered images spent in each stage: decode, resize (with normalisation), queue "
                     "(waiting in the model's batcher), infer (their batch's compute), post (decoding outputs, "
                     "NMS, JSON).");
  const std::pair<const char*, uint64_t> stages[] = {{"decode", s.decode_ns},
                                                     {"resize", s.resize_ns},
                                                     {"queue", s.queue_ns},
                                                     {"infer", s.infer_ns},
                                                     {"post", s.post_ns}};
  for (const auto& [stage, ns] : stages) {
    AppendMetricSample(out, std::string("quern_vision_stage_seconds_total{stage=\"") + stage + "\"}",
                       static_cast<double>(ns) / 1e9);
  }
  return out;
}

bool VisionHandler::Handles(std::string_view target) {
  return target.starts_with("/v1/") || target.starts_with("/predict/") || target == "/predict";
}

VisionStats VisionHandler::stats() const {
  VisionStats s;
  s.requests = requests_.load();
  s.rejected_overload = rejected_.load();
  s.dropped = dropped_.load();
  s.failed = failed_.load();
  s.in_flight = in_flight_.load();
  s.in_flight_bytes = in_flight_bytes_.load();
  s.capacity = Capacity();
  s.ms_per_image = ms_per_image_.load();
  s.timed_images = timed_images_.load(std::memory_order_relaxed);
  s.decode_ns = decode_ns_.load(std::memory_order_relaxed);
  s.resize_ns = resize_ns_.load(std::memory_order_relaxed);
  s.queue_ns = queue_ns_.load(std::memory_order_relaxed);
  s.infer_ns = infer_ns_.load(std::memory_order_relaxed);
  s.post_ns = post_ns_.load(std::memory_order_relaxed);
  return s;
}

int64_t VisionHandler::Capacity() const {
  if (options_.queue_capacity > 0) return options_.queue_capacity;
  const double per_image = std::max(0.01, ms_per_image_.load());
  return std::max<int64_t>(options_.stage_threads,
                           static_cast<int64_t>(static_cast<double>(QueueBudgetMs()) / per_image));
}

int64_t VisionHandler::QueueBudgetMs() const {
  if (options_.max_queue_wait_ms > 0) return std::min(options_.request_timeout_ms, options_.max_queue_wait_ms);
  return options_.request_timeout_ms;
}

void VisionHandler::Post(std::function<void()> task, bool urgent) {
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    if (urgent) {
      tasks_.push_front(std::move(task));
    } else {
      tasks_.push_back(std::move(task));
    }
  }
  pool_cv_.notify_one();
}

void VisionHandler::StageLoop() {
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(pool_mu_);
      pool_cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

Result<std::shared_ptr<const VisionModel>> VisionHandler::Model(const std::string& name) {
  QUERN_ASSIGN_OR_RETURN(ModelStatus status, engine_->GetModel(name));
  if (status.state != ModelState::kReady) {
    return std::unexpected(Unavailable("model '" + name + "' is not ready (" +
                                       std::string(ModelStateName(status.state)) +
                                       (status.reason.empty() ? "" : ": " + status.reason) + ")"));
  }
  if (!IsVisionModel(status.config)) {
    return std::unexpected(InvalidArgument("model '" + name +
                                           "' has no image pipeline (declare one with quern.task / quern.image.* "
                                           "parameters in its config.pbtxt)"));
  }
  {
    std::lock_guard<std::mutex> lock(models_mu_);
    auto it = models_.find(name);
    if (it != models_.end() && it->second->version == status.version) return it->second;
  }
  QUERN_ASSIGN_OR_RETURN(VisionModel m, VisionModelFromStatus(status, options_.model_repository / name));
  auto shared = std::make_shared<const VisionModel>(std::move(m));
  std::lock_guard<std::mutex> lock(models_mu_);
  models_[name] = shared;
  return shared;
}

std::string VisionHandler::DefaultDetectionModel() {
  if (!options_.detection_model.empty()) return options_.detection_model;
  std::string name;
  for (auto& n : DetectionModels()) {
    name = std::move(n);
    break;
  }
  std::lock_guard<std::mutex> lock(models_mu_);
  last_default_model_ = name;
  return name;
}

std::vector<std::string> VisionHandler::DetectionModels() {
  std::vector<std::string> out;
  for (const auto& m : engine_->ListModels()) {  // sorted by name
    if (m.state != ModelState::kReady || !IsVisionModel(m.config)) continue;
    if (!out.empty() && out.back() == m.name) continue;  // another version
    auto vm = Model(m.name);
    if (vm && (*vm)->task == VisionTask::kDetection) out.push_back(m.name);
  }
  return out;
}

void VisionHandler::Handle(HttpRequest&& request, HttpDone done) {
  const std::string path = Path(request.target);
  auto job = std::make_shared<Job>();
  job->received_ns = SteadyNs();
  job->deadline_ns = job->received_ns + options_.request_timeout_ms * 1'000'000;
  // A key in a header or the query; CodeProject.AI forms may carry one in a
  // field instead (checked with the form below).
  const std::string header_key = RequestKey(request);
  const bool form_route =
      request.method == "POST" &&
      (path == "/v1/vision/detection" || (path.starts_with("/v1/vision/custom/") && path != "/v1/vision/custom/list"));

  if (path.starts_with("/predict")) {
    job->kind = Job::Kind::kPredict;
    if (options_.authorize) {
      if (Status st = options_.authorize(header_key); !st.ok()) {
        return done(JsonError(AuthHttpStatus(st), st.message()));
      }
    }
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
    auto m = Model(model);
    if (!m) return done(JsonError(HttpStatusFor(m.error()), m.error().message()));
    if ((*m)->task != VisionTask::kClassification) {
      return done(JsonError(
          400, "model '" + model + "' is a detection model; /predict classifies. Use POST /v1/vision/custom/" + model));
    }
    job->image_storage = std::move(*bytes);
    job->image = job->image_storage;
    job->model = std::move(*m);
    job->request = std::move(request);
    job->done = std::move(done);
    return Admit(std::move(job));
  }

  // CodeProject.AI routes.
  job->request = std::move(request);
  job->done = std::move(done);
  if (options_.authorize && (!form_route || !header_key.empty())) {
    if (Status st = options_.authorize(header_key); !st.ok()) return Fail(job, st);
  }
  if (path == "/v1/status/ping") {
    return Respond(job, Json(200, "{\"success\":true}"));
  }
  if (job->request.method != "POST") {
    return Fail(job, InvalidArgument(job->request.method + " " + path + ": vision routes take POST"));
  }
  if (path == "/v1/vision/custom/list") {
    job->command = "list";
    rapidjson::StringBuffer sb;
    Writer w(sb);
    w.StartObject();
    w.Key("success");
    w.Bool(true);
    w.Key("models");
    w.StartArray();
    for (const auto& name : DetectionModels()) String(w, name);
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
  } else if (path.starts_with("/v1/vision/custom/") && path.size() > 18) {
    model = PercentDecode(path.substr(18));
    job->command = "custom";
  } else {
    return Fail(job, NotFound("no vision route " + path +
                              " (routes: /v1/vision/detection, /v1/vision/custom/{model}, /v1/vision/custom/list, "
                              "/v1/status/ping)"));
  }
  auto boundary = MultipartBoundary(job->request.Header("content-type"));
  if (!boundary) return Fail(job, boundary.error());
  auto parts = ParseMultipart(job->request.body, *boundary);
  if (!parts) return Fail(job, parts.error());
  const FormPart* image = nullptr;
  for (const auto& p : *parts) {
    if (p.name == "image" && !image) image = &p;
    if (p.name == "min_confidence") {
      const std::string v(p.data);
      char* end = nullptr;
      const float f = std::strtof(v.c_str(), &end);
      if (v.empty() || end != v.c_str() + v.size() || !(f >= 0.0f && f <= 1.0f)) {
        return Fail(job, InvalidArgument("min_confidence is '" + v + "'; expected a number from 0 to 1"));
      }
      job->min_confidence = f;
    }
    if (p.name == "api_key" && !options_.authorize && !options_.api_key.empty() && p.data != options_.api_key) {
      return Fail(job, PermissionDenied("the api_key is not valid"));
    }
  }
  if (options_.authorize && header_key.empty()) {
    std::string_view field_key;
    for (const auto& p : *parts) {
      if (p.name == "api_key") field_key = p.data;
    }
    if (Status st = options_.authorize(field_key); !st.ok()) return Fail(job, st);
  } else if (!options_.authorize && !options_.api_key.empty()) {
    bool has_key = false;
    for (const auto& p : *parts) has_key = has_key || p.name == "api_key";
    if (!has_key) return Fail(job, PermissionDenied("this server requires an api_key field"));
  }
  if (model.empty()) {
    return Fail(job, Unavailable("no detection model is loaded (set --detection-model, or give a model "
                                 "quern.task: detection)"));
  }
  if (!image) return Fail(job, InvalidArgument("no image was sent: expected a multipart form field named 'image'"));
  if (image->data.empty()) return Fail(job, InvalidArgument("the 'image' field is empty (0 bytes)"));
  job->image = image->data;
  auto m = Model(model);
  if (!m) return Fail(job, m.error());
  if ((*m)->task != VisionTask::kDetection) {
    return Fail(job, InvalidArgument("model '" + model + "' is a classification model; use POST /predict/" + model));
  }
  job->model = std::move(*m);
  Admit(std::move(job));
}

Status VisionHandler::Busy(int64_t in_flight, int64_t capacity, int64_t held, int64_t bytes) const {
  if (in_flight >= capacity) {
    return Unavailable("the server is busy: " + std::to_string(capacity) +
                       " images are already waiting, as many as it can finish within " +
                       std::to_string(QueueBudgetMs()) + " ms; try again later");
  }
  // One image is always let in, however large (within the body limit).
  if (options_.max_in_flight_bytes > 0 && held > 0 && held + bytes > options_.max_in_flight_bytes) {
    return Unavailable("the server is busy: the images already admitted hold " + std::to_string(held >> 20) +
                       " MiB, and this one would pass the limit of " +
                       std::to_string(options_.max_in_flight_bytes >> 20) +
                       " MiB (--vision-max-memory-mb); try again later");
  }
  return Status::Ok();
}

HttpResponse VisionHandler::Refusal(const Job& job, const Status& status) const {
  const int64_t now = SteadyNs();
  int64_t last = last_overload_log_ns_.load();
  if (now - last > 1'000'000'000 && last_overload_log_ns_.compare_exchange_strong(last, now)) {
    std::fprintf(stderr, "quern: warning: vision pipeline full, refusing requests: %s\n", status.message().c_str());
  }
  if (job.kind == Job::Kind::kPredict) {
    HttpResponse r = JsonError(503, status.message());
    r.headers.emplace_back("Retry-After", "1");
    return r;
  }
  return CpaiError(job, status);
}

std::optional<HttpResponse> VisionHandler::CheckHead(const HttpRequest& head) {
  if (head.method != "POST" || options_.authorize || !options_.api_key.empty()) return std::nullopt;
  const std::string path = Path(head.target);
  Job job;
  if (path.starts_with("/predict/")) {
    job.kind = Job::Kind::kPredict;
  } else if (path.starts_with("/v1/vision/custom/") && path != "/v1/vision/custom/list") {
    job.command = "custom";
  } else if (path != "/v1/vision/detection") {
    return std::nullopt;
  }
  int64_t body = 0;
  const std::string_view length = head.Header("content-length");
  (void)std::from_chars(length.data(), length.data() + length.size(), body);
  Status st = Busy(in_flight_.load(), Capacity(), in_flight_bytes_.load(), body);
  if (st.ok()) {
    // The model's queue, when the route names the model.
    std::string model = job.kind == Job::Kind::kPredict ? PercentDecode(path.substr(9))
                        : job.command == "custom"       ? PercentDecode(path.substr(18))
                                                        : options_.detection_model;
    if (model.empty() && job.kind != Job::Kind::kPredict && job.command != "custom") {
      std::lock_guard<std::mutex> lock(models_mu_);
      model = last_default_model_;  // as the last detection request found it
    }
    if (!model.empty()) st = engine_->CheckAdmission(model);
  }
  if (st.ok()) return std::nullopt;
  rejected_.fetch_add(1);
  job.received_ns = SteadyNs();
  return Refusal(job, st);
}

void VisionHandler::Admit(std::shared_ptr<Job> job) {
  const int64_t bytes =
      static_cast<int64_t>(job->request.body.size() + job->image_storage.size() + PreprocessedBytes(job->model->image));
  // The model's own queue is asked first: an image it would refuse is not
  // decoded and resized for nothing.
  Status st = engine_->CheckAdmission(job->model->name, job->model->version);
  if (st.ok()) {
    // Both bounds are claimed first and given back on refusal, so that
    // concurrent admissions cannot pass them together.
    const int64_t capacity = Capacity();
    const int64_t before = in_flight_.fetch_add(1);
    const int64_t held = in_flight_bytes_.fetch_add(bytes);
    st = Busy(before, capacity, held, bytes);
    if (!st.ok()) {
      in_flight_.fetch_sub(1);
      in_flight_bytes_.fetch_sub(bytes);
    }
  }
  if (!st.ok()) {
    rejected_.fetch_add(1);
    return job->done(Refusal(*job, st));
  }
  job->charged_bytes = bytes;
  job->admitted = true;
  requests_.fetch_add(1);
  Post([this, job] { Process(job); }, false);
}

void VisionHandler::Process(const std::shared_ptr<Job>& job) {
  job->stage_start_ns = SteadyNs();
  if (job->request.cancel && job->request.cancel->cancelled()) {
    dropped_.fetch_add(1);
    return Respond(job, JsonError(499, "client closed the request"));  // nobody reads it
  }
  if (job->stage_start_ns > job->deadline_ns) {
    dropped_.fetch_add(1);
    return Fail(job, DeadlineExceeded("the image waited " +
                                      std::to_string((job->stage_start_ns - job->received_ns) / 1'000'000) +
                                      " ms before decoding, over the request timeout of " +
                                      std::to_string(options_.request_timeout_ms) + " ms"));
  }
  const VisionModel& m = *job->model;
  DecodeOptions dopt;
  dopt.target = &m.image;
  dopt.max_pixels = options_.max_image_pixels;
  auto decoded = DecodeImage(job->image, dopt);
  if (!decoded) return Fail(job, decoded.error());
  const int64_t t1 = SteadyNs();
  Tensor input = Tensor::AllocateUninitialized(m.image.dtype, m.input_shape, PreprocessedBytes(m.image));
  job->transform = Preprocess(*decoded, m.image, input.mutable_data());
  const int64_t t2 = SteadyNs();
  job->decode_ns = t1 - job->stage_start_ns;
  job->resize_ns = t2 - t1;
  job->image = {};
  job->image_storage.clear();

  InferRequest ir;
  ir.model = m.name;
  ir.version = m.version;
  ir.inputs.push_back({m.input_name, std::move(input)});
  ir.cancel = job->request.cancel;
  ir.admitted = true;  // by Admit, within this pipeline's own bounds
  ir.deadline_ns = engine_->clock().NowNs() + std::max<int64_t>(job->deadline_ns - t2, 1);
  InferCallback done = [this, job](InferResponse&& r) {
    auto response = std::make_shared<InferResponse>(std::move(r));
    Post([this, job, response] { Finish(job, std::move(*response)); }, true);
  };
  if (Status st = engine_->InferAsync(std::move(ir), done); !st.ok()) Fail(job, st);
}

void VisionHandler::Finish(const std::shared_ptr<Job>& job, InferResponse&& r) {
  job->post_start_ns = SteadyNs();
  job->infer_ns = r.telemetry.compute_ns();
  job->queue_ns = r.telemetry.queue_ns();
  if (!r.status.ok()) {
    if (r.status.code() == StatusCode::kCancelled || r.status.code() == StatusCode::kDeadlineExceeded) {
      dropped_.fetch_add(1);
    }
    return Fail(job, r.status);
  }
  const VisionModel& m = *job->model;
  rapidjson::StringBuffer sb;
  Writer w(sb);
  if (job->kind == Job::Kind::kPredict) {
    if (r.outputs.empty()) return Fail(job, Internal("model '" + m.name + "' returned no output"));
    auto scores = OutputAsFloats(r.outputs[0]);
    if (!scores) return Fail(job, scores.error());
    const auto top = TopK(*scores, m.top_k, m.softmax, m.labels);
    w.StartObject();
    w.Key("predictions");
    w.StartArray();
    for (const auto& c : top) {
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
    w.Double(static_cast<double>(job->infer_ns) / 1e6);
    w.EndObject();
    return Respond(job, Json(200, sb.GetString()));
  }

  auto found = DecodeDetections(r.outputs, m.detection, job->min_confidence, m.image.width, m.image.height);
  if (!found) return Fail(job, Status(found.error().code(), "model '" + m.name + "': " + found.error().message()));
  std::vector<std::string> names;  // distinct labels found, for the message
  w.StartObject();
  w.Key("success");
  w.Bool(true);
  w.Key("predictions");
  w.StartArray();
  for (const auto& d : *found) {
    const Detection s = MapToSource(d, job->transform);
    const std::string& label = m.Label(d.class_id);
    const std::string name = label.empty() ? std::to_string(d.class_id) : label;
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
    w.StartObject();
    w.Key("label");
    String(w, name);
    w.Key("confidence");
    w.Double(d.confidence);
    w.Key("x_min");
    w.Int(static_cast<int>(std::lround(s.x_min)));
    w.Key("y_min");
    w.Int(static_cast<int>(std::lround(s.y_min)));
    w.Key("x_max");
    w.Int(static_cast<int>(std::lround(s.x_max)));
    w.Key("y_max");
    w.Int(static_cast<int>(std::lround(s.y_max)));
    w.EndObject();
  }
  w.EndArray();
  w.Key("count");
  w.Int(static_cast<int>(found->size()));
  w.Key("message");
  std::string message = found->empty() ? "No objects found" : "Found ";
  for (size_t i = 0; i < names.size(); ++i) message += (i ? ", " : "") + names[i];
  String(w, message);
  w.Key("error");
  w.Null();
  WriteCpaiMeta(w, *job);
  w.EndObject();
  return Respond(job, Json(200, sb.GetString()));
}

void VisionHandler::Fail(const std::shared_ptr<Job>& job, const Status& status) {
  failed_.fetch_add(1);
  job->post_start_ns = 0;  // only answered images are timed
  if (job->kind == Job::Kind::kPredict) return Respond(job, JsonError(HttpStatusFor(status), status.message()));
  Respond(job, CpaiError(*job, status));
}

// CodeProject.AI's answer to a request that failed: 200, success false.
HttpResponse VisionHandler::CpaiError(const Job& job, const Status& status) const {
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
  WriteCpaiMeta(w, job);
  w.EndObject();
  return Json(200, sb.GetString());
}

// CodeProject.AI's fields that every detection answer carries, written into
// the open object `w`.
void VisionHandler::WriteCpaiMeta(Writer& w, const Job& job) const {
  const int64_t now = SteadyNs();
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
  w.Int64(job.infer_ns / 1'000'000);
  w.Key("processMs");
  w.Int64(job.stage_start_ns > 0 ? (now - job.stage_start_ns) / 1'000'000 : 0);
  w.Key("analysisRoundTripMs");
  w.Int64((now - job.received_ns) / 1'000'000);
  w.Key("processedBy");
  String(w, hostname_);
  w.Key("timestampUTC");
  String(w, TimestampUtc());
  w.Key("requestId");
  String(w, RequestId());
}

// Releases the admission slot (if the job holds one) and sends the response.
void VisionHandler::Respond(const std::shared_ptr<Job>& job, HttpResponse response) {
  const int64_t now = SteadyNs();
  HttpDone done = std::move(job->done);
  if (job->post_start_ns > 0) {  // answered by Finish (Fail clears it)
    const int64_t post_ns = now - job->post_start_ns;
    char timing[160];
    std::snprintf(timing, sizeof(timing),
                  "decode;dur=%.3f, resize;dur=%.3f, queue;dur=%.3f, infer;dur=%.3f, post;dur=%.3f",
                  static_cast<double>(job->decode_ns) / 1e6, static_cast<double>(job->resize_ns) / 1e6,
                  static_cast<double>(job->queue_ns) / 1e6, static_cast<double>(job->infer_ns) / 1e6,
                  static_cast<double>(post_ns) / 1e6);
    response.headers.emplace_back("Server-Timing", timing);
    timed_images_.fetch_add(1, std::memory_order_relaxed);
    decode_ns_.fetch_add(static_cast<uint64_t>(job->decode_ns), std::memory_order_relaxed);
    resize_ns_.fetch_add(static_cast<uint64_t>(job->resize_ns), std::memory_order_relaxed);
    queue_ns_.fetch_add(static_cast<uint64_t>(job->queue_ns), std::memory_order_relaxed);
    infer_ns_.fetch_add(static_cast<uint64_t>(job->infer_ns), std::memory_order_relaxed);
    post_ns_.fetch_add(static_cast<uint64_t>(post_ns), std::memory_order_relaxed);
  }
  if (job->admitted) {
    // Update the time per image behind the derived capacity: the time this
    // image kept the pipeline busy (since it arrived or since the previous
    // image finished, whichever is later) — under load, 1 / throughput.
    const int64_t last = last_completion_ns_.exchange(now);
    const double busy_ms = static_cast<double>(now - std::max(job->received_ns, last)) / 1e6;
    ms_per_image_.store(0.9 * ms_per_image_.load() + 0.1 * busy_ms);
    in_flight_bytes_.fetch_sub(job->charged_bytes);
    if (in_flight_.fetch_sub(1) == 1) {
      std::lock_guard<std::mutex> lock(idle_mu_);
      idle_cv_.notify_all();
    }
  }
  if (done) done(std::move(response));
}

}  // namespace quern
