// BatchDelayTuner on simulated time: one model instance whose batches cost
// a synthetic curve (a fixed part per batch and a part per item), fed by an
// open loop (Poisson arrivals at a rate) or by closed-loop clients (each
// sends again 50-250 us after its answer). The three ways a batch leaves, as
// the batcher applies them: at once when the instance is free; once as many
// are queued as the model held on average over the last 2 ms, else after
// the delay; after the batching delay for its oldest request. A batch also
// leaves when full, or when waiting longer would break the latency target.
// Each load is also run with each way fixed, from the same state, which
// gives the expected best independently of the tuner.
#include "scheduler/batch_delay_tuner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <optional>
#include <random>
#include <vector>

namespace quern {
namespace {

constexpr int64_t kMs = 1'000'000;
constexpr int64_t kS = 1'000'000'000;

struct Load {
  double rate = 0;  // open loop: requests per second; 0 = closed loop
  int clients = 0;  // closed loop
  int64_t seconds = 5;
};

struct Outcome {
  double answered_per_s = 0;
  double run_ns_per_item = 0;
  int64_t p99_ns = 0;
};

class Sim {
 public:
  // `tuned`: the tuner decides; otherwise batches always leave as `fixed` says.
  Sim(bool tuned, BatchLeave fixed) : fixed_(fixed) {
    if (tuned) {
      BatchDelayTunerOptions o;
      o.target_ns = kTargetNs;
      tuner_.emplace(o);
    }
  }

  // Runs `load` for its seconds from where the last one left; measures its
  // second half.
  Outcome Run(const Load& load) {
    const int64_t end = now_ + load.seconds * kS;
    const int64_t measure_from = now_ + load.seconds * kS / 2;
    next_arrival_ = load.rate > 0 ? now_ + Gap(load.rate) : INT64_MAX;
    // A closed loop's clients: those of the last load finish what they
    // have in flight; new ones start now.
    clients_ = load.rate > 0 ? 0 : load.clients;
    while (active_ < clients_) {
      ++active_;
      Arrive(now_, true);
    }
    int64_t answered = 0, run_ns = 0, items = 0;
    std::vector<int64_t> latencies;
    while (now_ < end) {
      // The next event: an arrival (open loop, or a client back from its
      // turnaround), the running batch's end, or the moment the waiting
      // batch leaves.
      int64_t t = std::min(next_arrival_, busy_until_);
      if (!returns_.empty()) t = std::min(t, returns_.front());
      if (busy_until_ == INT64_MAX && !queue_.empty()) t = std::min(t, LeaveAt());
      if (t >= end) {
        now_ = end;
        break;
      }
      now_ = t;
      if (now_ == busy_until_) {
        const int64_t cost = busy_until_ - started_;
        TrackLoad();
        for (const Request& r : running_) {
          if (now_ >= measure_from) latencies.push_back(now_ - r.enqueued);
          if (!r.client) continue;
          if (active_ > clients_) {
            --active_;  // a client of an earlier, larger load stops
          } else {
            returns_.push_back(now_ + Turnaround());
          }
        }
        std::sort(returns_.begin(), returns_.end());
        if (now_ >= measure_from) {
          answered += static_cast<int64_t>(running_.size());
          run_ns += cost;
          items += static_cast<int64_t>(running_.size());
        }
        if (tuner_ &&
            tuner_->Observe(now_, static_cast<int64_t>(running_.size()), cost, now_ - running_.front().enqueued) &&
            getenv("TRACE"))
          printf("  t=%.3f leave %d settled %d\n", now_ / 1e9, (int)tuner_->leave(), (int)tuner_->settled());
        running_.clear();
        busy_until_ = INT64_MAX;
      }
      while (!returns_.empty() && returns_.front() == now_) {
        returns_.pop_front();
        Arrive(now_, true);
      }
      if (now_ == next_arrival_) {
        Arrive(now_, false);
        next_arrival_ = now_ + Gap(load.rate);
      }
      if (busy_until_ == INT64_MAX && !queue_.empty() && now_ >= LeaveAt()) Start();
    }
    Outcome o;
    const double span = static_cast<double>(end - measure_from) / 1e9;
    o.answered_per_s = static_cast<double>(answered) / span;
    o.run_ns_per_item = items ? static_cast<double>(run_ns) / static_cast<double>(items) : 0;
    if (!latencies.empty()) {
      const auto k = static_cast<size_t>(std::ceil(0.99 * static_cast<double>(latencies.size()))) - 1;
      std::nth_element(latencies.begin(), latencies.begin() + static_cast<std::ptrdiff_t>(k), latencies.end());
      o.p99_ns = latencies[k];
    }
    return o;
  }

  BatchLeave settled() const { return tuner_ ? tuner_->settled() : fixed_; }

  static constexpr int64_t kTargetNs = 20 * kMs;

 private:
  static constexpr int64_t kDelayNs = 2 * kMs;
  static constexpr int64_t kMaxBatch = 64;
  static constexpr int64_t kLoadWindowNs = 2 * kMs;
  static int64_t Cost(int64_t items) { return 40'000 + 40'000 * items; }  // ns

  BatchLeave leave() const { return tuner_ ? tuner_->leave() : fixed_; }
  int64_t Gap(double rate) {
    std::exponential_distribution<double> gap(rate);
    return std::max<int64_t>(1, static_cast<int64_t>(gap(rng_) * 1e9));
  }
  // A closed-loop client's time from its answer to its next request (the
  // network and its own work): 50-250 us.
  int64_t Turnaround() { return std::uniform_int_distribution<int64_t>(50'000, 250'000)(rng_); }
  // The model's load (queued and running) averaged over kLoadWindowNs, as
  // the batcher keeps it; brought up to now before the counts change.
  void TrackLoad() {
    const double keep = std::exp(-static_cast<double>(now_ - load_at_) / static_cast<double>(kLoadWindowNs));
    average_load_ = keep * average_load_ + (1 - keep) * static_cast<double>(queue_.size() + running_.size());
    load_at_ = now_;
  }
  struct Request {
    int64_t enqueued;
    bool client;  // a closed-loop client's (it sends again once answered)
  };
  void Arrive(int64_t t, bool client) {
    TrackLoad();
    queue_.push_back({t, client});
  }
  // When the queued batch leaves (the instance being free).
  int64_t LeaveAt() const {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(queue_.size()), kMaxBatch);
    if (leave() == BatchLeave::kAtOnce || n >= kMaxBatch) return now_;
    if (leave() == BatchLeave::kEveryoneHere &&
        static_cast<int64_t>(queue_.size()) >= std::max<int64_t>(1, std::llround(average_load_))) {
      return now_;
    }
    const int64_t oldest = queue_.front().enqueued;
    return std::max(now_, std::min(oldest + kDelayNs, oldest + kTargetNs - Cost(n)));
  }
  void Start() {
    TrackLoad();
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(queue_.size()), kMaxBatch);
    running_.assign(queue_.begin(), queue_.begin() + n);
    queue_.erase(queue_.begin(), queue_.begin() + n);
    started_ = now_;
    busy_until_ = now_ + Cost(n);
  }

  std::optional<BatchDelayTuner> tuner_;
  BatchLeave fixed_;
  std::mt19937_64 rng_{42};
  int64_t now_ = 0;
  int64_t next_arrival_ = INT64_MAX;
  int64_t busy_until_ = INT64_MAX;
  int64_t started_ = 0;
  int clients_ = 0;
  int active_ = 0;  // closed-loop clients, queued, running or on their way back
  std::deque<Request> queue_;
  std::deque<int64_t> returns_;  // when clients send again, ascending
  std::vector<Request> running_;
  double average_load_ = 0;
  int64_t load_at_ = 0;
};

constexpr BatchLeave kWays[] = {BatchLeave::kAtOnce, BatchLeave::kEveryoneHere, BatchLeave::kAfterDelay};

// Each way fixed on the same loads, from the same state: what the tuner is
// measured against.
struct Fixed {
  Sim sims[3] = {Sim(false, kWays[0]), Sim(false, kWays[1]), Sim(false, kWays[2])};
  Outcome runs[3];
  void Run(const Load& load) {
    for (int i = 0; i < 3; ++i) runs[i] = sims[i].Run(load);
  }
  double BestRate() const { return std::max({runs[0].answered_per_s, runs[1].answered_per_s, runs[2].answered_per_s}); }
  double LeastCost() const {
    return std::min({runs[0].run_ns_per_item, runs[1].run_ns_per_item, runs[2].run_ns_per_item});
  }
};

TEST(BatchDelayTuner, AnOpenLoopWaitsOutTheDelayAndSavesRunTime) {
  const Load open{3000, 0, 10};
  Sim tuned(true, BatchLeave::kEveryoneHere);
  Fixed fixed;
  const Outcome t = tuned.Run(open);
  fixed.Run(open);
  // Independent expectations: waiting fills batches (~6 arrivals in 2 ms),
  // which the cost curve makes ~40 % cheaper per item than batches of one.
  ASSERT_LT(fixed.runs[2].run_ns_per_item, 0.75 * fixed.runs[0].run_ns_per_item)
      << "the simulated curve must reward batching";
  EXPECT_EQ(tuned.settled(), BatchLeave::kAfterDelay);
  EXPECT_LT(t.run_ns_per_item, 0.8 * fixed.runs[0].run_ns_per_item);
  EXPECT_LT(t.run_ns_per_item, 0.8 * fixed.runs[1].run_ns_per_item);
  EXPECT_LE(t.p99_ns, Sim::kTargetNs);
  EXPECT_GT(t.answered_per_s, 0.95 * 3000);
}

TEST(BatchDelayTuner, ClosedLoopClientsAreNotMadeToWait) {
  for (int clients : {1, 16, 64}) {
    const Load closed{0, clients, 10};
    Sim tuned(true, BatchLeave::kAfterDelay);  // it starts waiting: the worst way for a closed loop
    Fixed fixed;
    const Outcome t = tuned.Run(closed);
    fixed.Run(closed);
    EXPECT_NE(tuned.settled(), BatchLeave::kAfterDelay) << clients << " clients";
    EXPECT_GE(t.answered_per_s, 0.9 * fixed.BestRate()) << clients << " clients";
    EXPECT_LE(t.p99_ns, Sim::kTargetNs) << clients << " clients";
  }
}

TEST(BatchDelayTuner, StepsInTheLoadKeepTheTargetAndNineTenthsOfTheBestFixedSetting) {
  // The steps (1 -> 16 -> 64 closed-loop clients), then an open
  // loop and back to one client: each step's second half against the
  // better fixed mode on the same load from the same state.
  const std::vector<Load> steps = {{0, 1, 5}, {0, 16, 5}, {0, 64, 5}, {3000, 0, 5}, {0, 1, 5}};
  Sim tuned(true, BatchLeave::kEveryoneHere);
  Fixed fixed;
  for (size_t i = 0; i < steps.size(); ++i) {
    const Outcome t = tuned.Run(steps[i]);
    fixed.Run(steps[i]);
    EXPECT_LE(t.p99_ns, Sim::kTargetNs) << "step " << i;
    if (steps[i].rate > 0) {
      // An open loop answers the rate either way: the better way is the
      // one that runs cheaper, and the tuner settles on it. Its probes of
      // the others (a phase of 2000 items each) cost some of the saving.
      EXPECT_EQ(tuned.settled(), BatchLeave::kAfterDelay) << "step " << i;
      EXPECT_LE(t.run_ns_per_item, 1.2 * fixed.LeastCost()) << "step " << i;
    } else {
      EXPECT_NE(tuned.settled(), BatchLeave::kAfterDelay) << "step " << i;
      EXPECT_GE(t.answered_per_s, 0.9 * fixed.BestRate()) << "step " << i;
    }
  }
}

// A tuner that probes at once (interval 0) with phases of 1000 items and a
// 20 ms target, fed by hand.
struct HandFed {
  static BatchDelayTunerOptions Options() {
    BatchDelayTunerOptions o;
    o.target_ns = 20 * kMs;
    o.interval_ns = 0;
    o.phase_items = 1000;
    return o;
  }
  BatchDelayTuner tuner{Options()};
  int64_t t = 0;
  // n batches of one item, gap_ns apart, each having waited gap_ns.
  void Feed(int64_t gap_ns, int n) {
    for (int i = 0; i < n; ++i) {
      t += gap_ns;
      tuner.Observe(t, 1, 10'000, gap_ns);
    }
  }
};

TEST(BatchDelayTuner, BaselinesThatDisagreeDecideNothing) {
  // The rate doubles between the two baselines: the load changed under the
  // comparison, so the probe (far better on rate) is not taken.
  HandFed h;
  BatchDelayTuner& tuner = h.tuner;
  auto feed = [&](int64_t gap_ns, int n) { h.Feed(gap_ns, n); };
  feed(100'000, 1);  // starts steady; the interval (0) has passed
  ASSERT_EQ(tuner.leave(), BatchLeave::kEveryoneHere);
  feed(100'000, 1001);  // baseline: 10k items/s
  ASSERT_NE(tuner.leave(), BatchLeave::kEveryoneHere) << "probing another way";
  feed(50'000, 2001);  // probe: 20k items/s
  ASSERT_EQ(tuner.leave(), BatchLeave::kEveryoneHere) << "the second baseline";
  feed(50'000, 2001);  // the second baseline at 20k items/s too: the load changed
  EXPECT_EQ(tuner.settled(), BatchLeave::kEveryoneHere);
}

TEST(BatchDelayTuner, AProbeThatBreaksTheTargetEndsAtOnceAndIsNotTaken) {
  // Near the model's capacity a costlier way builds a queue: its first
  // batch that waited past the target ends the probe, and the way is not
  // taken, however cheap or fast its batches were.
  HandFed h;
  BatchDelayTuner& tuner = h.tuner;
  int64_t& t = h.t;
  tuner.Observe(t += 100'000, 1, 50'000, 50'000);  // starts steady; the interval (0) has passed
  for (int i = 0; i < 1001; ++i) tuner.Observe(t += 100'000, 1, 50'000, 50'000);  // baseline
  const BatchLeave probed = tuner.leave();
  ASSERT_NE(probed, BatchLeave::kEveryoneHere);
  for (int i = 0; i < 5; ++i) tuner.Observe(t += 50'000, 2, 10'000, 40'000);  // a fast, cheap start
  ASSERT_EQ(tuner.leave(), probed);
  // A request that came 5 ms into the probe, answered 25 ms later: past the target.
  tuner.Observe(t += 30 * kMs, 2, 10'000, 25 * kMs);
  EXPECT_EQ(tuner.leave(), BatchLeave::kEveryoneHere) << "the probe went on past the target";
  for (int i = 0; i < 1001; ++i) tuner.Observe(t += 100'000, 1, 50'000, 50'000);  // the second baseline
  EXPECT_EQ(tuner.settled(), BatchLeave::kEveryoneHere);
}

TEST(BatchDelayTuner, AfterTakingAWayItComparesItWithTheThirdNotWithTheOneItLeft) {
  HandFed h;
  BatchDelayTuner& tuner = h.tuner;
  auto feed = [&](int64_t gap_ns, int n) { h.Feed(gap_ns, n); };
  // One comparison: a baseline at 10k items/s, the probe at `probe_gap_ns`,
  // the second baseline at 10k.
  // (Each phase ends with its 1000th item once 100 ms have passed.)
  auto compare = [&](BatchLeave probed, int64_t probe_gap_ns) {
    feed(100'000, 1000);
    ASSERT_EQ(tuner.leave(), probed);
    feed(probe_gap_ns, static_cast<int>(std::max<int64_t>(1000, 100 * kMs / probe_gap_ns)));
    feed(100'000, 1000);
  };
  feed(100'000, 1);  // starts steady; the interval (0) has passed
  ASSERT_EQ(tuner.leave(), BatchLeave::kEveryoneHere);
  // The new load: both other ways probed, both slower (8k items/s).
  compare(BatchLeave::kAfterDelay, 125'000);
  compare(BatchLeave::kAtOnce, 125'000);
  ASSERT_EQ(tuner.settled(), BatchLeave::kEveryoneHere);
  feed(100'000, 1);  // steady again; the interval (0) has passed
  compare(BatchLeave::kAfterDelay, 125'000);
  feed(100'000, 1);
  compare(BatchLeave::kAtOnce, 50'000);  // now faster (20k items/s): taken
  ASSERT_EQ(tuner.settled(), BatchLeave::kAtOnce);
  // At once, the baseline of the next comparison, then its probe.
  feed(100'000, 1000);
  EXPECT_EQ(tuner.leave(), BatchLeave::kAfterDelay) << "the way left behind is probed again";
}

}  // namespace
}  // namespace quern
