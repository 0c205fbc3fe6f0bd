// BatchSizeTuner fed with synthetic cost curves: where it settles, how it
// treats noise, an unsaturated queue and a cost curve that changes.
#include "scheduler/batch_size_tuner.h"

#include <gtest/gtest.h>

#include <functional>
#include <map>

namespace quern {
namespace {

BatchSizeTunerOptions Fast(std::vector<int64_t> candidates) {
  BatchSizeTunerOptions o;
  o.candidates = std::move(candidates);
  o.samples = 5;
  o.min_phase_ns = 0;
  o.interval = 4;
  o.max_interval = 64;
  return o;
}

// Runs `batches` saturated batches (each as large as the limit allows) whose
// cost per item is `per_item(size)`; returns how often each limit was used.
std::map<int64_t, int> RunSaturated(BatchSizeTuner& t, int batches, const std::function<double(int64_t)>& per_item) {
  std::map<int64_t, int> used;
  for (int i = 0; i < batches; ++i) {
    const int64_t n = t.limit();
    ++used[n];
    t.Observe(n, static_cast<int64_t>(per_item(n) * static_cast<double>(n)), /*capped=*/true);
  }
  return used;
}

TEST(BatchSizeTuner, StartsAtTheLargestCandidate) {
  BatchSizeTuner t(Fast({8, 1, 4, 2}));
  EXPECT_EQ(t.limit(), 8);
  EXPECT_EQ(t.settled_limit(), 8);
}

TEST(BatchSizeTuner, SettlesOnTheCheapestSizeBelowTheMaximum) {
  BatchSizeTuner t(Fast({1, 2, 4, 8}));
  const std::map<int64_t, double> cost{{1, 100}, {2, 90}, {4, 80}, {8, 120}};
  RunSaturated(t, 200, [&](int64_t n) { return cost.at(n); });
  EXPECT_EQ(t.settled_limit(), 4);
  // Once settled, nearly every batch runs at the best size.
  auto used = RunSaturated(t, 1000, [&](int64_t n) { return cost.at(n); });
  EXPECT_GT(used[4], 900);
}

TEST(BatchSizeTuner, WalksAllTheWayDownWhenSmallerIsAlwaysCheaper) {
  // A large model falling out of cache: batch 1 is 1.3x cheaper per item than 8.
  BatchSizeTuner t(Fast({1, 2, 4, 8}));
  RunSaturated(t, 300, [](int64_t n) { return 1000.0 + 40.0 * static_cast<double>(n); });
  EXPECT_EQ(t.settled_limit(), 1);
}

TEST(BatchSizeTuner, StaysAtTheMaximumWhenItIsCheapestAndProbesLessOften) {
  BatchSizeTuner t(Fast({1, 2, 4, 8, 16, 32}));
  auto cost = [](int64_t n) { return 100.0 + 800.0 / static_cast<double>(n); };  // per-call overhead
  RunSaturated(t, 200, cost);
  EXPECT_EQ(t.settled_limit(), 32);
  auto used = RunSaturated(t, 5000, cost);
  // Probes are spaced out to max_interval (64 batches): at most ~15% of batches probe.
  EXPECT_GT(used[32], 4250);
}

TEST(BatchSizeTuner, DifferencesWithinTheMarginDoNotMoveIt) {
  BatchSizeTuner t(Fast({1, 2, 4, 8}));
  const std::map<int64_t, double> cost{{1, 101}, {2, 100}, {4, 99}, {8, 100}};  // within 3%
  RunSaturated(t, 2000, [&](int64_t n) { return cost.at(n); });
  EXPECT_EQ(t.settled_limit(), 8);
}

TEST(BatchSizeTuner, WalksOverAPlateau) {
  // The 640x640 detector on one core: batch 4 saves 2 % per item against 8
  // (under the margin), 2 saves 10 % and 1 saves 15 %.
  BatchSizeTuner t(Fast({1, 2, 4, 8}));
  const std::map<int64_t, double> cost{{1, 85}, {2, 90}, {4, 98}, {8, 100}};
  RunSaturated(t, 300, [&](int64_t n) { return cost.at(n); });
  EXPECT_EQ(t.settled_limit(), 1);
}

TEST(BatchSizeTuner, AStepThatCostsMoreEndsTheWalk) {
  BatchSizeTuner t(Fast({1, 2, 4, 8}));
  const std::map<int64_t, double> cost{{1, 50}, {2, 150}, {4, 110}, {8, 100}};
  auto used = RunSaturated(t, 2000, [&](int64_t n) { return cost.at(n); });
  EXPECT_EQ(t.settled_limit(), 8);
  EXPECT_GT(used[4], 0) << "4 was probed";
  EXPECT_EQ(used.count(2), 0u) << "4 costs 10 % more than 8: no walk past it";
}

TEST(BatchSizeTuner, SlowBatchesStartProbingAfterHalfASecondNotSixteenBatches) {
  BatchSizeTunerOptions o;
  o.candidates = {1, 2, 4, 8};
  o.samples = 5;
  o.min_phase_ns = 0;
  o.interval = 16;
  o.interval_ns = 500'000'000;
  BatchSizeTuner t(o);
  // Batches of 8 that take 0.36 s each: after two (0.72 s) the baseline starts.
  int batches = 0;
  while (t.limit() == 8 && batches < 100) {
    t.Observe(8, 360'000'000, true);
    ++batches;
  }
  EXPECT_EQ(batches, 2 + o.samples);
  // Fast batches still wait for 16.
  BatchSizeTuner fast(o);
  batches = 0;
  while (fast.limit() == 8 && batches < 100) {
    fast.Observe(8, 8'000, true);
    ++batches;
  }
  EXPECT_EQ(batches, 16 + o.samples);
}

TEST(BatchSizeTuner, OnAFlatCurveProbingTakesLittleOfTheTime) {
  // ResNet-50 on one core: 80 ms per image at every batch size. Each return
  // from a probe to batches of 8 delays the requests queued meanwhile, so
  // probes that find nothing must be rare.
  BatchSizeTunerOptions o;
  o.candidates = {1, 2, 4, 8};
  BatchSizeTuner t(o);
  int64_t total = 0, probing = 0;
  while (total < 60'000'000'000) {  // a minute of batch time
    const int64_t n = t.limit();
    const int64_t ns = 80'000'000 * n;
    total += ns;
    if (n != 8) probing += ns;
    t.Observe(n, ns, true);
  }
  EXPECT_EQ(t.settled_limit(), 8);
  EXPECT_GT(probing, 0) << "it did probe";
  EXPECT_LT(static_cast<double>(probing) / static_cast<double>(total), 0.15);
}

TEST(BatchSizeTuner, OutliersDoNotDecide) {
  // Every fourth batch is preempted and takes 50x longer; the median ignores it.
  BatchSizeTuner t(Fast({1, 2, 4, 8}));
  const std::map<int64_t, double> cost{{1, 300}, {2, 200}, {4, 100}, {8, 150}};
  int i = 0;
  for (int k = 0; k < 400; ++k) {
    const int64_t n = t.limit();
    const double c = cost.at(n) * (++i % 4 == 0 ? 50 : 1);
    t.Observe(n, static_cast<int64_t>(c * static_cast<double>(n)), true);
  }
  EXPECT_EQ(t.settled_limit(), 4);
}

TEST(BatchSizeTuner, LightLoadNeverStartsAProbe) {
  // Single requests that find the queue empty: nothing a limit could change.
  BatchSizeTuner t(Fast({1, 2, 4, 8}));
  for (int i = 0; i < 1000; ++i) {
    EXPECT_FALSE(t.Observe(1, 10 + i % 7, /*capped=*/false));
    EXPECT_EQ(t.limit(), 8);
  }
}

TEST(BatchSizeTuner, BatchesSmallerThanTheLimitAreTunedToo) {
  // Moderate load: three requests wait whenever an instance frees up, so
  // batches of 3 form under a limit of 8. Batch 2 is the cheapest per item.
  BatchSizeTuner t(Fast({1, 2, 4, 8}));
  const std::map<int64_t, double> cost{{1, 70}, {2, 60}, {3, 100}};
  for (int i = 0; i < 500; ++i) {
    const int64_t n = std::min<int64_t>(3, t.limit());
    t.Observe(n, static_cast<int64_t>(cost.at(n) * static_cast<double>(n)), /*capped=*/3 > t.limit());
  }
  EXPECT_EQ(t.settled_limit(), 2);
}

TEST(BatchSizeTuner, NeverProbesAboveALimitTheQueueDoesNotFill) {
  BatchSizeTuner t(Fast({1, 2, 4, 8}));
  // Saturated, batch 4 cheapest: the limit settles at 4.
  const std::map<int64_t, double> saturated{{1, 100}, {2, 100}, {4, 50}, {8, 100}};
  RunSaturated(t, 300, [&](int64_t n) { return saturated.at(n); });
  ASSERT_EQ(t.settled_limit(), 4);
  // Now only three requests wait at a time: batches of 3 that the limit does
  // not cut. A larger limit would change nothing, so it is never tried.
  for (int i = 0; i < 2000; ++i) {
    ASSERT_LE(t.limit(), 4);
    const int64_t n = std::min<int64_t>(3, t.limit());
    t.Observe(n, 300 * n, 3 > t.limit());
  }
}

TEST(BatchSizeTuner, ABaselineTheLoadLeftIsDropped) {
  BatchSizeTuner t(Fast({1, 2, 4, 8}));
  // Saturated long enough to start measuring batches of 8 ...
  for (int i = 0; i < 6; ++i) t.Observe(8, 800, true);
  // ... then the load falls away, and later settles at batches of 3 under
  // the limit of 8, where batch 2 would be cheaper.
  for (int i = 0; i < 200; ++i) t.Observe(1, 100, false);
  const std::map<int64_t, double> cost{{1, 70}, {2, 60}, {3, 100}};
  for (int i = 0; i < 500; ++i) {
    const int64_t n = std::min<int64_t>(3, t.limit());
    t.Observe(n, static_cast<int64_t>(cost.at(n) * static_cast<double>(n)), 3 > t.limit());
  }
  EXPECT_EQ(t.settled_limit(), 2);
}

TEST(BatchSizeTuner, AProbeTheQueueCannotFillIsAbandoned) {
  BatchSizeTuner t(Fast({1, 2, 4, 8}));
  // Saturated at 8 until the tuner starts a probe at 4.
  int steps = 0;
  while (t.limit() == 8 && steps++ < 100) t.Observe(8, 8000, true);
  ASSERT_EQ(t.limit(), 4);
  // Load drops: batches no longer reach the probe size.
  bool back = false;
  for (int i = 0; i < 200 && !back; ++i) back = t.Observe(1, 10, false);
  EXPECT_TRUE(back);
  EXPECT_EQ(t.limit(), 8);
  EXPECT_EQ(t.settled_limit(), 8);
}

TEST(BatchSizeTuner, FollowsACostCurveThatChanges) {
  BatchSizeTuner t(Fast({1, 2, 4, 8}));
  RunSaturated(t, 300, [](int64_t n) { return 100.0 + 20.0 * static_cast<double>(n); });
  ASSERT_EQ(t.settled_limit(), 1);
  // Another model starts sharing the cores and per-call overhead now dominates.
  RunSaturated(t, 3000, [](int64_t n) { return 100.0 + 1000.0 / static_cast<double>(n); });
  EXPECT_EQ(t.settled_limit(), 8);
}

TEST(BatchSizeTuner, RequestsOfSeveralItemsCountForTheLimitTheyFilled) {
  // Requests of 3 items under a limit of 8 make capped batches of 6.
  BatchSizeTuner t(Fast({1, 2, 4, 8}));
  const std::map<int64_t, double> cost{{3, 60}, {6, 100}};
  for (int i = 0; i < 400; ++i) {
    // Whole requests of 3; under a limit below 3 a request still leaves alone.
    const int64_t n = std::max<int64_t>(3, (t.limit() / 3) * 3);
    t.Observe(n, static_cast<int64_t>(cost.at(n) * static_cast<double>(n)), true);
  }
  EXPECT_EQ(t.settled_limit(), 4);  // limit 4 forms batches of 3, the cheapest
}

TEST(BatchSizeTuner, ASingleCandidateNeverChanges) {
  BatchSizeTuner t(Fast({4}));
  for (int i = 0; i < 500; ++i) EXPECT_FALSE(t.Observe(4, 100 + i, true));
  EXPECT_EQ(t.limit(), 4);
}

}  // namespace
}  // namespace quern

namespace quern {
namespace {

TEST(BatchSizeTuner, ACeilingHoldsTheLimitAndProbesBelowIt) {
  BatchSizeTuner t(Fast({1, 2, 4, 8, 16}));
  EXPECT_TRUE(t.SetCeiling(5));
  EXPECT_EQ(t.limit(), 4) << "the largest candidate within it";
  EXPECT_FALSE(t.SetCeiling(4)) << "the same limit";
  // Smaller is cheaper: it walks down below the ceiling as without one.
  RunSaturated(t, 400, [](int64_t n) { return 10.0 * static_cast<double>(n); });
  EXPECT_EQ(t.settled_limit(), 1);
  // Larger is cheaper now: it climbs back, to the ceiling and no further.
  auto used = RunSaturated(t, 2000, [](int64_t n) { return 1000.0 / static_cast<double>(n); });
  EXPECT_EQ(t.settled_limit(), 4);
  EXPECT_EQ(used.count(8) + used.count(16), 0u) << "never probed above the ceiling";
  // A lone request above the ceiling (larger than any limit) starts nothing there.
  for (int i = 0; i < 100; ++i) EXPECT_FALSE(t.Observe(16, 1000, /*capped=*/false));
  EXPECT_EQ(t.limit(), 4);
  EXPECT_TRUE(t.SetCeiling(0));
  EXPECT_EQ(t.limit(), 1) << "below every candidate: the smallest";
}

TEST(BatchSizeTuner, ALoweredCeilingEndsAProbeAboveItAndARaisedOneGivesTheLimitBack) {
  BatchSizeTuner t(Fast({1, 2, 4, 8}));
  EXPECT_TRUE(t.SetCeiling(1));
  EXPECT_EQ(t.limit(), 1);
  EXPECT_TRUE(t.SetCeiling(INT64_MAX));
  EXPECT_EQ(t.limit(), 8) << "the settled limit, held at the ceiling meanwhile";
  // Batches of 8 measured, then a probe of 4 begins; a ceiling of 2 ends it.
  bool probing = false;
  for (int i = 0; i < 200 && !probing; ++i) {
    probing = t.Observe(t.limit(), 1000 * t.limit(), /*capped=*/true) && t.limit() == 4;
  }
  ASSERT_TRUE(probing);
  EXPECT_TRUE(t.SetCeiling(2));
  EXPECT_EQ(t.limit(), 2);
  EXPECT_EQ(t.settled_limit(), 2);
}

}  // namespace
}  // namespace quern
