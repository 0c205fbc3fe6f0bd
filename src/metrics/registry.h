// One metrics registry for the whole server: every family (name, type, help)
// is declared once, components hold handles to their series and update them
// with a relaxed atomic add, and one exposition path renders all of them as
// Prometheus text for GET /metrics.
//
//   MetricsRegistry registry;
//   Counter& done = registry.AddCounter("quern_jobs_finished_total", "Jobs finished.", {{"status", "done"}});
//   done.Increment();
//   std::string text = registry.Render();
//
// Values that live elsewhere (the engine's per-model statistics, the
// process's CPU time, a capacity derived at scrape time) are written by
// collectors: functions called during Render with a MetricWriter. A
// collector's families are declared with DeclareFamily; its samples are
// rendered inside their family, after the handles' series.
//
// Thread safety: handles are lock-free and safe from any thread. Adding
// series and collectors, and Render, take the registry's mutex; handles stay
// valid (never move) for the registry's lifetime. A component that is handed
// a registry must not outlive it.
//
// Declaring a name twice with a different type or help, a name or label
// name outside Prometheus' grammar, or a sample for an undeclared family is
// a programming error: the process aborts with a message naming the metric.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/mutex.h"

namespace quern {

using MetricLabels = std::vector<std::pair<std::string, std::string>>;

enum class MetricType { kCounter, kGauge, kHistogram };

// Whether `name` is in Prometheus' grammar: [a-zA-Z_][a-zA-Z0-9_]*, and ':' too where `colons`
// (metric names; label names take none).
bool IsPrometheusName(std::string_view name, bool colons);

namespace metrics_internal {
struct Family;
}  // namespace metrics_internal

// A count that only goes up.
class Counter {
 public:
  void Increment(uint64_t n = 1) { value_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

// A value that goes up and down. Sequentially consistent, so that a gauge
// can serve as an admission count (claim with Add, compare, give back).
class Gauge {
 public:
  void Set(int64_t v) { value_.store(v); }
  // Adds `delta` (may be negative) and returns the value before the add, as
  // fetch_add does.
  int64_t Add(int64_t delta) { return value_.fetch_add(delta); }
  int64_t value() const { return value_.load(); }

 private:
  std::atomic<int64_t> value_{0};
};

// A distribution over fixed upper bounds (Prometheus semantics: rendered as
// cumulative `_bucket{le=...}` counts, `_sum` and `_count`). Observations
// are lock-free; a Render running beside them may see a sum that lags its
// counts by the observations in flight.
class HistogramMetric {
 public:
  void Observe(double value);
  const std::vector<double>& bounds() const { return bounds_; }
  // bounds().size() + 1 counts, cumulative, the last one for +Inf.
  std::vector<uint64_t> Cumulative() const;
  double sum() const { return sum_.load(std::memory_order_relaxed); }

 private:
  friend class MetricsRegistry;
  explicit HistogramMetric(std::vector<double> bounds);
  const std::vector<double> bounds_;
  const std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // per bucket, not cumulative
  std::atomic<double> sum_{0};
};

// Where a collector writes its samples during MetricsRegistry::Render.
class MetricWriter {
 public:
  // One sample of a declared counter or gauge family.
  void Sample(std::string_view family, const MetricLabels& labels, double value);
  // One series of a declared histogram family: `cumulative` holds
  // bounds.size() + 1 counts, the last one for +Inf.
  void Histogram(std::string_view family, const MetricLabels& labels, const std::vector<double>& bounds,
                 const std::vector<uint64_t>& cumulative, double sum, uint64_t count);

 private:
  friend class MetricsRegistry;
  using Families = std::vector<std::pair<const metrics_internal::Family*, std::string>>;
  explicit MetricWriter(Families& families) : families_(families) {}
  // The text collected for `family` so far; aborts when it is not declared
  // or has another type.
  std::string& Out(std::string_view family, bool histogram);
  Families& families_;  // every declared family, with the samples collected for it
};

class MetricsRegistry {
 public:
  using Collect = std::function<void(MetricWriter&)>;

  // Removes its collector when destroyed (waiting for a Render that is
  // running it), so a collector may capture the component that holds this.
  class Collection {
   public:
    Collection() = default;
    Collection(Collection&& other) noexcept { *this = std::move(other); }
    Collection& operator=(Collection&& other) noexcept;
    ~Collection() { Reset(); }
    void Reset();

   private:
    friend class MetricsRegistry;
    Collection(MetricsRegistry* registry, uint64_t id) : registry_(registry), id_(id) {}
    MetricsRegistry* registry_ = nullptr;
    uint64_t id_ = 0;
  };

  MetricsRegistry();
  ~MetricsRegistry();
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // The series `name{labels}` of a counter family, declared on first use.
  // Asking again for the same series returns the same handle. A counter
  // with `unit` != 1 is rendered as value x unit (nanoseconds counted,
  // seconds exported: unit 1e-9).
  Counter& AddCounter(std::string_view name, std::string_view help, const MetricLabels& labels = {}, double unit = 1.0);
  Gauge& AddGauge(std::string_view name, std::string_view help, const MetricLabels& labels = {});
  // The series `name{labels}` of a histogram family with upper `bounds`
  // (ascending; +Inf is implied). A family's series share its bounds.
  HistogramMetric& AddHistogram(std::string_view name, std::string_view help, const MetricLabels& labels,
                                const std::vector<double>& bounds);

  // Declares a family whose samples a collector writes.
  void DeclareFamily(std::string_view name, MetricType type, std::string_view help);
  // Calls `collect` at every Render until the returned Collection is gone.
  // Declare its families first. A collector runs without the registry's
  // own lock (it may add series), but a Collection must not be destroyed
  // while holding a lock its collector takes.
  [[nodiscard]] Collection AddCollector(Collect collect);

  // Every family in the order declared: "# HELP", "# TYPE", then its
  // series. A family with no series yet is rendered with its header only.
  std::string Render() const;

 private:
  using Family = metrics_internal::Family;

  Family& Declare(std::string_view name, MetricType type, std::string_view help) QUERN_REQUIRES(mu_);
  void Remove(uint64_t id);

  // Families and their series. Families and series are never removed, so
  // the handles and Family pointers stay valid.
  mutable Mutex mu_;
  std::vector<std::unique_ptr<Family>> families_ QUERN_GUARDED_BY(mu_);
  // Collectors; held while they run, so that removing one waits for a
  // Render that is calling it.
  mutable Mutex collect_mu_;
  std::vector<std::pair<uint64_t, Collect>> collectors_ QUERN_GUARDED_BY(collect_mu_);
  uint64_t next_collector_ QUERN_GUARDED_BY(collect_mu_) = 1;
};

// Appends `value` as Prometheus writes numbers: the shortest text that
// reads back to the same double; NaN and infinities by name.
void AppendMetricValue(std::string& out, double value);
// `name{k="v",...}` with label values escaped (\\, \" and \n).
void AppendMetricSeries(std::string& out, std::string_view name, const MetricLabels& labels);

}  // namespace quern
