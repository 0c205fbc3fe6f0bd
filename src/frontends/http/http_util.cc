#include "frontends/http/http_util.h"

#include <rapidjson/writer.h>

#include <algorithm>
#include <charconv>

#include "core/json.h"
#include "protocol/kserve_codec.h"

namespace quern {

std::string PercentDecode(std::string_view s) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && hex(s[i + 1]) >= 0 && hex(s[i + 2]) >= 0) {
      out += static_cast<char>(hex(s[i + 1]) * 16 + hex(s[i + 2]));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

TargetPath SplitTargetPath(std::string_view target) {
  if (auto q = target.find('?'); q != std::string_view::npos) target = target.substr(0, q);
  TargetPath parts;
  // Decoding never lengthens a segment: room for the whole path, reserved
  // once (past the inline size, so a move keeps the views valid), holds
  // every decoded segment without moving.
  if (target.find('%') != std::string_view::npos) parts.decoded_.reserve(std::max<size_t>(target.size(), 32));
  size_t pos = 0;
  while (pos < target.size()) {
    if (target[pos] == '/') {
      ++pos;
      continue;
    }
    size_t end = target.find('/', pos);
    if (end == std::string_view::npos) end = target.size();
    const std::string_view segment = target.substr(pos, end - pos);
    if (segment.find('%') == std::string_view::npos) {
      parts.segments_.push_back(segment);
    } else {
      const size_t at = parts.decoded_.size();
      parts.decoded_ += PercentDecode(segment);
      parts.segments_.push_back(std::string_view(parts.decoded_).substr(at));
    }
    pos = end;
  }
  return parts;
}

Result<std::string_view> InferenceHeaderLength(const HttpRequest& req, const std::string& model) {
  constexpr std::string_view kName = "inference-header-content-length";
  const std::string* first = req.FindHeader(kName);
  if (first == nullptr) return std::string_view();
  if (first->empty()) {
    return Err(InvalidArgument("model '" + model +
                               "': Inference-Header-Content-Length has no value (expected the JSON header's "
                               "length in bytes, or no such field when the whole body is JSON)"));
  }
  for (const auto& [k, v] : req.headers) {
    if (k == kName && v != *first) {
      return Err(InvalidArgument("model '" + model + "': Inference-Header-Content-Length sent twice, as '" +
                                 first->substr(0, 32) + "' and '" + v.substr(0, 32) + "'"));
    }
  }
  return std::string_view(*first);
}

Status ParseModelVersion(std::string_view segment, int64_t* version) {
  *version = -1;
  if (segment.empty()) return Status::Ok();
  auto [p, ec] = std::from_chars(segment.data(), segment.data() + segment.size(), *version);
  if (ec != std::errc() || p != segment.data() + segment.size() || *version < 0) {
    *version = -1;
    return InvalidArgument("model version '" + std::string(segment.substr(0, 64)) + "' is not a number");
  }
  return Status::Ok();
}

int HttpStatusFor(const Status& s) {
  switch (s.code()) {
    case StatusCode::kOk: return 200;
    case StatusCode::kInvalidArgument:
    case StatusCode::kFailedPrecondition: return 400;
    case StatusCode::kNotFound: return 404;
    case StatusCode::kResourceExhausted: return 413;
    case StatusCode::kPermissionDenied: return 403;
    case StatusCode::kUnauthenticated: return 401;
    case StatusCode::kUnavailable: return 503;
    case StatusCode::kDeadlineExceeded: return 504;
    case StatusCode::kUnimplemented: return 501;
    case StatusCode::kCancelled: return 499;
    default: return 500;
  }
}

HttpResponse KServeBody(int status, const rapidjson::StringBuffer& json,
                        const std::vector<const Tensor*>& binary_parts) {
  KServeMessage m = JoinKServeMessage(json, binary_parts);
  HttpResponse resp;
  resp.status = status;
  resp.body = std::move(m.bytes);
  if (m.binary) {
    resp.headers.emplace_back("Inference-Header-Content-Length", std::to_string(m.json_size));
    resp.content_type = "application/octet-stream";
  }
  return resp;
}

HttpResponse ErrorResponse(const Status& st) {
  rapidjson::StringBuffer buf;
  rapidjson::Writer<rapidjson::StringBuffer> w(buf);
  w.StartObject();
  w.Key("error");
  const std::string message = ValidUtf8(st.message());  // a client's bytes it quotes may be cut anywhere
  w.String(message.c_str(), static_cast<rapidjson::SizeType>(message.size()));
  w.EndObject();
  HttpResponse r;
  r.status = HttpStatusFor(st);
  r.body.assign(buf.GetString(), buf.GetSize());
  // A refusal for now (queue full, a deadline it cannot meet, stopping):
  // clients and load balancers that honour it come back a second later.
  if (r.status == 503) r.headers.emplace_back("Retry-After", "1");
  return r;
}

}  // namespace quern
