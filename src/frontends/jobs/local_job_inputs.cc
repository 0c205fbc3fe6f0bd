#include "frontends/jobs/local_job_inputs.h"

namespace quern {

namespace {

const Clock& ClockOf(const LocalJobInputsOptions& o) {
  return o.clock ? *o.clock : RealClockInstance();
}

}  // namespace

LocalJobInputs::LocalJobInputs(LocalJobInputsOptions options) : options_(std::move(options)) {}

LocalJobInputs::~LocalJobInputs() = default;

void LocalJobInputs::ExpireLocked(int64_t now_ns, std::deque<Kept>& old) {
  const int64_t oldest = now_ns - options_.max_age_ms * 1'000'000;
  while (!order_.empty()) {
    auto& [at, id] = order_.front();
    auto it = kept_.find(id);
    if (it != kept_.end() && it->second.at_ns == at) {
      if (at > oldest) break;
      bytes_ -= it->second.bytes;
      old.push_back(std::move(it->second));
      kept_.erase(it);
    }
    order_.pop_front();
  }
  // Taken out of order, ids behind a kept one wait for it to go; never more
  // than a few times the jobs kept.
  if (order_.size() > 4 * kept_.size() + 1024) {
    std::erase_if(order_, [&](const auto& e) QUERN_REQUIRES(mu_) {
      auto it = kept_.find(e.second);
      return it == kept_.end() || it->second.at_ns != e.first;
    });
  }
}

bool LocalJobInputs::Put(const std::string& id, KServeInfer infer, size_t bytes) {
  std::deque<Kept> old;
  MutexLock lock(mu_);
  const int64_t now = ClockOf(options_).NowNs();
  ExpireLocked(now, old);
  if (bytes_ + bytes > options_.max_bytes || kept_.size() >= options_.max_entries || kept_.contains(id)) {
    lock.Unlock();
    return false;  // (`infer` and `old` go here, without the lock)
  }
  kept_.emplace(id, Kept{std::move(infer), bytes, now});
  order_.emplace_back(now, id);
  bytes_ += bytes;
  lock.Unlock();
  return true;
}

std::optional<KServeInfer> LocalJobInputs::Take(const std::string& id) {
  std::deque<Kept> old;
  MutexLock lock(mu_);
  ExpireLocked(ClockOf(options_).NowNs(), old);
  auto it = kept_.find(id);
  if (it == kept_.end()) return std::nullopt;
  bytes_ -= it->second.bytes;
  std::optional<KServeInfer> out(std::move(it->second.infer));
  kept_.erase(it);
  lock.Unlock();
  return out;
}

void LocalJobInputs::Drop(const std::string& id) {
  (void)Take(id);
}

size_t LocalJobInputs::bytes() const {
  MutexLock lock(mu_);
  return bytes_;
}

size_t LocalJobInputs::size() const {
  MutexLock lock(mu_);
  return kept_.size();
}

size_t LocalJobInputs::ordered() const {
  MutexLock lock(mu_);
  return order_.size();
}

}  // namespace quern
