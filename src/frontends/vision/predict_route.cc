// POST /predict/{model}: a base64 image in JSON, its top classes out.
#include <rapidjson/document.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>

#include "core/json.h"
#include "frontends/http/http_util.h"
#include "frontends/vision/vision_handler.h"
#include "frontends/vision/vision_job.h"
#include "frontends/vision/vision_json.h"

namespace quern {
namespace {

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

}  // namespace

using vision::Json;
using vision::JsonError;
using vision::String;
using vision::Writer;

void VisionHandler::Predict(HttpRequest&& request, const RouteMatch& match, HttpDone done) {
  const std::string& model = match.param("model");
  if (model.find('/') != std::string::npos) return done(JsonError(404, "no such route; use POST /predict/{model}"));
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
  auto job = NewJob(std::move(request), std::move(done));
  job->kind = Job::Kind::kPredict;
  job->image_storage = std::move(*bytes);
  job->image = job->image_storage;
  Submit(std::move(job), std::move(*m));
}

}  // namespace quern
