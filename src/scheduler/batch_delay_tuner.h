// BatchDelayTuner: decides, online, when a batch of a model with a latency
// target and a batching delay leaves: as soon as an instance is free, once
// every recent client is queued, or after the delay.
//
// Loads want different things. Clients that send their next request only
// once answered (a closed loop) bring nobody a delay could wait for once
// they are all queued: waiting only slows them (a lone client at 2 ms per
// request instead of 0.25), and even waiting for the last of them can cost
// more than it saves (16 clients: the instance idles while stragglers are
// on their way). Requests that arrive at a rate whatever the answers (an
// open loop: cameras, other services) keep arriving while a batch waits: a
// delay fills batches and saves CPU per request, paid in latency the target
// allows. Counting who is here cannot tell these apart at a light load (a
// lone closed-loop client and an open loop under one request on average
// look alike), so the tuner measures: it runs another way for a phase
// between two phases of the current one (baseline, probe, baseline again),
// and takes the probe when the model answered more items per second in it,
// or as many for less run time per item, with the longest wait of its
// batches' 99th percentile under the target. Baselines that disagree on the
// rate (the load changed meanwhile) decide nothing. The probes try the two
// other ways in turn, back to back at first, after a move and when the load
// changed (a rate far from the one settled on, or baselines that disagree);
// otherwise each decision spaces the next probe out (up to max_interval_ns).
//
// Pure logic with no clock or threads; the caller passes the time and
// serialises access.
#pragma once

#include <cstdint>
#include <vector>

namespace quern {

// When a batch that could take more requests leaves.
enum class BatchLeave {
  kAtOnce,        // as soon as an instance is free
  kEveryoneHere,  // once as many are queued or running as the model held on average lately, else after the delay
  kAfterDelay,    // after the batching delay (or full, or in time for the target)
};

struct BatchDelayTunerOptions {
  // The latency target (ns) the probes' waits must stay under.
  int64_t target_ns = 0;
  // A phase lasts at least this long and min_phase_batches batches, until
  // it holds phase_items items or lasts max_phase_ns (a probe at half the
  // baseline's rate or less ends as soon as it has the minimum, and one
  // whose batch waited past the target at once).
  int64_t min_phase_ns = 100'000'000;
  int64_t max_phase_ns = 500'000'000;
  int min_phase_batches = 16;
  int64_t phase_items = 2000;
  // Time in one mode before the first probe, and after a new load or an
  // undecided comparison; it doubles with each decision, up to
  // max_interval_ns.
  int64_t interval_ns = 1'000'000'000;
  int64_t max_interval_ns = 8'000'000'000;
  // To win on cost (run time per item cost_margin below the baselines'), the
  // probe's rate must be within rate_margin and three standard deviations
  // of the counts of theirs; to win on rate alone it must beat theirs by as
  // much (as if items arrived at random: an open loop's rate is the same in
  // either mode, and 2000 items vary by ~2 %).
  double rate_margin = 0.05;
  double cost_margin = 0.05;
  // Baselines whose rates differ by more than this (and three standard
  // deviations of their counts) saw the load change.
  double baseline_agreement = 0.10;
  // A rate this many times the settled one (or below its inverse), over a
  // window of min_phase_ns and min_phase_batches, is a new load: the next
  // probe comes at once.
  double load_change = 1.5;
};

class BatchDelayTuner {
 public:
  explicit BatchDelayTuner(BatchDelayTunerOptions options);

  // How batches leave now (a probe's way while one runs); kEveryoneHere
  // before any measurement.
  BatchLeave leave() const { return phase_ == Phase::kProbe ? probe_leave_ : settled_; }
  // The way settled on.
  BatchLeave settled() const { return settled_; }

  // Reports a batch that ended at `now_ns`: its items, its run time, and
  // the longest time one of its tasks took from enqueue to now. Returns
  // true when leave() changed.
  bool Observe(int64_t now_ns, int64_t items, int64_t run_ns, int64_t latency_ns);

 private:
  enum class Phase { kSteady, kBaseline, kProbe, kBaselineAgain };
  struct Sample {
    int64_t start_ns = 0;
    int64_t end_ns = 0;
    int64_t items = 0;
    int64_t run_ns = 0;
    int batches = 0;
    std::vector<int64_t> latencies;
    void Start(int64_t now_ns);
    void Add(int64_t now_ns, int64_t n, int64_t ns, int64_t latency_ns);
    double Rate() const;  // items per second
    double CostPerItem() const;
    int64_t P99();  // reorders latencies
  };
  bool PhaseDone(const Sample& s) const;
  // Starts the next phase at `now_ns`.
  void Begin(Phase phase, int64_t now_ns);
  // After the second baseline: takes the probe's mode or keeps the current.
  void Decide(int64_t now_ns);

  BatchDelayTunerOptions options_;
  BatchLeave settled_ = BatchLeave::kEveryoneHere;
  BatchLeave probe_leave_ = BatchLeave::kAtOnce;
  int next_probe_ = 0;  // which of the two other ways the next probe tries
  // Probes still to run back to back (a new load is measured both other
  // ways before the interval grows).
  int quick_probes_ = 2;
  bool started_ = false;
  Phase phase_ = Phase::kSteady;
  int64_t phase_start_ns_ = 0;
  int64_t interval_ns_;
  Sample window_;  // kSteady: the rate over the last phase-long window
  Sample baseline_, probe_, baseline_again_;
  double settled_rate_ = 0;  // the baselines' rate when a decision was last taken
};

}  // namespace quern
