// BatchDelayTuner on simulated time: one model instance whose batches cost
// a synthetic curve (a fixed part per batch and a part per item), fed by an
// open loop (Poisson arrivals at a rate) or by closed-loop clients (each
// sends again once answered). The two modes as the batcher applies them:
// "follow" sends a batch as soon as the instance is free (every closed-loop
// client is then queued), "wait" holds it until the batching delay has
// passed for its oldest request, it is full, or waiting longer would break
// the latency target. Each load is also run with each mode fixed, which
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
  double wait_share = 0;  // of the items, in batches formed in the wait mode
};

class Sim {
 public:
  // `tuned`: the tuner decides; otherwise the mode is fixed to `fixed_wait`.
  Sim(bool tuned, bool fixed_wait) : fixed_wait_(fixed_wait) {
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
    // A closed loop's clients: those of the last load keep their requests
    // in flight; new ones start now, surplus ones stop once answered.
    clients_ = load.rate > 0 ? 0 : load.clients;
    while (static_cast<int>(in_flight_) < clients_) Arrive(now_);
    int64_t answered = 0, run_ns = 0, items = 0, waited = 0;
    std::vector<int64_t> latencies;
    while (now_ < end) {
      // The next event: an arrival, the running batch's end, or the
      // moment the waiting batch must leave.
      int64_t t = std::min(next_arrival_, busy_until_);
      if (busy_until_ == INT64_MAX && !queue_.empty()) t = std::min(t, LeaveAt());
      if (t >= end) {
        now_ = end;
        break;
      }
      now_ = t;
      if (now_ == busy_until_) {
        const int64_t cost = busy_until_ - started_;
        for (int64_t enq : running_) {
          if (now_ >= measure_from) latencies.push_back(now_ - enq);
          --in_flight_;
          if (static_cast<int>(in_flight_) < clients_) Arrive(now_);  // the client sends again
        }
        if (now_ >= measure_from) {
          answered += static_cast<int64_t>(running_.size());
          run_ns += cost;
          items += static_cast<int64_t>(running_.size());
          waited += running_wait_ ? static_cast<int64_t>(running_.size()) : 0;
        }
        if (tuner_) {
          tuner_->Observe(now_, static_cast<int64_t>(running_.size()), cost, now_ - running_.front());
        }
        running_.clear();
        busy_until_ = INT64_MAX;
      }
      if (now_ == next_arrival_) {
        Arrive(now_);
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
    o.wait_share = items ? static_cast<double>(waited) / static_cast<double>(items) : 0;
    return o;
  }

  bool wait() const { return tuner_ ? tuner_->wait() : fixed_wait_; }
  bool settled_wait() const { return tuner_ ? tuner_->settled_wait() : fixed_wait_; }

  static constexpr int64_t kTargetNs = 20 * kMs;

 private:
  static constexpr int64_t kDelayNs = 2 * kMs;
  static constexpr int64_t kMaxBatch = 64;
  static int64_t Cost(int64_t items) { return 40'000 + 40'000 * items; }  // ns

  int64_t Gap(double rate) {
    std::exponential_distribution<double> gap(rate);
    return std::max<int64_t>(1, static_cast<int64_t>(gap(rng_) * 1e9));
  }
  void Arrive(int64_t t) {
    queue_.push_back(t);
    ++in_flight_;
  }
  // When the queued batch leaves (the instance being free).
  int64_t LeaveAt() const {
    if (!wait() || static_cast<int64_t>(queue_.size()) >= kMaxBatch) return now_;
    const int64_t oldest = queue_.front();
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(queue_.size()), kMaxBatch);
    return std::max(now_, std::min(oldest + kDelayNs, oldest + kTargetNs - Cost(n)));
  }
  void Start() {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(queue_.size()), kMaxBatch);
    running_.assign(queue_.begin(), queue_.begin() + n);
    queue_.erase(queue_.begin(), queue_.begin() + n);
    running_wait_ = wait();
    started_ = now_;
    busy_until_ = now_ + Cost(n);
  }

  std::optional<BatchDelayTuner> tuner_;
  bool fixed_wait_;
  std::mt19937_64 rng_{42};
  int64_t now_ = 0;
  int64_t next_arrival_ = INT64_MAX;
  int64_t busy_until_ = INT64_MAX;
  int64_t started_ = 0;
  int clients_ = 0;
  size_t in_flight_ = 0;
  std::deque<int64_t> queue_;
  std::vector<int64_t> running_;
  bool running_wait_ = false;
};

TEST(BatchDelayTuner, AnOpenLoopWaitsOutTheDelayAndSavesRunTime) {
  const Load open{3000, 0, 10};
  Sim tuned(true, false), follow(false, false), wait(false, true);
  const Outcome t = tuned.Run(open), f = follow.Run(open), w = wait.Run(open);
  // Independent expectations: waiting fills batches (~6 arrivals in 2 ms),
  // which the cost curve makes ~40 % cheaper per item than batches of one.
  ASSERT_LT(w.run_ns_per_item, 0.75 * f.run_ns_per_item) << "the simulated curve must reward batching";
  EXPECT_TRUE(tuned.settled_wait());
  EXPECT_GT(t.wait_share, 0.8);
  EXPECT_LT(t.run_ns_per_item, 0.8 * f.run_ns_per_item);
  EXPECT_LE(t.p99_ns, Sim::kTargetNs);
  EXPECT_GT(t.answered_per_s, 0.95 * 3000);
}

TEST(BatchDelayTuner, ClosedLoopClientsAreNotMadeToWait) {
  for (int clients : {1, 16, 64}) {
    const Load closed{0, clients, 10};
    Sim tuned(true, true), follow(false, false), wait(false, true);  // the tuned one starts waiting
    const Outcome t = tuned.Run(closed), f = follow.Run(closed), w = wait.Run(closed);
    const double best = std::max(f.answered_per_s, w.answered_per_s);
    EXPECT_FALSE(tuned.settled_wait()) << clients << " clients";
    EXPECT_GE(t.answered_per_s, 0.9 * best) << clients << " clients";
    EXPECT_LE(t.p99_ns, Sim::kTargetNs) << clients << " clients";
  }
}

TEST(BatchDelayTuner, StepsInTheLoadKeepTheTargetAndNineTenthsOfTheBestFixedSetting) {
  // The steps (1 -> 16 -> 64 closed-loop clients), then an open
  // loop and back to one client: each step's second half against the
  // better fixed mode on the same load from the same state.
  const std::vector<Load> steps = {{0, 1, 5}, {0, 16, 5}, {0, 64, 5}, {3000, 0, 5}, {0, 1, 5}};
  Sim tuned(true, false), follow(false, false), wait(false, true);
  for (size_t i = 0; i < steps.size(); ++i) {
    const Outcome t = tuned.Run(steps[i]), f = follow.Run(steps[i]), w = wait.Run(steps[i]);
    EXPECT_LE(t.p99_ns, Sim::kTargetNs) << "step " << i;
    if (steps[i].rate > 0) {
      // An open loop answers the rate either way: the better mode is the
      // one that runs cheaper, and the tuner settles on it. Its probes of
      // the other mode (a phase of 2000 items) cost some of the saving.
      EXPECT_TRUE(tuned.settled_wait()) << "step " << i;
      EXPECT_LE(t.run_ns_per_item, 1.2 * std::min(f.run_ns_per_item, w.run_ns_per_item)) << "step " << i;
    } else {
      EXPECT_FALSE(tuned.settled_wait()) << "step " << i;
      EXPECT_GE(t.answered_per_s, 0.9 * std::max(f.answered_per_s, w.answered_per_s)) << "step " << i;
    }
  }
}

TEST(BatchDelayTuner, BaselinesThatDisagreeDecideNothing) {
  // The rate doubles between the two baselines: the load changed under the
  // comparison, so the probe (far better on rate) is not taken.
  BatchDelayTunerOptions o;
  o.target_ns = 20 * kMs;
  o.interval_ns = 0;
  o.phase_items = 1000;
  BatchDelayTuner tuner(o);
  int64_t t = 0;
  auto feed = [&](int64_t gap_ns, int n) {
    for (int i = 0; i < n; ++i) {
      t += gap_ns;
      tuner.Observe(t, 1, 10'000, gap_ns);
    }
  };
  feed(100'000, 1);  // starts steady; the interval (0) has passed
  ASSERT_FALSE(tuner.wait());
  feed(100'000, 1001);  // baseline: 10k items/s
  ASSERT_TRUE(tuner.wait()) << "probing the other mode";
  feed(50'000, 2001);  // probe: 20k items/s
  ASSERT_FALSE(tuner.wait()) << "the second baseline";
  feed(50'000, 2001);  // the second baseline at 20k items/s too: the load changed
  EXPECT_FALSE(tuner.settled_wait());
}

}  // namespace
}  // namespace quern
