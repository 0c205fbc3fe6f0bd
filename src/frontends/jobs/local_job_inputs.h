// LocalJobInputs: the parsed requests of the jobs this instance accepted
// into a job stream, kept so that its own consumer runs them from memory
// rather than reading their bodies back from Redis and parsing them again.
//
// A cache, never the record of a job: Redis holds the body of every job
// accepted, and a job not found here (another instance's consumer took it,
// it was dropped, this process restarted) runs from there. Bounded: at most
// max_bytes of bodies and max_entries jobs at once (past either, a new job
// is not kept), and each kept at most max_age_ms (by then its job has most
// likely been taken elsewhere).
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#include "core/mutex.h"
#include "protocol/kserve_codec.h"
#include "quern/clock.h"

namespace quern {

struct LocalJobInputsOptions {
  size_t max_bytes = size_t{64} << 20;
  size_t max_entries = 65536;
  int64_t max_age_ms = 30000;
  const Clock* clock = nullptr;  // ages; null = the real clock
};

class LocalJobInputs {
 public:
  explicit LocalJobInputs(LocalJobInputsOptions options = {});
  ~LocalJobInputs();
  LocalJobInputs(const LocalJobInputs&) = delete;
  LocalJobInputs& operator=(const LocalJobInputs&) = delete;

  // Keeps `infer` (parsed from a body `bytes` long) for job `id`. False
  // (and `infer` dropped) when it would pass a bound, or `id` is kept
  // already.
  bool Put(const std::string& id, KServeInfer infer, size_t bytes);
  // The request kept for job `id`, no longer kept; nullopt when there is
  // none (never kept, taken, dropped or too old).
  std::optional<KServeInfer> Take(const std::string& id);
  // Forgets job `id` (its submission was refused).
  void Drop(const std::string& id);

  size_t bytes() const;
  size_t size() const;
  // Entries in the order of keeping, taken ones not yet forgotten among
  // them: at most 4 * size() + 1025.
  size_t ordered() const;

 private:
  struct Kept {
    KServeInfer infer;
    size_t bytes = 0;
    int64_t at_ns = 0;
  };
  // Moves the kept jobs older than max_age_ms into `old` (destroyed by the
  // caller once the lock is let go), and forgets the taken ones at the
  // front of the order.
  void ExpireLocked(int64_t now_ns, std::deque<Kept>& old) QUERN_REQUIRES(mu_);

  const LocalJobInputsOptions options_;
  mutable Mutex mu_;
  std::unordered_map<std::string, Kept> kept_ QUERN_GUARDED_BY(mu_);
  // Ids in the order kept (with the time), some of them taken since.
  std::deque<std::pair<int64_t, std::string>> order_ QUERN_GUARDED_BY(mu_);
  size_t bytes_ QUERN_GUARDED_BY(mu_) = 0;
};

}  // namespace quern
