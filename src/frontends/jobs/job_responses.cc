#include "frontends/jobs/job_responses.h"

#include <utility>

namespace quern {

namespace {

std::vector<NamedTensor> Owned(const std::vector<NamedTensor>& outputs, size_t& bytes) {
  std::vector<NamedTensor> out;
  out.reserve(outputs.size());
  for (const auto& o : outputs) {
    out.push_back({o.name, OwnedCopy(o.tensor)});
    bytes += o.tensor.byte_size();
  }
  return out;
}

}  // namespace

std::shared_ptr<JobResponses> JobResponses::Attach(InferRequest& request) {
  auto self = std::make_shared<JobResponses>();
  if (!request.cancel) request.cancel = std::make_shared<CancellationToken>();
  self->cancel_ = request.cancel;
  request.on_response = [self](InferResponse&& r) {
    {
      MutexLock lock(self->mu_);
      if (!self->exceeded_.ok()) return;
      size_t bytes = 0;
      for (const auto& o : r.outputs) bytes += o.tensor.byte_size();
      if (!r.status.ok()) {
        // An error among the responses fails the job (as it fails an ensemble's request).
        self->exceeded_ = r.status;
      } else if (self->responses_.size() >= kMaxResponses || self->bytes_ + bytes > kMaxBytes) {
        self->exceeded_ = ResourceExhausted(
            "model '" + r.model + "' sent more than " +
            (self->responses_.size() >= kMaxResponses ? std::to_string(kMaxResponses) + " responses"
                                                      : std::to_string(kMaxBytes >> 20) + " MiB of responses") +
            ", the most a job keeps; stream them instead (gRPC ModelStreamInfer, HTTP generate_stream)");
      } else {
        self->responses_.push_back(Owned(r.outputs, self->bytes_));
        return;
      }
      self->responses_.clear();
      self->bytes_ = 0;
    }
    self->cancel_->Cancel();  // (outside the lock: it runs the engine's cancellation functions)
  };
  return self;
}

void JobResponses::Fill(InferResponse&& r, JobRecord& record) {
  MutexLock lock(mu_);
  Status status = !exceeded_.ok() ? exceeded_ : r.status;
  if (!status.ok()) {
    record.state = status.code() == StatusCode::kCancelled ? JobState::kCancelled : JobState::kFailed;
    record.error = std::move(status);
    return;
  }
  record.state = JobState::kDone;
  size_t bytes = 0;
  if (!r.decoupled) {
    record.outputs = Owned(r.outputs, bytes);
    return;
  }
  record.decoupled = true;
  record.responses = std::move(responses_);
  if (!r.final_only) {
    record.responses.push_back(Owned(r.outputs, bytes));  // the last, with data
    if (bytes_ + bytes > kMaxBytes) {
      record.responses.clear();
      record.decoupled = false;
      record.state = JobState::kFailed;
      record.error = ResourceExhausted("model '" + r.model + "' sent more than " + std::to_string(kMaxBytes >> 20) +
                                       " MiB of responses, the most a job keeps; stream them instead (gRPC "
                                       "ModelStreamInfer, HTTP generate_stream)");
    }
  }
}

}  // namespace quern
