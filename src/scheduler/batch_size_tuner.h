// BatchSizeTuner: finds the batch size limit at which a busy model's
// instances compute the most items per second.
//
// The largest batch is not always the fastest: on a CPU a large batch can
// fall out of cache (a 640x640 detector runs 1.2-1.3x more images per second at
// batch 1 than at batch 8), and one instance per core already keeps every
// core busy. Candidate sizes split batches into buckets (size in (c[i-1],
// c[i]]). The tuner watches where batches land: once `interval` batches (or
// `interval_ns` of batch time) land in one bucket it measures them (the
// baseline), then probes a neighbour by moving the limit: one size down
// (batches would be cut smaller), or one size up when the limit itself cut
// the batches short (the queue held more). The comparison is paired
// (baseline re-measured right before each probe, median time per item); the
// probe is kept when it is cheaper by `margin`, and the tuner goes on in that
// direction. A probe within the margin of the baseline (a plateau: 8 -> 4
// saves 2 %, 4 -> 1 saves 13 %) does not end the walk: the next size in the
// same direction is probed against the same baseline. Probes that fail flip
// the direction and, two in a row, space the next ones out (up to
// `max_interval` batches), and after probing that moved nothing the next
// starts only when the batches have run at the settled limit for 8 times the
// probing's batch time, so a model at its best size pays little for
// probing. Batches of a light load (smaller than the limit, in the lowest
// bucket) never start a probe.
//
// Pure logic with no clock or threads; the caller serialises access.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace quern {

struct BatchSizeTunerOptions {
  // Sizes the limit may take (sorted and deduplicated); the largest is the
  // starting limit.
  std::vector<int64_t> candidates;
  // Batches measured per phase (baseline, probe), and at least this much
  // batch time in total, so that tiny batches are not judged on a few
  // microseconds.
  int samples = 8;
  int64_t min_phase_ns = 20'000'000;
  // Batches in one bucket before a probe: at first and after a move, and the
  // most it grows to while probes fail.
  int interval = 16;
  int max_interval = 4096;
  // Or this much batch time in one bucket (at least two batches), grown in
  // the same proportion: slow batches (a large model, ~0.4 s for 8 images)
  // start probing within a second instead of after 16 batches.
  int64_t interval_ns = 500'000'000;
  // A neighbour must be this much cheaper per item to be taken.
  double margin = 0.03;
};

class BatchSizeTuner {
 public:
  explicit BatchSizeTuner(BatchSizeTunerOptions options);

  // The limit to form batches with now (a probe's size while one runs).
  int64_t limit() const { return candidates_[Capped(phase_ == Phase::kProbe ? probe_ : current_)]; }
  // The limit the tuner has settled on.
  int64_t settled_limit() const { return candidates_[Capped(current_)]; }

  // Candidates above `max_items` are left out (the largest candidate within
  // it stays, the smallest if none is) until another ceiling is set: a
  // settled limit above it is held at it, a probe above it abandoned, and
  // none is started there. INT64_MAX: every candidate. Returns true when
  // limit() changed.
  bool SetCeiling(int64_t max_items);

  // Reports one executed batch: `items` in it, `ns` it took, `capped` when
  // the limit cut it short (more was waiting). Returns true when limit()
  // changed.
  bool Observe(int64_t items, int64_t ns, bool capped);

 private:
  enum class Phase { kSteady, kBaseline, kProbe };
  struct Sample {
    std::vector<double> per_item_ns;
    int64_t total_ns = 0;
    int capped = 0;
    void Clear() {
      per_item_ns.clear();
      total_ns = 0;
      capped = 0;
    }
    void Add(int64_t items, int64_t ns, bool was_capped);
    // Whether the limit cut at least half of these batches short.
    bool MostlyCapped() const;
  };
  bool PhaseDone(const Sample& s) const;
  // Reorders `v`.
  static double Median(std::vector<double>& v);
  // The bucket a batch of `items` falls in.
  int Bucket(int64_t items) const;
  // Whether a probe could start from batches in bucket `b`.
  bool CanProbeFrom(int b, bool capped_at_limit) const;
  void ToSteady();
  void StartProbe(int index);
  // A probe found nothing better: after two in a row, probe less often.
  void NoteFailure();
  // Batches outside the measured bucket before a phase is given up.
  int MissBudget() const;
  // Index `i` within the ceiling.
  std::size_t Capped(int i) const { return static_cast<std::size_t>(i < top_ ? i : top_); }

  BatchSizeTunerOptions options_;
  std::vector<int64_t> candidates_;
  int current_ = 0;    // index into candidates_: the settled limit (held at top_)
  int top_ = 0;        // the largest index within the ceiling (SetCeiling)
  int operating_ = 0;  // the bucket being measured (baseline)
  int probe_ = 0;
  Phase phase_ = Phase::kSteady;
  int direction_ = -1;  // -1 = probe a smaller size next, +1 = larger
  int interval_ = 0;
  std::vector<int> landed_;         // kSteady: batches per bucket since the last phase
  std::vector<int64_t> landed_ns_;  // and their time
  int misses_ = 0;                  // kBaseline / kProbe: batches outside the measured bucket
  int failures_ = 0;                // probes in a row that found nothing better
  int64_t cycle_ns_ = 0;            // batch time since the current baseline began
  int64_t steady_ns_ = 0;           // batch time since the last return to kSteady
  int64_t quiet_ns_ = 0;            // steady batch time required before the next probe
  Sample baseline_, probe_sample_;
  double baseline_cost_ = 0;
};

}  // namespace quern
