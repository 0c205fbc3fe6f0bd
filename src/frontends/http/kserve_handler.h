// KServe v2 (Open Inference Protocol) REST endpoints over a quern::Engine.
//
// A thin adapter: it parses the path and JSON, builds InferRequests, and
// writes the engine's responses back; every status is mapped to HTTP in
// HttpStatusFor. Thread-safe: Handle may be called from any number of I/O
// threads; inference responses complete on engine threads.
#pragma once

#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <boost/container/small_vector.hpp>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "frontends/http/http_types.h"
#include "protocol/kserve_codec.h"
#include "quern/engine.h"

namespace quern {

// An HTTP response of `json` followed by the binary parts (with
// Inference-Header-Content-Length when there are any).
HttpResponse KServeBody(int status, const rapidjson::StringBuffer& json,
                        const std::vector<const Tensor*>& binary_parts);

// The non-empty segments of a request target's path (the query dropped),
// each percent-decoded: "/v2/models/my%20model/infer?x=1" ->
// {"v2", "models", "my model", "infer"}. An encoded '/' stays inside its
// segment; a '%' not followed by two hex digits is kept as it is. Every
// request's target is split (by the router and its handler), so the
// segments are views: of the target itself (which must outlive them), or,
// for a segment with an escape, of the decoded copy this object holds. Up
// to 8 segments take no allocation; a path without '%' none at all.
class TargetPath {
 public:
  TargetPath() = default;
  TargetPath(TargetPath&&) = default;  // the decoded copy lives on the heap: its views stay valid
  TargetPath& operator=(TargetPath&&) = default;
  TargetPath(const TargetPath&) = delete;  // a copy's views would point into the original
  TargetPath& operator=(const TargetPath&) = delete;

  size_t size() const { return segments_.size(); }
  bool empty() const { return segments_.empty(); }
  std::string_view operator[](size_t i) const { return segments_[i]; }
  std::string_view back() const { return segments_.back(); }

 private:
  friend TargetPath SplitTargetPath(std::string_view target);
  boost::container::small_vector<std::string_view, 8> segments_;
  std::string decoded_;  // the decoded segments, one after another (reserved once: never moves)
};
TargetPath SplitTargetPath(std::string_view target);

// `s` with %XX sequences decoded (others kept as they are).
std::string PercentDecode(std::string_view s);

// {"error": message} with the status mapped by HttpStatusFor.
HttpResponse ErrorResponse(const Status& status);

// Triton's mapping: 400 invalid input, 404 unknown model, 503 unavailable or
// queue full, 504 deadline exceeded, 500 everything else.
int HttpStatusFor(const Status& status);

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
