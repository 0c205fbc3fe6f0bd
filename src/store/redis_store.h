// RedisResultStore: finished jobs kept in Redis, shared by every Quern
// instance that points at the same server, surviving their restarts.
//
// Layout (one job):
//   results:{id}          JSON: job_id, status, model_name, model_version,
//                         submitted_ms/started_ms/finished_ms, error
//                         {code, grpc_code, message} when it failed, and
//                         "result": the KServe v2 response ("outputs" with
//                         name, datatype, shape and data). An output larger
//                         than inline_max_bytes (or of type BYTES/FP16/BF16)
//                         carries parameters.binary_data_size instead of
//                         data, and its raw bytes are in the key named by
//                         "binary_keys" (in output order).
//   results:{id}:bin:{k}  the raw little-endian bytes of such an output
// Every key expires after ttl_s (PX), written together.
//
// Writes are asynchronous: Put queues the records and a writer thread sends
// everything queued in one MULTI ... EXEC round trip (the records of one
// batch, and whatever finished while the previous write was in flight).
// Until a record is written it is served from memory, so a poll right after
// Put finds it. When Redis is away the writer reconnects with backoff and
// Health() reports UNAVAILABLE; results wait in memory (bounded by
// max_backlog_bytes: beyond it CanAccept refuses new jobs rather than drop
// finished ones) and are written when Redis is back.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/mutex.h"
#include "metrics/registry.h"
#include "store/redis_client.h"
#include "store/result_store.h"

namespace quern {

struct RedisResultStoreOptions {
  RedisOptions redis;
  int64_t ttl_s = 3600;                          // 0 = results never expire
  size_t inline_max_bytes = 4096;                // larger outputs go in a binary key
  size_t max_backlog_bytes = size_t{256} << 20;  // results waiting for Redis
  // The largest value a read takes from Redis (a result's record or one of
  // its binary outputs): a longer one is dropped as it arrives and the read
  // fails (a Redis, or whatever answers in its place, cannot make the server
  // hold more). 0 = max_backlog_bytes (no result written here is larger).
  size_t max_value_bytes = 0;
  std::string key_prefix = "results:";
  const Clock* clock = nullptr;  // job ages for TTLs; null = the real clock
  // Where the quern_redis_* metrics are kept (must outlive the store); null
  // = a registry of the store's own (stats() still reads it).
  MetricsRegistry* metrics = nullptr;
};

// The quern_redis_* metrics, read back; cumulative unless noted.
struct RedisStoreStats {
  uint64_t writes = 0;           // MULTI/EXEC round trips that succeeded
  uint64_t records_written = 0;  // job results written
  uint64_t write_errors = 0;     // round trips that failed (retried)
  uint64_t reconnects = 0;       // connections made after the first
  int64_t backlog = 0;           // results waiting to be written (gauge)
  int64_t backlog_bytes = 0;     // (gauge)
  bool connected = false;        // (gauge)
};

class RedisResultStore final : public ResultStore {
 public:
  // Starts the writer; does not wait for Redis (it may come later).
  explicit RedisResultStore(RedisResultStoreOptions options);
  // Writes what is queued (waiting up to 5 s for Redis), then stops.
  ~RedisResultStore() override;

  void Put(std::vector<std::shared_ptr<const JobRecord>> records) override;
  // As Put, and `extra` commands (e.g. XACK) run in the same MULTI/EXEC
  // as the records, so they take effect together or not at all.
  // `on_written` (optional) runs on the writer thread after the EXEC, with
  // true (or false after the write was given up: Redis refused it for
  // good, e.g. NOPERM).
  void Put(std::vector<std::shared_ptr<const JobRecord>> records, RedisPipeline extra,
           std::function<void(bool written)> on_written = nullptr);
  void Enqueue(std::shared_ptr<const JobRecord> queued, const StreamSubmission& submission,
               std::function<void(Status)> done) override;
  Status CancelQueued(std::shared_ptr<const JobRecord> cancelled) override;
  Result<std::shared_ptr<const JobRecord>> Get(const std::string& id) override;
  Status Health() const override;
  Status CanAccept() const override;
  bool Durable() const override { return true; }

  // Blocks until everything queued so far is written, or `timeout` passes.
  bool Flush(std::chrono::milliseconds timeout);

  RedisStoreStats stats() const;
  const RedisResultStoreOptions& options() const { return options_; }

  // The JSON and binary values of one record, as written (exposed for tests).
  struct Encoded {
    std::string json;
    std::vector<std::pair<std::string, std::string>> binary;  // key, bytes
  };
  static Result<Encoded> Encode(const JobRecord& record, const RedisResultStoreOptions& options);
  static Result<std::shared_ptr<const JobRecord>> Decode(std::string_view json, const std::vector<std::string>& binary);

 private:
  struct Batch {
    std::vector<std::shared_ptr<const JobRecord>> records;
    RedisPipeline extra;
    std::function<void(bool written)> on_written;
    size_t bytes = 0;
    // A job being submitted (Enqueue): a write that fails refuses it at
    // once (its client may submit again) rather than holding it for later.
    bool submission = false;
    // Set by Write: a command of this submission failed inside the
    // transaction (the rest took effect): it was not accepted, and `undo`
    // (its record's and value's DEL) is run.
    bool failed = false;
    RedisPipeline undo;
    // Where its commands are among the transaction's (filled by Write).
    std::vector<std::pair<size_t, size_t>> commands;
  };
  void Queue(Batch b);
  void WriterLoop();
  Status Write(std::vector<Batch>& batches);
  // Batches written (or given up): forgets them, runs their on_written.
  // Called with mu_ held; lets it go while the callbacks run.
  void Settle(std::vector<Batch>& batches, bool written) QUERN_REQUIRES(mu_);
  Status Ping();
  void SetHealthLocked(const Status& s) QUERN_REQUIRES(mu_);  // logs changes
  Status EnsureConnected(std::unique_ptr<RedisConnection>& conn, bool count_reconnect);

  RedisResultStoreOptions options_;
  std::unique_ptr<MetricsRegistry> own_metrics_;
  MetricsRegistry& metrics_;
  Counter& writes_;
  Counter& records_written_;
  Counter& write_errors_;
  Counter& reconnects_;
  Counter& unreplicated_;             // writes that fewer than wait_replicas replicas confirmed in time
  bool unreplicated_logged_ = false;  // writer thread only
  Gauge& connected_;                  // 0 or 1
  Gauge& backlog_;                    // unwritten_.size(), set with mu_ held
  Gauge& backlog_bytes_;              // backlog_bytes_held_, set with mu_ held
  mutable Mutex mu_;
  CondVar cv_;          // writer: work or stop
  CondVar written_cv_;  // Flush: progress
  std::deque<Batch> queue_ QUERN_GUARDED_BY(mu_);
  // Records queued or being written, by id: served by Get until written.
  std::unordered_map<std::string, std::shared_ptr<const JobRecord>> unwritten_ QUERN_GUARDED_BY(mu_);
  size_t backlog_bytes_held_ QUERN_GUARDED_BY(mu_) = 0;
  uint64_t queued_seq_ QUERN_GUARDED_BY(mu_) = 0;
  uint64_t written_seq_ QUERN_GUARDED_BY(mu_) = 0;
  bool stop_ QUERN_GUARDED_BY(mu_) = false;
  Status health_ QUERN_GUARDED_BY(mu_);
  bool health_ok_since_write_ QUERN_GUARDED_BY(mu_) = false;
  bool writes_failing_ QUERN_GUARDED_BY(mu_) = false;  // the last write failed: submissions are refused

  Mutex read_mu_;
  std::unique_ptr<RedisConnection> reader_ QUERN_GUARDED_BY(read_mu_);
  int64_t reader_failed_at_ns_ QUERN_GUARDED_BY(read_mu_) = 0;  // options_.clock; 0 = never
  std::string reader_error_ QUERN_GUARDED_BY(read_mu_);

  std::atomic<bool> ever_connected_{false};
  std::unique_ptr<RedisConnection> writer_conn_;  // writer thread only
  std::thread writer_;
};

}  // namespace quern
