#include "store/redis_store.h"

#include <rapidjson/document.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>

#include "core/cpus.h"
#include "core/json.h"
#include "core/log.h"
#include "protocol/kserve_codec.h"
#include "store/job_json.h"

namespace quern {

namespace {

constexpr const char* kNotYet = "redis: not connected yet";

// JSON can carry these exactly; the rest go as binary values. BYTES
// elements go as JSON strings when every one is UTF-8 (labels, OCR text:
// readable with any Redis client), else as a binary value.
bool JsonFriendly(const Tensor& t) {
  switch (t.dtype()) {
    case DataType::kFp16:
    case DataType::kBf16:
    case DataType::kInvalid: return false;
    case DataType::kBytes: {
      auto strs = t.Strings();
      return strs && std::all_of(strs->begin(), strs->end(), [](std::string_view s) { return IsUtf8(s); });
    }
    default: return true;
  }
}

std::string BinaryKey(const RedisResultStoreOptions& o, const std::string& id, size_t k) {
  return o.key_prefix + id + ":bin:" + std::to_string(k);
}

}  // namespace

Result<RedisResultStore::Encoded> RedisResultStore::Encode(const JobRecord& rec, const RedisResultStoreOptions& o) {
  KServeOutputFormat format;  // binary: what JSON cannot carry exactly, or would bloat
  auto choose = [&](const NamedTensor& t) {
    const bool binary = t.tensor.byte_size() > o.inline_max_bytes || !JsonFriendly(t.tensor);
    // A decoupled model's responses share names: binary when any of them needs it.
    for (auto& [name, b] : format.binary_outputs) {
      if (name == t.name) {
        b = b || binary;
        return;
      }
    }
    format.binary_outputs.emplace_back(t.name, binary);
  };
  for (const auto& t : rec.outputs) choose(t);
  for (const auto& response : rec.responses) {
    for (const auto& t : response) choose(t);
  }
  rapidjson::StringBuffer buf;
  JsonWriter w(buf);
  std::vector<const Tensor*> parts;
  QUERN_RETURN_IF_ERROR(
      WriteJobJson(w, rec, JobJsonForm::kStored, format, parts, [&](size_t k) { return BinaryKey(o, rec.id, k); }));
  Encoded out;
  out.json.assign(buf.GetString(), buf.GetSize());
  for (size_t k = 0; k < parts.size(); ++k) {
    out.binary.emplace_back(BinaryKey(o, rec.id, k),
                            std::string_view(reinterpret_cast<const char*>(parts[k]->data()), parts[k]->byte_size()));
  }
  return out;
}

Result<std::shared_ptr<const JobRecord>> RedisResultStore::Decode(std::string_view json,
                                                                  const std::vector<std::string>& binary) {
  return ReadStoredJobJson(json, binary);
}

RedisResultStore::RedisResultStore(RedisResultStoreOptions options)
    : options_(std::move(options)),
      own_metrics_(options_.metrics ? nullptr : std::make_unique<MetricsRegistry>()),
      metrics_(options_.metrics ? *options_.metrics : *own_metrics_),
      writes_(metrics_.AddCounter("quern_redis_writes_total", "MULTI/EXEC round trips that wrote job results.")),
      records_written_(metrics_.AddCounter("quern_redis_results_written_total", "Job results written to Redis.")),
      write_errors_(
          metrics_.AddCounter("quern_redis_write_errors_total", "Result writes that failed and were retried.")),
      reconnects_(
          metrics_.AddCounter("quern_redis_reconnects_total", "Connections to Redis made again after a failure.")),
      unreplicated_(metrics_.AddCounter(
          "quern_redis_unreplicated_writes_total",
          "Result writes that fewer replicas than wait_replicas confirmed within wait_timeout_ms (written all the "
          "same; a failover before they replicate would lose them).")),
      connected_(
          metrics_.AddGauge("quern_redis_connected", "1 while the job result store's connection to Redis is up.")),
      backlog_(metrics_.AddGauge("quern_redis_backlog", "Job results held in memory, waiting to be written to Redis.")),
      backlog_bytes_(
          metrics_.AddGauge("quern_redis_backlog_bytes", "Bytes of job results waiting to be written to Redis.")) {
  if (!options_.clock) options_.clock = &RealClockInstance();
  // Every reply this store reads is bounded by what a result may hold.
  options_.redis.max_bulk_bytes = options_.max_value_bytes > 0 ? options_.max_value_bytes : options_.max_backlog_bytes;
  health_ = Unavailable(kNotYet);
  writer_ = std::thread([this] {
    NameThisThread("quern-redis");
    WriterLoop();
  });
}

RedisResultStore::~RedisResultStore() {
  Flush(std::chrono::seconds(5));
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  writer_.join();
  MutexLock lock(mu_);
  if (!unwritten_.empty()) {
    Log(LogLevel::kError, std::to_string(unwritten_.size()) + " job results could not be written to redis at " +
                              options_.redis.Address() + " before exit");
  }
}

void RedisResultStore::Put(std::vector<std::shared_ptr<const JobRecord>> records) {
  Put(std::move(records), RedisPipeline(), nullptr);
}

void RedisResultStore::Put(std::vector<std::shared_ptr<const JobRecord>> records, RedisPipeline extra,
                           std::function<void(bool written)> on_written) {
  Batch b;
  for (const auto& r : records) b.bytes += r->ByteSize();
  b.bytes += extra.bytes();
  b.records = std::move(records);
  b.extra = std::move(extra);
  b.on_written = std::move(on_written);
  Queue(std::move(b));
}

void RedisResultStore::Queue(Batch b) {
  {
    MutexLock lock(mu_);
    if (b.submission && writes_failing_) {
      // Redis failed the last write: refused now, not after the retries.
      lock.Unlock();
      b.on_written(false);
      return;
    }
    for (const auto& r : b.records) unwritten_[r->id] = r;
    backlog_bytes_held_ += b.bytes;
    backlog_.Set(static_cast<int64_t>(unwritten_.size()));
    backlog_bytes_.Set(static_cast<int64_t>(backlog_bytes_held_));
    ++queued_seq_;
    queue_.push_back(std::move(b));
  }
  cv_.Signal();
}

Status RedisResultStore::EnsureConnected(std::unique_ptr<RedisConnection>& conn, bool count_reconnect) {
  if (conn && !conn->broken()) return Status::Ok();
  conn.reset();
  auto c = RedisConnection::Connect(options_.redis);
  if (!c) return c.error();
  conn = std::move(*c);
  if (count_reconnect) reconnects_.Increment();
  return Status::Ok();
}

namespace {

// UNAVAILABLE unless `replies` (MULTI, the commands, EXEC) are what Redis
// answers a transaction that ran: the job is not counted as written.
Status CheckTransactionReplies(const std::vector<RedisReply>& replies, const std::string& address) {
  const auto garbage = [&](const std::string& what) {
    return Unavailable("redis at " + address + " answered a transaction with " + what +
                       ", which Redis never does; the results are not counted as written");
  };
  if (replies.size() < 2) return garbage("too few replies");
  const RedisReply& multi = replies.front();
  if (multi.type != RedisReply::Type::kStatus || multi.str != "OK") return garbage("something else than +OK to MULTI");
  const size_t queued = replies.size() - 2;
  for (size_t i = 1; i + 1 < replies.size(); ++i) {
    if (replies[i].type != RedisReply::Type::kStatus || replies[i].str != "QUEUED") {
      return garbage("something else than +QUEUED to a queued command");
    }
  }
  const RedisReply& exec = replies.back();
  if (!exec.is_array() || exec.elements.size() != queued) {
    return garbage("an EXEC reply that is not an array of " + std::to_string(queued) + " replies");
  }
  return Status::Ok();
}

}  // namespace

Status RedisResultStore::Write(std::vector<Batch>& batches) {
  RedisPipeline p;
  p.Add({"MULTI"});
  const std::string ttl_ms = std::to_string(options_.ttl_s * 1000);
  for (Batch& b : batches) {
    b.commands.clear();
    b.failed = false;
    const size_t first = p.size() - 1;  // (EXEC's answers leave MULTI out)
    for (const auto& r : b.records) {
      auto enc = Encode(*r, options_);
      // A value longer than reads take would be written and never read
      // back: the job fails saying so instead.
      if (enc && options_.redis.max_bulk_bytes > 0) {
        size_t largest = enc->json.size();
        for (const auto& [k, v] : enc->binary) largest = std::max(largest, v.size());
        if (largest > options_.redis.max_bulk_bytes) {
          enc = Err(ResourceExhausted("the result holds a value of " + std::to_string(largest) +
                                      " bytes, more than the job store keeps (" +
                                      std::to_string(options_.redis.max_bulk_bytes) + ", --job-store-max-bytes)"));
        }
      }
      if (!enc) {
        // Cannot happen for records the engine produced; never block the
        // queue on one: store the reason instead.
        JobRecord failed = *r;
        failed.outputs.clear();
        failed.state = JobState::kFailed;
        failed.error = Internal("the result could not be stored: " + enc.error().message());
        enc = Encode(failed, options_);
        if (!enc) return enc.error();
      }
      const std::string key = options_.key_prefix + r->id;
      // A queued job's record lives as long as the job waits; a finished
      // one, the result's time to live.
      if (options_.ttl_s > 0 && r->finished()) {
        p.Add({"SET", key, enc->json, "PX", ttl_ms});
        for (const auto& [k, v] : enc->binary) p.Add({"SET", k, v, "PX", ttl_ms});
      } else {
        p.Add({"SET", key, enc->json});
        for (const auto& [k, v] : enc->binary) p.Add({"SET", k, v});
      }
    }
    b.commands.emplace_back(first, p.size() - 1);
  }
  for (Batch& b : batches) {
    const size_t first = p.size() - 1;
    p.Append(b.extra);
    b.commands.emplace_back(first, p.size() - 1);
  }
  p.Add({"EXEC"});
  // With replicas to wait for, the results count as written (and their
  // stream entries as acknowledged, in the same transaction) only once the
  // replicas have them or the wait timed out.
  const int wait = options_.redis.wait_replicas;
  const std::string wait_n = std::to_string(wait), wait_ms = std::to_string(options_.redis.wait_timeout.count());
  if (wait > 0) p.Add({"WAIT", wait_n, wait_ms});
  std::unique_ptr<RedisConnection>& conn = writer_conn_;
  if (Status s = EnsureConnected(conn, ever_connected_.load()); !s.ok()) return s;
  ever_connected_.store(true);
  connected_.Set(1);
  auto replies = conn->Execute(p, wait > 0 ? options_.redis.wait_timeout : std::chrono::milliseconds(0));
  if (!replies) {
    connected_.Set(0);
    return replies.error();
  }
  if (wait > 0) {
    const RedisReply& acked = replies->back();
    const bool short_of = !acked.is_error() && acked.integer < wait;
    if (short_of || acked.is_error()) {
      unreplicated_.Increment();
      if (!unreplicated_logged_) {
        Log(LogLevel::kWarning, "redis at " + options_.redis.Address() + ": job results written but " +
                                    (acked.is_error() ? "WAIT failed: " + acked.str
                                                      : "only " + std::to_string(acked.integer) + " of " + wait_n +
                                                            " replicas confirmed them within " + wait_ms + " ms") +
                                    " (said once until replicas confirm again)");
        unreplicated_logged_ = true;
      }
    } else if (unreplicated_logged_) {
      Log(LogLevel::kInfo, "redis at " + options_.redis.Address() + ": replicas confirm job results again");
      unreplicated_logged_ = false;
    }
    replies->pop_back();
  }
  const RedisReply& exec = replies->back();
  if (exec.is_error() || exec.is_nil()) {
    std::string why = exec.is_nil() ? "transaction aborted" : exec.str;
    for (const RedisReply& r : *replies) {
      if (r.is_error()) {
        why = r.str;
        break;
      }
    }
    // Errors that pass (memory, loading, failover) are retried; others
    // (permissions, sizes) would fail again and again.
    const bool transient = why.starts_with("OOM") || why.starts_with("LOADING") || why.starts_with("READONLY") ||
                           why.starts_with("TRYAGAIN") || why.starts_with("BUSY") || why.starts_with("MASTERDOWN") ||
                           why.starts_with("CLUSTERDOWN") || why == "transaction aborted";
    const std::string message = "redis at " + options_.redis.Address() + " refused the write: " + why;
    return transient ? Unavailable(message) : FailedPrecondition(message);
  }
  // What Redis answers a transaction: +OK to MULTI, +QUEUED to each command,
  // and EXEC an array of their replies. Anything else (a proxy or a server
  // speaking something else) wrote nothing we can count on.
  if (Status st = CheckTransactionReplies(*replies, options_.redis.Address()); !st.ok()) return st;
  // A command inside the transaction can fail on its own (e.g. WRONGTYPE on
  // a key that is not a stream): the rest took effect; say so.
  if (exec.is_array()) {
    for (const RedisReply& r : exec.elements) {
      if (r.is_error()) {
        Log(LogLevel::kError,
            "redis at " + options_.redis.Address() + ": a command written with job results failed: " + r.str);
        break;
      }
    }
    // A submission with a failed command (its XADD: the stream key holds
    // something else) was not accepted.
    RedisPipeline undo;
    for (Batch& b : batches) {
      if (!b.submission) continue;
      for (const auto& [from, to] : b.commands) {
        for (size_t i = from; i < to && i < exec.elements.size(); ++i)
          b.failed = b.failed || exec.elements[i].is_error();
      }
      if (b.failed) undo.Append(b.undo);
    }
    // What such a submission did write (its queued record, its body) goes:
    // a client told it was not accepted may submit again, and nothing would
    // ever delete them. Best effort: a failure here leaves them as before.
    if (!undo.empty()) (void)conn->Execute(undo);
  }
  return Status::Ok();
}

void RedisResultStore::WriterLoop() {
  auto backoff = std::chrono::milliseconds(50);
  constexpr size_t kMaxWriteBytes = size_t{64} << 20;
  std::vector<Batch> batches;
  MutexLock lock(mu_);
  while (true) {
    if (batches.empty()) {
      // Idle: check the connection every second, so readiness tells the
      // truth before the next write needs it.
      if (!cv_.WaitFor(lock, *options_.clock, health_ok_since_write_ ? std::chrono::milliseconds(1000) : backoff,
                       [&]() QUERN_REQUIRES(mu_) { return stop_ || !queue_.empty(); })) {
        lock.Unlock();
        Status s = Ping();
        lock.Lock();
        SetHealthLocked(s);
        writes_failing_ = !s.ok();
        if (s.ok()) {
          backoff = std::chrono::milliseconds(50);
        } else {
          backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
        }
        continue;
      }
      if (queue_.empty()) {
        if (stop_) break;
        continue;
      }
      size_t bytes = 0;
      while (!queue_.empty() && (batches.empty() || bytes + queue_.front().bytes <= kMaxWriteBytes)) {
        bytes += queue_.front().bytes;
        batches.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    lock.Unlock();
    Status s = Write(batches);
    lock.Lock();
    if (s.code() == StatusCode::kFailedPrecondition) {
      write_errors_.Increment();
      if (batches.size() > 1) {
        // Find the batch Redis will not take: write them one at a time.
        for (size_t i = batches.size(); i-- > 1;) queue_.push_front(std::move(batches[i]));
        batches.resize(1);
        continue;
      }
      // This one can never be written: give it up rather than hold every
      // later result behind it.
      size_t n = batches[0].records.size();
      Log(LogLevel::kError, std::to_string(n) + " job result(s) dropped (first: " +
                                (n > 0 ? batches[0].records[0]->id : std::string("-")) + "): " + s.message());
      Settle(batches, /*written=*/false);
      continue;
    }
    if (!s.ok()) {
      write_errors_.Increment();
      SetHealthLocked(s);
      // Submissions (these and those queued meanwhile) are refused now;
      // results are kept for the next try.
      writes_failing_ = true;
      std::vector<Batch> refused;
      for (auto& b : batches) {
        if (b.submission) refused.push_back(std::move(b));
      }
      std::erase_if(batches, [](const Batch& b) { return b.submission; });
      for (auto& b : queue_) {
        if (b.submission) refused.push_back(std::move(b));
      }
      std::erase_if(queue_, [](const Batch& b) { return b.submission; });
      if (!refused.empty()) Settle(refused, /*written=*/false);
      if (batches.empty()) continue;
      if (stop_) break;
      // Keep the batches; try again after the backoff (a stop wakes it).
      cv_.WaitFor(lock, *options_.clock, backoff, [&]() QUERN_REQUIRES(mu_) { return stop_; });
      backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
      continue;
    }
    SetHealthLocked(Status::Ok());
    writes_failing_ = false;
    backoff = std::chrono::milliseconds(50);
    writes_.Increment();
    Settle(batches, /*written=*/true);
  }
}

void RedisResultStore::Settle(std::vector<Batch>& batches, bool written) {
  std::vector<std::function<void(bool)>> callbacks;
  for (Batch& b : batches) {
    if (written) records_written_.Increment(b.records.size());
    for (const auto& r : b.records) {
      auto it = unwritten_.find(r->id);
      if (it != unwritten_.end() && it->second == r) unwritten_.erase(it);
    }
    backlog_bytes_held_ -= b.bytes;
    backlog_.Set(static_cast<int64_t>(unwritten_.size()));
    backlog_bytes_.Set(static_cast<int64_t>(backlog_bytes_held_));
    ++written_seq_;
    if (b.on_written) {
      if (written && b.failed) {
        callbacks.push_back([cb = std::move(b.on_written)](bool) { cb(false); });
      } else {
        callbacks.push_back(std::move(b.on_written));
      }
    }
  }
  batches.clear();
  written_cv_.SignalAll();
  if (!callbacks.empty()) {
    mu_.Unlock();
    for (auto& cb : callbacks) cb(written);
    mu_.Lock();
  }
}

Status RedisResultStore::Ping() {
  if (Status s = EnsureConnected(writer_conn_, ever_connected_.load()); !s.ok()) {
    connected_.Set(0);
    return s;
  }
  ever_connected_.store(true);
  auto r = writer_conn_->Command({"PING"});
  connected_.Set(r.has_value() ? 1 : 0);
  return r ? Status::Ok() : r.error();
}

void RedisResultStore::SetHealthLocked(const Status& s) {
  if (!s.ok() && (health_.ok() || health_.message() != s.message())) {
    Log(LogLevel::kWarning, "job results wait in memory: " + s.message());
  } else if (s.ok() && !health_.ok() && health_.message() != kNotYet) {
    Log(LogLevel::kInfo, "redis at " + options_.redis.Address() + " is reachable again");
  }
  health_ = s;
  health_ok_since_write_ = s.ok();
}

bool RedisResultStore::Flush(std::chrono::milliseconds timeout) {
  MutexLock lock(mu_);
  const uint64_t target = queued_seq_;
  return written_cv_.WaitFor(lock, *options_.clock, timeout,
                             [&]() QUERN_REQUIRES(mu_) { return written_seq_ >= target; });
}

void RedisResultStore::Enqueue(std::shared_ptr<const JobRecord> queued, const StreamSubmission& submission,
                               std::function<void(Status)> done) {
  std::vector<std::string_view> xadd{"XADD", submission.stream, "*"};
  for (const auto& [k, v] : submission.fields) xadd.insert(xadd.end(), {k, v});
  RedisPipeline extra;
  // A large value is sent from where it is; a small one is copied (a piece
  // of its own would cost a write, a TLS record, of its own).
  constexpr size_t kViewFrom = 4096;
  if (!submission.value_key.empty()) {
    if (submission.value_owner && submission.value.size() >= kViewFrom) {
      extra.AddViewing({"SET", submission.value_key}, submission.value, submission.value_owner);
    } else {
      extra.Add({"SET", submission.value_key, submission.value});
    }
  }
  extra.Add(xadd);
  const std::string id = queued->id;
  Batch b;
  b.bytes = queued->ByteSize() + extra.bytes();
  b.records = {std::move(queued)};
  b.extra = std::move(extra);
  b.submission = true;
  b.undo.Add({"DEL", options_.key_prefix + b.records[0]->id});
  if (!submission.value_key.empty()) b.undo.Add({"DEL", submission.value_key});
  b.on_written = [done = std::move(done), id, address = options_.redis.Address()](bool written) {
    done(written ? Status::Ok()
                 : Unavailable("the job could not be written to redis at " + address + "; it was not accepted"));
  };
  Queue(std::move(b));
}

// Sets a queued job's record to `ARGV[1]` (cancelled) if it is still queued;
// answers the record's status before.
constexpr char kCancelScript[] = R"lua(
local v = redis.call('GET', KEYS[1])
if not v then return 'missing' end
if string.find(v, '"status":"queued"', 1, true) then
  if tonumber(ARGV[2]) > 0 then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  else
    redis.call('SET', KEYS[1], ARGV[1])
  end
  return 'queued'
end
return 'not queued'
)lua";

Status RedisResultStore::CancelQueued(std::shared_ptr<const JobRecord> cancelled) {
  auto enc = Encode(*cancelled, options_);
  if (!enc) return enc.error();
  MutexLock lock(read_mu_);
  if (Status s = EnsureConnected(reader_, false); !s.ok()) {
    return Unavailable("job results are kept in redis, which cannot be reached now: " + s.message());
  }
  auto reply = reader_->Command({"EVAL", kCancelScript, "1", options_.key_prefix + cancelled->id, enc->json,
                                 std::to_string(options_.ttl_s * 1000)});
  if (!reply) return Unavailable("job results are kept in redis, which failed: " + reply.error().message());
  if (reply->is_error()) return Unavailable("redis refused the cancel: " + reply->str);
  if (reply->str == "queued") return Status::Ok();
  if (reply->str == "missing") return NotFound("no job '" + cancelled->id + "'");
  return FailedPrecondition("job '" + cancelled->id + "' is no longer queued");
}

Result<std::shared_ptr<const JobRecord>> RedisResultStore::Get(const std::string& id) {
  using Err = std::unexpected<Status>;
  {
    MutexLock lock(mu_);
    if (auto it = unwritten_.find(id); it != unwritten_.end()) return it->second;
  }
  MutexLock lock(read_mu_);
  if (!reader_ || reader_->broken()) {
    // While Redis is away, answer at once rather than have every poll wait
    // for a connect timeout: one attempt per second.
    const int64_t now = options_.clock->NowNs();
    if (reader_failed_at_ns_ != 0 && now - reader_failed_at_ns_ < 1'000'000'000) {
      return Err(Unavailable("job results are kept in redis, which cannot be reached now: " + reader_error_));
    }
    if (Status s = EnsureConnected(reader_, false); !s.ok()) {
      reader_failed_at_ns_ = now;
      reader_error_ = s.message();
      return Err(Unavailable("job results are kept in redis, which cannot be reached now: " + s.message()));
    }
  }
  auto missing = [&]() -> Result<std::shared_ptr<const JobRecord>> {
    const int64_t submitted = JobIdSubmittedMs(id);
    if (submitted >= 0 && options_.ttl_s > 0 && options_.clock->WallMs() - submitted >= options_.ttl_s * 1000) {
      return Err(NotFound("the result of job '" + id + "' expired (results are kept " + std::to_string(options_.ttl_s) +
                          " s)"));
    }
    return Err(NotFound("no job '" + id + "'"));
  };
  auto reply = reader_->Command({"GET", options_.key_prefix + id});
  if (!reply) return Err(Unavailable("job results are kept in redis, which failed: " + reply.error().message()));
  if (reply->is_nil()) return missing();
  if (!reply->is_string()) return Err(Internal("redis key " + options_.key_prefix + id + " is not a job result"));
  const auto oversize = [&](const RedisReply& r) {
    return Err(Internal("redis key " + options_.key_prefix + id + " holds " + std::to_string(r.oversize) +
                        " bytes, more than a job result here may (" + std::to_string(options_.redis.max_bulk_bytes) +
                        "); it was not read"));
  };
  if (reply->oversize >= 0) return oversize(*reply);
  std::vector<std::string> binary;
  {
    rapidjson::Document doc;
    if (JsonParseError bad; ParseJson(doc, reply->str.data(), reply->str.size(), bad) && doc.IsObject()) {
      if (auto it = doc.FindMember("binary_keys"); it != doc.MemberEnd() && it->value.IsArray() && !it->value.Empty()) {
        RedisPipeline p;
        std::vector<std::string_view> args{"MGET"};
        for (const auto& k : it->value.GetArray()) {
          if (k.IsString()) args.emplace_back(k.GetString(), k.GetStringLength());
        }
        p.Add(args);
        auto parts = reader_->Execute(p);
        if (!parts) return Err(Unavailable("job results are kept in redis, which failed: " + parts.error().message()));
        const RedisReply& arr = parts->front();
        if (!arr.is_array()) return Err(Internal("redis MGET: " + arr.str));
        for (const RedisReply& e : arr.elements) {
          if (e.is_nil()) return missing();  // expired between the two reads
          if (e.oversize >= 0) return oversize(e);
          binary.push_back(e.str);
        }
      }
    }
  }
  return Decode(reply->str, binary);
}

Status RedisResultStore::Health() const {
  MutexLock lock(mu_);
  return health_;
}

Status RedisResultStore::CanAccept() const {
  MutexLock lock(mu_);
  if (backlog_bytes_held_ > options_.max_backlog_bytes) {
    return Unavailable("job results are waiting for redis (" + std::to_string(backlog_bytes_held_ >> 20) +
                       " MiB held in memory, the limit): no new jobs until it is back. " + health_.message());
  }
  return Status::Ok();
}

RedisStoreStats RedisResultStore::stats() const {
  RedisStoreStats s;
  s.writes = writes_.value();
  s.records_written = records_written_.value();
  s.write_errors = write_errors_.value();
  s.reconnects = reconnects_.value();
  s.connected = connected_.value() != 0;
  s.backlog = backlog_.value();
  s.backlog_bytes = backlog_bytes_.value();
  return s;
}

}  // namespace quern
