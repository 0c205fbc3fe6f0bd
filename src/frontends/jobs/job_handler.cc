#include "frontends/jobs/job_handler.h"

#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "frontends/http/http_util.h"
#include "frontends/jobs/job_responses.h"
#include "frontends/jobs/stream_consumer.h"
#include "store/job_json.h"

namespace quern {

using Writer = rapidjson::Writer<rapidjson::StringBuffer>;

namespace {

std::string_view Query(std::string_view target) {
  const auto q = target.find('?');
  return q == std::string_view::npos ? std::string_view() : target.substr(q + 1);
}

// The value of `key` in a query string; nullopt when absent.
std::optional<std::string_view> QueryValue(std::string_view query, std::string_view key) {
  while (!query.empty()) {
    const auto amp = query.find('&');
    const std::string_view pair = query.substr(0, amp);
    const auto eq = pair.find('=');
    if (pair.substr(0, eq) == key) return eq == std::string_view::npos ? std::string_view() : pair.substr(eq + 1);
    if (amp == std::string_view::npos) break;
    query = query.substr(amp + 1);
  }
  return std::nullopt;
}

void String(Writer& w, std::string_view s) {
  w.String(s.data(), static_cast<rapidjson::SizeType>(s.size()));
}

HttpResponse JsonResponse(int status, const rapidjson::StringBuffer& buf) {
  HttpResponse r;
  r.status = status;
  r.body.assign(buf.GetString(), buf.GetSize());
  return r;
}

HttpResponse Conflict(const std::string& message) {
  rapidjson::StringBuffer buf;
  Writer w(buf);
  w.StartObject();
  w.Key("error");
  String(w, message);
  w.EndObject();
  return JsonResponse(409, buf);
}

std::string CancelledMessage(const std::string& id) {
  return "job '" + id + "' was cancelled (DELETE /v2/jobs/" + id + ")";
}

// {"job_id": id, "status": status[, "durable": ...]}: the answer to an
// accepted job (202, durable given, with its Location) or a cancelled one.
HttpResponse JobStatusAnswer(const std::string& id, const char* status, std::optional<bool> durable) {
  rapidjson::StringBuffer buf;
  Writer w(buf);
  w.StartObject();
  w.Key("job_id");
  String(w, id);
  w.Key("status");
  w.String(status);
  if (durable) {
    w.Key("durable");
    w.Bool(*durable);
  }
  w.EndObject();
  if (!durable) return JsonResponse(200, buf);
  HttpResponse resp = JsonResponse(202, buf);
  resp.headers.emplace_back("Location", "/v2/jobs/" + id);
  return resp;
}

HttpResponse CancelledAnswer(const std::string& id) {
  return JobStatusAnswer(id, "cancelled", std::nullopt);
}

HttpResponse Accepted(const std::string& id, bool durable) {
  return JobStatusAnswer(id, "queued", durable);
}

// Another owner's job is answered as an id never issued (the store's words).
Status NoJob(const std::string& id) {
  return NotFound("no job '" + id + "'");
}

enum PendingState : int { kPendingQueued = 0, kPendingRunning = 1, kPendingCancelRequested = 2 };

}  // namespace

struct JobHandler::Pending {
  std::string id;
  std::string model;
  std::string owner;
  int64_t version = -1;
  int64_t submitted_ms = 0;
  std::atomic<int64_t> started_ms{0};
  std::atomic<int64_t> cancelled_ms{0};
  std::atomic<int> state{kPendingQueued};
  std::shared_ptr<CancellationToken> cancel = std::make_shared<CancellationToken>();
  bool binary_default = false;
  std::vector<std::pair<std::string, bool>> binary_outputs;
  std::shared_ptr<JobResponses> responses;  // set before it is submitted
};

namespace {

Counter& FinishedCounter(MetricsRegistry& metrics, const char* status) {
  return metrics.AddCounter("quern_jobs_finished_total", "Jobs finished, by final status.", {{"status", status}});
}

}  // namespace

JobHandler::JobHandler(Engine* engine, ResultStore* store, MetricsRegistry* metrics)
    : engine_(engine),
      store_(store),
      started_ms_(engine->clock().WallMs()),
      own_metrics_(metrics ? nullptr : std::make_unique<MetricsRegistry>()),
      metrics_(metrics ? *metrics : *own_metrics_),
      submitted_(metrics_.AddCounter("quern_jobs_submitted_total", "Asynchronous jobs accepted.")),
      rejected_(metrics_.AddCounter("quern_jobs_rejected_total",
                                    "Job submissions refused at once (bad input, unknown model, queue full).")),
      done_(FinishedCounter(metrics_, "done")),
      failed_(FinishedCounter(metrics_, "failed")),
      cancelled_(FinishedCounter(metrics_, "cancelled")),
      pending_count_(metrics_.AddGauge("quern_jobs_pending", "Jobs queued or running now.")) {}

JobHandler::~JobHandler() {
  store_io_.Stop();  // before anything its lookups use goes
}

JobStats JobHandler::stats() const {
  JobStats s;
  s.submitted = submitted_.value();
  s.rejected = rejected_.value();
  s.done = done_.value();
  s.failed = failed_.value();
  s.cancelled = cancelled_.value();
  s.pending = pending_count_.value();
  return s;
}

Status JobHandler::AddRoutes(Router& router) {
  const Route routes[] = {
      {"POST", "/v2/models/{model}[/versions/{version}]/jobs", KeyPolicy::kUser, false, nullptr,
       [this](HttpRequest&& r, const RouteMatch& m, HttpDone done) {
         int64_t version = -1;
         if (Status st = ParseModelVersion(m.param("version"), &version); !st.ok()) return done(ErrorResponse(st));
         Submit(m.param("model"), version, std::move(r), std::move(done));
       }},
      {"GET", "/v2/jobs/{id}", KeyPolicy::kUser, false, nullptr,
       [this](HttpRequest&& r, const RouteMatch& m, HttpDone done) {
         Get(m.param("id"), owner_of_ ? owner_of_(r) : std::string(), Query(r.target), std::move(done));
       }},
      {"DELETE", "/v2/jobs/{id}", KeyPolicy::kUser, false, nullptr,
       [this](HttpRequest&& r, const RouteMatch& m, HttpDone done) {
         Cancel(m.param("id"), owner_of_ ? owner_of_(r) : std::string(), std::move(done));
       }},
  };
  for (const Route& r : routes) QUERN_RETURN_IF_ERROR(router.Add(r));
  return Status::Ok();
}

void JobHandler::Submit(const std::string& model, int64_t version, HttpRequest&& req, HttpDone done) {
  if (!stream_prefix_.empty() && (!durable_ || durable_(model))) {
    return SubmitToStream(model, version, std::move(req), std::move(done));
  }
  if (Status s = store_->CanAccept(); !s.ok()) {
    rejected_.Increment();
    return done(ErrorResponse(s));
  }
  auto json_length = InferenceHeaderLength(req, model);
  if (!json_length) {
    rejected_.Increment();
    return done(ErrorResponse(json_length.error()));
  }
  auto parsed = ParseKServeInferBody(model, version, std::move(req.body), *json_length);
  if (!parsed) {
    rejected_.Increment();
    return done(ErrorResponse(parsed.error()));
  }
  if (!parsed->format.classifications.empty()) {
    rejected_.Increment();
    return done(ErrorResponse(InvalidArgument(
        "model '" + model + "' output '" + parsed->format.classifications.front().first +
        "': parameter 'classification' is not supported for jobs (a job keeps its outputs as tensors)")));
  }
  auto job = std::make_shared<Pending>();
  job->submitted_ms = engine_->clock().WallMs();
  job->id = NewJobId(job->submitted_ms);
  job->model = model;
  job->owner = owner_of_ ? owner_of_(req) : std::string();
  job->version = version;
  job->binary_default = parsed->format.binary_default;
  job->binary_outputs = std::move(parsed->format.binary_outputs);

  InferRequest ir = std::move(parsed->request);
  ir.metadata.emplace_back("request_id", job->id);  // the engine's log lines name the job
  ir.cancel = job->cancel;                          // the job outlives the connection that submitted it
  job->responses = JobResponses::Attach(ir);        // a decoupled model's, all kept
  SubmitOptions options;
  options.on_start = [job, clock = &engine_->clock()] {
    int queued = kPendingQueued;
    if (job->state.compare_exchange_strong(queued, kPendingRunning)) job->started_ms.store(clock->WallMs());
  };
  options.loop = req.loop;
  {
    // Listed before it is submitted: it may complete (and be unlisted) at once.
    MutexLock lock(mu_);
    pending_.emplace(job->id, job);
    pending_count_.Set(static_cast<int64_t>(pending_.size()));
  }
  InferCallback complete = [this, job](InferResponse&& r) { Complete(job, std::move(r)); };
  if (Status st = engine_->InferAsync(std::move(ir), complete, options); !st.ok()) {
    // Refused at submission (bad input, unknown model, queue full): no job.
    {
      MutexLock lock(mu_);
      pending_.erase(job->id);
      pending_count_.Set(static_cast<int64_t>(pending_.size()));
    }
    rejected_.Increment();
    return done(ErrorResponse(st));
  }
  submitted_.Increment();
  done(Accepted(job->id, false));  // queued in this process: it dies with it
}

void JobHandler::SubmitToStream(const std::string& model, int64_t version, HttpRequest&& req, HttpDone done) {
  auto refuse = [&](const Status& st) {
    rejected_.Increment();
    done(ErrorResponse(st));
  };
  if (Status s = store_->CanAccept(); !s.ok()) return refuse(s);
  auto json_length = InferenceHeaderLength(req, model);
  if (!json_length) return refuse(json_length.error());
  const std::string header_length(*json_length);
  // Shared: the request's inputs view it, and it is written to Redis.
  std::shared_ptr<const std::string> body = ShareBody(std::move(req.body));
  auto parsed = ParseKServeInferBody(model, version, body, header_length);
  if (!parsed) return refuse(parsed.error());
  if (!parsed->format.classifications.empty()) {
    return refuse(InvalidArgument(
        "model '" + model + "' output '" + parsed->format.classifications.front().first +
        "': parameter 'classification' is not supported for jobs (a job keeps its outputs as tensors)"));
  }
  // Refused as infer would refuse it (unknown model, bad input); a full
  // queue is not a refusal: the stream is the queue, and any instance may
  // take it.
  // (A decoupled model's responses are all kept: the consumer attaches a JobResponses.)
  parsed->request.on_response = [](InferResponse&&) {};
  if (Status st = engine_->Validate(parsed->request); !st.ok()) return refuse(st);
  parsed->request.on_response = nullptr;
  auto record = std::make_shared<JobRecord>();
  record->submitted_ms = engine_->clock().WallMs();
  record->id = NewJobId(record->submitted_ms);
  record->model = model;
  record->owner = owner_of_ ? owner_of_(req) : std::string();
  record->version = std::max<int64_t>(version, 0);
  record->state = JobState::kQueued;
  record->binary_default = parsed->format.binary_default;
  record->binary_outputs = parsed->format.binary_outputs;
  // The body goes under a key of its own, which the entry names: a
  // consumer that has the job here already (local_) never reads it back.
  StreamSubmission sub;
  sub.stream = stream_prefix_ + model;
  sub.value_key = StreamBodyKey(sub.stream, record->id);
  sub.value = *body;
  sub.value_owner = body;
  sub.fields = {{"id", record->id}, {"body_key", sub.value_key}};
  if (!header_length.empty()) sub.fields.emplace_back("header_length", header_length);
  if (version > 0) sub.fields.emplace_back("version", std::to_string(version));
  if (!record->owner.empty()) sub.fields.emplace_back("owner", record->owner);
  sub.fields.emplace_back("tracked", "1");
  const std::string id = record->id;
  // Kept before it is written: this instance's consumer may read the entry
  // before the write's answer comes back.
  // Its memory: the body, and the inputs (a JSON array decodes to several
  // times its text; binary inputs view the body and are counted twice).
  size_t held = body->size();
  for (const auto& in : parsed->request.inputs) held += in.tensor.byte_size();
  const bool kept = local_ && local_->Put(id, std::move(*parsed), held);
  submitting_->fetch_add(1, std::memory_order_acq_rel);
  store_->Enqueue(std::move(record), sub, [this, id, kept, done = std::move(done)](Status st) {
    if (!st.ok()) {
      if (kept) local_->Drop(id);
      rejected_.Increment();
      done(ErrorResponse(st));
    } else {
      submitted_.Increment();
      done(Accepted(id, true));
    }
    submitting_->fetch_sub(1, std::memory_order_acq_rel);
  });
}

void JobHandler::Complete(const std::shared_ptr<Pending>& job, InferResponse&& r) {
  auto record = std::make_shared<JobRecord>();
  record->id = job->id;
  record->model = job->model;
  record->owner = job->owner;
  record->version = r.version > 0 ? r.version : std::max<int64_t>(job->version, 0);
  record->submitted_ms = job->submitted_ms;
  record->started_ms = job->started_ms.load();
  record->finished_ms = engine_->clock().WallMs();
  record->binary_default = job->binary_default;
  record->binary_outputs = job->binary_outputs;
  if (job->state.load() == kPendingCancelRequested) {
    record->state = JobState::kCancelled;
    record->error = Cancelled(CancelledMessage(job->id));
    record->finished_ms = job->cancelled_ms.load();
  } else {
    job->responses->Fill(std::move(r), *record);
  }
  const JobState state = record->state;
  // Stored before it leaves the pending map, so a poll always finds it.
  store_->Put({std::move(record)});
  {
    MutexLock lock(mu_);
    pending_.erase(job->id);
    pending_count_.Set(static_cast<int64_t>(pending_.size()));
  }
  (state == JobState::kDone ? done_ : state == JobState::kFailed ? failed_ : cancelled_).Increment();
}

void JobHandler::Get(const std::string& id, const std::string& owner, std::string_view query, HttpDone done) {
  std::shared_ptr<Pending> pending;
  {
    MutexLock lock(mu_);
    if (auto it = pending_.find(id); it != pending_.end()) pending = it->second;
  }
  if (pending && !pending->owner.empty() && pending->owner != owner) return done(ErrorResponse(NoJob(id)));
  rapidjson::StringBuffer buf;
  JsonWriter w(buf);
  std::vector<const Tensor*> binary_parts;
  if (pending) {
    JobRecord rec;  // what is known of a job not finished
    rec.id = id;
    rec.model = pending->model;
    rec.submitted_ms = pending->submitted_ms;
    rec.started_ms = pending->started_ms.load();
    const int state = pending->state.load();
    rec.state = state == kPendingQueued    ? JobState::kQueued
                : state == kPendingRunning ? JobState::kRunning
                                           : JobState::kCancelled;
    if (state == kPendingCancelRequested) {
      rec.finished_ms = pending->cancelled_ms.load();
      rec.error = Cancelled(CancelledMessage(id));
    }
    Status st = WriteJobJson(w, rec, JobJsonForm::kPoll, KServeOutputFormat{}, binary_parts);
    return done(st.ok() ? JsonResponse(200, buf) : ErrorResponse(st));
  }
  Lookup(std::move(done),
         [this, id, owner, query = std::string(query)](HttpDone d) { GetStored(id, owner, query, std::move(d)); });
}

void JobHandler::Lookup(HttpDone done, std::function<void(HttpDone)> lookup) {
  if (!store_->Durable()) return lookup(std::move(done));
  // Answered exactly once: by the lookup, or 503 when the worker refuses it
  // or drops it unrun (the server stopping).
  struct Answer {
    HttpDone done;
    ~Answer() {
      if (done) done(ErrorResponse(Unavailable("the server is shutting down")));
    }
  };
  auto answer = std::make_shared<Answer>();  // in place: a copy's destructor would answer
  answer->done = std::move(done);
  const bool queued =
      store_io_.Post([answer, lookup = std::move(lookup)] { lookup(std::exchange(answer->done, nullptr)); });
  if (!queued && answer->done) {
    std::exchange(answer->done,
                  nullptr)(ErrorResponse(Unavailable("the job store is busy: " + std::to_string(kMaxStoreLookups) +
                                                     " lookups wait for redis already; try again later")));
  }
}

void JobHandler::GetStored(const std::string& id, const std::string& owner, std::string_view query, HttpDone done) {
  rapidjson::StringBuffer buf;
  JsonWriter w(buf);
  std::vector<const Tensor*> binary_parts;
  auto stored = store_->Get(id);
  if (!stored) return done(NotStored(id, stored.error()));
  if (!(*stored)->owner.empty() && (*stored)->owner != owner) return done(ErrorResponse(NoJob(id)));
  const JobRecord& rec = **stored;
  KServeOutputFormat format;
  format.binary_default = rec.binary_default;
  format.binary_outputs = rec.binary_outputs;
  if (auto b = QueryValue(query, "binary_data_output")) {
    format.binary_default = *b == "true" || *b == "1";
    format.binary_outputs.clear();
  }
  if (Status st = WriteJobJson(w, rec, JobJsonForm::kPoll, format, binary_parts); !st.ok()) {
    return done(ErrorResponse(st));
  }
  // The body views the stored record's tensors: copy them out now.
  done(KServeBody(200, buf, binary_parts));
}

HttpResponse JobHandler::NotStored(const std::string& id, const Status& not_found) const {
  const int64_t submitted_ms = JobIdSubmittedMs(id);
  if (not_found.code() != StatusCode::kNotFound || store_->Durable() || submitted_ms < 0 ||
      submitted_ms >= started_ms_) {
    return ErrorResponse(not_found);
  }
  rapidjson::StringBuffer buf;
  Writer w(buf);
  w.StartObject();
  w.Key("error");
  String(w, "job '" + id +
                "': the server restarted after this job was accepted; its result is lost (results are "
                "kept in memory; with --redis-url they outlive a restart)");
  w.EndObject();
  return JsonResponse(410, buf);
}

void JobHandler::CancelStored(const std::string& id, const std::string& owner, HttpDone done) {
  auto stored = store_->Get(id);
  if (!stored) return done(NotStored(id, stored.error()));
  const JobRecord& rec = **stored;
  if (!rec.owner.empty() && rec.owner != owner) return done(ErrorResponse(NoJob(id)));
  if (rec.state == JobState::kRunning) {
    return done(Conflict("job '" + id + "' is running; only a queued job can be cancelled"));
  }
  if (rec.state != JobState::kQueued) {
    return done(Conflict("job '" + id + "' has already finished (" + std::string(JobStateName(rec.state)) +
                         "); only a queued job can be cancelled"));
  }
  auto cancelled = std::make_shared<JobRecord>(rec);
  cancelled->state = JobState::kCancelled;
  cancelled->finished_ms = engine_->clock().WallMs();
  cancelled->error = Cancelled(CancelledMessage(id));
  if (Status st = store_->CancelQueued(cancelled); !st.ok()) {
    if (st.code() == StatusCode::kFailedPrecondition) {
      return done(Conflict("job '" + id +
                           "' is no longer queued (it started meanwhile); only a queued job can be "
                           "cancelled"));
    }
    return done(ErrorResponse(st));
  }
  cancelled_.Increment();
  done(CancelledAnswer(id));
}

void JobHandler::Cancel(const std::string& id, const std::string& owner, HttpDone done) {
  std::shared_ptr<Pending> pending;
  {
    MutexLock lock(mu_);
    if (auto it = pending_.find(id); it != pending_.end()) pending = it->second;
  }
  if (pending && !pending->owner.empty() && pending->owner != owner) return done(ErrorResponse(NoJob(id)));
  if (!pending) {
    return Lookup(std::move(done), [this, id, owner](HttpDone d) { CancelStored(id, owner, std::move(d)); });
  }
  int queued = kPendingQueued;
  if (!pending->state.compare_exchange_strong(queued, kPendingCancelRequested)) {
    if (queued == kPendingCancelRequested) return done(Conflict("job '" + id + "' is already cancelled"));
    return done(Conflict("job '" + id + "' is running; only a queued job can be cancelled"));
  }
  pending->cancelled_ms.store(engine_->clock().WallMs());
  pending->cancel->Cancel();
  done(CancelledAnswer(id));
}

}  // namespace quern
