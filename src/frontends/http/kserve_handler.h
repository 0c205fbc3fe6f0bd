// KServe v2 (Open Inference Protocol) REST endpoints over a quern::Engine.
//
// A thin adapter: it parses the path and JSON, builds InferRequests, and
// writes the engine's responses back; every status is mapped to HTTP in
// HttpStatusFor. Thread-safe: Handle may be called from any number of I/O
// threads; inference responses complete on engine threads.
#pragma once

#include "frontends/http/http_types.h"
#include "quern/engine.h"

namespace quern {

// Triton's mapping: 400 invalid input, 404 unknown model, 503 unavailable or
// queue full, 504 deadline exceeded, 500 everything else.
int HttpStatusFor(const Status& status);

class KServeHandler {
 public:
  // `engine` must outlive the handler.
  explicit KServeHandler(Engine* engine) : engine_(engine) {}

  void Handle(HttpRequest&& request, HttpDone done);

 private:
  // POST .../infer: JSON tensors and the binary tensor data extension
  // (Inference-Header-Content-Length); binary inputs are used without copying.
  void Infer(const std::string& model, int64_t version, HttpRequest&& request, HttpDone done);

  Engine* engine_;
};

}  // namespace quern
