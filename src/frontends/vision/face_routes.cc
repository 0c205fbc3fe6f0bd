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
using vision::JsonError;
using vision::String;
using vision::WriteBox;
using vision::Writer;

void VisionHandler::HandleFaces(const std::shared_ptr<Job>& job, const std::vector<FormPart>& parts,
                                const std::string& face_model) {
  const std::string& command = job->command;
  if (!options_.faces) {
    return Fail(job, Unavailable("face recognition is off on this server (it needs a face descriptor model, e.g. "
                                 "examples/models/face_descriptor)"));
  }
  const auto field = [&parts](std::string_view name) -> const FormPart* {
    for (const auto& p : parts) {
      if (p.name == name) return &p;
    }
    return nullptr;
  };
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
    const std::vector<std::string> users = options_.faces->Users();
    return respond([&users](Writer& w) {
      w.Key("faces");
      w.StartArray();
      for (const auto& u : users) String(w, u);
      w.EndArray();
    });
  }
  auto face_job = std::make_shared<FaceJob>();
  face_job->job = job;
  if (command == "register" || command == "delete") {
    const FormPart* userid = field("userid");
    if (!userid) return Fail(job, InvalidArgument("no userid was sent: expected a form field named 'userid'"));
    face_job->userid = std::string(userid->data);
    if (Status st = FaceGallery::CheckUserId(face_job->userid); !st.ok()) return Fail(job, st);
  }
  if (command == "delete") {
    if (Status st = options_.faces->Delete(face_job->userid); !st.ok()) return Fail(job, st);
    return respond([](Writer& w) {
      w.Key("message");
      w.String("face deleted");
    });
  }

  // register, recognize and match: find the faces, then describe them.
  if (command == "register") {
    constexpr size_t kMaxImages = 16;
    for (const auto& p : parts) {
      const bool numbered = p.name.size() > 5 && p.name.starts_with("image") &&
                            std::all_of(p.name.begin() + 5, p.name.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (p.name != "image" && !numbered) continue;
      if (std::find(face_job->fields.begin(), face_job->fields.end(), p.name) != face_job->fields.end()) continue;
      if (face_job->fields.size() == kMaxImages) {
        return Fail(job, InvalidArgument("register takes at most " + std::to_string(kMaxImages) + " images"));
      }
      face_job->fields.push_back(p.name);
    }
  } else if (command == "recognize") {
    face_job->fields = {"image"};
    if (const FormPart* c = field("min_confidence")) {
      face_job->threshold = ParseMinConfidence(c->data, kDefaultFaceMatchConfidence);
    }
  } else {  // match
    face_job->fields = {"image1", "image2"};
  }
  if (face_job->fields.empty()) {
    return Fail(job, InvalidArgument("no image was sent: expected form fields named 'image' or 'image1'.."));
  }
  for (const auto& name : face_job->fields) {
    const FormPart* p = field(name);
    if (!p)
      return Fail(job, InvalidArgument("no image was sent in '" + name + "': expected a form field of that name"));
    if (p->data.empty()) return Fail(job, InvalidArgument("the '" + name + "' field is empty (0 bytes)"));
  }
  if (face_model.empty()) {
    return Fail(job, Unavailable("no face model is loaded (a detection model with quern.detection.format "
                                 "centerface, such as examples/models/faces, or --face-model)"));
  }
  std::string descriptor_name = options_.face_descriptor_model;
  if (descriptor_name.empty()) {
    auto names = service_->Models(VisionTask::kEmbedding);
    if (!names.empty()) descriptor_name = names.front();
  }
  if (descriptor_name.empty()) {
    return Fail(job, Unavailable("no face descriptor model is loaded (a model with quern.task embedding, such as "
                                 "examples/models/face_descriptor, or --face-descriptor-model)"));
  }
  auto detector = service_->Model(face_model);
  if (!detector) return Fail(job, detector.error());
  if ((*detector)->task != VisionTask::kDetection) {
    return Fail(job, InvalidArgument("the face model '" + face_model + "' is not a detection model"));
  }
  auto descriptor = service_->Model(descriptor_name);
  if (!descriptor) return Fail(job, descriptor.error());
  if ((*descriptor)->task != VisionTask::kEmbedding) {
    return Fail(job, InvalidArgument("the face descriptor model '" + descriptor_name +
                                     "' is not an embedding model (quern.task: embedding)"));
  }
  {
    MutexLock lock(face_job->mu);
    face_job->results.resize(face_job->fields.size());
    face_job->remaining = face_job->fields.size();
  }
  for (size_t i = 0; i < face_job->fields.size(); ++i) {
    VisionRequest r;
    r.model = *detector;
    r.image = field(face_job->fields[i])->data;
    r.owner = job;  // the body the images are viewed in
    // The body, shared out among the images that view it.
    r.held_bytes = static_cast<int64_t>(job->request.body.size() / face_job->fields.size());
    r.cancel = job->request.cancel;
    r.descriptor = *descriptor;
    // Recognition describes every face it finds (up to a batch); the others
    // the most confident face of each image.
    r.max_described = command == "recognize" ? (*descriptor)->max_batch_size : 1;
    Status st = SubmitCounted(std::move(r), [this, face_job, i](VisionResult&& result) {
      if (face_job->Done(i, std::move(result))) FinishFaces(*face_job);
    });
    if (!st.ok()) {
      // The rest are not sent: the answer is this refusal.
      for (size_t j = i; j < face_job->fields.size(); ++j) {
        VisionResult refused;
        refused.status = st;
        if (face_job->Done(j, std::move(refused))) FinishFaces(*face_job);
      }
      return;
    }
  }
}

void VisionHandler::FinishFaces(FaceJob& f) {
  const std::shared_ptr<Job>& job = f.job;
  std::vector<VisionResult> results;
  {
    MutexLock lock(f.mu);
    results = std::move(f.results);
  }
  for (size_t i = 0; i < results.size(); ++i) {
    const Status& st = results[i].status;
    if (st.ok()) continue;
    // Refused, or failed in the service (which counted the failure).
    if (st.code() == StatusCode::kUnavailable) return Respond(job, Refusal(*job, st));
    return Respond(job, CpaiError(*job, Status(st.code(), f.fields[i] + ": " + st.message()), nullptr));
  }
  // The most confident face of each image (boxes come best first).
  const auto best_face = [&](size_t i) -> const std::vector<float>* {
    const auto& d = results[i].detections;
    return d.empty() || d.front().embedding.empty() ? nullptr : &d.front().embedding;
  };
  rapidjson::StringBuffer sb;
  Writer w(sb);
  w.StartObject();
  w.Key("success");
  w.Bool(true);
  if (job->command == "register" || job->command == "match") {
    std::vector<std::vector<float>> faces;
    for (size_t i = 0; i < results.size(); ++i) {
      const std::vector<float>* face = best_face(i);
      if (!face) return Fail(job, InvalidArgument("no face was found in '" + f.fields[i] + "'"));
      faces.push_back(*face);
    }
    if (job->command == "register") {
      if (Status st = options_.faces->Register(f.userid, faces); !st.ok()) return Fail(job, st);
      w.Key("message");
      w.String("face added");
    } else {
      w.Key("similarity");
      w.Double(FaceGallery::Similarity(faces[0], faces[1]));
    }
  } else {  // recognize
    std::vector<std::string> names;
    const std::shared_ptr<const FaceSet> registered = options_.faces->Current();  // one look at the store
    w.Key("predictions");
    w.StartArray();
    for (const auto& d : results[0].detections) {
      if (d.embedding.empty()) break;  // beyond the faces described
      const auto closest = registered->Closest(d.embedding);
      const bool known = closest && closest->similarity >= f.threshold;
      names.push_back(known ? closest->userid : "unknown");
      w.StartObject();
      w.Key("userid");
      String(w, names.back());
      w.Key("confidence");
      w.Double(known ? closest->similarity : 0.0);
      WriteBox(w, d.box);
      w.EndObject();
    }
    w.EndArray();
    w.Key("count");
    w.Int(static_cast<int>(names.size()));
    std::string message = names.empty() ? "No faces found" : "Found ";
    for (size_t i = 0; i < names.size(); ++i) message += (i ? ", " : "") + names[i];
    w.Key("message");
    String(w, message);
  }
  WriteCpaiMeta(w, *job, &results[0].timings);
  w.EndObject();
  Respond(job, Json(200, sb.GetString()));
}

}  // namespace quern
