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
#include "protocol/kserve_codec.h"
#include "quern/engine.h"

namespace quern {

class KServeHandler {
 public:
  // `engine` must outlive the handler.
  explicit KServeHandler(Engine* engine) : engine_(engine) {}

  void Handle(HttpRequest&& request, HttpDone done);

  // Given a request's line and headers alone (body not read yet): the 503
  // an inference request would get because its model's queue is full, or
  // nothing. Lets the server refuse before it reads and parses the body.
  std::optional<HttpResponse> CheckHead(const HttpRequest& head) const;

  // An extra condition for /v2/health/ready (e.g. the job result store is
  // reachable): not OK answers 503 with its message. Set before serving.
  void set_ready_check(std::function<Status()> check) { ready_check_ = std::move(check); }

  // Whether POST /v2/repository/models/{m}/load and /unload act (Triton's
  // --model-control-mode explicit); off, they answer 400. On by default.
  void set_model_control(bool on) { model_control_ = on; }

 private:
  // POST .../infer: JSON tensors and the binary tensor data extension
  // (Inference-Header-Content-Length); binary inputs are used without copying.
  void Infer(const std::string& model, int64_t version, HttpRequest&& request, HttpDone done);

  Engine* engine_;
  std::function<Status()> ready_check_;
  bool model_control_ = true;
};

}  // namespace quern
