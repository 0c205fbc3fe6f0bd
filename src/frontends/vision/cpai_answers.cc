// The answers of the image routes: CodeProject.AI's detection, scene and error JSON,
// /predict's classes, and the custom model list.
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "auth/api_keys.h"
#include "frontends/http/http_util.h"
#include "frontends/vision/vision_handler.h"
#include "frontends/vision/vision_job.h"
#include "frontends/vision/vision_json.h"

namespace quern {

using vision::Json;
using vision::JsonError;
using vision::RequestId;
using vision::String;
using vision::TimestampUtc;
using vision::WriteBox;
using vision::Writer;

void VisionHandler::CustomList(HttpRequest&& request, HttpDone done) {
  auto job = NewJob(std::move(request), std::move(done));
  job->command = "list";
  rapidjson::StringBuffer sb;
  Writer w(sb);
  w.StartObject();
  w.Key("success");
  w.Bool(true);
  w.Key("models");
  w.StartArray();
  for (const auto& name : service_->DetectionModels()) String(w, name);
  w.EndArray();
  w.Key("moduleId");
  w.String("quern");
  w.Key("command");
  w.String("list");
  w.EndObject();
  Respond(job, Json(200, sb.GetString()));
}

void VisionHandler::Answer(const std::shared_ptr<Job>& job, VisionResult&& r) {
  const VisionTimings& t = r.timings;
  if (!r.status.ok()) {
    if (job->kind == Job::Kind::kPredict) {
      return Respond(job, JsonError(r.status.code() == StatusCode::kCancelled ? 499 : HttpStatusFor(r.status),
                                    r.status.message()));
    }
    return Respond(job, CpaiError(*job, r.status, &t));
  }
  rapidjson::StringBuffer sb;
  Writer w(sb);
  if (job->kind == Job::Kind::kPredict) {
    w.StartObject();
    w.Key("predictions");
    w.StartArray();
    for (const auto& c : r.classes) {
      w.StartObject();
      w.Key("class_id");
      w.Int(c.class_id);
      w.Key("label");
      String(w, c.label);
      w.Key("confidence");
      w.Double(c.confidence);
      w.EndObject();
    }
    w.EndArray();
    w.Key("inference_time_ms");
    w.Double(static_cast<double>(t.infer_ns) / 1e6);
    w.EndObject();
  } else if (job->command == "scene") {
    // DeepStack / CodeProject.AI scene: the best class.
    w.StartObject();
    w.Key("success");
    w.Bool(true);
    w.Key("label");
    if (r.classes.empty()) {
      w.Null();
    } else {
      String(w, r.classes.front().label);
    }
    w.Key("confidence");
    w.Double(r.classes.empty() ? 0.0 : r.classes.front().confidence);
    w.Key("message");
    String(w, r.classes.empty() ? std::string("No scene found") : "Found " + r.classes.front().label);
    w.Key("error");
    w.Null();
    WriteCpaiMeta(w, *job, &t);
    w.EndObject();
  } else {
    std::vector<std::string_view> names;  // distinct labels found, for the message
    // Detections come best first: the first max_predictions are the most confident.
    if (options_.max_predictions > 0 && r.detections.size() > static_cast<size_t>(options_.max_predictions)) {
      r.detections.resize(static_cast<size_t>(options_.max_predictions));
    }
    w.StartObject();
    w.Key("success");
    w.Bool(true);
    w.Key("predictions");
    w.StartArray();
    for (const auto& d : r.detections) {
      if (std::find(names.begin(), names.end(), d.label) == names.end()) names.push_back(d.label);
      w.StartObject();
      w.Key("label");
      String(w, d.label);
      w.Key("confidence");
      w.Double(d.box.confidence);
      WriteBox(w, d.box);
      w.EndObject();
    }
    w.EndArray();
    w.Key("count");
    w.Int(static_cast<int>(r.detections.size()));
    w.Key("message");
    std::string message = r.detections.empty() ? "No objects found" : "Found ";
    for (size_t i = 0; i < names.size(); ++i) {
      if (i) message += ", ";
      message += names[i];
    }
    String(w, message);
    w.Key("error");
    w.Null();
    WriteCpaiMeta(w, *job, &t);
    w.EndObject();
  }
  HttpResponse response = Json(200, sb.GetString());
  if (r.timed) {
    char timing[160];
    std::snprintf(timing, sizeof(timing),
                  "decode;dur=%.3f, resize;dur=%.3f, queue;dur=%.3f, infer;dur=%.3f, post;dur=%.3f",
                  static_cast<double>(t.decode_ns) / 1e6, static_cast<double>(t.resize_ns) / 1e6,
                  static_cast<double>(t.queue_ns) / 1e6, static_cast<double>(t.infer_ns) / 1e6,
                  static_cast<double>(t.post_ns) / 1e6);
    response.headers.emplace_back("Server-Timing", timing);
  }
  Respond(job, std::move(response));
}

// CodeProject.AI's answer to a request that failed: 200, success false.
HttpResponse VisionHandler::CpaiError(const Job& job, const Status& status, const VisionTimings* timings) const {
  rapidjson::StringBuffer sb;
  Writer w(sb);
  w.StartObject();
  w.Key("success");
  w.Bool(false);
  w.Key("predictions");
  w.StartArray();
  w.EndArray();
  w.Key("count");
  w.Int(0);
  w.Key("message");
  w.String("");
  w.Key("error");
  String(w, status.message());
  WriteCpaiMeta(w, job, timings);
  w.EndObject();
  return Json(200, sb.GetString());
}

// CodeProject.AI's fields that every detection answer carries, written into
// the open object `w`.
void VisionHandler::WriteCpaiMeta(Writer& w, const Job& job, const VisionTimings* timings) const {
  const int64_t now = service_->clock().NowNs();
  w.Key("command");
  String(w, job.command);
  w.Key("moduleId");
  w.String("quern");
  w.Key("moduleName");
  w.String("Quern");
  w.Key("executionProvider");
  w.String("CPU");
  w.Key("canUseGPU");
  w.Bool(false);
  w.Key("inferenceMs");
  w.Int64(timings ? timings->infer_ns / 1'000'000 : 0);
  w.Key("processMs");
  w.Int64(timings && timings->stage_start_ns > 0 ? (now - timings->stage_start_ns) / 1'000'000 : 0);
  w.Key("analysisRoundTripMs");
  w.Int64((now - job.received_ns) / 1'000'000);
  w.Key("processedBy");
  String(w, hostname_);
  w.Key("timestampUTC");
  String(w, TimestampUtc(service_->clock().WallNs()));
  w.Key("requestId");
  String(w, RequestId());
}

std::string VisionHandler::CommandOf(std::string_view target) {
  const TargetPath path = SplitTargetPath(target);
  // /v1/vision/<route>[/<sub>], /v1/image/ocr
  if (path.size() < 3) return "detect";
  const std::string_view route = path[2];
  if (route == "detection") return "detect";
  if (route == "custom") return path.size() > 3 && path[3] == "list" ? "list" : "custom";
  if (route == "face" && path.size() > 3) {
    for (const char* c : {"register", "recognize", "match", "list", "delete"}) {
      if (path[3] == c) return c;
    }
  }
  for (const char* c : {"scene", "face", "ocr"}) {
    if (route == c) return c;
  }
  return "detect";
}

HttpResponse VisionHandler::KeyRefusal(const HttpRequest& head, const Status& st, KeyProblem problem,
                                       bool predict) const {
  if (predict) {
    HttpResponse resp = JsonError(AuthHttpStatus(st), st.message());
    if (resp.status == 401) resp.headers.emplace_back("WWW-Authenticate", "Bearer");
    return resp;
  }
  Job job;
  job.command = CommandOf(head.target);
  job.received_ns = service_->clock().NowNs();
  return CpaiError(job, CpaiKeyWords(st, problem), nullptr);
}

Status VisionHandler::CpaiKeyWords(const Status& st, KeyProblem problem) {
  if (st.code() != StatusCode::kUnauthenticated || problem == KeyProblem::kNotInHead) return st;
  // In the words of CodeProject.AI's clients, which send an api_key field.
  return Unauthenticated(problem == KeyProblem::kMissing
                             ? "this server requires an api_key (a form field, the api_key query parameter, or "
                               "Authorization: Bearer <key>)"
                             : "the api_key is not valid");
}

}  // namespace quern
