// JobResponses: what a job keeps of its model's answers. A job's request
// takes every response of a decoupled model (InferRequest::on_response,
// which other models never call) and its last answer, and the job's record
// (store/result_store.h) gets them: a model's outputs, or a decoupled
// model's responses in order (the "responses" of the job's JSON).
//
// Bounded: at most kMaxResponses responses and kMaxBytes of their tensors per
// job; past either the request is cancelled (the model sees is_cancelled())
// and the job fails with RESOURCE_EXHAUSTED saying which bound. A response
// that is an error fails the job with it (the request cancelled likewise).
//
// Thread safety: the responses may come on any thread, one at a time (a
// request's responses are sent in order); Fill after the last answer.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "core/mutex.h"
#include "quern/engine.h"
#include "store/result_store.h"

namespace quern {

class JobResponses {
 public:
  static constexpr size_t kMaxResponses = 4096;
  static constexpr size_t kMaxBytes = size_t{64} << 20;

  // Sets `request`'s on_response (and a cancellation token, if it has none)
  // to collect into the returned object.
  static std::shared_ptr<JobResponses> Attach(InferRequest& request);

  // The job's outcome from its last answer `r`: `record`'s state (done or
  // failed), and its outputs or responses, or its error. A cancelled request
  // is kCancelled.
  void Fill(InferResponse&& r, JobRecord& record);

 private:
  Mutex mu_;
  std::vector<std::vector<NamedTensor>> responses_ QUERN_GUARDED_BY(mu_);
  size_t bytes_ QUERN_GUARDED_BY(mu_) = 0;
  Status exceeded_ QUERN_GUARDED_BY(mu_);  // a bound passed: why the job fails
  std::shared_ptr<CancellationToken> cancel_;
};

}  // namespace quern
