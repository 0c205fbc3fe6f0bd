#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "metrics/registry.h"

namespace quern {
namespace {

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    out.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

TEST(MetricsRegistry, OneHeaderPerFamilyAndItsSeriesTogether) {
  MetricsRegistry r;
  Counter& a = r.AddCounter("quern_things_total", "Things.", {{"kind", "a"}});
  Gauge& g = r.AddGauge("quern_level", "A level.");
  Counter& b = r.AddCounter("quern_things_total", "Things.", {{"kind", "b"}});
  r.DeclareFamily("quern_collected", MetricType::kGauge, "Collected at scrape time.");
  auto c = r.AddCollector([](MetricWriter& w) {
    w.Sample("quern_things_total", {{"kind", "c"}}, 7);
    w.Sample("quern_collected", {{"model", "m"}}, 1.5);
  });
  a.Increment();
  b.Increment(41);
  g.Set(-3);
  EXPECT_EQ(r.Render(),
            "# HELP quern_things_total Things.\n"
            "# TYPE quern_things_total counter\n"
            "quern_things_total{kind=\"a\"} 1\n"
            "quern_things_total{kind=\"b\"} 41\n"
            "quern_things_total{kind=\"c\"} 7\n"
            "# HELP quern_level A level.\n"
            "# TYPE quern_level gauge\n"
            "quern_level -3\n"
            "# HELP quern_collected Collected at scrape time.\n"
            "# TYPE quern_collected gauge\n"
            "quern_collected{model=\"m\"} 1.5\n");
}

TEST(MetricsRegistry, TheSameSeriesTwiceIsOneHandle) {
  MetricsRegistry r;
  Counter& a = r.AddCounter("quern_x_total", "X.", {{"k", "v"}});
  Counter& b = r.AddCounter("quern_x_total", "X.", {{"k", "v"}});
  EXPECT_EQ(&a, &b);
  a.Increment();
  b.Increment();
  EXPECT_EQ(a.value(), 2u);
  EXPECT_NE(r.Render().find("quern_x_total{k=\"v\"} 2\n"), std::string::npos) << r.Render();
}

// A model directory may be named with a quote or a backslash: its label
// value must be escaped, or the whole exposition stops parsing.
TEST(MetricsRegistry, LabelValuesAndHelpAreEscaped) {
  MetricsRegistry r;
  r.AddGauge("quern_g", "Help with a \\ and a\nnewline.", {{"model", "we\"ird\\name\nx"}}).Set(1);
  const auto lines = Lines(r.Render());
  ASSERT_EQ(lines.size(), 3u) << r.Render();
  EXPECT_EQ(lines[0], "# HELP quern_g Help with a \\\\ and a\\nnewline.");
  EXPECT_EQ(lines[2], "quern_g{model=\"we\\\"ird\\\\name\\nx\"} 1");
}

TEST(MetricsRegistry, NanosecondsCountedSecondsExported) {
  MetricsRegistry r;
  r.AddCounter("quern_stage_seconds_total", "Time.", {{"stage", "decode"}}, 1e-9).Increment(1'500'000'000);
  EXPECT_NE(r.Render().find("quern_stage_seconds_total{stage=\"decode\"} 1.5\n"), std::string::npos) << r.Render();
}

TEST(MetricsRegistry, NumbersAsPrometheusReadsThem) {
  std::string s;
  AppendMetricValue(s, 2'000'000'000.0);  // not 2e+09
  s += ' ';
  AppendMetricValue(s, 0.1);  // not 0.10000000000000001
  s += ' ';
  AppendMetricValue(s, 1e300);
  s += ' ';
  AppendMetricValue(s, std::numeric_limits<double>::infinity());
  s += ' ';
  AppendMetricValue(s, -std::numeric_limits<double>::infinity());
  s += ' ';
  AppendMetricValue(s, std::numeric_limits<double>::quiet_NaN());
  EXPECT_EQ(s, "2000000000 0.1 1e+300 +Inf -Inf NaN");
}

TEST(MetricsRegistry, HistogramBucketsSumAndCount) {
  MetricsRegistry r;
  r.DeclareFamily("quern_latency_us", MetricType::kHistogram, "Latency.");
  // Observations 3, 30, 300: cumulative counts for le 10, 100, +Inf.
  auto c = r.AddCollector([](MetricWriter& w) {
    w.Histogram("quern_latency_us", {{"model", "m"}}, {10, 100}, {1, 2, 3}, 333, 3);
  });
  EXPECT_EQ(r.Render(),
            "# HELP quern_latency_us Latency.\n"
            "# TYPE quern_latency_us histogram\n"
            "quern_latency_us_bucket{model=\"m\",le=\"10\"} 1\n"
            "quern_latency_us_bucket{model=\"m\",le=\"100\"} 2\n"
            "quern_latency_us_bucket{model=\"m\",le=\"+Inf\"} 3\n"
            "quern_latency_us_sum{model=\"m\"} 333\n"
            "quern_latency_us_count{model=\"m\"} 3\n");
}

TEST(MetricsRegistry, AHistogramHandleCountsEachObservationInItsBucket) {
  MetricsRegistry r;
  HistogramMetric& h = r.AddHistogram("quern_stage_us", "Stage.", {{"stage", "decode"}}, {10, 100});
  EXPECT_EQ(&h, &r.AddHistogram("quern_stage_us", "Stage.", {{"stage", "decode"}}, {10, 100}));
  // 10 is in le="10" (upper bounds are inclusive); 1000 only in +Inf.
  for (double v : {3.0, 10.0, 30.0, 1000.0}) h.Observe(v);
  h.Observe(std::numeric_limits<double>::quiet_NaN());  // not an observation
  EXPECT_EQ(r.Render(),
            "# HELP quern_stage_us Stage.\n"
            "# TYPE quern_stage_us histogram\n"
            "quern_stage_us_bucket{stage=\"decode\",le=\"10\"} 2\n"
            "quern_stage_us_bucket{stage=\"decode\",le=\"100\"} 3\n"
            "quern_stage_us_bucket{stage=\"decode\",le=\"+Inf\"} 4\n"
            "quern_stage_us_sum{stage=\"decode\"} 1043\n"
            "quern_stage_us_count{stage=\"decode\"} 4\n");
}

TEST(MetricsRegistry, HistogramObservationsFromManyThreadsAreAllCounted) {
  MetricsRegistry r;
  HistogramMetric& h = r.AddHistogram("quern_h", "H.", {}, {1, 2});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&h] {
      for (int i = 0; i < 10000; ++i) h.Observe(i % 3 + 0.5);  // 0.5, 1.5, 2.5
    });
  }
  for (auto& t : threads) t.join();
  const std::vector<uint64_t> counts = h.Cumulative();
  ASSERT_EQ(counts.size(), 3u);
  EXPECT_EQ(counts[2], 40000u);
  EXPECT_EQ(counts[2] - counts[1], 13332u);  // 2.5: i % 3 == 2, 3333 of each 10000
  EXPECT_DOUBLE_EQ(h.sum(), 4 * (3334 * 0.5 + 3333 * 1.5 + 3333 * 2.5));
}

TEST(MetricsRegistry, ARemovedCollectorIsNotCalled) {
  MetricsRegistry r;
  r.DeclareFamily("quern_c", MetricType::kGauge, "C.");
  int calls = 0;
  auto c = r.AddCollector([&calls](MetricWriter& w) {
    ++calls;
    w.Sample("quern_c", {}, 1);
  });
  EXPECT_NE(r.Render().find("quern_c 1\n"), std::string::npos);
  c.Reset();
  EXPECT_EQ(r.Render(), "# HELP quern_c C.\n# TYPE quern_c gauge\n");
  EXPECT_EQ(calls, 1);
  // A moved-from Collection removes nothing; the one moved to does.
  auto d = r.AddCollector([&calls](MetricWriter&) { ++calls; });
  MetricsRegistry::Collection e = std::move(d);
  d.Reset();
  r.Render();
  EXPECT_EQ(calls, 2);
  e = MetricsRegistry::Collection();
  r.Render();
  EXPECT_EQ(calls, 2);
}

// A component's destructor removes its collector; the collector reads the
// component, so the removal must wait for a Render that is running it.
TEST(MetricsRegistry, RemovingACollectorWaitsForARenderRunningIt) {
  MetricsRegistry r;
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> removed{false};
  std::atomic<bool> removed_while_running{false};
  auto c = r.AddCollector([&, released](MetricWriter&) {
    entered.set_value();
    released.wait();
    removed_while_running = removed.load();
  });
  std::thread render([&r] { r.Render(); });
  entered.get_future().wait();
  std::thread remover([&] {
    c.Reset();
    removed = true;
  });
  // Time for a removal that does not wait to finish (and be caught).
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  release.set_value();
  render.join();
  remover.join();
  EXPECT_FALSE(removed_while_running.load());
  EXPECT_TRUE(removed.load());
}

// A collector may add series (a stream's gauge the first time Redis
// answers) without deadlocking the Render that runs it.
TEST(MetricsRegistry, ACollectorMayAddSeries) {
  MetricsRegistry r;
  auto c = r.AddCollector([&r](MetricWriter&) { r.AddGauge("quern_late", "Late.").Set(5); });
  r.Render();
  EXPECT_NE(r.Render().find("quern_late 5\n"), std::string::npos);
}

TEST(MetricsRegistryDeathTest, ANameDeclaredTwiceDifferentlyIsAProgrammingError) {
  EXPECT_DEATH(
      {
        MetricsRegistry r;
        r.AddCounter("quern_a_total", "A.");
        r.AddGauge("quern_a_total", "A.");
      },
      "quern_a_total is declared twice");
  EXPECT_DEATH(
      {
        MetricsRegistry r;
        r.AddGauge("quern a", "A.");
      },
      "not a valid Prometheus metric name");
  EXPECT_DEATH(
      {
        MetricsRegistry r;
        auto c = r.AddCollector([](MetricWriter& w) { w.Sample("quern_undeclared", {}, 1); });
        r.Render();
      },
      "quern_undeclared, which is not declared");
  EXPECT_DEATH(
      {
        MetricsRegistry r;
        r.AddHistogram("quern_h", "H.", {}, {10, 1});
      },
      "not finite and strictly ascending");
  EXPECT_DEATH(
      {
        MetricsRegistry r;
        r.AddHistogram("quern_h", "H.", {{"a", "1"}}, {1, 10});
        r.AddHistogram("quern_h", "H.", {{"a", "2"}}, {1, 100});
      },
      "added with different bounds");
}

}  // namespace
}  // namespace quern
