#include "scheduler/batch_size_tuner.h"

#include <algorithm>

namespace quern {

namespace {
// A phase of tiny batches ends here even if min_phase_ns is not reached.
constexpr size_t kMaxPhaseSamples = 8192;
// After probing that moved nothing, the batches run at the settled limit for
// at least this many times the probing's batch time before the next probe:
// probes then take at most a ninth of the time. Each return from a smaller
// probe size to a larger one keeps the requests queued meanwhile waiting for
// a larger batch (a slow one for a large model), which is what a latency
// percentile sees.
constexpr int64_t kQuietFactor = 8;
}  // namespace

int BatchSizeTuner::MissBudget() const {
  return 4 * options_.samples + 16;
}

BatchSizeTuner::BatchSizeTuner(BatchSizeTunerOptions options) : options_(std::move(options)) {
  candidates_ = options_.candidates;
  std::sort(candidates_.begin(), candidates_.end());
  candidates_.erase(std::unique(candidates_.begin(), candidates_.end()), candidates_.end());
  if (candidates_.empty()) candidates_.push_back(1);
  options_.samples = std::max(options_.samples, 1);
  options_.interval = std::max(options_.interval, 1);
  options_.max_interval = std::max(options_.max_interval, options_.interval);
  current_ = static_cast<int>(candidates_.size()) - 1;
  top_ = current_;
  interval_ = options_.interval;
  landed_.assign(candidates_.size(), 0);
  landed_ns_.assign(candidates_.size(), 0);
}

bool BatchSizeTuner::Sample::MostlyCapped() const {
  return 2 * capped >= static_cast<int>(per_item_ns.size());
}

void BatchSizeTuner::Sample::Add(int64_t items, int64_t ns, bool was_capped) {
  per_item_ns.push_back(static_cast<double>(ns) / static_cast<double>(items));
  total_ns += ns;
  if (was_capped) ++capped;
}

bool BatchSizeTuner::PhaseDone(const Sample& s) const {
  if (s.per_item_ns.size() >= kMaxPhaseSamples) return true;
  return s.per_item_ns.size() >= static_cast<size_t>(options_.samples) && s.total_ns >= options_.min_phase_ns;
}

double BatchSizeTuner::Median(std::vector<double>& v) {
  if (v.empty()) return 0;
  auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  return *mid;
}

int BatchSizeTuner::Bucket(int64_t items) const {
  auto it = std::lower_bound(candidates_.begin(), candidates_.end(), items);
  if (it == candidates_.end()) return static_cast<int>(candidates_.size());  // above every candidate
  return static_cast<int>(it - candidates_.begin());
}

bool BatchSizeTuner::CanProbeFrom(int b, bool capped_at_limit) const {
  if (b > std::min(current_, top_)) return false;  // a lone request larger than the limit
  if (b > 0) return true;                          // a smaller limit would cut these batches
  return b == current_ && capped_at_limit && current_ + 1 <= top_;
}

bool BatchSizeTuner::SetCeiling(int64_t max_items) {
  const int64_t before = limit();
  const auto within = std::upper_bound(candidates_.begin(), candidates_.end(), max_items) - candidates_.begin();
  top_ = std::max(static_cast<int>(within) - 1, 0);
  // A phase measuring above the ceiling ends (its batches can no longer form).
  if ((phase_ == Phase::kProbe && probe_ > top_) || (phase_ == Phase::kBaseline && operating_ > top_)) ToSteady();
  return limit() != before;
}

void BatchSizeTuner::ToSteady() {
  phase_ = Phase::kSteady;
  quiet_ns_ = kQuietFactor * cycle_ns_;
  steady_ns_ = 0;
  std::fill(landed_.begin(), landed_.end(), 0);
  std::fill(landed_ns_.begin(), landed_ns_.end(), 0);
}

void BatchSizeTuner::StartProbe(int index) {
  probe_ = index;
  phase_ = Phase::kProbe;
  probe_sample_.Clear();
  misses_ = 0;
}

void BatchSizeTuner::NoteFailure() {
  if (++failures_ >= 2) interval_ = std::min(interval_ * 2, options_.max_interval);
}

bool BatchSizeTuner::Observe(int64_t items, int64_t ns, bool capped) {
  if (items < 1) return false;
  ns = std::max<int64_t>(ns, 0);
  const int b = Bucket(items);
  (phase_ == Phase::kSteady ? steady_ns_ : cycle_ns_) += ns;
  switch (phase_) {
    case Phase::kSteady: {
      if (!CanProbeFrom(b, capped)) return false;
      const auto i = static_cast<size_t>(b);
      ++landed_[i];
      landed_ns_[i] += ns;
      // The time bound grows with interval_ as probes fail.
      const double grown = static_cast<double>(interval_) / static_cast<double>(options_.interval);
      const bool enough_time =
          landed_[i] >= 2 && static_cast<double>(landed_ns_[i]) >= static_cast<double>(options_.interval_ns) * grown;
      if ((landed_[i] >= interval_ || enough_time) && steady_ns_ >= quiet_ns_) {
        operating_ = b;
        phase_ = Phase::kBaseline;
        baseline_.Clear();
        misses_ = 0;
        cycle_ns_ = 0;
      }
      return false;
    }

    case Phase::kBaseline: {
      if (b != operating_) {
        // The load moved to another bucket: start over from there.
        if (++misses_ > MissBudget()) ToSteady();
        return false;
      }
      baseline_.Add(items, ns, capped);
      if (!PhaseDone(baseline_)) return false;
      baseline_cost_ = Median(baseline_.per_item_ns);
      // Down: a smaller limit cuts these batches. Up: only when the limit
      // itself cut most of them short.
      const int down = operating_ - 1;
      const bool up_ok = operating_ == current_ && current_ + 1 <= top_ && baseline_.MostlyCapped();
      int pick = -1;
      for (int dir : {direction_, -direction_}) {
        if (dir < 0 && down >= 0) pick = down;
        if (dir > 0 && up_ok) pick = current_ + 1;
        if (pick >= 0) break;
      }
      if (pick < 0) {
        NoteFailure();
        ToSteady();
        return false;
      }
      direction_ = pick > operating_ ? 1 : -1;
      StartProbe(pick);
      return true;
    }

    case Phase::kProbe: {
      if (b != probe_) {
        // Batches formed before the probe began, or a queue that no longer
        // fills the probe size: give up after a while (not a failure).
        if (++misses_ > MissBudget()) {
          direction_ = -direction_;
          ToSteady();
          return true;
        }
        return false;
      }
      probe_sample_.Add(items, ns, capped);
      if (!PhaseDone(probe_sample_)) return false;
      const double cost = Median(probe_sample_.per_item_ns);
      if (cost < baseline_cost_ * (1.0 - options_.margin)) {
        // Better: take it and try the next size the same way at once, with
        // this probe's cost as the baseline.
        current_ = probe_;
        operating_ = probe_;
        failures_ = 0;
        interval_ = options_.interval;
        baseline_cost_ = cost;
        const int next = current_ + direction_;
        const bool next_ok = direction_ < 0 ? next >= 0 : next <= top_ && probe_sample_.MostlyCapped();
        if (next_ok) {
          StartProbe(next);
          return true;
        }
        ToSteady();
        quiet_ns_ = 0;  // a move: probing may go on as soon as the interval allows
        return false;   // the probe size is now the settled limit
      }
      // A plateau (within the margin of the baseline): try the next size the
      // same way, against the same baseline.
      const int further = probe_ + direction_;
      const bool further_ok = direction_ < 0 ? further >= 0 : further <= top_ && probe_sample_.MostlyCapped();
      if (cost <= baseline_cost_ * (1.0 + options_.margin) && further_ok) {
        StartProbe(further);
        return true;
      }
      // Not better: back to the settled limit; the other direction next time,
      // and after two failures in a row, wait longer before probing again.
      direction_ = -direction_;
      NoteFailure();
      ToSteady();
      return true;
    }
  }
  return false;
}

}  // namespace quern
