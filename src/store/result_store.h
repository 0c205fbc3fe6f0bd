// Results of asynchronous jobs: what a job is, and where finished jobs are
// kept until their owners fetch them.
//
// A ResultStore holds finished jobs (done, failed or cancelled) by id. Two
// implementations: MemoryResultStore (embedded, the default: bounded by
// bytes, oldest finished results evicted first, TTL; lost on restart) and
// RedisResultStore (store/redis_store.h).
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/mutex.h"
#include "quern/clock.h"
#include "quern/status.h"
#include "quern/tensor.h"

namespace quern {

enum class JobState { kQueued, kRunning, kDone, kFailed, kCancelled };
std::string_view JobStateName(JobState state);

// One job, as its owner sees it.
struct JobRecord {
  std::string id;
  std::string model;
  int64_t version = 0;  // the version that ran it (0 = not known yet)
  // Who may read and cancel it: a digest naming the API key that submitted
  // it (JobOwner); empty = anyone (no keys, or a job from a Redis stream).
  std::string owner;
  JobState state = JobState::kQueued;
  // Wall clock, milliseconds since the Unix epoch; 0 = not reached.
  int64_t submitted_ms = 0, started_ms = 0, finished_ms = 0;
  Status error;                      // kFailed and kCancelled: why
  std::vector<NamedTensor> outputs;  // kDone: the results (owned)
  // A decoupled model's job (kDone): every response it sent, in order, each
  // its outputs (owned; `outputs` is then empty). The JSON's "responses".
  bool decoupled = false;
  std::vector<std::vector<NamedTensor>> responses;
  // How the submitter wants the outputs back: names sent as binary data,
  // or every output when binary_default (KServe's binary_data_output).
  bool binary_default = false;
  std::vector<std::pair<std::string, bool>> binary_outputs;

  bool finished() const {
    return state == JobState::kDone || state == JobState::kFailed || state == JobState::kCancelled;
  }
  // Bytes this record holds (outputs and strings), for store bounds.
  size_t ByteSize() const;
};

// A compact copy of `t` in a buffer of its own (aligned): a stored result
// must not keep a whole batch's output alive, nor view a request body.
Tensor OwnedCopy(const Tensor& t);

// Job ids carry their submission time: 12 hex digits of milliseconds since
// the epoch, '-', 32 hex digits of 128 random bits from the kernel's CSPRNG
// (getrandom): another client's ids cannot be guessed from one's own. A
// store can so tell an id that has expired from one it never saw.
std::string NewJobId(int64_t submitted_ms);
// The submission time inside a job id (also of the older form with 16
// random digits); -1 when `id` is not a job id.
int64_t JobIdSubmittedMs(std::string_view id);
// The owner (JobRecord::owner) of jobs submitted with API key `key`: a
// SHA-256 digest in hex, so a store never holds the key itself. Empty for
// an empty key.
std::string JobOwner(std::string_view key);

// A job written to a stream (ResultStore::Enqueue): the entry's fields, and
// a value under a key of its own (the job's body, which the entry names)
// written with it.
struct StreamSubmission {
  std::string stream;
  std::vector<std::pair<std::string, std::string>> fields;
  std::string value_key;  // "" = no value
  std::string_view value;
  // Keeps `value` alive until it is written (then it is not copied); null:
  // `value` is read before Enqueue returns.
  std::shared_ptr<const void> value_owner;
};

class ResultStore {
 public:
  virtual ~ResultStore() = default;

  // Stores finished jobs; a record with an id already stored replaces it (a
  // job processed twice keeps one result). A remote store writes the
  // records of one call in one round trip.
  virtual void Put(std::vector<std::shared_ptr<const JobRecord>> records) = 0;

  // The finished job `id`. NOT_FOUND for an id never stored, and NOT_FOUND
  // with a message saying so for one whose result expired or was evicted.
  virtual Result<std::shared_ptr<const JobRecord>> Get(const std::string& id) = 0;

  // OK, or UNAVAILABLE saying why results cannot be stored durably now.
  virtual Status Health() const = 0;

  // OK, or UNAVAILABLE when the store cannot take more results now (new
  // jobs are then refused rather than finished results dropped).
  virtual Status CanAccept() const { return Status::Ok(); }

  // Whether results outlive this process (Redis: yes; memory: no).
  virtual bool Durable() const = 0;

  // Durable stores: stores `queued` (a job accepted, state kQueued) and
  // `submission`'s value (when it has a key; no time to live) and appends
  // its entry to its stream, all or none; `done` gets OK once all are
  // stored (on another thread), else the error. Others: UNIMPLEMENTED at
  // once.
  virtual void Enqueue(std::shared_ptr<const JobRecord> queued, const StreamSubmission& submission,
                       std::function<void(Status)> done) {
    (void)queued, (void)submission;
    done(Unimplemented("this result store takes no job streams"));
  }
  // Replaces a stored queued job's record by `cancelled` if it is still
  // queued: FAILED_PRECONDITION when it is not, NOT_FOUND when none.
  virtual Status CancelQueued(std::shared_ptr<const JobRecord> cancelled) {
    (void)cancelled;
    return Unimplemented("this result store keeps no queued jobs");
  }
};

struct MemoryResultStoreOptions {
  // Bytes of results kept; beyond it the oldest finished results of the
  // owner holding the most bytes are evicted first (one key filling the
  // store evicts its own results, not another key's).
  size_t max_bytes = size_t{256} << 20;
  // Seconds a finished result is kept; 0 = until evicted.
  int64_t ttl_s = 3600;
  // Ids of evicted results remembered (to say "evicted" rather than
  // "unknown").
  size_t max_tombstones = 65536;
  // Time source for TTLs; null = the real clock.
  const Clock* clock = nullptr;
};

// The embedded store: results in process memory, lost on restart.
class MemoryResultStore final : public ResultStore {
 public:
  explicit MemoryResultStore(MemoryResultStoreOptions options = {});

  void Put(std::vector<std::shared_ptr<const JobRecord>> records) override;
  Result<std::shared_ptr<const JobRecord>> Get(const std::string& id) override;
  Status Health() const override { return Status::Ok(); }
  bool Durable() const override { return false; }

  size_t bytes() const;
  size_t size() const;

 private:
  struct Entry {
    std::shared_ptr<const JobRecord> record;
    size_t bytes = 0;
    int64_t expires_ns = 0;  // on options_.clock; 0 = never
    uint64_t seq = 0;        // insertion number, to match the order queues
  };
  // One owner's results, oldest first, and their bytes.
  struct Owner {
    size_t bytes = 0;
    std::deque<std::pair<uint64_t, std::string>> order;  // (seq, id)
  };
  void EvictLocked(int64_t now_ns) QUERN_REQUIRES(mu_);
  void ForgetLocked(const std::string& id, const char* why) QUERN_REQUIRES(mu_);

  MemoryResultStoreOptions options_;
  mutable Mutex mu_;
  std::unordered_map<std::string, Entry> entries_ QUERN_GUARDED_BY(mu_);
  std::deque<std::pair<uint64_t, std::string>> order_ QUERN_GUARDED_BY(mu_);       // (seq, id), oldest first
  std::unordered_map<std::string, Owner> owners_ QUERN_GUARDED_BY(mu_);            // by JobRecord::owner
  std::unordered_map<std::string, const char*> tombstones_ QUERN_GUARDED_BY(mu_);  // id -> why it is gone
  std::deque<std::string> tombstone_order_ QUERN_GUARDED_BY(mu_);
  size_t bytes_ QUERN_GUARDED_BY(mu_) = 0;
  uint64_t next_seq_ QUERN_GUARDED_BY(mu_) = 1;
};

}  // namespace quern
