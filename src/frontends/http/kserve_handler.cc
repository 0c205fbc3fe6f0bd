#include "frontends/http/kserve_handler.h"

#include <google/protobuf/util/json_util.h>
#include <rapidjson/document.h>
#include <rapidjson/error/en.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>

#include "core/json.h"
#include "core/log.h"
#include "core/model_config_parser.h"

namespace quern {
namespace {

using Writer = rapidjson::Writer<rapidjson::StringBuffer>;

// What an infer answer is written with, kept by each thread that answers
// (its buffer, the writer's level stack and the list of binary parts cost
// three allocations each time otherwise). Used from ForThisThread to the
// copy into the response, then Release, both before the response is handed
// on (an answer given inline may lead, on this thread, to the next
// request's answer).
class AnswerScratch {
 public:
  static AnswerScratch& ForThisThread() {
    std::optional<AnswerScratch>& scratch = Slot();
    if (!scratch) scratch.emplace();
    scratch->buf_.Clear();
    scratch->writer_.Reset(scratch->buf_);
    scratch->binary_parts_.clear();
    return *scratch;
  }
  // A large answer's room is given back at once: a thread keeps at most
  // about kKeepBytes between answers, however large the last one was.
  static void Release() {
    std::optional<AnswerScratch>& scratch = Slot();
    if (scratch && scratch->buf_.GetSize() > kKeepBytes) scratch.reset();
  }
  AnswerScratch() : buf_(SharedCrtAllocator(), 1024), writer_(buf_, SharedCrtAllocator()) {}
  AnswerScratch(const AnswerScratch&) = delete;  // the writer points at buf_
  AnswerScratch& operator=(const AnswerScratch&) = delete;
  rapidjson::StringBuffer& buf() { return buf_; }
  Writer& writer() { return writer_; }
  std::vector<const Tensor*>& binary_parts() { return binary_parts_; }

 private:
  static std::optional<AnswerScratch>& Slot() {
    thread_local std::optional<AnswerScratch> scratch;
    return scratch;
  }
  static constexpr size_t kKeepBytes = 64 << 10;
  rapidjson::StringBuffer buf_;
  Writer writer_;
  std::vector<const Tensor*> binary_parts_;
};

HttpResponse Json(int status, const rapidjson::StringBuffer& buf) {
  HttpResponse r;
  r.status = status;
  r.body.assign(buf.GetString(), buf.GetSize());
  return r;
}

HttpResponse Error(const Status& st) {
  return ErrorResponse(st);
}

void WriteShape(Writer& w, const Shape& s) {
  w.StartArray();
  for (int64_t d : s) w.Int64(d);
  w.EndArray();
}

void WriteTensorMetadata(Writer& w, const TensorConfig& t, bool batched) {
  w.StartObject();
  w.Key("name");
  w.String(t.name.c_str());
  w.Key("datatype");
  w.String(std::string(DataTypeName(t.dtype)).c_str());
  w.Key("shape");
  Shape s = t.dims;
  if (batched) s.insert(s.begin(), -1);
  WriteShape(w, s);
  w.EndObject();
}

HttpResponse ServerMetadata() {
  rapidjson::StringBuffer buf;
  Writer w(buf);
  w.StartObject();
  w.Key("name");
  w.String("quern");
  w.Key("version");
  w.String("0.1.0");
  w.Key("extensions");
  w.StartArray();
  for (const std::string_view e : kKServeExtensions) w.String(e.data(), static_cast<rapidjson::SizeType>(e.size()));
  w.EndArray();
  w.EndObject();
  return Json(200, buf);
}

HttpResponse ModelMetadata(const ModelStatus& m) {
  rapidjson::StringBuffer buf;
  Writer w(buf);
  w.StartObject();
  w.Key("name");
  w.String(m.name.c_str());
  w.Key("versions");
  w.StartArray();
  w.String(std::to_string(m.version).c_str());
  w.EndArray();
  w.Key("platform");
  w.String(!m.config.platform.empty()     ? m.config.platform.c_str()
           : m.config.backend == "python" ? "python"
                                          : "onnxruntime_onnx");
  const bool batched = m.config.max_batch_size > 0;
  w.Key("inputs");
  w.StartArray();
  for (const auto& t : m.config.inputs) WriteTensorMetadata(w, t, batched);
  w.EndArray();
  w.Key("outputs");
  w.StartArray();
  for (const auto& t : m.config.outputs) WriteTensorMetadata(w, t, batched);
  w.EndArray();
  w.EndObject();
  return Json(200, buf);
}

void WriteDuration(Writer& w, const char* key, const DurationStat& d) {
  w.Key(key);
  w.StartObject();
  w.Key("count");
  w.Uint64(d.count);
  w.Key("ns");
  w.Uint64(d.ns);
  w.EndObject();
}

// Triton's statistics JSON (GET /v2/models[/{m}[/versions/{v}]]/stats).
HttpResponse StatisticsJson(const std::vector<ModelStatistics>& all) {
  rapidjson::StringBuffer buf;
  Writer w(buf);
  w.StartObject();
  w.Key("model_stats");
  w.StartArray();
  for (const auto& s : all) {
    w.StartObject();
    w.Key("name");
    w.String(s.name.c_str());
    w.Key("version");
    w.String(std::to_string(s.version).c_str());
    w.Key("last_inference");
    w.Uint64(s.last_inference_ms);
    w.Key("inference_count");
    w.Uint64(s.inference_count);
    w.Key("execution_count");
    w.Uint64(s.execution_count);
    w.Key("inference_stats");
    w.StartObject();
    WriteDuration(w, "success", s.success);
    WriteDuration(w, "fail", s.fail);
    WriteDuration(w, "queue", s.queue);
    WriteDuration(w, "compute_input", s.compute_input);
    WriteDuration(w, "compute_infer", s.compute_infer);
    WriteDuration(w, "compute_output", s.compute_output);
    WriteDuration(w, "cache_hit", {});
    WriteDuration(w, "cache_miss", {});
    w.EndObject();
    w.Key("batch_stats");
    w.StartArray();
    for (const auto& b : s.batch_stats) {
      w.StartObject();
      w.Key("batch_size");
      w.Int64(b.batch_size);
      WriteDuration(w, "compute_input", b.compute_input);
      WriteDuration(w, "compute_infer", b.compute_infer);
      WriteDuration(w, "compute_output", b.compute_output);
      w.EndObject();
    }
    w.EndArray();
    w.EndObject();
  }
  w.EndArray();
  w.EndObject();
  return Json(200, buf);
}

std::string JsonString(const std::string& s) {
  rapidjson::StringBuffer buf;
  Writer w(buf);
  w.String(s.c_str(), static_cast<rapidjson::SizeType>(s.size()));
  return std::string(buf.GetString(), buf.GetSize());
}

HttpResponse MethodNotAllowed(const HttpRequest& req, const char* allowed) {
  HttpResponse r = Error(
      InvalidArgument(req.method.substr(0, 32) + " " + req.target.substr(0, 256) + ": this route takes " + allowed));
  r.status = 405;
  r.headers.emplace_back("Allow", std::string(allowed) + (std::string_view(allowed) == "GET" ? ", HEAD" : ""));
  return r;
}

// The method a KServe route takes, or null when `parts` names no route.
const char* AllowedMethod(const TargetPath& parts) {
  if (parts.empty() || parts[0] != "v2") return nullptr;
  const size_t n = parts.size();
  if (n == 1) return "GET";
  if (n == 3 && parts[1] == "health" && (parts[2] == "live" || parts[2] == "ready")) return "GET";
  if (n == 3 && parts[1] == "repository" && parts[2] == "index") return "POST";
  if (n == 5 && parts[1] == "repository" && parts[2] == "models" && (parts[4] == "load" || parts[4] == "unload")) {
    return "POST";
  }
  if (parts[1] != "models" || n < 3) return nullptr;
  if (n == 3) return "GET";  // /v2/models/stats or /v2/models/{m}
  size_t next = 3;
  if (n >= 5 && parts[3] == "versions") next = 5;
  if (n == next) return "GET";
  if (n != next + 1) return nullptr;
  const std::string_view action = parts[next];
  if (action == "ready" || action == "stats" || action == "config") return "GET";
  if (action == "infer") return "POST";
  return nullptr;
}

HttpResponse RepositoryIndex(const std::vector<ModelStatus>& models, bool ready_only) {
  rapidjson::StringBuffer buf;
  Writer w(buf);
  w.StartArray();
  for (const auto& m : models) {
    if (ready_only && m.state != ModelState::kReady) continue;
    w.StartObject();
    w.Key("name");
    w.String(m.name.c_str());
    w.Key("version");
    w.String(std::to_string(m.version).c_str());
    w.Key("state");
    w.String(std::string(ModelStateName(m.state)).c_str());
    w.Key("reason");
    w.String(m.reason.c_str());
    w.EndObject();
  }
  w.EndArray();
  return Json(200, buf);
}

}  // namespace

void KServeHandler::Handle(HttpRequest&& req, HttpDone done) {
  const auto parts = SplitTargetPath(req.target);
  const bool get = req.method == "GET" || req.method == "HEAD";
  // {"<key>": value[, "error": reason]} (health and readiness answers).
  auto flag = [](int status, const char* key, bool value, const std::string& error = {}) {
    rapidjson::StringBuffer buf;
    Writer w(buf);
    w.StartObject();
    w.Key(key);
    w.Bool(value);
    if (!error.empty()) {
      w.Key("error");
      w.String(error.c_str(), static_cast<rapidjson::SizeType>(error.size()));
    }
    w.EndObject();
    return Json(status, buf);
  };
  static constexpr std::string_view kMethods[] = {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"};
  if (std::find(std::begin(kMethods), std::end(kMethods), req.method) == std::end(kMethods)) {
    HttpResponse r = Error(Status(StatusCode::kUnimplemented, "method " + req.method.substr(0, 32) +
                                                                  " is not supported (routes take GET, HEAD or POST)"));
    r.status = 501;
    return done(std::move(r));
  }
  if (parts.empty() || parts[0] != "v2") return done(Error(NotFound("no route for " + req.target)));
  if (parts.size() == 1) return get ? done(ServerMetadata()) : done(MethodNotAllowed(req, "GET"));
  if (parts.size() == 3 && parts[1] == "health" && (parts[2] == "live" || parts[2] == "ready")) {
    if (!get) return done(MethodNotAllowed(req, "GET"));
    if (parts[2] == "live") return done(flag(200, "live", true));
    if (!engine_->AllModelsReady()) {
      std::string why;
      for (const auto& m : engine_->ListModels()) {
        if (m.state != ModelState::kReady) {
          why = "model '" + m.name + "' is " + std::string(ModelStateName(m.state));
          break;
        }
      }
      return done(flag(503, "ready", false, "not ready: " + why));
    }
    if (ready_check_) {
      if (Status s = ready_check_(); !s.ok()) return done(flag(503, "ready", false, "not ready: " + s.message()));
    }
    return done(flag(200, "ready", true));
  }
  if (parts.size() == 2 && parts[1] == "repository") return done(Error(NotFound("no route for " + req.target)));
  if (parts.size() == 3 && parts[1] == "repository" && parts[2] == "index" && req.method == "POST") {
    rapidjson::Document doc;
    bool ready_only = false;
    if (JsonParseError e; !req.body.empty() && ParseJson(doc, req.body.data(), req.body.size(), e) && doc.IsObject() &&
                          doc.HasMember("ready") && doc["ready"].IsBool()) {
      ready_only = doc["ready"].GetBool();
    }
    return done(RepositoryIndex(engine_->ListModels(), ready_only));
  }
  if (parts.size() == 5 && parts[1] == "repository" && parts[2] == "models" && req.method == "POST" &&
      (parts[4] == "load" || parts[4] == "unload")) {
    const std::string model(parts[3]);
    if (!model_control_) {
      return done(Error(FailedPrecondition(
          "model load and unload over the API are off; start quern serve with --model-control explicit")));
    }
    // Triton's load takes parameters "config" (a configuration override)
    // and "file:<path>" (model files in the request); Quern loads what the
    // repository holds, so a request asking for more is refused rather than
    // half applied. Unload's "unload_dependents" has nothing to act on.
    if (!req.body.empty()) {
      rapidjson::Document doc;
      JsonParseError e;
      if (!ParseJson(doc, req.body.data(), req.body.size(), e) || !doc.IsObject()) {
        return done(Error(InvalidArgument("model '" + model + "': the " + std::string(parts[4]) +
                                          " request body must be a JSON object (" +
                                          (e.message.empty() ? "not an object" : e.message) + ")")));
      }
      if (auto it = doc.FindMember("parameters"); it != doc.MemberEnd()) {
        if (!it->value.IsObject()) {
          return done(Error(InvalidArgument("model '" + model + "': 'parameters' must be an object")));
        }
        for (const auto& m : it->value.GetObject()) {
          const std::string key(m.name.GetString(), m.name.GetStringLength());
          if (parts[4] == "unload" && key == "unload_dependents") continue;
          return done(Error(InvalidArgument(
              "model '" + model + "': " + std::string(parts[4]) + " parameter '" + key.substr(0, 64) +
              "' is not supported; Quern loads the model's files and config.pbtxt from the repository as they are")));
        }
      }
    }
    Status st = parts[4] == "load" ? engine_->LoadModel(model) : engine_->UnloadModel(model);
    if (!st.ok()) {
      // Triton answers a failed load with 400 and the reason.
      return done(Error(st.code() == StatusCode::kNotFound ? st : InvalidArgument(st.message())));
    }
    HttpResponse ok;
    ok.body = "{}";
    return done(std::move(ok));
  }
  if (parts.size() == 3 && parts[1] == "models" && parts[2] == "stats" && get) {
    auto stats = engine_->GetStatistics();
    if (!stats) return done(Error(stats.error()));
    return done(StatisticsJson(*stats));
  }
  if (parts.size() >= 3 && parts[1] == "models") {
    const std::string model(parts[2]);
    size_t next = 3;
    int64_t version = -1;
    if (parts.size() >= 5 && parts[3] == "versions") {
      auto [p, ec] = std::from_chars(parts[4].data(), parts[4].data() + parts[4].size(), version);
      if (ec != std::errc() || p != parts[4].data() + parts[4].size() || version < 0) {
        return done(Error(InvalidArgument("model version '" + std::string(parts[4]) + "' is not a number")));
      }
      next = 5;
    }
    const std::string_view action = parts.size() > next ? parts[next] : std::string_view();
    if (parts.size() > next + 1) return done(Error(NotFound("no route for " + req.target)));
    if (action.empty() && get) {
      auto m = engine_->GetModel(model, version);
      if (!m) return done(Error(m.error()));
      return done(ModelMetadata(*m));
    }
    if (action == "ready" && get) {
      const bool ready = engine_->ModelReady(model, version);
      HttpResponse r = flag(ready ? 200 : 400, "ready", ready);
      r.body.insert(1, "\"name\":" + JsonString(model) + ",");
      return done(std::move(r));
    }
    if (action == "stats" && get) {
      auto stats = engine_->GetStatistics(model, version);
      if (!stats) return done(Error(stats.error()));
      return done(StatisticsJson(*stats));
    }
    if (action == "config" && get) {
      auto m = engine_->GetModel(model, version);
      if (!m) return done(Error(m.error()));
      google::protobuf::util::JsonPrintOptions opts;
      opts.preserve_proto_field_names = true;
      HttpResponse r;
      auto st = google::protobuf::util::MessageToJsonString(ToProto(m->config), &r.body, opts);
      if (!st.ok()) return done(Error(Internal("cannot write the configuration of '" + model + "' as JSON")));
      return done(std::move(r));
    }
    if (action == "infer" && req.method == "POST") return Infer(model, version, std::move(req), std::move(done));
  }
  if (const char* allowed = AllowedMethod(parts)) return done(MethodNotAllowed(req, allowed));
  done(Error(NotFound("no route for " + req.method + " " + req.target)));
}

std::optional<HttpResponse> KServeHandler::CheckHead(const HttpRequest& head) const {
  if (head.method != "POST") return std::nullopt;
  // Only a path that ends in /infer is split (the common case for a POST).
  const std::string_view target = std::string_view(head.target).substr(0, head.target.find('?'));
  if (!target.ends_with("/infer")) return std::nullopt;
  const auto parts = SplitTargetPath(target);
  int64_t version = -1;
  if (parts.size() == 6 && parts[3] == "versions") {
    auto [p, ec] = std::from_chars(parts[4].data(), parts[4].data() + parts[4].size(), version);
    if (ec != std::errc() || p != parts[4].data() + parts[4].size() || version < 0) return std::nullopt;
  } else if (parts.size() != 4) {
    return std::nullopt;
  }
  if (parts[0] != "v2" || parts[1] != "models" || parts.back() != "infer") return std::nullopt;
  Status st = engine_->CheckAdmission(std::string(parts[2]), version);
  if (st.ok()) return std::nullopt;
  return Error(st);
}

void KServeHandler::Infer(const std::string& model, int64_t version, HttpRequest&& req, HttpDone done) {
  auto parsed =
      ParseKServeInferBody(model, version, std::move(req.body), req.Header("inference-header-content-length"));
  if (!parsed) return done(Error(parsed.error()));
  parsed->request.cancel = std::move(req.cancel);
  // A lone client's batch may run on this I/O thread (the engine decides
  // whether it is short enough): no hand-off to an engine thread and back.
  parsed->request.lend_thread = req.lone_client;
  // The request's name in the engine (and a Python model's request_id()):
  // its KServe id, else the X-Request-ID.
  if (UsableRequestId(parsed->format.id)) {
    parsed->request.metadata.emplace_back("request_id", parsed->format.id);
  } else if (!req.request_id.empty()) {
    parsed->request.metadata.emplace_back("request_id", std::move(req.request_id));
  }
  InferCallback respond = [done = std::move(done), format = std::move(parsed->format),
                           engine = engine_](InferResponse&& r) {
    if (!r.status.ok()) return done(Error(r.status));
    if (!format.classifications.empty()) {
      // Labels of the version that answered.
      const OutputLabels labels = [&](const std::string& output) {
        return engine->OutputLabels(r.model, r.version, output);
      };
      if (Status st = ApplyClassifications(r.outputs, format, r.model, labels); !st.ok()) return done(Error(st));
    }
    AnswerScratch& scratch = AnswerScratch::ForThisThread();
    Status st =
        WriteKServeResult(scratch.writer(), format.id, r.model, r.version, r.outputs, format, scratch.binary_parts());
    HttpResponse answer = st.ok() ? KServeBody(200, scratch.buf(), scratch.binary_parts()) : Error(st);
    AnswerScratch::Release();
    done(std::move(answer));
  };
  if (Status st = engine_->InferAsync(std::move(parsed->request), respond); !st.ok()) {
    InferResponse refused;  // the callback is still ours: it answers
    refused.status = std::move(st);
    respond(std::move(refused));
  }
}

}  // namespace quern
