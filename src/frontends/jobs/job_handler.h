// Asynchronous jobs over HTTP: submit an inference now, collect its result
// later.
//
//   POST   /v2/models/{m}[/versions/{v}]/jobs   body as for .../infer → 202 {"job_id", "status"}
//   GET    /v2/jobs/{id}                        status, timestamps, and the result or the error
//   DELETE /v2/jobs/{id}                        cancels a queued job
//
// A submitted job is validated and queued in the model's batcher at once: a
// bad request or a full queue is answered with the same errors as infer
// (400 / 404 / 503), never with a job id. A job is independent of the
// connection that submitted it. Queued and running jobs live here; finished
// ones (done, failed, cancelled) go to the ResultStore, which bounds how long
// and how many are kept. GET answers the result in the KServe v2 response
// format under "result", with binary outputs (the binary tensor extension)
// when the submission asked for them or when the query says
// ?binary_data_output=true.
//
// Without a stream (set_stream_prefix), a job is queued in this process
// and dies with it: the 202 says "durable": false. With a store that keeps no result past the process
// (memory), an id issued before the process started (ids carry their
// submission time) answers 410 Gone, where an id never issued answers 404.
//
// Thread safety: the routes may be called from any number of threads. The
// engine must be drained (its callbacks delivered) before the handler is
// destroyed; the store must outlive the handler.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "core/mutex.h"
#include "core/serial_worker.h"
#include "frontends/http/http_types.h"
#include "frontends/http/router.h"
#include "frontends/jobs/local_job_inputs.h"
#include "metrics/registry.h"
#include "quern/engine.h"
#include "store/result_store.h"

namespace quern {

// The quern_jobs_* metrics, read back; counters are cumulative.
struct JobStats {
  uint64_t submitted = 0;  // accepted (got a job id)
  uint64_t rejected = 0;   // refused at submission (bad input, unknown model, queue full)
  uint64_t done = 0, failed = 0, cancelled = 0;
  int64_t pending = 0;  // queued or running now
};

class JobHandler {
 public:
  // `engine`, `store` and `metrics` must outlive the handler; null `metrics`
  // = a registry of the handler's own (stats() still reads it).
  JobHandler(Engine* engine, ResultStore* store, MetricsRegistry* metrics = nullptr);
  ~JobHandler();
  JobHandler(const JobHandler&) = delete;
  JobHandler& operator=(const JobHandler&) = delete;

  // Declares the routes above on `router`, which must not outlive the
  // handler.
  Status AddRoutes(Router& router);

  // Who submits (JobRecord::owner): set when API keys are on, from the key a
  // request presents. A job with an owner is read and cancelled only by a
  // request with the same owner; to any other it is an id never issued.
  // Unset: every job is anyone's. Set before the first request.
  void set_owner_of(std::function<std::string(const HttpRequest&)> owner_of) { owner_of_ = std::move(owner_of); }
  // Waits for the store lookup running, if any; those still queued, and
  // later ones, are answered 503. For a stopping server, before the store
  // and the HTTP server go.
  void StopLookups() { store_io_.Stop(); }

  // Durable jobs: with a store that outlives the process, each accepted job
  // is written to the stream `prefix`{model} (the StreamConsumer's format,
  // with fields owner and tracked, its body under StreamBodyKey) together
  // with a queued record, and answered 202 ("durable": true) once Redis has
  // them all; the instances that consume that stream run it, whichever of
  // them is alive. Any instance answers its status from the record, and
  // cancels it while it is queued. Only for the models `durable` says
  // (whose streams someone takes jobs from); others run here. Set before the first request; empty prefix
  // (the default): every job runs here.
  void set_stream_prefix(std::string prefix, std::function<bool(const std::string& model)> durable) {
    stream_prefix_ = std::move(prefix);
    durable_ = std::move(durable);
  }
  // Where the jobs accepted into a stream are kept parsed for this
  // instance's consumer (which takes them from there); null (the default):
  // not kept. Must outlive the handler; set before the first request.
  void set_local_inputs(LocalJobInputs* local) { local_ = local; }
  // Jobs being written to the stream, not yet answered.
  int64_t submitting() const { return submitting_->load(std::memory_order_acquire); }

  JobStats stats() const;

 private:
  struct Pending;
  void Submit(const std::string& model, int64_t version, HttpRequest&& request, HttpDone done);
  void SubmitToStream(const std::string& model, int64_t version, HttpRequest&& request, HttpDone done);
  // DELETE of a job this process does not hold: a queued record is set to
  // cancelled in the store.
  void CancelStored(const std::string& id, const std::string& owner, HttpDone done);
  void Get(const std::string& id, const std::string& owner, std::string_view query, HttpDone done);
  // GET of a job this process does not hold: its record from the store.
  void GetStored(const std::string& id, const std::string& owner, std::string_view query, HttpDone done);
  // Runs `lookup` (a store lookup that answers `done`) on store_io_ when the
  // store is a round trip away (Redis), at once otherwise (in memory).
  void Lookup(HttpDone done, std::function<void(HttpDone)> lookup);
  void Cancel(const std::string& id, const std::string& owner, HttpDone done);
  void Complete(const std::shared_ptr<Pending>& job, InferResponse&& response);

  // The store's answer for `id` not found there: 410 Gone for an id issued
  // before this handler started when the store is not durable.
  HttpResponse NotStored(const std::string& id, const Status& not_found) const;

  Engine* engine_;
  ResultStore* store_;
  const int64_t started_ms_;  // wall clock, when the handler was made
  std::string stream_prefix_;
  std::function<bool(const std::string&)> durable_;
  LocalJobInputs* local_ = nullptr;
  std::shared_ptr<std::atomic<int64_t>> submitting_ = std::make_shared<std::atomic<int64_t>>(0);
  std::function<std::string(const HttpRequest&)> owner_of_;
  std::unique_ptr<MetricsRegistry> own_metrics_;
  MetricsRegistry& metrics_;
  Counter& submitted_;
  Counter& rejected_;
  Counter& done_;
  Counter& failed_;
  Counter& cancelled_;
  Gauge& pending_count_;  // pending_.size()
  // Store lookups that wait on Redis run here, never on an HTTP I/O thread
  // (a slow or hung Redis would stall every connection of that thread);
  // at most kMaxStoreLookups wait, beyond: 503.
  static constexpr size_t kMaxStoreLookups = 256;
  SerialWorker store_io_{"quern-jobs-io", kMaxStoreLookups};
  mutable Mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<Pending>> pending_ QUERN_GUARDED_BY(mu_);  // queued or running
};

}  // namespace quern
