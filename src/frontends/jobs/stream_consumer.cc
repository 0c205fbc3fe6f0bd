#include "frontends/jobs/stream_consumer.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <unordered_set>
#include <utility>

#include "core/cpus.h"
#include "core/log.h"
#include "core/model_config_parser.h"
#include "core/mutex.h"
#include "frontends/jobs/job_responses.h"

namespace quern {

namespace {

// A tracked job's record (KEYS[1]) set to ARGV[1] (running, no time to
// live) when it says queued or running (a job taken over): 1. Otherwise 0:
// the job was cancelled, or finished (another consumer wrote its result
// before this one took the entry over), or its record is gone; the entry
// is then acknowledged without running. (The record's JSON has one
// "status" key, and its string values are escaped: no other text matches.)
// Claims a job for an entry before it runs, in one step on the Redis side:
// KEYS[1] the job's record, ARGV[1] the entry's owner, ARGV[2] the record
// saying running (an HTTP job's entry, whose record says queued) or "".
// -1: the record is another owner's (an entry may not take over another
// key's job); 0: not to run (an HTTP job cancelled, finished or gone);
// 1: run it.
constexpr char kClaimScript[] = R"lua(
local v = redis.call('GET', KEYS[1])
if not v then
  if ARGV[2] ~= '' then return 0 end
  return 1
end
local ok, doc = pcall(cjson.decode, v)
if not ok or type(doc) ~= 'table' then return -1 end
local owner = doc['owner']
if type(owner) ~= 'string' then owner = '' end
if owner ~= ARGV[1] then return -1 end
if ARGV[2] == '' then return 1 end
if doc['status'] == 'queued' or doc['status'] == 'running' then
  redis.call('SET', KEYS[1], ARGV[2])
  return 1
end
return 0
)lua";

constexpr char kLengthHelp[] = "Entries in each model's job stream (XLEN).";
constexpr char kPendingHelp[] = "Entries delivered to some consumer and not yet acknowledged (XPENDING).";
constexpr char kTrimmedHelp[] =
    "Entries trimmed from each model's job stream (acknowledged by every consumer group, past --stream-retain-secs).";

// The streams are trimmed once a second, and after this many entries were
// acknowledged (a fast stream grows by at most this much between trims).
constexpr int kTrimEveryAcks = 1000;

// A stream entry id, "<ms>-<seq>".
struct EntryId {
  uint64_t ms = 0, seq = 0;
  bool operator<(const EntryId& o) const { return ms != o.ms ? ms < o.ms : seq < o.seq; }
  std::string ToString() const { return std::to_string(ms) + "-" + std::to_string(seq); }
};

std::optional<EntryId> ParseEntryId(std::string_view s) {
  const size_t dash = s.find('-');
  if (dash == std::string_view::npos) return std::nullopt;
  EntryId id;
  const auto ms = std::from_chars(s.data(), s.data() + dash, id.ms);
  const auto seq = std::from_chars(s.data() + dash + 1, s.data() + s.size(), id.seq);
  if (ms.ec != std::errc() || ms.ptr != s.data() + dash || seq.ec != std::errc() || seq.ptr != s.data() + s.size()) {
    return std::nullopt;
  }
  return id;
}

Counter& OutcomeCounter(MetricsRegistry& metrics, const char* outcome) {
  return metrics.AddCounter("quern_stream_entries_total",
                            "Job stream entries by outcome: taken (read or reclaimed), reclaimed, done, failed, dead "
                            "(dead-lettered), retried (left pending after a transient failure), cancelled (a job "
                            "cancelled while queued, acknowledged without running), local (an HTTP job taken by the "
                            "instance that accepted it, run from the request it kept, its body not read back), "
                            "foreign (an entry naming a job another owner submitted: acknowledged, not run).",
                            {{"outcome", outcome}});
}

int64_t ParseInt64(std::string_view s, int64_t fallback) {
  int64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  return ec == std::errc() && p == s.data() + s.size() ? v : fallback;
}

// Errors that the same request would get again: no point retrying.
bool Deterministic(StatusCode code) {
  switch (code) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kFailedPrecondition:
    case StatusCode::kUnimplemented:
    case StatusCode::kResourceExhausted:
    case StatusCode::kPermissionDenied:
    case StatusCode::kAlreadyExists:
    case StatusCode::kDeadlineExceeded: return true;
    default: return false;
  }
}

std::string DefaultConsumerName() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "quern");
  return std::string(host) + "-" + std::to_string(getpid());
}

}  // namespace

std::string StreamBodyKey(const std::string& stream, const std::string& job_id) {
  return stream + ":body:" + job_id;
}

std::string_view StreamEntry::Field(std::string_view name) const {
  for (const auto& [k, v] : fields) {
    if (k == name) return v;
  }
  return {};
}

bool ParseStreamEntry(RedisReply& e, StreamEntry& out) {
  if (!e.is_array() || e.elements.size() != 2 || !e.elements[0].is_string() || !e.elements[1].is_array()) {
    return false;
  }
  out.entry_id = std::move(e.elements[0].str);
  auto& f = e.elements[1].elements;
  for (size_t i = 0; i + 1 < f.size(); i += 2) {
    if (f[i + 1].oversize >= 0) {
      out.oversize.emplace_back(f[i].str.substr(0, 64), f[i + 1].oversize);
    } else {
      out.fields.emplace_back(std::move(f[i].str), std::move(f[i + 1].str));
    }
  }
  return true;
}

Result<int64_t> StreamEntryDeadline(const StreamEntry& e) {
  const std::string_view d = e.Field("deadline_ms");
  if (d.empty()) return int64_t{0};
  const int64_t deadline_ms = ParseInt64(d, -1);
  if (deadline_ms < 0) {
    return Err(InvalidArgument("job stream entry " + e.entry_id + ": deadline_ms '" + std::string(d.substr(0, 64)) +
                               "' is not a Unix time in milliseconds"));
  }
  return deadline_ms;
}

Result<StreamJob> DecodeStreamJob(const StreamEntry& e, const std::string& model, const std::string& stream) {
  StreamJob job;
  if (!e.oversize.empty()) {
    return Err(InvalidArgument("job stream entry " + e.entry_id + " of " + stream + ": field '" +
                               e.oversize.front().first + "' holds " + std::to_string(e.oversize.front().second) +
                               " bytes, over the limit for an entry's value (--http-max-body-bytes); it was not read"));
  }
  const std::string_view body = e.Field("body");
  if (body.empty()) {
    return Err(InvalidArgument("job stream entry " + e.entry_id + " of " + stream +
                               " has no 'body' field (the KServe v2 infer request)"));
  }
  QUERN_ASSIGN_OR_RETURN(job.deadline_ms, StreamEntryDeadline(e));
  int64_t version = -1;
  if (auto v = e.Field("version"); !v.empty()) {
    version = ParseInt64(v, -2);
    if (version < 1) {
      return Err(InvalidArgument("job stream entry " + e.entry_id + ": version '" + std::string(v.substr(0, 64)) +
                                 "' is not a model version"));
    }
  }
  QUERN_ASSIGN_OR_RETURN(job.infer, ParseKServeInferBody(model, version, std::string(body), e.Field("header_length")));
  if (!job.infer.format.classifications.empty()) {
    return Err(InvalidArgument("model '" + model + "' output '" + job.infer.format.classifications.front().first +
                               "': parameter 'classification' is not supported for jobs (a job keeps its outputs "
                               "as tensors)"));
  }
  return job;
}

class StreamConsumer::Impl : public std::enable_shared_from_this<Impl> {
 public:
  struct Model {
    std::string name, stream, dead;
    int count = 1;  // entries per read (its batch size)
    std::string claim_cursor = "0-0";
  };

  // One stream entry taken by this consumer.
  struct Entry : StreamEntry {
    size_t model = 0;
    int64_t deliveries = 1;
    bool cancelled = false;            // its job was cancelled, or has a result: acknowledged, not run
    bool unchecked = false;            // Redis did not answer what it needs (may it start, its body): left pending
    std::string body_key;              // its field body_key, when it has no body of its own
    bool delete_body = false;          // body_key holds its body (a string): deleted with the entry
    Status problem;                    // set: not run, fails with this (a body_key not its stream's, a body gone)
    std::optional<KServeInfer> local;  // its job, parsed when it was accepted here
  };
  // kSkipped: acknowledged, not run (cancelled, or finished elsewhere);
  // kLeft: not run, left pending for a later delivery.
  enum class Kind { kDone, kFailed, kDead, kRetry, kSkipped, kLeft };
  struct Outcome {
    Kind kind = Kind::kRetry;
    std::shared_ptr<JobRecord> record;
  };
  // Entries read together, finished together: their results and XACKs go
  // to Redis in one MULTI/EXEC.
  struct Group {
    std::vector<Entry> entries;
    std::vector<Outcome> outcomes;
    std::atomic<size_t> remaining{0};
  };

  Impl(StreamConsumerOptions options, Engine* engine, RedisResultStore* store)
      : options_(std::move(options)),
        engine_(engine),
        store_(store),
        own_metrics_(options_.metrics ? nullptr : std::make_unique<MetricsRegistry>()),
        metrics_(options_.metrics ? *options_.metrics : *own_metrics_),
        taken_(OutcomeCounter(metrics_, "taken")),
        local_(OutcomeCounter(metrics_, "local")),
        reclaimed_(OutcomeCounter(metrics_, "reclaimed")),
        done_(OutcomeCounter(metrics_, "done")),
        failed_(OutcomeCounter(metrics_, "failed")),
        dead_(OutcomeCounter(metrics_, "dead")),
        retried_(OutcomeCounter(metrics_, "retried")),
        cancelled_(OutcomeCounter(metrics_, "cancelled")),
        foreign_(OutcomeCounter(metrics_, "foreign")),
        inflight_gauge_(metrics_.AddGauge("quern_stream_inflight",
                                          "Job stream entries taken by this instance and not yet finished.")),
        connected_(
            metrics_.AddGauge("quern_stream_connected", "1 while the job stream reader is connected to Redis.")) {
    // Each model's series appears once Redis has told its value.
    metrics_.DeclareFamily("quern_stream_length", MetricType::kGauge, kLengthHelp);
    metrics_.DeclareFamily("quern_stream_pending", MetricType::kGauge, kPendingHelp);
    metrics_.DeclareFamily("quern_stream_trimmed_total", MetricType::kCounter, kTrimmedHelp);
  }

  Status Init() {
    if (options_.consumer.empty()) options_.consumer = DefaultConsumerName();
    const auto all = engine_->ListModels();
    std::vector<std::string> names = options_.models;
    if (names.empty()) {
      for (const auto& m : all) {
        if (m.state == ModelState::kReady && std::find(names.begin(), names.end(), m.name) == names.end()) {
          names.push_back(m.name);
        }
      }
    }
    if (names.empty()) return InvalidArgument("--consume: no ready model to take jobs for");
    int auto_inflight = 0;
    for (const auto& name : names) {
      const ModelStatus* found = nullptr;
      for (const auto& m : all) {
        if (m.name == name && (found == nullptr || m.version > found->version)) found = &m;
      }
      if (found == nullptr) return NotFound("--consume: no model '" + name + "' in the repository");
      Model m;
      m.name = name;
      m.stream = options_.stream_prefix + name;
      m.dead = options_.dead_prefix + name;
      m.count = std::max(1, found->config.max_batch_size);
      auto_inflight += m.count * std::max(1, found->config.instance_count);
      models_.push_back(std::move(m));
    }
    {
      MutexLock lock(mu_);
      length_.assign(models_.size(), nullptr);
      pending_.assign(models_.size(), nullptr);
      trimmed_.assign(models_.size(), nullptr);
      model_inflight_.assign(models_.size(), 0);
    }
    if (options_.max_inflight <= 0) options_.max_inflight = std::max(2, 2 * auto_inflight);
    if (options_.max_deliveries < 1) options_.max_deliveries = 1;
    return Status::Ok();
  }

  void Run() {
    reader_ = std::thread([self = shared_from_this()] {
      NameThisThread("quern-stream");
      self->Loop();
    });
  }

  void Stop() {
    {
      MutexLock lock(mu_);  // no lost wakeup for a reader about to wait
      stop_.store(true);
    }
    cv_.SignalAll();
    if (reader_.joinable()) reader_.join();
  }

  StreamConsumerStats stats() const {
    StreamConsumerStats s;
    s.taken = taken_.value();
    s.reclaimed = reclaimed_.value();
    s.local = local_.value();
    s.done = done_.value();
    s.failed = failed_.value();
    s.dead = dead_.value();
    s.retried = retried_.value();
    s.connected = connected_.value() != 0;
    s.inflight = inflight_gauge_.value();
    MutexLock lock(mu_);
    for (size_t i = 0; i < models_.size(); ++i) {
      s.streams.push_back({models_[i].name, length_[i] ? length_[i]->value() : -1,
                           pending_[i] ? pending_[i]->value() : -1, trimmed_[i] ? trimmed_[i]->value() : 0});
    }
    return s;
  }

  const std::string& name() const { return options_.consumer; }
  bool Consumes(const std::string& model) const {
    return std::any_of(models_.begin(), models_.end(), [&](const Model& m) { return m.name == model; });
  }

 private:
  void Loop() {
    const Clock& clock = engine_->clock();
    auto backoff = std::chrono::milliseconds(50);
    int64_t next_claim_ns = clock.NowNs();
    int64_t next_stats_ns = next_claim_ns;
    const int64_t claim_every_ns = std::clamp<int64_t>(options_.claim_idle_ms / 4, 50, 5000) * 1'000'000;
    while (!stop_.load()) {
      if (!conn_ || conn_->broken()) {
        connected_.Set(0);
        Status s = Connect();
        if (!s.ok()) {
          if (s.message() != last_error_) {
            Log(LogLevel::kWarning, "job streams: " + s.message() + " (retrying)");
            last_error_ = s.message();
          }
          MutexLock lock(mu_);
          cv_.WaitFor(lock, clock, backoff, [&] { return stop_.load(); });
          backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
          continue;
        }
        last_error_.clear();
        backoff = std::chrono::milliseconds(50);
        connected_.Set(1);
      }
      const int64_t now = clock.NowNs();
      if (now >= next_stats_ns || acked_since_trim_.load(std::memory_order_relaxed) >= kTrimEveryAcks) {
        acked_since_trim_.store(0, std::memory_order_relaxed);
        Trim();
        UpdateStreamStats();
        next_stats_ns = now + 1'000'000'000;
      }
      if (now >= next_claim_ns) {
        Heartbeat();
        Reclaim();
        next_claim_ns = clock.NowNs() + claim_every_ns;
      }
      int slots = 0;
      {
        MutexLock lock(mu_);
        cv_.WaitFor(lock, clock, std::chrono::milliseconds(200),
                    [&]() QUERN_REQUIRES(mu_) { return stop_.load() || inflight_ < options_.max_inflight; });
        slots = options_.max_inflight - inflight_;
      }
      if (stop_.load() || slots <= 0) continue;
      // After an error reply, or while the engine refuses work (queue full):
      // wait instead of asking again at once.
      const int64_t pause_ns = pause_until_ns_.load(std::memory_order_relaxed);
      if (clock.NowNs() < pause_ns) {
        MutexLock lock(mu_);
        cv_.WaitUntil(lock, clock, pause_ns, [&] { return stop_.load(); });
        continue;
      }
      const int64_t until_claim_ms = (next_claim_ns - clock.NowNs()) / 1'000'000;
      const int64_t block = std::clamp<int64_t>(until_claim_ms, 1, options_.block_ms);
      Read(slots, block);
    }
  }

  Status Connect() {
    conn_.reset();
    auto c = RedisConnection::Connect(options_.redis);
    if (!c) return c.error();
    conn_ = std::move(*c);
    Status s = CreateGroups();
    if (!s.ok()) conn_.reset();  // try again after the backoff, not at once
    return s;
  }

  Status CreateGroups() {
    RedisPipeline p;
    for (const auto& m : models_) p.Add({"XGROUP", "CREATE", m.stream, options_.group, "0", "MKSTREAM"});
    auto r = conn_->Execute(p);
    if (!r) return r.error();
    for (const auto& reply : *r) {
      if (reply.is_error() && !reply.str.starts_with("BUSYGROUP")) {
        return Internal("redis XGROUP CREATE: " + reply.str);
      }
    }
    return Status::Ok();
  }

  // Whether model `m` may take more jobs: it holds fewer than the slots
  // left when every other model keeps a batch's worth (so one model's flood
  // or slow jobs never leave another model's stream unread).
  bool HasShareLocked(size_t m) const QUERN_REQUIRES(mu_) {
    int others = 0;
    for (size_t j = 0; j < models_.size(); ++j) {
      if (j != m) others += models_[j].count;
    }
    return model_inflight_[m] < std::max(models_[m].count, options_.max_inflight - others);
  }

  void Read(int slots, int64_t block_ms) {
    std::vector<size_t> open;  // the models with a share left
    {
      MutexLock lock(mu_);
      for (size_t m = 0; m < models_.size(); ++m) {
        if (HasShareLocked(m)) open.push_back(m);
      }
    }
    if (open.empty()) {
      MutexLock lock(mu_);
      cv_.WaitFor(lock, engine_->clock(), std::chrono::milliseconds(50), [&] { return stop_.load(); });
      return;
    }
    // A model at its share reads again soon after a job of its own ends.
    if (open.size() < models_.size()) block_ms = std::min<int64_t>(block_ms, 50);
    // COUNT applies to each stream read: together they stay within the
    // slots left.
    int count = 1;
    for (size_t m : open) count = std::max(count, models_[m].count);
    count = std::min(count, std::max(1, slots / static_cast<int>(open.size())));
    std::vector<std::string_view> args{"XREADGROUP", "GROUP", options_.group, options_.consumer, "COUNT"};
    const std::string count_s = std::to_string(count), block_s = std::to_string(block_ms);
    args.insert(args.end(), {count_s, "BLOCK", block_s, "STREAMS"});
    for (size_t m : open) args.push_back(models_[m].stream);
    for (size_t i = 0; i < open.size(); ++i) args.push_back(">");
    RedisPipeline p;
    p.Add(args);
    auto r = conn_->Execute(p, std::chrono::milliseconds(block_ms));
    if (!r) return;  // the connection is broken: the loop reconnects
    RedisReply& reply = r->front();
    if (reply.is_error()) {
      if (reply.str.starts_with("NOGROUP") && CreateGroups().ok()) return;  // a stream was deleted: made again
      // READONLY, NOPERM, WRONGTYPE, LOADING...: say so once, and back off.
      if (reply.str != last_error_) {
        Log(LogLevel::kWarning, "job streams: XREADGROUP: " + reply.str + " (backing off)");
        last_error_ = reply.str;
      }
      error_backoff_ = std::clamp(error_backoff_ * 2, std::chrono::milliseconds(100), std::chrono::milliseconds(2000));
      PauseFor(error_backoff_);
      return;
    }
    error_backoff_ = std::chrono::milliseconds(0);
    if (!reply.is_array()) return;  // timed out, nothing new
    // A group per model: entries finish (and their results are written)
    // with the others of their model, never held back by another model's
    // slow ones read in the same call.
    for (auto& stream : reply.elements) {
      if (!stream.is_array() || stream.elements.size() != 2) continue;
      const size_t model = ModelOf(stream.elements[0].str);
      if (model == models_.size()) continue;
      auto group = std::make_shared<Group>();
      for (auto& e : stream.elements[1].elements) {
        Entry entry;
        entry.model = model;
        if (ParseStreamEntry(e, entry)) group->entries.push_back(std::move(entry));
      }
      Dispatch(group);
    }
  }

  void PauseFor(std::chrono::milliseconds d) {
    const int64_t until = engine_->clock().NowNs() + std::chrono::nanoseconds(d).count();
    int64_t cur = pause_until_ns_.load(std::memory_order_relaxed);
    while (cur < until && !pause_until_ns_.compare_exchange_weak(cur, until, std::memory_order_relaxed)) {
    }
  }

  // Resets the idle time of the entries running here (XCLAIM ... JUSTID does
  // not count a delivery), so no other consumer takes over a job that is
  // only waiting in this instance's queue.
  void Heartbeat() {
    std::vector<std::vector<std::string>> per_model(models_.size());
    {
      MutexLock lock(mu_);
      for (const auto& key : mine_) {
        const auto space = key.find(' ');
        const size_t m = ModelOf(key.substr(0, space));
        if (m < models_.size()) per_model[m].push_back(key.substr(space + 1));
      }
    }
    RedisPipeline p;
    for (size_t m = 0; m < models_.size(); ++m) {
      if (per_model[m].empty()) continue;
      std::vector<std::string_view> args{"XCLAIM", models_[m].stream, options_.group, options_.consumer, "0"};
      for (const auto& id : per_model[m]) args.push_back(id);
      args.push_back("JUSTID");
      p.Add(args);
    }
    if (!p.empty()) (void)conn_->Execute(p);
  }

  // Takes over entries idle for claim_idle_ms (their consumer died, or a
  // transient failure left them pending), with their delivery counts.
  void Reclaim() {
    int slots;
    {
      MutexLock lock(mu_);
      slots = options_.max_inflight - inflight_;
    }
    if (slots <= 0) return;
    const std::string idle = std::to_string(options_.claim_idle_ms);
    const std::string count = std::to_string(std::max<size_t>(1, static_cast<size_t>(slots) / models_.size()));
    RedisPipeline p;
    for (const auto& m : models_) {
      p.Add({"XAUTOCLAIM", m.stream, options_.group, options_.consumer, idle, m.claim_cursor, "COUNT", count});
    }
    auto r = conn_->Execute(p);
    if (!r) return;
    auto group = std::make_shared<Group>();
    for (size_t i = 0; i < models_.size(); ++i) {
      RedisReply& reply = (*r)[i];
      if (reply.is_error()) {
        if (reply.str.starts_with("NOGROUP")) (void)CreateGroups();
        continue;
      }
      if (!reply.is_array() || reply.elements.size() < 2) continue;
      models_[i].claim_cursor = reply.elements[0].is_string() ? reply.elements[0].str : "0-0";
      for (auto& e : reply.elements[1].elements) {
        Entry entry;
        entry.model = i;
        if (!ParseStreamEntry(e, entry)) continue;  // deleted from the stream meanwhile
        {
          MutexLock lock(mu_);
          if (mine_.contains(models_[i].stream + " " + entry.entry_id)) continue;  // still running here
        }
        group->entries.push_back(std::move(entry));
      }
    }
    if (group->entries.empty()) return;
    RedisPipeline q;
    for (const auto& e : group->entries) {
      q.Add({"XPENDING", models_[e.model].stream, options_.group, e.entry_id, e.entry_id, "1"});
    }
    auto counts = conn_->Execute(q);
    if (!counts) return;  // not dispatched: they will be claimed again
    for (size_t i = 0; i < group->entries.size(); ++i) {
      const RedisReply& c = (*counts)[i];
      if (c.is_array() && !c.elements.empty() && c.elements[0].is_array() && c.elements[0].elements.size() == 4) {
        group->entries[i].deliveries = std::max<int64_t>(1, c.elements[0].elements[3].integer);
      }
    }
    reclaimed_.Increment(group->entries.size());
    // A group per model, as Read makes them.
    std::vector<std::shared_ptr<Group>> per_model(models_.size());
    for (auto& e : group->entries) {
      auto& g = per_model[e.model];
      if (!g) g = std::make_shared<Group>();
      g->entries.push_back(std::move(e));
    }
    for (const auto& g : per_model) {
      if (g) Dispatch(g);
    }
  }

  void UpdateStreamStats() {
    RedisPipeline p;
    for (const auto& m : models_) {
      p.Add({"XLEN", m.stream});
      p.Add({"XPENDING", m.stream, options_.group});
    }
    auto r = conn_->Execute(p);
    if (!r) return;
    MutexLock lock(mu_);
    for (size_t i = 0; i < models_.size(); ++i) {
      const RedisReply& len = (*r)[2 * i];
      const RedisReply& pend = (*r)[2 * i + 1];
      const MetricLabels labels = {{"model", models_[i].name}};
      if (len.type == RedisReply::Type::kInteger) {
        if (!length_[i]) length_[i] = &metrics_.AddGauge("quern_stream_length", kLengthHelp, labels);
        length_[i]->Set(len.integer);
      }
      if (pend.is_array() && !pend.elements.empty() && pend.elements[0].type == RedisReply::Type::kInteger) {
        if (!pending_[i]) pending_[i] = &metrics_.AddGauge("quern_stream_pending", kPendingHelp, labels);
        pending_[i]->Set(pend.elements[0].integer);
      }
    }
  }

  // Trims each stream below the oldest entry a consumer group still needs
  // (its oldest pending entry, else the one after the last delivered), and
  // keeps what was acknowledged within the last stream_retain_ms. The trim
  // is approximate (`~`: whole nodes of the stream), so its work is bounded
  // (at most 100 nodes a call) and a node's worth of entries may stay. A
  // stream no group reads is left alone.
  void Trim() {
    RedisPipeline groups;
    for (const auto& m : models_) groups.Add({"XINFO", "GROUPS", m.stream});
    auto infos = conn_->Execute(groups);
    if (!infos) return;
    // Per model: the lowest entry id some group still needs.
    std::vector<std::optional<EntryId>> floor(models_.size());
    RedisPipeline oldest;  // each group with entries pending: its oldest
    std::vector<size_t> oldest_model;
    for (size_t i = 0; i < models_.size(); ++i) {
      const RedisReply& info = (*infos)[i];
      if (!info.is_array() || info.elements.empty()) continue;  // no stream, or no group
      bool known = true;
      for (const RedisReply& g : info.elements) {
        std::string_view name, last;
        int64_t pending = -1;
        for (size_t k = 0; g.is_array() && k + 1 < g.elements.size(); k += 2) {
          const std::string_view key = g.elements[k].str;
          if (key == "name") name = g.elements[k + 1].str;
          if (key == "pending") pending = g.elements[k + 1].integer;
          if (key == "last-delivered-id") last = g.elements[k + 1].str;
        }
        const auto delivered = ParseEntryId(last);
        if (name.empty() || pending < 0 || !delivered) {
          known = false;
          break;
        }
        const EntryId next{delivered->ms, delivered->seq + 1};
        if (!floor[i] || next < *floor[i]) floor[i] = next;
        if (pending > 0) {
          oldest.Add({"XPENDING", models_[i].stream, name, "-", "+", "1"});
          oldest_model.push_back(i);
        }
      }
      if (!known) floor[i].reset();
    }
    if (!oldest.empty()) {
      auto firsts = conn_->Execute(oldest);
      if (!firsts) return;
      for (size_t k = 0; k < oldest_model.size(); ++k) {
        const RedisReply& r = (*firsts)[k];
        const size_t i = oldest_model[k];
        if (r.is_array() && r.elements.empty()) continue;  // acknowledged since: the delivered bound holds
        std::optional<EntryId> first;
        if (r.is_array() && r.elements[0].is_array() && !r.elements[0].elements.empty()) {
          first = ParseEntryId(r.elements[0].elements[0].str);
        }
        if (!first) {
          floor[i].reset();  // not known: not trimmed this time
        } else if (floor[i] && *first < *floor[i]) {
          floor[i] = first;
        }
      }
    }
    if (options_.stream_retain_ms > 0) {
      const int64_t keep_from = engine_->clock().WallMs() - options_.stream_retain_ms;
      const EntryId retained{static_cast<uint64_t>(std::max<int64_t>(keep_from, 0)), 0};
      for (auto& f : floor) {
        if (f && retained < *f) f = retained;
      }
    }
    RedisPipeline trim;
    std::vector<size_t> trimmed_model;
    for (size_t i = 0; i < models_.size(); ++i) {
      if (!floor[i]) continue;
      trim.Add({"XTRIM", models_[i].stream, "MINID", "~", floor[i]->ToString()});
      trimmed_model.push_back(i);
    }
    if (trim.empty()) return;
    auto counts = conn_->Execute(trim);
    if (!counts) return;
    MutexLock lock(mu_);
    for (size_t k = 0; k < trimmed_model.size(); ++k) {
      const RedisReply& r = (*counts)[k];
      const size_t i = trimmed_model[k];
      if (r.type != RedisReply::Type::kInteger) continue;
      if (!trimmed_[i]) {
        trimmed_[i] = &metrics_.AddCounter("quern_stream_trimmed_total", kTrimmedHelp, {{"model", models_[i].name}});
      }
      trimmed_[i]->Increment(static_cast<uint64_t>(std::max<int64_t>(r.integer, 0)));
    }
  }

  size_t ModelOf(const std::string& stream) const {
    for (size_t i = 0; i < models_.size(); ++i) {
      if (models_[i].stream == stream) return i;
    }
    return models_.size();
  }

  void Dispatch(const std::shared_ptr<Group>& group) {
    const size_t n = group->entries.size();
    if (n == 0) return;
    taken_.Increment(n);
    group->outcomes.resize(n);
    group->remaining.store(n);
    {
      MutexLock lock(mu_);
      inflight_ += static_cast<int>(n);
      inflight_gauge_.Set(inflight_);
      for (const auto& e : group->entries) {
        mine_.insert(models_[e.model].stream + " " + e.entry_id);
        ++model_inflight_[e.model];
      }
    }
    for (auto& e : group->entries) {
      if (!e.Field("body").empty()) continue;
      const std::string_view key = e.Field("body_key");
      if (key.empty()) continue;
      // Only this job's own key: an entry cannot make a consumer read (and
      // delete) another job's body, or any other key.
      const std::string& stream = models_[e.model].stream;
      const std::string_view id = e.Field("id");
      const std::string expected = StreamBodyKey(stream, id.empty() ? e.entry_id : std::string(id));
      if (key != expected) {
        e.problem = InvalidArgument("job stream entry " + e.entry_id + " of " + stream + ": body_key '" +
                                    std::string(key.substr(0, 128)) + "' is not this job's (" + expected + ")");
        continue;
      }
      e.body_key = key;
      if (options_.local && e.Field("tracked") == "1") {
        e.local = options_.local->Take(std::string(id));
        // Kept for this job of this model only (an id reused in another
        // model's stream reads its own body).
        if (e.local && e.local->request.model != models_[e.model].name) e.local.reset();
        if (e.local) {
          e.delete_body = true;  // written by this instance, a string
          local_.Increment();
        }
      }
    }
    Prepare(*group);
    for (size_t i = 0; i < n; ++i) Submit(group, i);
  }

  // A job accepted over HTTP (field `tracked`) has a record saying queued:
  // it now says running, unless the job was cancelled meanwhile (then the
  // entry is only acknowledged). An entry whose body is under body_key,
  // and not here already, gets it. One round trip for the group; if Redis
  // fails it, the entries it was for are left pending (not run).
  void Prepare(Group& group) {
    RedisPipeline p;
    enum class Ask { kStart, kCheck, kBody };
    std::vector<std::pair<size_t, Ask>> asked;
    std::vector<int> wanted(group.entries.size(), 0), answered(group.entries.size(), 0);  // replies, by entry
    std::vector<size_t> missing;  // entries whose body key is not there
    const int64_t now = engine_->clock().WallMs();
    for (size_t i = 0; i < group.entries.size(); ++i) {
      Entry& e = group.entries[i];
      // Every entry claims its job's record, one with a problem too (it is
      // stored as failed): one whose record is another owner's is neither
      // run nor stored (its record would replace theirs).
      auto rec = NewRecord(e);
      std::string running;
      if (e.problem.ok() && e.Field("tracked") == "1") {
        rec->state = JobState::kRunning;
        rec->started_ms = now;
        auto enc = RedisResultStore::Encode(*rec, store_->options());
        if (!enc) continue;
        running = std::move(enc->json);
      }
      p.Add({"EVAL", kClaimScript, "1", store_->options().key_prefix + rec->id, rec->owner, running});
      asked.emplace_back(i, running.empty() ? Ask::kCheck : Ask::kStart);
      ++wanted[i];
      e.unchecked = true;  // until Redis says
      if (!e.problem.ok()) continue;
      if (!e.body_key.empty() && !e.local) {
        p.Add({"GET", e.body_key});
        asked.emplace_back(i, Ask::kBody);
        ++wanted[i];
        e.unchecked = true;
      }
    }
    if (p.empty()) return;
    auto replies = conn_->Execute(p);
    if (!replies) return;  // none checked: left pending, taken again later
    for (size_t k = 0; k < asked.size(); ++k) {
      RedisReply& r = (*replies)[k];
      const auto [i, ask] = asked[k];
      Entry& e = group.entries[i];
      if (ask == Ask::kStart || ask == Ask::kCheck) {
        if (r.type != RedisReply::Type::kInteger) {
          // An error (NOPERM, scripting off, OOM...): an HTTP job's entry is
          // left unchecked (pending, taken again); any other runs, as entries
          // did before they were claimed.
          if (ask == Ask::kCheck) ++answered[i];
          continue;
        }
        if (r.integer == 0) e.cancelled = true;
        if (r.integer < 0) {
          // Acknowledged and not run: nothing is written under that job's id.
          e.cancelled = true;
          foreign_.Increment();
          Log(LogLevel::kWarning, "job stream entry " + e.entry_id + " of " + models_[e.model].stream + " names job '" +
                                      NewRecord(e)->id.substr(0, 64) +
                                      "', which another owner submitted: dropped, not run");
        }
      } else if (r.is_nil()) {
        missing.push_back(i);
      } else if (r.oversize >= 0) {
        e.oversize.emplace_back("body", r.oversize);
        e.delete_body = true;
      } else if (r.type == RedisReply::Type::kString) {
        e.fields.emplace_back("body", std::move(r.str));
        e.delete_body = true;
      } else if (r.is_error() && r.str.starts_with("WRONGTYPE")) {
        e.problem = FailedPrecondition("job stream entry " + e.entry_id + " of " + models_[e.model].stream +
                                       ": its body_key " + e.body_key + " holds something other than a body");
      } else {
        continue;  // an error (NOPERM, LOADING...): unchecked
      }
      ++answered[i];
    }
    for (size_t i = 0; i < group.entries.size(); ++i) {
      if (wanted[i] > 0 && answered[i] == wanted[i]) group.entries[i].unchecked = false;
    }
    if (!missing.empty()) Missing(group, missing);
  }

  // Entries whose body key is gone: a job that has finished (another
  // consumer ran it and deleted its body with its acknowledgement, before
  // this delivery) is acknowledged and left as it is; any other fails
  // saying its body is gone.
  void Missing(Group& group, const std::vector<size_t>& missing) {
    RedisPipeline p;
    for (size_t i : missing) p.Add({"GET", store_->options().key_prefix + NewRecord(group.entries[i])->id});
    auto replies = conn_->Execute(p);
    for (size_t k = 0; k < missing.size(); ++k) {
      Entry& e = group.entries[missing[k]];
      if (!replies) {
        e.unchecked = true;  // left pending, taken again later
        continue;
      }
      const RedisReply& r = (*replies)[k];
      if (r.type == RedisReply::Type::kString && (r.str.find(R"("status":"done")") != std::string::npos ||
                                                  r.str.find(R"("status":"failed")") != std::string::npos ||
                                                  r.str.find(R"("status":"cancelled")") != std::string::npos)) {
        e.cancelled = true;  // finished: acknowledged, not run
        continue;
      }
      e.problem = FailedPrecondition("job stream entry " + e.entry_id + " of " + models_[e.model].stream +
                                     ": its body (key " + e.body_key +
                                     ") is not in redis (deleted, or evicted: job streams need "
                                     "maxmemory-policy noeviction)");
    }
  }

  std::shared_ptr<JobRecord> NewRecord(const Entry& e) const {
    auto rec = std::make_shared<JobRecord>();
    const std::string_view id = e.Field("id");
    rec->id = id.empty() ? e.entry_id : std::string(id);
    rec->model = models_[e.model].name;
    rec->owner = std::string(e.Field("owner"));
    rec->submitted_ms = ParseInt64(std::string_view(e.entry_id).substr(0, e.entry_id.find('-')), 0);
    if (const int64_t from_id = JobIdSubmittedMs(rec->id); from_id > 0) rec->submitted_ms = from_id;
    return rec;
  }

  void Submit(const std::shared_ptr<Group>& group, size_t i) {
    const Entry& e = group->entries[i];
    if (e.cancelled || (e.unchecked && e.deliveries <= options_.max_deliveries)) {
      group->outcomes[i].kind = e.cancelled ? Kind::kSkipped : Kind::kLeft;
      if (group->remaining.fetch_sub(1) == 1) Complete(group);
      return;
    }
    auto rec = NewRecord(e);
    auto fail = [&](Status s) {
      rec->state = JobState::kFailed;
      rec->error = s;
      rec->finished_ms = engine_->clock().WallMs();
      Finish(group, i, std::move(rec), std::move(s));
    };
    if (e.deliveries > options_.max_deliveries) {
      // Every earlier delivery ended without a result: its consumer died
      // with it, or could not record it. Whatever the entry holds, it is
      // neither parsed nor run again.
      return fail(Internal("job stream entry " + e.entry_id + " of " + models_[e.model].stream + " was delivered " +
                           std::to_string(e.deliveries) + " times without finishing (limit " +
                           std::to_string(options_.max_deliveries) + ", --consume-max-deliveries)"));
    }
    if (!e.problem.ok()) return fail(e.problem);
    Result<StreamJob> job = Err(Internal("unset"));
    if (e.local) {
      job = StreamJob{};
      if (auto deadline = StreamEntryDeadline(e)) {
        job->deadline_ms = *deadline;
        job->infer = std::move(*group->entries[i].local);
      } else {
        job = Err(deadline.error());
      }
    } else {
      job = DecodeStreamJob(e, models_[e.model].name, models_[e.model].stream);
    }
    if (!job) return fail(job.error());
    const int64_t deadline_ms = job->deadline_ms;
    if (deadline_ms > 0 && deadline_ms <= engine_->clock().WallMs()) {
      return fail(DeadlineExceeded("job '" + rec->id + "' reached its deadline before it could run"));
    }
    rec->binary_default = job->infer.format.binary_default;
    rec->binary_outputs = std::move(job->infer.format.binary_outputs);
    InferRequest ir = std::move(job->infer.request);
    ir.metadata.emplace_back("request_id", rec->id);  // the engine's log lines name the job
    if (deadline_ms > 0) {
      // A date further away than the bound on queue timeouts (30 days)
      // counts as that far: a deadline_ms up to 2^63-1 parses, and its
      // distance in nanoseconds would overflow.
      constexpr auto kMaxAheadMs = static_cast<int64_t>(kMaxQueueTimeoutUs / 1000);
      const int64_t ahead_ms = std::min(deadline_ms - engine_->clock().WallMs(), kMaxAheadMs);
      ir.deadline_ns = engine_->clock().NowNs() + ahead_ms * 1'000'000;
    }
    auto started = std::make_shared<std::atomic<int64_t>>(0);
    SubmitOptions options;
    options.on_start = [started, clock = &engine_->clock()] { started->store(clock->WallMs()); };
    auto responses = JobResponses::Attach(ir);  // a decoupled model's, all kept
    InferCallback done = [self = shared_from_this(), group, i, rec, started, responses](InferResponse&& r) {
      rec->started_ms = started->load();
      rec->finished_ms = self->engine_->clock().WallMs();
      rec->version = r.version;
      responses->Fill(std::move(r), *rec);
      if (rec->state == JobState::kCancelled) rec->state = JobState::kFailed;  // (not by its owner)
      Status status = rec->state == JobState::kDone ? Status::Ok() : rec->error;
      self->Finish(group, i, rec, std::move(status));
    };
    if (Status st = engine_->InferAsync(std::move(ir), done, options); !st.ok()) fail(std::move(st));
  }

  void Finish(const std::shared_ptr<Group>& group, size_t i, std::shared_ptr<JobRecord> rec, Status status) {
    Outcome& out = group->outcomes[i];
    const Entry& e = group->entries[i];
    if (status.ok()) {
      out.kind = Kind::kDone;
    } else if (status.code() == StatusCode::kDeadlineExceeded ||
               (e.Field("tracked") == "1" && status.code() != StatusCode::kUnavailable)) {
      // (An HTTP job fails as its infer would: its client sees the error
      // and may submit again; only a full queue or a stop is retried.)
      out.kind = Kind::kFailed;
    } else if (Deterministic(status.code()) || e.deliveries >= options_.max_deliveries) {
      out.kind = e.Field("tracked") == "1" ? Kind::kFailed : Kind::kDead;
    } else {
      out.kind = Kind::kRetry;
      // The engine refused it (queue full, shutting down): read no more for a moment.
      if (status.code() == StatusCode::kUnavailable) PauseFor(std::chrono::milliseconds(50));
    }
    out.record = std::move(rec);
    if (group->remaining.fetch_sub(1) == 1) Complete(group);
  }

  // All entries of a group finished: store results, dead letters and
  // acknowledgements in one transaction.
  void Complete(const std::shared_ptr<Group>& group) {
    std::vector<std::shared_ptr<const JobRecord>> records;
    RedisPipeline extra;
    std::vector<std::string> settled;    // mine_ keys of entries acknowledged by this write
    std::vector<size_t> settled_models;  // and their models
    size_t retry = 0;
    for (size_t i = 0; i < group->entries.size(); ++i) {
      const Entry& e = group->entries[i];
      const Outcome& out = group->outcomes[i];
      const Model& m = models_[e.model];
      if (out.kind == Kind::kLeft) {
        ++retry;
        MutexLock lock(mu_);
        mine_.erase(m.stream + " " + e.entry_id);
        --model_inflight_[e.model];
        continue;
      }
      if (out.kind == Kind::kRetry) {
        ++retry;
        retried_.Increment();
        Log(LogLevel::kWarning,
            "job '" + out.record->id + "' (" + m.stream + ", delivery " + std::to_string(e.deliveries) + " of " +
                std::to_string(options_.max_deliveries) + ") failed, will be retried: " + out.record->error.message(),
            {{"job_id", out.record->id}, {"stream", m.stream}});
        MutexLock lock(mu_);
        mine_.erase(m.stream + " " + e.entry_id);
        --model_inflight_[e.model];
        continue;
      }
      // Its body goes with it (a dead letter holds a copy).
      if (e.delete_body) extra.Add({"DEL", e.body_key});
      if (out.kind == Kind::kSkipped) {  // cancelled or finished: its record says so already
        extra.Add({"XACK", m.stream, options_.group, e.entry_id});
        cancelled_.Increment();
        settled.push_back(m.stream + " " + e.entry_id);
        settled_models.push_back(e.model);
        continue;
      }
      if (out.kind == Kind::kDead) {
        const std::string deliveries = std::to_string(e.deliveries);
        extra.Add({"XADD", m.dead, "*", "id", out.record->id, "entry", e.entry_id, "error", out.record->error.message(),
                   "code", StatusCodeName(out.record->error.code()), "deliveries", deliveries, "consumer",
                   options_.consumer, "body", e.Field("body"), "header_length", e.Field("header_length")});
        dead_.Increment();
      }
      extra.Add({"XACK", m.stream, options_.group, e.entry_id});
      (out.kind == Kind::kDone ? done_ : failed_).Increment();
      settled.push_back(m.stream + " " + e.entry_id);
      settled_models.push_back(e.model);
      records.push_back(out.record);
    }
    if (retry > 0) {
      MutexLock lock(mu_);
      inflight_ -= static_cast<int>(retry);
      inflight_gauge_.Set(inflight_);
    }
    cv_.SignalAll();
    if (settled.empty()) return;
    const int n = static_cast<int>(settled.size());
    store_->Put(std::move(records), std::move(extra),
                [self = shared_from_this(), n, settled = std::move(settled), models = std::move(settled_models)](bool) {
                  {
                    MutexLock lock(self->mu_);
                    self->inflight_ -= n;
                    self->inflight_gauge_.Set(self->inflight_);
                    for (const auto& k : settled) self->mine_.erase(k);
                    for (size_t m : models) --self->model_inflight_[m];
                  }
                  self->acked_since_trim_.fetch_add(n, std::memory_order_relaxed);
                  self->cv_.SignalAll();
                });
  }

  StreamConsumerOptions options_;
  Engine* engine_;
  RedisResultStore* store_;
  std::unique_ptr<MetricsRegistry> own_metrics_;
  MetricsRegistry& metrics_;
  Counter& taken_;
  Counter& local_;
  Counter& reclaimed_;
  Counter& done_;
  Counter& failed_;
  Counter& dead_;
  Counter& retried_;
  Counter& cancelled_;
  Counter& foreign_;
  Gauge& inflight_gauge_;                       // inflight_, set with mu_ held
  Gauge& connected_;                            // 0 or 1
  std::vector<Model> models_;                   // fixed after Init
  std::unique_ptr<RedisConnection> conn_;       // reader thread only
  std::string last_error_;                      // reader thread only
  std::chrono::milliseconds error_backoff_{0};  // reader thread only
  std::atomic<int64_t> pause_until_ns_{0};      // engine clock: no reads before
  mutable Mutex mu_;
  CondVar cv_;
  int inflight_ QUERN_GUARDED_BY(mu_) = 0;
  std::vector<int> model_inflight_ QUERN_GUARDED_BY(mu_);       // inflight_ by model
  std::unordered_set<std::string> mine_ QUERN_GUARDED_BY(mu_);  // "stream entry-id" in flight here
  // Each model's XLEN and XPENDING gauges, by index in models_; null until
  // Redis has answered.
  std::vector<Gauge*> length_ QUERN_GUARDED_BY(mu_);
  std::vector<Gauge*> pending_ QUERN_GUARDED_BY(mu_);
  std::vector<Counter*> trimmed_ QUERN_GUARDED_BY(mu_);  // quern_stream_trimmed_total, once trimmed
  std::atomic<bool> stop_{false};
  std::atomic<int> acked_since_trim_{0};  // entries acknowledged since the last trim
  std::thread reader_;
};

StreamConsumer::StreamConsumer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

StreamConsumer::~StreamConsumer() {
  Stop();
}

Result<std::unique_ptr<StreamConsumer>> StreamConsumer::Start(StreamConsumerOptions options, Engine* engine,
                                                              RedisResultStore* store) {
  options.redis.max_bulk_bytes = options.max_entry_bytes;
  auto impl = std::make_shared<Impl>(std::move(options), engine, store);
  if (Status s = impl->Init(); !s.ok()) return Err(s);
  impl->Run();
  return std::unique_ptr<StreamConsumer>(new StreamConsumer(std::move(impl)));
}

void StreamConsumer::Stop() {
  impl_->Stop();
}

StreamConsumerStats StreamConsumer::stats() const {
  return impl_->stats();
}

const std::string& StreamConsumer::consumer_name() const {
  return impl_->name();
}

bool StreamConsumer::Consumes(const std::string& model) const {
  return impl_->Consumes(model);
}

}  // namespace quern
