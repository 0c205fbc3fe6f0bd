// Servable: one version of a model as the registry serves it — a model with
// instances and a batcher (ServedModel), or an ensemble that runs its steps
// on other servables (EnsembleModel). The registry and the Engine reach
// every kind through this interface; front ends see neither.
//
// Thread safety: every method may be called from any thread, except that
// Shutdown must not be called from a completion callback.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "quern/engine.h"
#include "quern/model.h"

namespace quern {

class Servable {
 public:
  virtual ~Servable() = default;

  // Validates and queues `request`. Accepted: `done` is moved out and later
  // receives exactly one response on an engine thread. Refused (invalid
  // input, queue full, stopping): the refusal is returned, counted in the
  // statistics, and `done` is left with the caller, untouched; refused
  // because it is stopping (stopping() true), `request` too is left as it
  // was, so that the caller can give it to the version that replaced this one.
  // `options`: as Engine::InferAsync takes them. `run_here`: the caller
  // blocks until the answer anyway; its batch may run on the calling thread,
  // and `done` may then be called before Submit returns.
  virtual Status Submit(InferRequest&& request, uint64_t request_id, InferCallback& done, const SubmitOptions& options,
                        bool run_here) = 0;
  // Whether Shutdown has begun.
  virtual bool stopping() const = 0;

  // OK, or the UNAVAILABLE a request would get now (counted as refused: the
  // caller answers it without submitting it).
  virtual Status CheckAdmission() = 0;
  // Counts a request a front end refused for this model on its own grounds
  // (`status`: why), as CheckAdmission counts its refusals.
  virtual void CountRefused(const Status& status) = 0;

  // Asks running work to end early and later work to fail (see
  // Model::Abandon); once, from any thread.
  virtual void Abandon() = 0;

  // Queued requests leave without waiting for company (a draining server:
  // DynamicBatcher::SendQueuedNow). Any thread.
  virtual void SendQueuedNow() {}

  // Stops intake and finishes every accepted request. Idempotent.
  virtual void Shutdown() = 0;

  virtual const ModelConfig& config() const = 0;
  virtual int64_t version() const = 0;
  // The class labels of output `output` (its label_filename, read at load),
  // or null when it has none.
  virtual std::shared_ptr<const std::vector<std::string>> OutputLabels(const std::string& /*output*/) const {
    return nullptr;
  }
  virtual ModelStatistics Statistics() const = 0;
  // Requests submitted and not yet answered.
  virtual int64_t in_flight() const = 0;
};

}  // namespace quern
