#include "pipeline/face_service.h"

#include <utility>

#include "core/mutex.h"

namespace quern {

// One request: its images, each with the vision service, and their results
// as they come.
struct FaceService::Run {
  FaceRequest request;
  FaceCallback done;
  Mutex mu;
  std::vector<VisionResult> results QUERN_GUARDED_BY(mu);  // by image
  size_t remaining QUERN_GUARDED_BY(mu) = 0;
  // Records image i's result; true for the last one.
  bool Done(size_t i, VisionResult&& r) {
    MutexLock lock(mu);
    results[i] = std::move(r);
    return --remaining == 0;
  }
};

FaceService::FaceService(VisionService* service, FaceGallery* gallery, std::string descriptor_model)
    : service_(service), gallery_(gallery), descriptor_model_(std::move(descriptor_model)) {}

Status FaceService::Available() const {
  if (gallery_) return Status::Ok();
  return Unavailable(
      "face recognition is off on this server (it needs a face descriptor model, e.g. "
      "examples/models/face_descriptor)");
}

Result<std::vector<std::string>> FaceService::Users() {
  QUERN_RETURN_IF_ERROR(Available());
  return gallery_->Users();
}

Status FaceService::Delete(const std::string& userid) {
  QUERN_RETURN_IF_ERROR(Available());
  QUERN_RETURN_IF_ERROR(FaceGallery::CheckUserId(userid));
  return gallery_->Delete(userid);
}

Status FaceService::Submit(FaceRequest request, FaceCallback done) {
  QUERN_RETURN_IF_ERROR(Available());
  const FaceRequest::Kind kind = request.kind;
  if (kind == FaceRequest::Kind::kRegister) QUERN_RETURN_IF_ERROR(FaceGallery::CheckUserId(request.userid));
  const size_t n = request.images.size();
  if (n == 0 || (kind == FaceRequest::Kind::kRegister && n > kMaxRegisterImages) ||
      (kind == FaceRequest::Kind::kRecognize && n != 1) || (kind == FaceRequest::Kind::kMatch && n != 2)) {
    return InvalidArgument(kind == FaceRequest::Kind::kRegister
                               ? "register takes 1 to " + std::to_string(kMaxRegisterImages) + " images"
                           : kind == FaceRequest::Kind::kMatch ? "match takes two images"
                                                               : "recognize takes one image");
  }
  for (const FaceImage& image : request.images) {
    if (image.bytes.empty()) return InvalidArgument("the '" + image.name + "' field is empty (0 bytes)");
  }
  if (request.face_model.empty()) {
    return Unavailable(
        "no face model is loaded (a detection model with quern.detection.format centerface, such as "
        "examples/models/faces, or --face-model)");
  }
  std::string descriptor_name = descriptor_model_;
  if (descriptor_name.empty()) {
    auto names = service_->Models(VisionTask::kEmbedding);
    if (!names.empty()) descriptor_name = names.front();
  }
  if (descriptor_name.empty()) {
    return Unavailable(
        "no face descriptor model is loaded (a model with quern.task embedding, such as "
        "examples/models/face_descriptor, or --face-descriptor-model)");
  }
  QUERN_ASSIGN_OR_RETURN(auto detector, service_->Model(request.face_model));
  if (detector->task != VisionTask::kDetection) {
    return InvalidArgument("the face model '" + request.face_model + "' is not a detection model");
  }
  QUERN_ASSIGN_OR_RETURN(auto descriptor, service_->Model(descriptor_name));
  if (descriptor->task != VisionTask::kEmbedding) {
    return InvalidArgument("the face descriptor model '" + descriptor_name +
                           "' is not an embedding model (quern.task: embedding)");
  }

  auto run = std::make_shared<Run>();
  run->request = std::move(request);
  run->done = std::move(done);
  {
    MutexLock lock(run->mu);
    run->results.resize(n);
    run->remaining = n;
  }
  const FaceRequest& r = run->request;
  for (size_t i = 0; i < n; ++i) {
    VisionRequest v;
    v.model = detector;
    v.image = r.images[i].bytes;
    v.owner = r.owner;
    v.held_bytes = r.held_bytes / static_cast<int64_t>(n);  // shared out among the images
    v.cancel = r.cancel;
    v.descriptor = descriptor;
    // Recognition describes every face it finds (up to a batch); the others
    // the most confident face of each image.
    v.max_described = kind == FaceRequest::Kind::kRecognize ? descriptor->max_batch_size : 1;
    VisionCallback answer = [this, run, i](VisionResult&& result) {
      if (run->Done(i, std::move(result))) Finish(*run);
    };
    if (Status st = service_->Submit(std::move(v), answer); !st.ok()) {
      // The rest are not sent: the answer is this refusal.
      for (size_t j = i; j < n; ++j) {
        VisionResult refused;
        refused.status = st;
        if (run->Done(j, std::move(refused))) Finish(*run);
      }
      break;
    }
  }
  return Status::Ok();
}

void FaceService::Finish(Run& run) {
  std::vector<VisionResult> results;
  {
    MutexLock lock(run.mu);
    results = std::move(run.results);
  }
  const FaceRequest& r = run.request;
  FaceResult out;
  out.timings = results[0].timings;
  const auto answer = [&run, &out] {
    FaceCallback done = std::move(run.done);
    done(std::move(out));
  };
  for (size_t i = 0; i < results.size(); ++i) {
    const Status& st = results[i].status;
    if (st.ok()) continue;
    // Refused (as it is), or failed in the service (naming the image).
    out.status = st.code() == StatusCode::kUnavailable ? st : Status(st.code(), r.images[i].name + ": " + st.message());
    out.counted = true;
    return answer();
  }
  if (r.kind == FaceRequest::Kind::kRecognize) {
    const std::shared_ptr<const FaceSet> registered = gallery_->Current();  // one look at the store
    for (const auto& d : results[0].detections) {
      if (d.embedding.empty()) break;  // beyond the faces described
      const auto closest = registered->Closest(d.embedding);
      const bool known = closest && closest->similarity >= r.threshold;
      out.faces.push_back({known ? closest->userid : "unknown", known ? closest->similarity : 0.0, d.box});
    }
    return answer();
  }
  // Register and match: the most confident face of each image (boxes come
  // best first).
  Faces faces;
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& d = results[i].detections;
    if (d.empty() || d.front().embedding.empty()) {
      out.status = InvalidArgument("no face was found in '" + r.images[i].name + "'");
      return answer();
    }
    faces.push_back(d.front().embedding);
  }
  if (r.kind == FaceRequest::Kind::kRegister) {
    out.status = gallery_->Register(r.userid, faces);
  } else {
    out.similarity = FaceGallery::Similarity(faces[0], faces[1]);
  }
  answer();
}

}  // namespace quern
