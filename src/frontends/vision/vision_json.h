// The JSON the vision routes answer with, shared by their files (internal
// to src/frontends/vision): CodeProject.AI's fields and /predict's errors.
//
// Thread safety: plain functions.
#pragma once

#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "frontends/http/http_types.h"
#include "pipeline/postprocess.h"

namespace quern::vision {

using Writer = rapidjson::Writer<rapidjson::StringBuffer>;

// An answer of `status` with the JSON `body`.
HttpResponse Json(int status, std::string body);
// {"error": message}: /predict's errors.
HttpResponse JsonError(int status, const std::string& message);
void String(Writer& w, std::string_view s);
// A box's corners as CodeProject.AI writes them: whole pixels of the image.
void WriteBox(Writer& w, const Detection& box);
// "Fri, 27 Nov 2026 08:00:00 GMT" (CodeProject.AI's timestampUTC).
std::string TimestampUtc(int64_t wall_ns);
// A random version-4 UUID (CodeProject.AI's requestId).
std::string RequestId();

}  // namespace quern::vision
