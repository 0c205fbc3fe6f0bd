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
#include "protocol/kserve_codec.h"

namespace quern {

namespace {

using Writer = rapidjson::Writer<rapidjson::StringBuffer>;

void String(Writer& w, std::string_view s) {
  w.String(s.data(), static_cast<rapidjson::SizeType>(s.size()));
}

constexpr const char* kNotYet = "redis: not connected yet";

// JSON can carry these exactly; the rest go as binary values.
bool JsonFriendly(DataType t) {
  return t != DataType::kBytes && t != DataType::kFp16 && t != DataType::kBf16 && t != DataType::kInvalid;
}

std::string BinaryKey(const RedisResultStoreOptions& o, const std::string& id, size_t k) {
  return o.key_prefix + id + ":bin:" + std::to_string(k);
}

int64_t Int(const rapidjson::Value& v, const char* key) {
  auto it = v.FindMember(key);
  return it != v.MemberEnd() && it->value.IsInt64() ? it->value.GetInt64() : 0;
}

std::string Str(const rapidjson::Value& v, const char* key) {
  auto it = v.FindMember(key);
  return it != v.MemberEnd() && it->value.IsString() ? std::string(it->value.GetString(), it->value.GetStringLength())
                                                     : std::string();
}

}  // namespace

Result<RedisResultStore::Encoded> RedisResultStore::Encode(const JobRecord& rec, const RedisResultStoreOptions& o) {
  rapidjson::StringBuffer buf;
  Writer w(buf);
  w.StartObject();
  w.Key("job_id");
  String(w, rec.id);
  w.Key("status");
  String(w, JobStateName(rec.state));
  w.Key("model_name");
  String(w, rec.model);
  w.Key("model_version");
  String(w, std::to_string(rec.version));
  w.Key("submitted_ms");
  w.Int64(rec.submitted_ms);
  w.Key("started_ms");
  w.Int64(rec.started_ms);
  w.Key("finished_ms");
  w.Int64(rec.finished_ms);
  w.Key("binary_data_output");
  w.Bool(rec.binary_default);
  w.Key("binary_outputs");
  w.StartObject();
  for (const auto& [name, binary] : rec.binary_outputs) {
    String(w, name);
    w.Bool(binary);
  }
  w.EndObject();
  Encoded out;
  if (rec.state == JobState::kDone) {
    KServeOutputFormat format;  // binary: what JSON cannot carry exactly, or would bloat
    for (const auto& o2 : rec.outputs) {
      format.binary_outputs.emplace_back(
          o2.name, o2.tensor.byte_size() > o.inline_max_bytes || !JsonFriendly(o2.tensor.dtype()));
    }
    std::vector<const Tensor*> parts;
    w.Key("result");
    QUERN_RETURN_IF_ERROR(WriteKServeResult(w, "", rec.model, rec.version, rec.outputs, format, parts));
    w.Key("binary_keys");
    w.StartArray();
    for (size_t k = 0; k < parts.size(); ++k) {
      std::string key = BinaryKey(o, rec.id, k);
      String(w, key);
      out.binary.emplace_back(std::move(key),
                              std::string_view(reinterpret_cast<const char*>(parts[k]->data()), parts[k]->byte_size()));
    }
    w.EndArray();
  } else {
    w.Key("error");
    w.StartObject();
    w.Key("code");
    String(w, StatusCodeName(rec.error.code()));
    w.Key("grpc_code");
    w.Int(static_cast<int>(rec.error.code()));
    w.Key("message");
    String(w, rec.error.message());
    w.EndObject();
  }
  w.EndObject();
  out.json.assign(buf.GetString(), buf.GetSize());
  return out;
}

Result<std::shared_ptr<const JobRecord>> RedisResultStore::Decode(std::string_view json,
                                                                  const std::vector<std::string>& binary) {
  rapidjson::Document doc;
  if (JsonParseError e; !ParseJson(doc, json.data(), json.size(), e) || !doc.IsObject()) {
    return Err(Internal("a stored job result is not valid JSON"));
  }
  auto rec = std::make_shared<JobRecord>();
  rec->id = Str(doc, "job_id");
  rec->model = Str(doc, "model_name");
  rec->version = std::atoll(Str(doc, "model_version").c_str());
  rec->submitted_ms = Int(doc, "submitted_ms");
  rec->started_ms = Int(doc, "started_ms");
  rec->finished_ms = Int(doc, "finished_ms");
  const std::string status = Str(doc, "status");
  if (status == "done") {
    rec->state = JobState::kDone;
  } else if (status == "failed") {
    rec->state = JobState::kFailed;
  } else if (status == "cancelled") {
    rec->state = JobState::kCancelled;
  } else {
    return Err(Internal("stored job '" + rec->id + "' has status '" + status + "', not a finished one"));
  }
  if (auto it = doc.FindMember("binary_data_output"); it != doc.MemberEnd() && it->value.IsBool()) {
    rec->binary_default = it->value.GetBool();
  }
  if (auto it = doc.FindMember("binary_outputs"); it != doc.MemberEnd() && it->value.IsObject()) {
    for (const auto& m : it->value.GetObject()) {
      if (m.value.IsBool()) rec->binary_outputs.emplace_back(m.name.GetString(), m.value.GetBool());
    }
  }
  if (rec->state != JobState::kDone) {
    auto it = doc.FindMember("error");
    if (it == doc.MemberEnd() || !it->value.IsObject())
      return Err(Internal("stored job '" + rec->id + "' has no error"));
    const int code = static_cast<int>(Int(it->value, "grpc_code"));
    rec->error = Status(code > 0 && code <= 16 ? static_cast<StatusCode>(code) : StatusCode::kUnknown,
                        Str(it->value, "message"));
    return std::shared_ptr<const JobRecord>(std::move(rec));
  }
  auto result = doc.FindMember("result");
  if (result == doc.MemberEnd() || !result->value.IsObject() || !result->value.HasMember("outputs") ||
      !result->value["outputs"].IsArray()) {
    return Err(Internal("stored job '" + rec->id + "' has no result.outputs"));
  }
  // The outputs are in KServe's tensor format: read them back with the
  // infer request parser, as the "inputs" of a request.
  rapidjson::StringBuffer buf;
  // NaN and infinities are stored as NaN / Infinity (see WriteKServeOutputs).
  rapidjson::Writer<rapidjson::StringBuffer, rapidjson::UTF8<>, rapidjson::UTF8<>, rapidjson::CrtAllocator,
                    rapidjson::kWriteNanAndInfFlag>
      w(buf);
  w.StartObject();
  w.Key("inputs");
  if (!result->value["outputs"].Accept(w)) {
    return Err(Internal("stored result of job '" + rec->id + "' is damaged: its outputs cannot be read"));
  }
  w.EndObject();
  std::string joined;
  for (const auto& b : binary) joined += b;
  auto parsed = ParseKServeInfer(rec->model, rec->version, std::string_view(buf.GetString(), buf.GetSize()), joined,
                                 nullptr);  // the outputs are copied out below, while `joined` lives
  if (!parsed) return Err(Internal("stored result of job '" + rec->id + "' is damaged: " + parsed.error().message()));
  // Binary parts sit at arbitrary offsets of the body: copy each into its
  // own (aligned) buffer, which also frees the body.
  rec->outputs.reserve(parsed->request.inputs.size());
  for (const auto& t : parsed->request.inputs) {
    if (Status st = t.tensor.Validate(); !st.ok()) {
      return Err(
          Internal("stored result of job '" + rec->id + "' is damaged: output '" + t.name + "': " + st.message()));
    }
    rec->outputs.push_back({t.name, OwnedCopy(t.tensor)});
  }
  return std::shared_ptr<const JobRecord>(std::move(rec));
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
      connected_(
          metrics_.AddGauge("quern_redis_connected", "1 while the job result store's connection to Redis is up.")),
      backlog_(metrics_.AddGauge("quern_redis_backlog", "Job results held in memory, waiting to be written to Redis.")),
      backlog_bytes_(
          metrics_.AddGauge("quern_redis_backlog_bytes", "Bytes of job results waiting to be written to Redis.")) {
  if (!options_.clock) options_.clock = &RealClockInstance();
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
    std::fprintf(stderr, "quern: %zu job results could not be written to redis at %s before exit\n", unwritten_.size(),
                 options_.redis.Address().c_str());
  }
}

void RedisResultStore::Put(std::vector<std::shared_ptr<const JobRecord>> records) {
  Put(std::move(records), RedisPipeline(), nullptr);
}

void RedisResultStore::Put(std::vector<std::shared_ptr<const JobRecord>> records, RedisPipeline extra,
                           std::function<void()> on_written) {
  Batch b;
  for (const auto& r : records) b.bytes += r->ByteSize();
  b.bytes += extra.data().size();
  b.records = std::move(records);
  b.extra = std::move(extra);
  b.on_written = std::move(on_written);
  {
    MutexLock lock(mu_);
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

Status RedisResultStore::Write(std::vector<Batch>& batches) {
  RedisPipeline p;
  p.Add({"MULTI"});
  const std::string ttl_ms = std::to_string(options_.ttl_s * 1000);
  for (const Batch& b : batches) {
    for (const auto& r : b.records) {
      auto enc = Encode(*r, options_);
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
      if (options_.ttl_s > 0) {
        p.Add({"SET", key, enc->json, "PX", ttl_ms});
        for (const auto& [k, v] : enc->binary) p.Add({"SET", k, v, "PX", ttl_ms});
      } else {
        p.Add({"SET", key, enc->json});
        for (const auto& [k, v] : enc->binary) p.Add({"SET", k, v});
      }
    }
  }
  for (const Batch& b : batches) p.Append(b.extra);
  p.Add({"EXEC"});
  std::unique_ptr<RedisConnection>& conn = writer_conn_;
  if (Status s = EnsureConnected(conn, ever_connected_.load()); !s.ok()) return s;
  ever_connected_.store(true);
  connected_.Set(1);
  auto replies = conn->Execute(p);
  if (!replies) {
    connected_.Set(0);
    return replies.error();
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
  // A command inside the transaction can fail on its own (e.g. WRONGTYPE on
  // a key that is not a stream): the rest took effect; say so.
  if (exec.is_array()) {
    for (const RedisReply& r : exec.elements) {
      if (r.is_error()) {
        std::fprintf(stderr, "quern: redis at %s: a command written with job results failed: %s\n",
                     options_.redis.Address().c_str(), r.str.c_str());
        break;
      }
    }
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
      if (!cv_.WaitFor(lock, health_ok_since_write_ ? std::chrono::milliseconds(1000) : backoff,
                       [&]() QUERN_REQUIRES(mu_) { return stop_ || !queue_.empty(); })) {
        lock.Unlock();
        Status s = Ping();
        lock.Lock();
        SetHealthLocked(s);
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
      std::fprintf(stderr, "quern: %zu job result(s) dropped (first: %s): %s\n", n,
                   n > 0 ? batches[0].records[0]->id.c_str() : "-", s.message().c_str());
      Settle(batches, /*written=*/false);
      continue;
    }
    if (!s.ok()) {
      write_errors_.Increment();
      SetHealthLocked(s);
      if (stop_) break;
      // Keep the batches; try again after the backoff (a stop wakes it).
      cv_.WaitFor(lock, backoff, [&]() QUERN_REQUIRES(mu_) { return stop_; });
      backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
      continue;
    }
    SetHealthLocked(Status::Ok());
    backoff = std::chrono::milliseconds(50);
    writes_.Increment();
    Settle(batches, /*written=*/true);
  }
}

void RedisResultStore::Settle(std::vector<Batch>& batches, bool written) {
  std::vector<std::function<void()>> callbacks;
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
    if (b.on_written) callbacks.push_back(std::move(b.on_written));
  }
  batches.clear();
  written_cv_.SignalAll();
  if (!callbacks.empty()) {
    mu_.Unlock();
    for (auto& cb : callbacks) cb();
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
    std::fprintf(stderr, "quern: job results wait in memory: %s\n", s.message().c_str());
  } else if (s.ok() && !health_.ok() && health_.message() != kNotYet) {
    std::fprintf(stderr, "quern: redis at %s is reachable again\n", options_.redis.Address().c_str());
  }
  health_ = s;
  health_ok_since_write_ = s.ok();
}

bool RedisResultStore::Flush(std::chrono::milliseconds timeout) {
  MutexLock lock(mu_);
  const uint64_t target = queued_seq_;
  return written_cv_.WaitFor(lock, timeout, [&]() QUERN_REQUIRES(mu_) { return written_seq_ >= target; });
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
    const auto now = std::chrono::steady_clock::now();
    if (now - reader_failed_at_ < std::chrono::seconds(1)) {
      return Err(Unavailable("job results are kept in redis, which cannot be reached now: " + reader_error_));
    }
    if (Status s = EnsureConnected(reader_, false); !s.ok()) {
      reader_failed_at_ = now;
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
