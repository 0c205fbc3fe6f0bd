// KServe v2 (Open Inference Protocol) REST endpoints over a quern::Engine.
//
// A thin adapter: it parses the path and JSON, builds InferRequests, and
// writes the engine's responses back; every status is mapped to HTTP in
// HttpStatusFor. Thread-safe: Handle may be called from any number of I/O
// threads; inference responses complete on engine threads.
#pragma once

#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "frontends/http/http_types.h"
#include "frontends/http/http_util.h"
#include "frontends/http/router.h"
#include "protocol/kserve_codec.h"
#include "quern/engine.h"

namespace quern {

class KServeHandler {
 public:
  // `engine` must outlive the handler.
  explicit KServeHandler(Engine* engine) : engine_(engine) {}

  // Declares the /v2 routes (metadata, health, repository, statistics,
  // configuration, infer) on `router`, which must not outlive the handler.
  // Infer's head check refuses, before the body is read, a request whose
  // model's queue is full (503).
  Status AddRoutes(Router& router);

  // An extra condition for /v2/health/ready (e.g. the job result store is
  // reachable): not OK answers 503 with its message. Set before serving.
  void set_ready_check(std::function<Status()> check) { ready_check_ = std::move(check); }

  // Whether POST /v2/repository/models/{m}/load and /unload act (Triton's
  // --model-control-mode explicit); off, they answer 400. On by default.
  void set_model_control(bool on) { model_control_ = on; }

 private:
  // The routes' handlers.
  void ServerMetadata(HttpRequest&& request, const RouteMatch& match, HttpDone done);
  void Live(HttpRequest&& request, const RouteMatch& match, HttpDone done);
  void Ready(HttpRequest&& request, const RouteMatch& match, HttpDone done);  // the server's, or a model's
  void Index(HttpRequest&& request, const RouteMatch& match, HttpDone done);
  void Control(bool load, HttpRequest&& request, const RouteMatch& match, const HttpDone& done);
  void Stats(HttpRequest&& request, const RouteMatch& match, HttpDone done);  // every model's, or one's
  void Metadata(HttpRequest&& request, const RouteMatch& match, HttpDone done);
  void Config(HttpRequest&& request, const RouteMatch& match, HttpDone done);
  // POST .../infer: JSON tensors and the binary tensor data extension
  // (Inference-Header-Content-Length); binary inputs are used without copying.
  void Infer(HttpRequest&& request, const RouteMatch& match, HttpDone done);
  // POST .../generate and .../generate_stream (Triton's generate extension,
  // frontends/http/generate.h): one JSON answer, or server-sent events, one
  // per response of a decoupled model.
  void Generate(bool stream, HttpRequest&& request, const RouteMatch& match, HttpDone done);
  // The model version a route's {model} and {version} name.
  Result<ModelStatus> FindModel(const RouteMatch& match) const;
  // Infer's head check: the model's queue.
  std::optional<HttpResponse> Admission(const RouteMatch& match) const;

  Engine* engine_;
  std::function<Status()> ready_check_;
  bool model_control_ = true;
};

}  // namespace quern
