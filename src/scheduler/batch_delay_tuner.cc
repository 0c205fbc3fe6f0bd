#include "scheduler/batch_delay_tuner.h"

#include <algorithm>
#include <cmath>

namespace quern {

void BatchDelayTuner::Sample::Start(int64_t now_ns) {
  start_ns = end_ns = now_ns;
  items = run_ns = 0;
  batches = 0;
  latencies.clear();
}

void BatchDelayTuner::Sample::Add(int64_t now_ns, int64_t n, int64_t ns, int64_t latency_ns) {
  end_ns = now_ns;
  items += n;
  run_ns += ns;
  ++batches;
  latencies.push_back(latency_ns);
}

double BatchDelayTuner::Sample::Rate() const {
  const int64_t span = end_ns - start_ns;
  return span > 0 ? static_cast<double>(items) * 1e9 / static_cast<double>(span) : 0;
}

double BatchDelayTuner::Sample::CostPerItem() const {
  return items > 0 ? static_cast<double>(run_ns) / static_cast<double>(items) : 0;
}

int64_t BatchDelayTuner::Sample::P99() {
  if (latencies.empty()) return 0;
  const auto k = static_cast<size_t>(std::ceil(0.99 * static_cast<double>(latencies.size()))) - 1;
  std::nth_element(latencies.begin(), latencies.begin() + static_cast<std::ptrdiff_t>(k), latencies.end());
  return latencies[k];
}

BatchDelayTuner::BatchDelayTuner(BatchDelayTunerOptions options)
    : options_(options), interval_ns_(options.interval_ns) {}

bool BatchDelayTuner::PhaseDone(const Sample& s) const {
  const int64_t span = s.end_ns - s.start_ns;
  if (span >= options_.max_phase_ns) return true;
  return span >= options_.min_phase_ns && s.batches >= options_.min_phase_batches && s.items >= options_.phase_items;
}

void BatchDelayTuner::Begin(Phase phase, int64_t now_ns) {
  phase_ = phase;
  phase_start_ns_ = now_ns;
  switch (phase) {
    case Phase::kSteady: window_.Start(now_ns); break;
    case Phase::kBaseline: baseline_.Start(now_ns); break;
    case Phase::kProbe: {
      probe_.Start(now_ns);
      // The two ways other than the settled one, in turn.
      const int settled = static_cast<int>(settled_);
      probe_leave_ = static_cast<BatchLeave>((settled + 1 + next_probe_) % 3);
      next_probe_ ^= 1;
      break;
    }
    case Phase::kBaselineAgain: baseline_again_.Start(now_ns); break;
  }
}

bool BatchDelayTuner::Observe(int64_t now_ns, int64_t items, int64_t run_ns, int64_t latency_ns) {
  const BatchLeave before = leave();
  if (!started_) {
    started_ = true;
    Begin(Phase::kSteady, now_ns);
  }
  // A batch whose oldest task came before the phase began was formed, at
  // least in part, under the previous mode: it counts in no phase. (A
  // backlog that keeps every batch that old for a whole phase ends the
  // comparison undecided.)
  if (phase_ != Phase::kSteady && now_ns - latency_ns < phase_start_ns_) {
    if (now_ns - phase_start_ns_ >= options_.max_phase_ns) Begin(Phase::kSteady, now_ns);
    return leave() != before;
  }
  switch (phase_) {
    case Phase::kSteady: {
      window_.Add(now_ns, items, run_ns, latency_ns);
      bool moved = false;
      if (window_.end_ns - window_.start_ns >= options_.min_phase_ns && window_.batches >= options_.min_phase_batches) {
        const double r = window_.Rate();
        moved =
            settled_rate_ > 0 && (r > settled_rate_ * options_.load_change || r * options_.load_change < settled_rate_);
        window_.Start(now_ns);
      }
      if (moved) {  // a new load: probe it now, both other ways
        interval_ns_ = options_.interval_ns;
        quick_probes_ = 2;
      }
      if (moved || now_ns - phase_start_ns_ >= interval_ns_) {
        Begin(Phase::kBaseline, now_ns);
      }
      break;
    }
    case Phase::kBaseline:
      baseline_.Add(now_ns, items, run_ns, latency_ns);
      if (PhaseDone(baseline_)) Begin(Phase::kProbe, now_ns);
      break;
    case Phase::kProbe: {
      probe_.Add(now_ns, items, run_ns, latency_ns);
      // A probe already far behind the baseline (a lone closed-loop client
      // made to wait) is not run to its full length, nor one that made a
      // request wait past the target (near the model's capacity, a costlier
      // way builds a queue that outlasts the probe).
      const bool losing = probe_.end_ns - probe_.start_ns >= options_.min_phase_ns &&
                          probe_.batches >= options_.min_phase_batches && probe_.Rate() * 2 < baseline_.Rate();
      const bool late = options_.target_ns > 0 && latency_ns > options_.target_ns;
      if (losing || late || PhaseDone(probe_)) Begin(Phase::kBaselineAgain, now_ns);
      break;
    }
    case Phase::kBaselineAgain:
      baseline_again_.Add(now_ns, items, run_ns, latency_ns);
      if (PhaseDone(baseline_again_)) Decide(now_ns);
      break;
  }
  return leave() != before;
}

void BatchDelayTuner::Decide(int64_t now_ns) {
  const double r1 = baseline_.Rate(), r2 = baseline_again_.Rate();
  const double rate = (r1 + r2) / 2;
  const double probe_rate = probe_.Rate();
  const int64_t target = options_.target_ns;
  const int64_t probe_p99 = probe_.P99();
  const int64_t base_p99 = std::max(baseline_.P99(), baseline_again_.P99());
  // The relative standard deviation of the probe's rate against the
  // baselines', were items to arrive at random.
  const double spread =
      std::sqrt(1.0 / static_cast<double>(std::max<int64_t>(probe_.items, 1)) +
                1.0 / static_cast<double>(std::max<int64_t>(baseline_.items + baseline_again_.items, 1)));
  enum { kKeep, kTake, kUnsure } verdict = kKeep;
  const double baselines_spread = std::sqrt(1.0 / static_cast<double>(std::max<int64_t>(baseline_.items, 1)) +
                                            1.0 / static_cast<double>(std::max<int64_t>(baseline_again_.items, 1)));
  if (rate <= 0 || std::abs(r1 - r2) > std::max(options_.baseline_agreement, 3 * baselines_spread) * rate) {
    verdict = kUnsure;  // the load changed under the comparison
  } else if (target > 0 && probe_p99 > target && base_p99 <= target) {
    verdict = kKeep;  // the probe broke the target the current mode keeps
  } else if (target > 0 && base_p99 > target && probe_p99 <= target) {
    verdict = kTake;  // and the other way round
  } else if (probe_.batches < options_.min_phase_batches) {
    verdict = kKeep;  // a probe cut short past the target: too few batches to judge by
  } else if (probe_rate > rate * (1 + std::max(options_.rate_margin, 3 * spread))) {
    verdict = kTake;
  } else if (probe_rate < rate * (1 - std::max(options_.rate_margin, 3 * spread))) {
    verdict = kKeep;
  } else {
    const double cost = (baseline_.CostPerItem() + baseline_again_.CostPerItem()) / 2;
    verdict = probe_.CostPerItem() < cost * (1 - options_.cost_margin) ? kTake : kKeep;
  }
  if (verdict == kUnsure) {
    // Measure the new load: both other ways, one after the other.
    settled_rate_ = r2;
    interval_ns_ = options_.interval_ns;
    quick_probes_ = 2;
    Begin(Phase::kSteady, now_ns);
    return;
  }
  if (verdict == kTake) {
    // The third way is compared with the one taken next, at once (not the
    // way just left, found worse already); unless this was the second probe
    // of a new load, whose first found the third way worse than the one left.
    const int third = 3 - static_cast<int>(settled_) - static_cast<int>(probe_leave_);
    settled_ = probe_leave_;
    next_probe_ = (third - static_cast<int>(settled_) + 2) % 3;
    quick_probes_ = quick_probes_ == 1 ? 0 : 1;
  } else if (quick_probes_ > 0) {
    --quick_probes_;
  }
  settled_rate_ = verdict == kTake ? probe_rate : rate;
  if (quick_probes_ > 0) {
    // The other way is probed at once (the second baseline starts its
    // comparison).
    Begin(Phase::kBaseline, now_ns);
    return;
  }
  // Otherwise the next probe comes later: a probe runs a way found worse,
  // and a new load brings the next one forward anyway.
  interval_ns_ = std::min(interval_ns_ * 2, options_.max_interval_ns);
  Begin(Phase::kSteady, now_ns);
}

}  // namespace quern
