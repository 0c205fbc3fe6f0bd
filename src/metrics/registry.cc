#include "metrics/registry.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace quern {
namespace metrics_internal {

struct Series {
  MetricLabels labels;
  std::string text;  // name{labels}, as rendered
  double unit = 1.0;
  Counter counter;  // the one matching the family's type is used
  Gauge gauge;
  std::unique_ptr<HistogramMetric> histogram;  // histogram families' handles
};

struct Family {
  std::string name, help;
  MetricType type = MetricType::kCounter;
  std::vector<std::unique_ptr<Series>> series;
};

}  // namespace metrics_internal

bool IsPrometheusName(std::string_view name, bool colons) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colons && c == ':') ||
                    (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

namespace {

using metrics_internal::Family;
using metrics_internal::Series;

[[noreturn]] void Fatal(const std::string& message) {
  std::fprintf(stderr, "quern: metrics: %s\n", message.c_str());
  std::abort();
}

const char* TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter: return "counter";
    case MetricType::kGauge: return "gauge";
    case MetricType::kHistogram: return "histogram";
  }
  return "untyped";
}

void CheckLabels(std::string_view metric, const MetricLabels& labels) {
  for (const auto& [name, value] : labels) {
    if (!IsPrometheusName(name, false) || name.rfind("__", 0) == 0 || name == "le") {
      Fatal("label name '" + name + "' of " + std::string(metric) + " is not a valid Prometheus label name");
    }
  }
}

void AppendHelp(std::string& out, std::string_view help) {
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
}

void AppendHeader(std::string& out, const Family& f) {
  out.append("# HELP ").append(f.name).append(" ");
  AppendHelp(out, f.help);
  out.append("\n# TYPE ").append(f.name).append(" ").append(TypeName(f.type)).append("\n");
}

template <typename Int>
void AppendInt(std::string& out, Int v) {
  char buf[24];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  out.append(buf, end);
}

}  // namespace

void AppendMetricValue(std::string& out, double value) {
  if (std::isnan(value)) {
    out += "NaN";
  } else if (std::isinf(value)) {
    out += value > 0 ? "+Inf" : "-Inf";
  } else if (value == std::trunc(value) && std::fabs(value) < 1e15) {
    AppendInt(out, static_cast<int64_t>(value));  // integers as integers, not 2e+09
  } else {
    char buf[32];
    auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), value);
    out.append(buf, end);
  }
}

void AppendMetricSeries(std::string& out, std::string_view name, const MetricLabels& labels) {
  out.append(name);
  if (labels.empty()) return;
  out += '{';
  bool first = true;
  for (const auto& [k, v] : labels) {
    if (!first) out += ',';
    first = false;
    out.append(k).append("=\"");
    for (char c : v) {
      if (c == '\\') {
        out += "\\\\";
      } else if (c == '"') {
        out += "\\\"";
      } else if (c == '\n') {
        out += "\\n";
      } else {
        out += c;
      }
    }
    out += '"';
  }
  out += '}';
}

namespace {

void AppendHistogram(std::string& out, std::string_view family, const MetricLabels& labels,
                     const std::vector<double>& bounds, const std::vector<uint64_t>& cumulative, double sum,
                     uint64_t count) {
  const std::string name(family);
  MetricLabels with_le = labels;
  with_le.emplace_back("le", "");
  for (size_t i = 0; i <= bounds.size(); ++i) {
    with_le.back().second.clear();
    if (i < bounds.size()) {
      AppendMetricValue(with_le.back().second, bounds[i]);
    } else {
      with_le.back().second = "+Inf";
    }
    AppendMetricSeries(out, name + "_bucket", with_le);
    out += ' ';
    AppendInt(out, cumulative[i]);
    out += '\n';
  }
  AppendMetricSeries(out, name + "_sum", labels);
  out += ' ';
  AppendMetricValue(out, sum);
  out += '\n';
  AppendMetricSeries(out, name + "_count", labels);
  out += ' ';
  AppendInt(out, count);
  out += '\n';
}

}  // namespace

// --- HistogramMetric ---

HistogramMetric::HistogramMetric(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0, std::memory_order_relaxed);
}

void HistogramMetric::Observe(double value) {
  if (std::isnan(value)) return;
  const size_t i = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin());
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
}

std::vector<uint64_t> HistogramMetric::Cumulative() const {
  std::vector<uint64_t> out(bounds_.size() + 1);
  uint64_t total = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    total += buckets_[i].load(std::memory_order_relaxed);
    out[i] = total;
  }
  return out;
}

// --- MetricWriter ---

std::string& MetricWriter::Out(std::string_view family, bool histogram) {
  for (auto& [f, text] : families_) {
    if (f->name != family) continue;
    if ((f->type == MetricType::kHistogram) != histogram) {
      Fatal("a collector wrote " + std::string(histogram ? "a histogram" : "a sample") + " to " + f->name +
            ", declared as a " + TypeName(f->type));
    }
    return text;
  }
  Fatal("a collector wrote to " + std::string(family) + ", which is not declared");
}

void MetricWriter::Sample(std::string_view family, const MetricLabels& labels, double value) {
  std::string& out = Out(family, false);
  AppendMetricSeries(out, family, labels);
  out += ' ';
  AppendMetricValue(out, value);
  out += '\n';
}

void MetricWriter::Histogram(std::string_view family, const MetricLabels& labels, const std::vector<double>& bounds,
                             const std::vector<uint64_t>& cumulative, double sum, uint64_t count) {
  std::string& out = Out(family, true);
  if (cumulative.size() != bounds.size() + 1) {
    Fatal("histogram " + std::string(family) + " has " + std::to_string(cumulative.size()) + " counts for " +
          std::to_string(bounds.size()) + " bounds (bounds + 1 expected)");
  }
  AppendHistogram(out, family, labels, bounds, cumulative, sum, count);
}

// --- MetricsRegistry ---

MetricsRegistry::MetricsRegistry() = default;
MetricsRegistry::~MetricsRegistry() = default;

MetricsRegistry::Collection& MetricsRegistry::Collection::operator=(Collection&& other) noexcept {
  if (this != &other) {
    Reset();
    registry_ = std::exchange(other.registry_, nullptr);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

void MetricsRegistry::Collection::Reset() {
  if (registry_ != nullptr) registry_->Remove(id_);
  registry_ = nullptr;
  id_ = 0;
}

MetricsRegistry::Family& MetricsRegistry::Declare(std::string_view name, MetricType type, std::string_view help) {
  for (auto& f : families_) {
    if (f->name != name) continue;
    if (f->type != type || f->help != help) {
      Fatal(std::string(name) + " is declared twice: as a " + TypeName(f->type) + " (\"" + f->help + "\") and as a " +
            TypeName(type) + " (\"" + std::string(help) + "\")");
    }
    return *f;
  }
  if (!IsPrometheusName(name, true)) Fatal("'" + std::string(name) + "' is not a valid Prometheus metric name");
  auto f = std::make_unique<Family>();
  f->name = name;
  f->help = help;
  f->type = type;
  families_.push_back(std::move(f));
  return *families_.back();
}

Counter& MetricsRegistry::AddCounter(std::string_view name, std::string_view help, const MetricLabels& labels,
                                     double unit) {
  CheckLabels(name, labels);
  MutexLock lock(mu_);
  Family& f = Declare(name, MetricType::kCounter, help);
  for (auto& s : f.series) {
    if (s->labels != labels) continue;
    if (s->unit != unit) Fatal(std::string(name) + " is added twice with different units");
    return s->counter;
  }
  auto s = std::make_unique<Series>();
  s->labels = labels;
  s->unit = unit;
  AppendMetricSeries(s->text, name, labels);
  f.series.push_back(std::move(s));
  return f.series.back()->counter;
}

Gauge& MetricsRegistry::AddGauge(std::string_view name, std::string_view help, const MetricLabels& labels) {
  CheckLabels(name, labels);
  MutexLock lock(mu_);
  Family& f = Declare(name, MetricType::kGauge, help);
  for (auto& s : f.series) {
    if (s->labels == labels) return s->gauge;
  }
  auto s = std::make_unique<Series>();
  s->labels = labels;
  AppendMetricSeries(s->text, name, labels);
  f.series.push_back(std::move(s));
  return f.series.back()->gauge;
}

HistogramMetric& MetricsRegistry::AddHistogram(std::string_view name, std::string_view help, const MetricLabels& labels,
                                               const std::vector<double>& bounds) {
  CheckLabels(name, labels);
  if (!std::is_sorted(bounds.begin(), bounds.end()) ||
      std::adjacent_find(bounds.begin(), bounds.end()) != bounds.end() ||
      std::any_of(bounds.begin(), bounds.end(), [](double b) { return !std::isfinite(b); })) {
    Fatal("the bounds of histogram " + std::string(name) + " are not finite and strictly ascending");
  }
  MutexLock lock(mu_);
  Family& f = Declare(name, MetricType::kHistogram, help);
  for (auto& s : f.series) {
    if (s->histogram->bounds() != bounds) Fatal(std::string(name) + " is added with different bounds");
    if (s->labels == labels) return *s->histogram;
  }
  auto s = std::make_unique<Series>();
  s->labels = labels;
  s->histogram.reset(new HistogramMetric(bounds));
  f.series.push_back(std::move(s));
  return *f.series.back()->histogram;
}

void MetricsRegistry::DeclareFamily(std::string_view name, MetricType type, std::string_view help) {
  MutexLock lock(mu_);
  Declare(name, type, help);
}

MetricsRegistry::Collection MetricsRegistry::AddCollector(Collect collect) {
  MutexLock lock(collect_mu_);
  const uint64_t id = next_collector_++;
  collectors_.emplace_back(id, std::move(collect));
  return Collection(this, id);
}

void MetricsRegistry::Remove(uint64_t id) {
  MutexLock lock(collect_mu_);
  for (auto it = collectors_.begin(); it != collectors_.end(); ++it) {
    if (it->first == id) {
      collectors_.erase(it);
      return;
    }
  }
}

std::string MetricsRegistry::Render() const {
  MetricWriter::Families collected;
  {
    MutexLock lock(mu_);
    collected.reserve(families_.size());
    for (const auto& f : families_) collected.emplace_back(f.get(), std::string());
  }
  {
    MutexLock lock(collect_mu_);
    MetricWriter writer(collected);
    for (const auto& [id, collect] : collectors_) collect(writer);
  }
  std::string out;
  MutexLock lock(mu_);
  for (size_t i = 0; i < families_.size(); ++i) {
    const Family& f = *families_[i];
    AppendHeader(out, f);
    for (const auto& s : f.series) {
      if (s->histogram) {
        const HistogramMetric& h = *s->histogram;
        const std::vector<uint64_t> counts = h.Cumulative();
        AppendHistogram(out, f.name, s->labels, h.bounds(), counts, h.sum(), counts.back());
        continue;
      }
      out.append(s->text).append(" ");
      if (f.type == MetricType::kGauge) {
        AppendInt(out, s->gauge.value());
      } else if (s->unit == 1.0) {
        AppendInt(out, s->counter.value());
      } else {
        AppendMetricValue(out, static_cast<double>(s->counter.value()) * s->unit);
      }
      out += '\n';
    }
    if (i < collected.size()) out += collected[i].second;
  }
  return out;
}

}  // namespace quern
