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
#include "core/mutex.h"
#include "frontends/http/generate.h"

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

HttpResponse ServerMetadataJson() {
  rapidjson::StringBuffer buf;
  Writer w(buf);
  w.StartObject();
  w.Key("name");
  w.String("quern");
  w.Key("version");
  w.String(Version());
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

// {"<key>": value[, "error": reason]} (health and readiness answers).
HttpResponse Flag(int status, const char* key, bool value, const std::string& error = {}) {
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
}

}  // namespace

Status KServeHandler::AddRoutes(Router& router) {
  using K = KeyPolicy;
  // Binds a member function as a route's handler.
  auto to = [this](void (KServeHandler::*f)(HttpRequest&&, const RouteMatch&, HttpDone)) -> RouteHandler {
    return [this, f](HttpRequest&& r, const RouteMatch& m, HttpDone done) {
      (this->*f)(std::move(r), m, std::move(done));
    };
  };
  const Route routes[] = {
      {"GET", "/v2", K::kUser, false, nullptr, to(&KServeHandler::ServerMetadata)},
      {"GET", "/v2/health/live", K::kUser, true, nullptr, to(&KServeHandler::Live)},
      {"GET", "/v2/health/ready", K::kUser, true, nullptr, to(&KServeHandler::Ready)},
      {"POST", "/v2/repository/index", K::kUser, false, nullptr, to(&KServeHandler::Index)},
      {"POST", "/v2/repository/models/{model}/load", K::kAdmin, false, nullptr,
       [this](HttpRequest&& r, const RouteMatch& m, HttpDone done) { Control(true, std::move(r), m, done); }},
      {"POST", "/v2/repository/models/{model}/unload", K::kAdmin, false, nullptr,
       [this](HttpRequest&& r, const RouteMatch& m, HttpDone done) { Control(false, std::move(r), m, done); }},
      {"GET", "/v2/models/stats", K::kUser, false, nullptr, to(&KServeHandler::Stats)},
      {"GET", "/v2/models/{model}[/versions/{version}]", K::kUser, false, nullptr, to(&KServeHandler::Metadata)},
      {"GET", "/v2/models/{model}[/versions/{version}]/ready", K::kUser, false, nullptr, to(&KServeHandler::Ready)},
      {"GET", "/v2/models/{model}[/versions/{version}]/stats", K::kUser, false, nullptr, to(&KServeHandler::Stats)},
      {"GET", "/v2/models/{model}[/versions/{version}]/config", K::kUser, false, nullptr, to(&KServeHandler::Config)},
      {"POST", "/v2/models/{model}[/versions/{version}]/infer", K::kUser, false,
       [this](const HttpRequest&, const RouteMatch& m) { return Admission(m); }, to(&KServeHandler::Infer)},
      {"POST", "/v2/models/{model}[/versions/{version}]/generate", K::kUser, false,
       [this](const HttpRequest&, const RouteMatch& m) { return Admission(m); },
       [this](HttpRequest&& r, const RouteMatch& m, HttpDone done) {
         Generate(false, std::move(r), m, std::move(done));
       }},
      {"POST", "/v2/models/{model}[/versions/{version}]/generate_stream", K::kUser, false,
       [this](const HttpRequest&, const RouteMatch& m) { return Admission(m); },
       [this](HttpRequest&& r, const RouteMatch& m, HttpDone done) {
         Generate(true, std::move(r), m, std::move(done));
       }},
  };
  for (const Route& r : routes) QUERN_RETURN_IF_ERROR(router.Add(r));
  return Status::Ok();
}

void KServeHandler::ServerMetadata(HttpRequest&&, const RouteMatch&, HttpDone done) {
  done(ServerMetadataJson());
}

void KServeHandler::Live(HttpRequest&&, const RouteMatch&, HttpDone done) {
  done(Flag(200, "live", true));
}

// /v2/health/ready, and a model's .../ready.
void KServeHandler::Ready(HttpRequest&&, const RouteMatch& m, HttpDone done) {
  if (const std::string& model = m.param("model"); !model.empty()) {
    int64_t version = -1;
    if (Status st = ParseModelVersion(m.param("version"), &version); !st.ok()) return done(Error(st));
    const bool ready = engine_->ModelReady(model, version);
    HttpResponse r = Flag(ready ? 200 : 400, "ready", ready);
    r.body.insert(1, "\"name\":" + JsonString(model) + ",");
    return done(std::move(r));
  }
  if (!engine_->AllModelsReady()) {
    std::string why;
    for (const auto& s : engine_->ListModels()) {
      if (s.state != ModelState::kReady) {
        why = "model '" + s.name + "' is " + std::string(ModelStateName(s.state));
        break;
      }
    }
    return done(Flag(503, "ready", false, "not ready: " + why));
  }
  if (ready_check_) {
    if (Status s = ready_check_(); !s.ok()) return done(Flag(503, "ready", false, "not ready: " + s.message()));
  }
  done(Flag(200, "ready", true));
}

void KServeHandler::Index(HttpRequest&& req, const RouteMatch&, HttpDone done) {
  // The body is optional (tritonclient sends none); when present, a JSON object whose "ready", if
  // any, is a boolean.
  rapidjson::Document doc;
  bool ready_only = false;
  if (!req.body.empty()) {
    JsonParseError e;
    if (!ParseJson(doc, req.body.data(), req.body.size(), e) || !doc.IsObject()) {
      return done(
          ErrorResponse(InvalidArgument("repository index: the body must be a JSON object, e.g. {\"ready\": true} (" +
                                        (e.message.empty() ? "not an object" : e.message) + ")")));
    }
    if (doc.HasMember("ready")) {
      if (!doc["ready"].IsBool()) {
        return done(ErrorResponse(InvalidArgument("repository index: \"ready\" must be true or false")));
      }
      ready_only = doc["ready"].GetBool();
    }
  }
  done(RepositoryIndex(engine_->ListModels(), ready_only));
}

// .../load and .../unload.
void KServeHandler::Control(bool load, HttpRequest&& req, const RouteMatch& m, const HttpDone& done) {
  const std::string& model = m.param("model");
  const std::string_view action = load ? "load" : "unload";
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
      return done(Error(InvalidArgument("model '" + model + "': the " + std::string(action) +
                                        " request body must be a JSON object (" +
                                        (e.message.empty() ? "not an object" : e.message) + ")")));
    }
    if (auto it = doc.FindMember("parameters"); it != doc.MemberEnd()) {
      if (!it->value.IsObject()) {
        return done(Error(InvalidArgument("model '" + model + "': 'parameters' must be an object")));
      }
      for (const auto& p : it->value.GetObject()) {
        const std::string key(p.name.GetString(), p.name.GetStringLength());
        if (action == "unload" && key == "unload_dependents") {
          if (p.value.IsBool()) continue;
          return done(Error(InvalidArgument("model '" + model + "': 'unload_dependents' must be true or false")));
        }
        return done(Error(InvalidArgument(
            "model '" + model + "': " + std::string(action) + " parameter '" + key.substr(0, 64) +
            "' is not supported; Quern loads the model's files and config.pbtxt from the repository as they are")));
      }
    }
  }
  Status st = load ? engine_->LoadModel(model) : engine_->UnloadModel(model);
  if (!st.ok()) {
    // Triton answers a failed load with 400 and the reason.
    return done(Error(st.code() == StatusCode::kNotFound ? st : InvalidArgument(st.message())));
  }
  HttpResponse ok;
  ok.body = "{}";
  done(std::move(ok));
}

// /v2/models/stats (every model) and a model's .../stats.
void KServeHandler::Stats(HttpRequest&&, const RouteMatch& m, HttpDone done) {
  int64_t version = -1;
  if (Status st = ParseModelVersion(m.param("version"), &version); !st.ok()) return done(Error(st));
  const std::string& model = m.param("model");
  auto stats = model.empty() ? engine_->GetStatistics() : engine_->GetStatistics(model, version);
  if (!stats) return done(Error(stats.error()));
  done(StatisticsJson(*stats));
}

Result<ModelStatus> KServeHandler::FindModel(const RouteMatch& m) const {
  int64_t version = -1;
  QUERN_RETURN_IF_ERROR(ParseModelVersion(m.param("version"), &version));
  return engine_->GetModel(m.param("model"), version);
}

void KServeHandler::Metadata(HttpRequest&&, const RouteMatch& m, HttpDone done) {
  auto model = FindModel(m);
  if (!model) return done(Error(model.error()));
  done(ModelMetadata(*model));
}

void KServeHandler::Config(HttpRequest&&, const RouteMatch& m, HttpDone done) {
  auto model = FindModel(m);
  if (!model) return done(Error(model.error()));
  auto json = ToTritonJson(model->config);  // as Triton writes it: every field, integers as numbers
  if (!json) return done(Error(json.error()));
  HttpResponse r;
  r.body = std::move(*json);
  done(std::move(r));
}

std::optional<HttpResponse> KServeHandler::Admission(const RouteMatch& m) const {
  int64_t version = -1;
  if (!ParseModelVersion(m.param("version"), &version).ok()) return std::nullopt;  // answered with the body
  Status st = engine_->CheckAdmission(m.param("model"), version);
  if (st.ok()) return std::nullopt;
  return Error(st);
}

void KServeHandler::Infer(HttpRequest&& req, const RouteMatch& m, HttpDone done) {
  int64_t version = -1;
  if (Status st = ParseModelVersion(m.param("version"), &version); !st.ok()) return done(Error(st));
  const std::string& model = m.param("model");
  auto json_length = InferenceHeaderLength(req, model);
  if (!json_length) return done(Error(json_length.error()));
  auto parsed = ParseKServeInferBody(model, version, std::move(req.body), *json_length);
  if (!parsed) return done(Error(parsed.error()));
  parsed->request.cancel = std::move(req.cancel);
  // A lone client's batch may run on this I/O thread (the engine decides
  // whether it is short enough): no hand-off to an engine thread and back;
  // a lending loop's, later, on it.
  const SubmitOptions options{.lend_thread = req.lone_client, .loop = req.loop};
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
  if (Status st = engine_->InferAsync(std::move(parsed->request), respond, options); !st.ok()) {
    InferResponse refused;  // the callback is still ours: it answers
    refused.status = std::move(st);
    respond(std::move(refused));
  }
}

namespace {

// One generate request's answers. A request's responses come one after another (a decoupled
// model's from its instance's thread, the last after them), never two at once.
class GenerateAnswers : public std::enable_shared_from_this<GenerateAnswers> {
 public:
  GenerateAnswers(bool stream, HttpDone done, std::shared_ptr<CancellationToken> cancel)
      : stream_(stream), done_(std::move(done)), cancel_(std::move(cancel)) {}

  void Response(InferResponse&& r, bool final) { stream_ ? Event(std::move(r), final) : One(std::move(r), final); }

 private:
  // generate: the one response (a decoupled model's: the only one with data).
  void One(InferResponse&& r, bool final) {
    if (!final || !r.final_only) {
      if (!r.status.ok()) {
        if (!error_) error_ = r.status;
      } else if (++answers_ == 1) {
        kept_ = std::move(r);
      }
    }
    if (!final) return;
    if (error_) return done_(ErrorResponse(*error_));
    if (answers_ > 1) {
      const std::string& model = kept_->model;
      return done_(ErrorResponse(InvalidArgument("model '" + model + "' answered with " + std::to_string(answers_) +
                                                 " responses; POST /v2/models/" + model +
                                                 "/generate_stream returns each of them")));
    }
    if (answers_ == 0) {  // a decoupled model that sent nothing: an answer without outputs
      kept_ = std::move(r);
      kept_->outputs.clear();
    }
    auto json = GenerateAnswerJson(*kept_);
    if (!json) return done_(ErrorResponse(json.error()));
    HttpResponse answer;
    answer.body = std::move(*json);
    done_(std::move(answer));
  }

  // generate_stream: an event per response; the first one starts the answer (a request that fails
  // before any response gets a JSON error with its status instead). The events written in order,
  // under the lock (a slow reader holds the next response's sender, as it should).
  void Event(InferResponse&& r, bool final) {
    {
      MutexLock lock(mu_);
      if (gone_) return;  // (not encoded for nobody)
    }
    std::string event;
    if (!final || !r.final_only) {
      if (r.status.ok()) {
        auto json = GenerateAnswerJson(r);
        event = json ? std::move(*json) : ErrorResponse(json.error()).body;
      } else {
        event = ErrorResponse(r.status).body;
      }
      event = "data: " + event + "\n\n";
    }
    MutexLock lock(mu_);
    if (gone_) return;
    if (started_) {
      if (!body_) {  // the answer's head is on its way: the event waits for the body
        if (!event.empty()) pending_.push_back(std::move(event));
        end_ = end_ || final;
        return;
      }
      WriteLocked(std::move(event), final);
      return;
    }
    if (final && !r.status.ok()) {
      lock.Unlock();
      return done_(ErrorResponse(r.status));
    }
    started_ = true;
    end_ = final;
    HttpResponse answer;
    answer.content_type = "text/event-stream; charset=utf-8";
    answer.body = std::move(event);
    answer.stream = [self = shared_from_this()](std::shared_ptr<HttpBodyStream> body) {
      MutexLock held(self->mu_);
      self->body_ = std::move(body);
      std::vector<std::string> pending = std::move(self->pending_);
      for (std::string& e : pending) {
        if (!self->WriteLocked(std::move(e), false)) return;
      }
      if (self->end_) self->WriteLocked({}, true);
    };
    lock.Unlock();
    done_(std::move(answer));
  }

  // False when the client has gone (or did not read): the rest is dropped, the model told.
  bool WriteLocked(std::string event, bool final) QUERN_REQUIRES(mu_) {
    if (!body_) return false;
    if (!event.empty() && !body_->Write(std::move(event))) {
      gone_ = true;  // later events are dropped
      pending_.clear();
      if (cancel_) cancel_->Cancel();
      body_->End();
      body_.reset();
      return false;
    }
    if (final) {
      gone_ = true;
      body_->End();
      body_.reset();
    }
    return true;
  }

  const bool stream_;
  HttpDone done_;
  std::shared_ptr<CancellationToken> cancel_;
  Mutex mu_;
  std::shared_ptr<HttpBodyStream> body_ QUERN_GUARDED_BY(mu_);  // generate_stream, once started
  std::vector<std::string> pending_ QUERN_GUARDED_BY(mu_);      // events before the body came
  bool started_ QUERN_GUARDED_BY(mu_) = false;
  bool end_ QUERN_GUARDED_BY(mu_) = false;   // the last event came before the body
  bool gone_ QUERN_GUARDED_BY(mu_) = false;  // the body has ended: nothing more is written
  int answers_ = 0;
  std::optional<Status> error_;
  std::optional<InferResponse> kept_;
};

}  // namespace

void KServeHandler::Generate(bool stream, HttpRequest&& req, const RouteMatch& m, HttpDone done) {
  auto model = FindModel(m);
  if (!model) return done(Error(model.error()));
  int64_t version = -1;
  (void)ParseModelVersion(m.param("version"), &version);  // (FindModel checked it)
  auto request = ParseGenerateBody(model->config, version, req.body);
  if (!request) return done(Error(request.error()));
  request->cancel = req.cancel;
  if (!req.request_id.empty()) request->metadata.emplace_back("request_id", std::move(req.request_id));
  auto answers = std::make_shared<GenerateAnswers>(stream, std::move(done), req.cancel);
  request->on_response = [answers](InferResponse&& r) { answers->Response(std::move(r), false); };
  InferCallback last = [answers](InferResponse&& r) { answers->Response(std::move(r), true); };
  if (Status st = engine_->InferAsync(std::move(*request), last, {}); !st.ok()) {
    InferResponse refused;
    refused.status = std::move(st);
    last(std::move(refused));
  }
}

}  // namespace quern
