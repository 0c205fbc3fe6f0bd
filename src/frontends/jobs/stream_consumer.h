// StreamConsumer: takes jobs from Redis streams, so that any number of Quern
// instances share one queue of work.
//
// Producers add a job with
//   XADD quern:jobs:{model} * id {job id} body {KServe v2 infer request}
//        [header_length {n}] [deadline_ms {Unix ms}] [version {n}]
// An entry may name the key holding its body instead of holding it:
// `body_key` {stream}:body:{job id} (read with GET when the entry is taken,
// deleted with its acknowledgement; a key outside {stream}:body: is
// refused). An HTTP job accepted by an instance with Redis (JobHandler) is
// such an entry, with `owner` (its submitter's JobOwner) and `tracked` 1;
// the instance that accepted it keeps it parsed (LocalJobInputs) and its
// consumer, if it takes the entry, runs it from there. Its
// record says queued; taking it, a consumer sets it to running unless the
// job was cancelled meanwhile (then the entry is acknowledged, not run);
// it fails as its infer would (stored failed, not dead-lettered), but for
// UNAVAILABLE (a full queue, a stop), which is retried.
// (`body` is the JSON request, or with header_length the JSON header
// followed by binary tensors, as in Inference-Header-Content-Length; `id`
// defaults to the entry id). Each instance reads with XREADGROUP in group
// "quern" (up to the model's batch size per call, a bounded number in
// flight, of which one model may hold all but a batch's worth for each
// other model), feeds the dynamic batcher, and writes each result to
// results:{id} (see RedisResultStore) together with the XACK, in one
// MULTI/EXEC per batch: a result and its acknowledgement land together or
// not at all.
//
// Failures: a job whose request is invalid, or that fails with a
// deterministic error, is stored as failed, copied to quern:dead:{model}
// (fields id, error, code, deliveries, body) and acknowledged. A job that
// fails with a transient error (queue full, a backend error) is left
// pending and is retried; one delivered max_deliveries times goes to the
// dead-letter stream. Entries left pending by a dead instance are reclaimed
// with XAUTOCLAIM once idle for claim_idle_ms. Processing is at least once;
// results are keyed by job id, so a job processed twice has one result. A
// job whose deadline has passed is stored as failed (DEADLINE_EXCEEDED) and
// acknowledged, without running.
//
// The streams stay bounded: once a second, and after every 1,000 entries
// acknowledged here, entries that every consumer group has been delivered
// and has acknowledged (and older than stream_retain_ms) are trimmed
// (XTRIM MINID ~, Redis 6.2+), at a bounded cost per call.
//
// Thread safety: Start/Stop from one thread. The engine and the store must
// outlive the consumer, and the engine must be drained before the store is
// destroyed.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "frontends/jobs/local_job_inputs.h"
#include "protocol/kserve_codec.h"
#include "quern/engine.h"
#include "store/redis_client.h"
#include "store/redis_store.h"

namespace quern {

// One entry of a job stream, as XREADGROUP and XAUTOCLAIM return it.
struct StreamEntry {
  std::string entry_id;  // "<ms>-<seq>"
  std::vector<std::pair<std::string, std::string>> fields;
  // Fields whose values were over the consumer's bound (never read into
  // memory; they are not in `fields`): name and length.
  std::vector<std::pair<std::string, int64_t>> oversize;
  // The value of field `name`, or "" when absent.
  std::string_view Field(std::string_view name) const;
};

// Moves an entry's strings out of a reply element [id, [field, value, ...]].
// False when the element has another shape (an entry deleted meanwhile
// comes back as [id, nil]).
bool ParseStreamEntry(RedisReply& element, StreamEntry& out);

// What a job stream entry asks for.
struct StreamJob {
  int64_t deadline_ms = 0;  // field `deadline_ms` (Unix ms); 0 = none
  KServeInfer infer;        // the request in `body` (+ `header_length`), for `model`
};

// Where an entry of `stream` keeps job `job_id`'s body (field body_key).
std::string StreamBodyKey(const std::string& stream, const std::string& job_id);

// An entry's deadline_ms (0 when absent); INVALID_ARGUMENT when it is not
// a Unix time in milliseconds.
Result<int64_t> StreamEntryDeadline(const StreamEntry& entry);

// Decodes an entry's job for `model` (`stream` names it in errors).
// INVALID_ARGUMENT names the entry and what was wrong with it; the
// deadline is not checked against the clock here.
Result<StreamJob> DecodeStreamJob(const StreamEntry& entry, const std::string& model, const std::string& stream);

struct StreamConsumerOptions {
  RedisOptions redis;
  std::vector<std::string> models;  // empty = every model ready at start
  std::string stream_prefix = "quern:jobs:";
  std::string dead_prefix = "quern:dead:";
  std::string group = "quern";
  std::string consumer;           // this instance's name in the group; empty = host-pid
  int max_inflight = 0;           // jobs taken and not finished; 0 = 2 x the models' batch sizes x instances
  int64_t claim_idle_ms = 30000;  // reclaim entries pending (unacknowledged) this long
  int max_deliveries = 3;         // deliveries before a failing job is dead-lettered
  int block_ms = 500;             // XREADGROUP BLOCK
  // The largest field value an entry may hold (an HTTP body's bound): a
  // longer one is dropped as it arrives, and its entry dead-lettered.
  size_t max_entry_bytes = size_t{64} << 20;
  // Entries every consumer group has acknowledged are trimmed from the
  // stream once older than this (0: at once; their id's time counts).
  int64_t stream_retain_ms = 0;
  // Where the quern_stream_* metrics are kept (must outlive the consumer
  // and the jobs it has in flight); null = a registry of its own.
  MetricsRegistry* metrics = nullptr;
  // The jobs accepted by this instance, parsed (JobHandler): a tracked
  // entry whose job is there runs from there, its body never read back.
  // Null = none; must outlive the consumer.
  LocalJobInputs* local = nullptr;
};

// The quern_stream_* metrics, read back; cumulative unless noted.
struct StreamModelStats {
  std::string model;
  int64_t length = -1;   // XLEN (gauge; -1 = not known yet)
  int64_t pending = -1;  // entries delivered and not acknowledged, all consumers (gauge)
  uint64_t trimmed = 0;  // entries trimmed by this instance
};
struct StreamConsumerStats {
  uint64_t taken = 0;      // entries read (new or reclaimed)
  uint64_t reclaimed = 0;  // of which taken over with XAUTOCLAIM
  uint64_t local = 0;      // of which run from the request kept here at acceptance (LocalJobInputs)
  uint64_t done = 0;       // results stored as done and acknowledged
  uint64_t failed = 0;     // stored as failed and acknowledged
  uint64_t dead = 0;       // of which copied to the dead-letter stream
  uint64_t retried = 0;    // left pending after a transient failure
  int64_t inflight = 0;    // (gauge)
  bool connected = false;  // (gauge)
  std::vector<StreamModelStats> streams;
};

class StreamConsumer {
 public:
  // Creates the consumer group on each model's stream (from the start of the
  // stream, so entries added before any consumer existed are not missed) and
  // starts reading. Redis may be away at start: it keeps trying.
  static Result<std::unique_ptr<StreamConsumer>> Start(StreamConsumerOptions options, Engine* engine,
                                                       RedisResultStore* store);
  ~StreamConsumer();  // Stop()

  // Stops taking entries; jobs in flight finish through the engine.
  void Stop();

  StreamConsumerStats stats() const;
  const std::string& consumer_name() const;
  // Whether it takes jobs from `model`'s stream (fixed at Start).
  bool Consumes(const std::string& model) const;

  class Impl;

 private:
  explicit StreamConsumer(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace quern
