// What every HTTP front end needs, whatever its protocol: the segments of
// a request's path, percent-decoding, the mapping of a Status to an HTTP
// status and its {"error": ...} answer, and a JSON answer followed by
// binary parts (the binary tensor extension's framing).
//
// Thread safety: plain functions; a TargetPath is used by one thread.
#pragma once

#include <rapidjson/stringbuffer.h>

#include <boost/container/small_vector.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "frontends/http/http_types.h"
#include "quern/status.h"
#include "quern/tensor.h"

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

// The Inference-Header-Content-Length of a request to `model` as sent
// (its JSON header's length; "" when absent: the whole body is JSON). The
// field sent with no value, or twice with two values, leaves the body's
// split unknown: INVALID_ARGUMENT naming the field and the model.
Result<std::string_view> InferenceHeaderLength(const HttpRequest& req, const std::string& model);

// A {version} path segment: "" = -1 (the model's latest), else a
// non-negative integer; INVALID_ARGUMENT naming the segment otherwise.
Status ParseModelVersion(std::string_view segment, int64_t* version);

// {"error": message} with the status mapped by HttpStatusFor.
HttpResponse ErrorResponse(const Status& status);

// Triton's mapping: 400 invalid input, 404 unknown model, 503 unavailable or
// queue full, 504 deadline exceeded, 500 everything else.
int HttpStatusFor(const Status& status);

}  // namespace quern
