// BatchSizeTuner: finds, while a model is saturated, the batch size limit at
// which its instances compute the most items per second.
//
// The largest batch is not always the fastest: on a CPU a large batch can
// fall out of cache (a 640x640 detector runs 1.3x faster per image at batch 1
// than at batch 8), and one instance per core already keeps every core busy.
// The tuner only acts on batches that the limit cut short (the queue held
// more): those are the ones the limit decides. It hill-climbs over candidate
// sizes with paired measurements: the per-item cost at the current limit,
// measured again right before each probe, against the cost at a neighbouring
// candidate. It moves when the neighbour is cheaper by `margin`, keeps going
// in that direction, and spaces out probes (up to `max_interval` batches)
// while they keep failing, so a model at its best pays little for probing.
//
// Pure logic with no clock or threads; the caller serialises access.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace quern {

struct BatchSizeTunerOptions {
  // Sizes the limit may take, ascending; the last one is the starting limit.
  std::vector<int64_t> candidates;
  // Batches measured per phase (baseline, probe), and at least this much
  // batch time in total, so that tiny batches are not judged on a few
  // microseconds.
  int samples = 8;
  int64_t min_phase_ns = 20'000'000;
  // Capped batches at the current limit between probes: at first and after a
  // move, and the most it grows to while probes fail.
  int interval = 16;
  int max_interval = 4096;
  // A neighbour must be this much cheaper per item to be taken.
  double margin = 0.03;
};

class BatchSizeTuner {
 public:
  explicit BatchSizeTuner(BatchSizeTunerOptions options);

  // The limit to form batches with now.
  int64_t limit() const { return candidates_[static_cast<std::size_t>(phase_ == Phase::kProbe ? probe_ : current_)]; }
  // The limit the tuner has settled on (not a probe in progress).
  int64_t settled_limit() const { return candidates_[static_cast<std::size_t>(current_)]; }

  // Reports one executed batch: `items` in it, `ns` it took, `capped` when
  // the limit cut it short (more was waiting). Returns true when limit()
  // changed.
  bool Observe(int64_t items, int64_t ns, bool capped);

 private:
  enum class Phase { kSteady, kBaseline, kProbe };
  struct Sample {
    std::vector<double> per_item_ns;
    int64_t total_ns = 0;
    void Clear() {
      per_item_ns.clear();
      total_ns = 0;
    }
  };
  bool PhaseDone(const Sample& s) const;
  // Whether a capped batch of `items` was formed under candidates_[index]
  // (requests of several items can stop a batch short of the limit).
  bool Matches(int64_t items, int index) const;
  static double Median(std::vector<double> v);
  // Picks the neighbour to probe next, or -1 when there is none.
  int NextProbe() const;

  BatchSizeTunerOptions options_;
  std::vector<int64_t> candidates_;
  int current_ = 0;  // index into candidates_
  int probe_ = 0;
  Phase phase_ = Phase::kSteady;
  int direction_ = -1;  // -1 = probe a smaller size next, +1 = larger
  int interval_ = 0;    // capped batches to wait before the next probe
  int waited_ = 0;      // capped batches seen in kSteady
  int probe_misses_ = 0;
  int failures_ = 0;  // probes in a row that found nothing better
  Sample baseline_, probe_sample_;
  double baseline_cost_ = 0;
};

}  // namespace quern
