#include <openssl/sha.h>
#include <sys/random.h>

#include <cerrno>
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
  for (const auto& r : responses) {
    n += sizeof(r);
    for (const auto& o : r) n += sizeof(NamedTensor) + o.name.size() + o.tensor.byte_size();
  }
  for (const auto& [name, _] : binary_outputs) n += name.size() + sizeof(std::pair<std::string, bool>);
  return n;
}

std::string NewJobId(int64_t submitted_ms) {
  uint64_t random[2] = {0, 0};
  size_t got = 0;
  while (got < sizeof random) {
    const ssize_t n = ::getrandom(reinterpret_cast<char*>(random) + got, sizeof random - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      // No kernel CSPRNG (before Linux 3.17): std::random_device reads
      // /dev/urandom.
      std::random_device rd;
      random[0] = uint64_t{rd()} << 32 | rd();
      random[1] = uint64_t{rd()} << 32 | rd();
      break;
    }
  }
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%012llx-%016llx%016llx",
                static_cast<unsigned long long>(submitted_ms & 0xFFFFFFFFFFFFLL),
                static_cast<unsigned long long>(random[0]), static_cast<unsigned long long>(random[1]));
  return buf;
}

std::string JobOwner(std::string_view key) {
  if (key.empty()) return {};
  // Domain-separated, so the digest is not the one keys are checked by.
  const std::string input = std::string("quern job owner\n") + std::string(key);
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(input.data()), input.size(), digest);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * sizeof digest);
  for (unsigned char c : digest) {
    out += kHex[c >> 4];
    out += kHex[c & 15];
  }
  return out;
}

int64_t JobIdSubmittedMs(std::string_view id) {
  if ((id.size() != 45 && id.size() != 29) || id[12] != '-') return -1;
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
      owners_[it->second.record->owner].bytes -= it->second.bytes;
      entries_.erase(it);  // its order_ entries are skipped by seq
    }
    tombstones_.erase(id);
    Entry e;
    e.bytes = r->ByteSize();
    e.expires_ns = options_.ttl_s > 0 ? now + options_.ttl_s * 1'000'000'000 : 0;
    e.seq = next_seq_++;
    e.record = std::move(r);
    bytes_ += e.bytes;
    order_.emplace_back(e.seq, id);
    Owner& owner = owners_[e.record->owner];
    owner.bytes += e.bytes;
    owner.order.emplace_back(e.seq, id);
    entries_.emplace(id, std::move(e));
  }
  EvictLocked(now);
}

// Drops expired results (all at the front of order_: one TTL for all), then,
// while over the byte bound, the oldest result of the owner holding the
// most bytes.
void MemoryResultStore::EvictLocked(int64_t now_ns) {
  const auto live = [this](const std::pair<uint64_t, std::string>& e) QUERN_REQUIRES(mu_) {
    auto it = entries_.find(e.second);
    return it != entries_.end() && it->second.seq == e.first;  // else replaced or already gone
  };
  while (!order_.empty()) {
    if (!live(order_.front())) {
      order_.pop_front();
      continue;
    }
    auto it = entries_.find(order_.front().second);
    if (it->second.expires_ns == 0 || it->second.expires_ns > now_ns) break;
    ForgetLocked(order_.front().second, "expired");
    order_.pop_front();
  }
  while (bytes_ > options_.max_bytes) {
    auto largest = owners_.end();
    for (auto o = owners_.begin(); o != owners_.end(); ++o) {
      if (largest == owners_.end() || o->second.bytes > largest->second.bytes) largest = o;
    }
    if (largest == owners_.end() || largest->second.bytes == 0) break;
    auto& order = largest->second.order;
    while (!order.empty() && !live(order.front())) order.pop_front();
    if (order.empty()) break;
    const std::string id = order.front().second;
    order.pop_front();
    ForgetLocked(id, "was evicted (the result store was full)");
  }
  // The TTL queue holds an entry per result stored; those evicted by owner
  // stay in it behind an older live one: compacted once it holds twice what
  // is stored.
  if (order_.size() > 2 * entries_.size() + 64) {
    std::deque<std::pair<uint64_t, std::string>> kept;
    for (auto& e : order_) {
      if (live(e)) kept.push_back(std::move(e));
    }
    order_.swap(kept);
  }
  // Owners with nothing left, and stale queue entries, are let go.
  for (auto o = owners_.begin(); o != owners_.end();) {
    auto& order = o->second.order;
    while (!order.empty() && !live(order.front())) order.pop_front();
    o = order.empty() ? owners_.erase(o) : std::next(o);
  }
}

void MemoryResultStore::ForgetLocked(const std::string& id, const char* why) {
  auto it = entries_.find(id);
  if (it != entries_.end()) {
    bytes_ -= it->second.bytes;
    if (auto o = owners_.find(it->second.record->owner); o != owners_.end()) o->second.bytes -= it->second.bytes;
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
