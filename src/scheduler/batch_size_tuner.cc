#include "scheduler/batch_size_tuner.h"

#include <algorithm>

namespace quern {

namespace {
// A phase of tiny batches ends here even if min_phase_ns is not reached.
constexpr size_t kMaxPhaseSamples = 8192;
}  // namespace

BatchSizeTuner::BatchSizeTuner(BatchSizeTunerOptions options) : options_(std::move(options)) {
  candidates_ = options_.candidates;
  std::sort(candidates_.begin(), candidates_.end());
  candidates_.erase(std::unique(candidates_.begin(), candidates_.end()), candidates_.end());
  if (candidates_.empty()) candidates_.push_back(1);
  options_.samples = std::max(options_.samples, 1);
  options_.interval = std::max(options_.interval, 1);
  options_.max_interval = std::max(options_.max_interval, options_.interval);
  current_ = static_cast<int>(candidates_.size()) - 1;
  interval_ = options_.interval;
}

bool BatchSizeTuner::PhaseDone(const Sample& s) const {
  if (s.per_item_ns.size() >= kMaxPhaseSamples) return true;
  return s.per_item_ns.size() >= static_cast<size_t>(options_.samples) && s.total_ns >= options_.min_phase_ns;
}

double BatchSizeTuner::Median(std::vector<double> v) {
  if (v.empty()) return 0;
  auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  return *mid;
}

bool BatchSizeTuner::Matches(int64_t items, int index) const {
  const auto i = static_cast<size_t>(index);
  return items <= candidates_[i] && (i == 0 || items > candidates_[i - 1]);
}

int BatchSizeTuner::NextProbe() const {
  const int n = static_cast<int>(candidates_.size());
  for (int dir : {direction_, -direction_}) {
    const int i = current_ + dir;
    if (i >= 0 && i < n) return i;
  }
  return -1;
}

bool BatchSizeTuner::Observe(int64_t items, int64_t ns, bool capped) {
  ns = std::max<int64_t>(ns, 0);
  switch (phase_) {
    case Phase::kSteady:
      if (capped && Matches(items, current_) && ++waited_ >= interval_) {
        phase_ = Phase::kBaseline;
        baseline_.Clear();
      }
      return false;

    case Phase::kBaseline: {
      if (!capped || !Matches(items, current_)) return false;
      baseline_.per_item_ns.push_back(static_cast<double>(ns) / static_cast<double>(items));
      baseline_.total_ns += ns;
      if (!PhaseDone(baseline_)) return false;
      baseline_cost_ = Median(baseline_.per_item_ns);
      probe_ = NextProbe();
      if (probe_ < 0) {  // a single candidate: nothing to tune
        phase_ = Phase::kSteady;
        waited_ = 0;
        interval_ = options_.max_interval;
        return false;
      }
      direction_ = probe_ > current_ ? 1 : -1;
      phase_ = Phase::kProbe;
      probe_sample_.Clear();
      probe_misses_ = 0;
      return true;
    }

    case Phase::kProbe: {
      if (!capped || !Matches(items, probe_)) {
        // Batches formed before the probe began, or a queue that no longer
        // fills the probe size: give up after a while (not a failure).
        if (++probe_misses_ > 4 * options_.samples + 16) {
          direction_ = -direction_;
          phase_ = Phase::kSteady;
          waited_ = 0;
          return true;
        }
        return false;
      }
      probe_sample_.per_item_ns.push_back(static_cast<double>(ns) / static_cast<double>(items));
      probe_sample_.total_ns += ns;
      if (!PhaseDone(probe_sample_)) return false;
      const double cost = Median(probe_sample_.per_item_ns);
      if (cost < baseline_cost_ * (1.0 - options_.margin)) {
        // Better: take it and try the next size the same way at once, with
        // this probe's cost as the baseline.
        current_ = probe_;
        failures_ = 0;
        interval_ = options_.interval;
        baseline_cost_ = cost;
        const int next = current_ + direction_;
        if (next >= 0 && next < static_cast<int>(candidates_.size())) {
          probe_ = next;
          probe_sample_.Clear();
          probe_misses_ = 0;
          return true;
        }
        phase_ = Phase::kSteady;
        waited_ = 0;
        return false;  // the probe size is now the settled limit
      }
      // Not better: back to the settled limit; the other direction next time,
      // and after both failed, wait longer before probing again.
      direction_ = -direction_;
      if (++failures_ >= 2) interval_ = std::min(interval_ * 2, options_.max_interval);
      phase_ = Phase::kSteady;
      waited_ = 0;
      return true;
    }
  }
  return false;
}

}  // namespace quern
