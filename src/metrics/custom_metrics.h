// Metrics that models define themselves (a Python model's pb_utils.MetricFamily), exported in
// /metrics after the server's own: counters, gauges and histograms, each family named once with
// its kind and help text, each series by its labels.
//
// Bounded: at most kMaxFamilies families and kMaxSeriesPerFamily series in each, at most
// kMaxLabels labels per series, names of the Prometheus grammar that do not take the server's own
// prefixes (quern_, process_); what a model asks beyond is refused with a message.
//
// A model whose values may arrive while it runs no batch (a Python model's process sends what
// changed since its last batch on its own) adds a refresher: Render runs every refresher first.
//
// Thread-safe. One store per process (Global()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/mutex.h"
#include "metrics/registry.h"
#include "quern/status.h"

namespace quern {

class CustomMetrics {
 public:
  enum class Kind { kCounter, kGauge, kHistogram };
  static constexpr size_t kMaxFamilies = 256;
  static constexpr size_t kMaxSeriesPerFamily = 1024;
  static constexpr size_t kMaxLabels = 16;
  static constexpr size_t kMaxBuckets = 64;

  static CustomMetrics& Global();

  // Declares a family; declaring it again with the same kind is allowed (the first help text
  // stays), with another kind is refused.
  Status Declare(const std::string& name, const std::string& help, Kind kind);
  // A counter's or gauge's series += delta (a counter refuses a negative delta).
  Status Add(const std::string& name, const MetricLabels& labels, double delta);
  // A gauge's series = value.
  Status Set(const std::string& name, const MetricLabels& labels, double value);
  // A histogram's series observes value; its buckets (upper bounds, increasing) are fixed by the
  // first observation of the series.
  Status Observe(const std::string& name, const MetricLabels& labels, const std::vector<double>& buckets, double value);
  // Observations gathered: `counts` per bucket (one more than `buckets`: +Inf last), `sum` their sum.
  Status ObserveCounts(const std::string& name, const MetricLabels& labels, const std::vector<double>& buckets,
                       const std::vector<uint64_t>& counts, double sum);
  // Applies a model's operations, a JSON list of {"op": "declare"|"add"|"set"|"observe", ...} (an
  // "observe" with "counts": observations gathered, "value" their sum): each one the store takes;
  // the first refusal is returned, naming `model`.
  Status Apply(const std::string& model, std::string_view json);
  // `f` runs at the start of each Render, on the rendering thread, one refresher at a time; it
  // must not block (a model that is busy skips its turn). `key` names it for RemoveRefresher;
  // adding a key again replaces its function.
  void AddRefresher(const void* key, std::function<void()> f);
  // The function added under `key` is not running and will not run once this returns.
  void RemoveRefresher(const void* key);
  // The refreshers run, then the families in Prometheus text, appended to `out`.
  void Render(std::string& out);

 private:
  struct Series {
    double value = 0;              // counter, gauge; a histogram's sum
    std::vector<double> buckets;   // histogram upper bounds
    std::vector<uint64_t> counts;  // per bucket (not cumulative), then +Inf
    uint64_t count = 0;
  };
  struct Family {
    std::string help;
    Kind kind = Kind::kCounter;
    std::map<MetricLabels, Series> series;
  };
  Result<Series*> Find(const std::string& name, const MetricLabels& labels, Kind kind) QUERN_REQUIRES(mu_);

  mutable Mutex mu_;
  std::map<std::string, Family> families_ QUERN_GUARDED_BY(mu_);
  // Taken before mu_ (a refresher applies what it gathers).
  Mutex refresh_mu_;
  std::map<const void*, std::function<void()>> refreshers_ QUERN_GUARDED_BY(refresh_mu_);
};

}  // namespace quern
