// /v1/vision/face/{register,recognize,match,list,delete}: face recognition.
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "frontends/vision/vision_handler.h"
#include "frontends/vision/vision_job.h"
#include "frontends/vision/vision_json.h"

namespace quern {

using vision::Json;
using vision::String;
using vision::WriteBox;
using vision::Writer;

namespace {

// A part that carries a file: one with a filename (every client's file
// upload), or a field named image or image<digits> (a form built by hand).
bool IsImagePart(const FormPart& p) {
  if (!p.filename.empty()) return true;
  return p.name.starts_with("image") &&
         std::all_of(p.name.begin() + 5, p.name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

void VisionHandler::HandleFaces(const std::shared_ptr<Job>& job, const std::string& face_model) {
  const std::string& command = job->command;
  if (Status st = faces_.Available(); !st.ok()) return Fail(job, st);
  const std::vector<FormPart>& parts = job->form.parts;
  const auto field = [job](std::string_view name) { return job->form.Field(name); };
  const auto respond = [this, &job](const std::function<void(Writer&)>& fields) {
    rapidjson::StringBuffer sb;
    Writer w(sb);
    w.StartObject();
    w.Key("success");
    w.Bool(true);
    fields(w);
    WriteCpaiMeta(w, *job, nullptr);
    w.EndObject();
    Respond(job, Json(200, sb.GetString()));
  };
  if (command == "list") {
    auto users = faces_.Users();
    if (!users) return Fail(job, users.error());
    return respond([&users](Writer& w) {
      w.Key("faces");
      w.StartArray();
      for (const auto& u : *users) String(w, u);
      w.EndArray();
    });
  }
  FaceRequest r;
  if (command == "register" || command == "delete") {
    const FormPart* userid = field("userid");
    if (!userid) return Fail(job, InvalidArgument("no userid was sent: expected a form field named 'userid'"));
    r.userid = std::string(userid->data);
    if (Status st = FaceGallery::CheckUserId(r.userid); !st.ok()) return Fail(job, st);
  }
  if (command == "delete") {
    if (Status st = faces_.Delete(r.userid); !st.ok()) return Fail(job, st);
    return respond([](Writer& w) {
      w.Key("message");
      w.String("face deleted");
    });
  }
  // register, recognize and match: their images. Register takes every
  // file sent, under any field name (DeepStack's clients name theirs
  // image<uuid>); recognize the one named image, else the first file.
  if (command == "register") {
    r.kind = FaceRequest::Kind::kRegister;
    for (const auto& p : parts) {
      // (A browser sends an empty file input as a part of 0 bytes without a filename.)
      if (!IsImagePart(p) || (p.data.empty() && p.filename.empty())) continue;
      if (r.images.size() == kMaxRegisterImages) {
        return Fail(job, InvalidArgument("register takes at most " + std::to_string(kMaxRegisterImages) + " images"));
      }
      r.images.push_back({p.name, p.data});
    }
    if (r.images.empty()) {
      return Fail(job, InvalidArgument("no image was sent: expected one or more files (e.g. a field named 'image')"));
    }
  } else if (command == "recognize") {
    r.kind = FaceRequest::Kind::kRecognize;
    const FormPart* image = field("image");
    for (auto it = parts.begin(); image == nullptr && it != parts.end(); ++it) {
      if (IsImagePart(*it)) image = &*it;
    }
    if (!image) return Fail(job, InvalidArgument("no image was sent: expected a file in a field named 'image'"));
    r.images.push_back({image->name, image->data});
    if (const FormPart* c = field("min_confidence")) r.threshold = ParseMinConfidence(c->data, r.threshold);
  } else {
    r.kind = FaceRequest::Kind::kMatch;
    for (const char* name : {"image1", "image2"}) {
      const FormPart* p = field(name);
      if (!p) {
        return Fail(job, InvalidArgument(std::string("no image was sent in '") + name +
                                         "': expected a form field of that name"));
      }
      r.images.push_back({name, p->data});
    }
  }
  r.face_model = face_model;
  r.owner = job;  // the body the images are viewed in
  r.held_bytes = static_cast<int64_t>(job->request.body.size() + job->form.decoded.capacity());
  r.cancel = job->request.cancel;
  BeginPending();
  if (Status st = faces_.Submit(std::move(r),
                                [this, job](FaceResult&& result) {
                                  AnswerFaces(job, std::move(result));
                                  EndPending();
                                });
      !st.ok()) {
    EndPending();
    Fail(job, st);
  }
}

void VisionHandler::AnswerFaces(const std::shared_ptr<Job>& job, FaceResult&& result) {
  const Status& st = result.status;
  if (!st.ok() && result.counted) {
    // Refused, or failed in the service (which counted the failure).
    return Respond(job, st.code() == StatusCode::kUnavailable ? Refusal(*job, st) : CpaiError(*job, st, nullptr));
  }
  if (!st.ok()) return Fail(job, st);
  rapidjson::StringBuffer sb;
  Writer w(sb);
  w.StartObject();
  w.Key("success");
  w.Bool(true);
  if (job->command == "register") {
    w.Key("message");
    w.String("face added");
  } else if (job->command == "match") {
    w.Key("similarity");
    w.Double(result.similarity);
  } else {  // recognize
    w.Key("predictions");
    w.StartArray();
    for (const RecognizedFace& f : result.faces) {
      w.StartObject();
      w.Key("userid");
      String(w, f.userid);
      w.Key("confidence");
      w.Double(f.confidence);
      WriteBox(w, f.box);
      w.EndObject();
    }
    w.EndArray();
    w.Key("count");
    w.Int(static_cast<int>(result.faces.size()));
    std::string message = result.faces.empty() ? "No faces found" : "Found ";
    for (size_t i = 0; i < result.faces.size(); ++i) message += (i ? ", " : "") + result.faces[i].userid;
    w.Key("message");
    String(w, message);
  }
  WriteCpaiMeta(w, *job, &result.timings);
  w.EndObject();
  Respond(job, Json(200, sb.GetString()));
}

}  // namespace quern
