#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>

#include "store/result_store.h"

namespace quern {

std::string_view JobStateName(JobState state) {
  switch (state) {
    case JobState::kQueued: return "queued";
    case JobState::kRunning: return "running";
    case JobState::kDone: return "done";
    case JobState::kFailed: return "failed";
    case JobState::kCancelled: return "cancelled";
  }
  return "unknown";
}

Tensor OwnedCopy(const Tensor& t) {
  Tensor copy = Tensor::AllocateUninitialized(t.dtype(), t.shape(), t.byte_size());
  if (t.byte_size() > 0) std::memcpy(copy.mutable_data(), t.data(), t.byte_size());
  return copy;
}

size_t JobRecord::ByteSize() const {
  size_t n = sizeof(JobRecord) + id.size() + model.size() + error.message().size();
  for (const auto& o : outputs) n += sizeof(NamedTensor) + o.name.size() + o.tensor.byte_size();
  for (const auto& [name, _] : binary_outputs) n += name.size() + sizeof(std::pair<std::string, bool>);
  return n;
}

std::string NewJobId(int64_t submitted_ms) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%012llx-%016llx", static_cast<unsigned long long>(submitted_ms & 0xFFFFFFFFFFFFLL),
                static_cast<unsigned long long>(rng()));
  return buf;
}

int64_t JobIdSubmittedMs(std::string_view id) {
  if (id.size() != 29 || id[12] != '-') return -1;
  int64_t ms = 0;
  for (size_t i = 0; i < id.size(); ++i) {
    if (i == 12) continue;
    const char c = id[i];
    const int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (v < 0) return -1;
    if (i < 12) ms = ms * 16 + v;
  }
  return ms;
}

MemoryResultStore::MemoryResultStore(MemoryResultStoreOptions options) : options_(options) {
  if (!options_.clock) options_.clock = &RealClockInstance();
}

void MemoryResultStore::Put(std::vector<std::shared_ptr<const JobRecord>> records) {
  MutexLock lock(mu_);
  const int64_t now = options_.clock->NowNs();
  for (auto& r : records) {
    if (!r) continue;
    const std::string id = r->id;
    if (auto it = entries_.find(id); it != entries_.end()) {
      bytes_ -= it->second.bytes;
      entries_.erase(it);  // its order_ entry is skipped by seq
    }
    tombstones_.erase(id);
    Entry e;
    e.bytes = r->ByteSize();
    e.expires_ns = options_.ttl_s > 0 ? now + options_.ttl_s * 1'000'000'000 : 0;
    e.seq = next_seq_++;
    e.record = std::move(r);
    bytes_ += e.bytes;
    order_.emplace_back(e.seq, id);
    entries_.emplace(id, std::move(e));
  }
  EvictLocked(now);
}

// Drops expired results (all at the front of order_: one TTL for all) and
// then the oldest ones while over the byte bound.
void MemoryResultStore::EvictLocked(int64_t now_ns) {
  while (!order_.empty()) {
    auto& [seq, id] = order_.front();
    auto it = entries_.find(id);
    if (it == entries_.end() || it->second.seq != seq) {  // replaced or already gone
      order_.pop_front();
      continue;
    }
    const bool expired = it->second.expires_ns != 0 && it->second.expires_ns <= now_ns;
    if (!expired && bytes_ <= options_.max_bytes) break;
    ForgetLocked(id, expired ? "expired" : "was evicted (the result store was full)");
    order_.pop_front();
  }
}

void MemoryResultStore::ForgetLocked(const std::string& id, const char* why) {
  auto it = entries_.find(id);
  if (it != entries_.end()) {
    bytes_ -= it->second.bytes;
    entries_.erase(it);
  }
  if (options_.max_tombstones == 0) return;
  if (tombstones_.emplace(id, why).second) tombstone_order_.push_back(id);
  while (tombstone_order_.size() > options_.max_tombstones) {
    tombstones_.erase(tombstone_order_.front());
    tombstone_order_.pop_front();
  }
}

Result<std::shared_ptr<const JobRecord>> MemoryResultStore::Get(const std::string& id) {
  MutexLock lock(mu_);
  EvictLocked(options_.clock->NowNs());
  if (auto it = entries_.find(id); it != entries_.end()) return it->second.record;
  if (auto t = tombstones_.find(id); t != tombstones_.end()) {
    return Err(NotFound("the result of job '" + id + "' " + t->second));
  }
  // Forgotten tombstones and restarts: the id's own timestamp tells.
  const int64_t submitted = JobIdSubmittedMs(id);
  if (submitted >= 0 && options_.ttl_s > 0 && submitted + options_.ttl_s * 1000 < options_.clock->WallMs()) {
    return Err(
        NotFound("the result of job '" + id + "' expired (results are kept " + std::to_string(options_.ttl_s) + " s)"));
  }
  return Err(NotFound("no job '" + id + "'"));
}

size_t MemoryResultStore::bytes() const {
  MutexLock lock(mu_);
  return bytes_;
}

size_t MemoryResultStore::size() const {
  MutexLock lock(mu_);
  return entries_.size();
}

}  // namespace quern
