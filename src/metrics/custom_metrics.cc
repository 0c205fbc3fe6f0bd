#include "metrics/custom_metrics.h"

#include <rapidjson/document.h>

#include <algorithm>
#include <cmath>

#include "metrics/registry.h"

namespace quern {
namespace {

// Prometheus' grammar (no ':' in a label name), at most 200 bytes, and no label name of the
// reserved "__" prefix.
bool ValidCustomName(std::string_view s, bool label) {
  return s.size() <= 200 && IsPrometheusName(s, !label) && !(label && s.starts_with("__"));
}

const char* KindName(CustomMetrics::Kind k) {
  switch (k) {
    case CustomMetrics::Kind::kCounter: return "counter";
    case CustomMetrics::Kind::kGauge: return "gauge";
    case CustomMetrics::Kind::kHistogram: return "histogram";
  }
  return "";
}

}  // namespace

CustomMetrics& CustomMetrics::Global() {
  static CustomMetrics* store = new CustomMetrics();  // never destroyed: used until the process ends
  return *store;
}

Status CustomMetrics::Declare(const std::string& name, const std::string& help, Kind kind) {
  if (!ValidCustomName(name, false)) {
    return InvalidArgument("metric family name '" + name.substr(0, 200) + "' is not a Prometheus metric name");
  }
  if (name.starts_with("quern_") || name.starts_with("process_")) {
    return InvalidArgument("metric family name '" + name + "': the prefixes quern_ and process_ are the server's");
  }
  MutexLock lock(mu_);
  auto it = families_.find(name);
  if (it != families_.end()) {
    if (it->second.kind != kind) {
      return InvalidArgument("metric family '" + name + "' is a " + KindName(it->second.kind) + " already, not a " +
                             KindName(kind));
    }
    return Status::Ok();
  }
  if (families_.size() >= kMaxFamilies) {
    return ResourceExhausted("metric family '" + name + "': the models have declared " + std::to_string(kMaxFamilies) +
                             " families, the most there may be");
  }
  families_[name] = Family{help.substr(0, 1024), kind, {}};
  return Status::Ok();
}

Result<CustomMetrics::Series*> CustomMetrics::Find(const std::string& name, const MetricLabels& labels, Kind kind) {
  auto it = families_.find(name);
  if (it == families_.end()) return Err(NotFound("metric family '" + name.substr(0, 200) + "' was never declared"));
  Family& f = it->second;
  if (f.kind != kind) {
    return Err(InvalidArgument("metric family '" + name + "' is a " + KindName(f.kind) + ", not a " + KindName(kind)));
  }
  if (labels.size() > kMaxLabels) {
    return Err(InvalidArgument("metric '" + name + "': at most " + std::to_string(kMaxLabels) + " labels"));
  }
  for (size_t i = 0; i < labels.size(); ++i) {
    const auto& [k, v] = labels[i];
    if (!ValidCustomName(k, true) || v.size() > 1024) {
      return Err(InvalidArgument("metric '" + name + "': label '" + k.substr(0, 200) +
                                 "' is not a Prometheus label name, or its value is over 1 KiB"));
    }
    // (labels come sorted: a name twice is side by side)
    if (i > 0 && labels[i - 1].first == k) {
      return Err(InvalidArgument("metric '" + name + "': label '" + k + "' given twice"));
    }
    if (kind == Kind::kHistogram && k == "le") {
      return Err(InvalidArgument("histogram '" + name + "': the label 'le' is its buckets' own"));
    }
  }
  auto s = f.series.find(labels);
  if (s == f.series.end()) {
    if (f.series.size() >= kMaxSeriesPerFamily) {
      return Err(ResourceExhausted("metric family '" + name + "' has " + std::to_string(kMaxSeriesPerFamily) +
                                   " series, the most it may have"));
    }
    s = f.series.emplace(labels, Series{}).first;
  }
  return &s->second;
}

Status CustomMetrics::Add(const std::string& name, const MetricLabels& labels, double delta) {
  if (!std::isfinite(delta)) return InvalidArgument("metric '" + name + "': an increment must be a finite number");
  MutexLock lock(mu_);
  auto it = families_.find(name);
  const Kind kind = it != families_.end() && it->second.kind == Kind::kGauge ? Kind::kGauge : Kind::kCounter;
  if (kind == Kind::kCounter && delta < 0) return InvalidArgument("counter '" + name + "' cannot decrease");
  QUERN_ASSIGN_OR_RETURN(Series * s, Find(name, labels, kind));
  s->value += delta;
  return Status::Ok();
}

Status CustomMetrics::Set(const std::string& name, const MetricLabels& labels, double value) {
  MutexLock lock(mu_);
  QUERN_ASSIGN_OR_RETURN(Series * s, Find(name, labels, Kind::kGauge));
  s->value = value;
  return Status::Ok();
}

Status CustomMetrics::Observe(const std::string& name, const MetricLabels& labels, const std::vector<double>& buckets,
                              double value) {
  std::vector<uint64_t> counts(buckets.size() + 1, 0);
  counts[static_cast<size_t>(std::lower_bound(buckets.begin(), buckets.end(), value) - buckets.begin())] = 1;
  return ObserveCounts(name, labels, buckets, counts, value);
}

Status CustomMetrics::ObserveCounts(const std::string& name, const MetricLabels& labels,
                                    const std::vector<double>& buckets, const std::vector<uint64_t>& counts,
                                    double sum) {
  if (buckets.empty() || buckets.size() > kMaxBuckets || !std::is_sorted(buckets.begin(), buckets.end()) ||
      std::adjacent_find(buckets.begin(), buckets.end()) != buckets.end() ||
      std::any_of(buckets.begin(), buckets.end(), [](double b) { return !std::isfinite(b); })) {
    return InvalidArgument("histogram '" + name + "': buckets must be 1 to " + std::to_string(kMaxBuckets) +
                           " increasing finite upper bounds");
  }
  if (counts.size() != buckets.size() + 1) {
    return InvalidArgument("histogram '" + name + "': " + std::to_string(counts.size()) + " counts for " +
                           std::to_string(buckets.size()) + " buckets (one more: +Inf)");
  }
  MutexLock lock(mu_);
  QUERN_ASSIGN_OR_RETURN(Series * s, Find(name, labels, Kind::kHistogram));
  if (s->buckets.empty()) {
    s->buckets = buckets;
    s->counts.assign(buckets.size() + 1, 0);
  } else if (s->buckets != buckets) {
    return InvalidArgument("histogram '" + name + "': a series keeps the buckets it was first observed with");
  }
  uint64_t count = s->count;
  for (size_t i = 0; i < counts.size(); ++i) {
    uint64_t bucket = 0;
    if (__builtin_add_overflow(count, counts[i], &count) || __builtin_add_overflow(s->counts[i], counts[i], &bucket)) {
      return InvalidArgument("histogram '" + name + "': counts past 2^64 observations");
    }
  }
  for (size_t i = 0; i < counts.size(); ++i) s->counts[i] += counts[i];
  s->count = count;
  s->value += sum;
  return Status::Ok();
}

Status CustomMetrics::Apply(const std::string& model, std::string_view json) {
  rapidjson::Document doc;
  doc.Parse(json.data(), json.size());
  const std::string who = "model '" + model + "': custom metrics: ";
  if (doc.HasParseError() || !doc.IsArray()) return InvalidArgument(who + "a malformed list of operations");
  Status first;
  for (const auto& op : doc.GetArray()) {
    if (!op.IsObject() || !op.HasMember("op") || !op["op"].IsString() || !op.HasMember("name") ||
        !op["name"].IsString()) {
      return InvalidArgument(who + "a malformed operation");
    }
    const std::string kind = op["op"].GetString(), name = op["name"].GetString();
    MetricLabels labels;
    if (auto l = op.FindMember("labels"); l != op.MemberEnd() && l->value.IsObject()) {
      for (const auto& kv : l->value.GetObject()) {
        if (!kv.value.IsString()) return InvalidArgument(who + "metric '" + name + "': label values are strings");
        labels.emplace_back(kv.name.GetString(), kv.value.GetString());
      }
    }
    std::sort(labels.begin(), labels.end());
    const double value = op.HasMember("value") && op["value"].IsNumber() ? op["value"].GetDouble() : 0;
    Status st;
    if (kind == "declare") {
      const std::string help = op.HasMember("help") && op["help"].IsString() ? op["help"].GetString() : "";
      const std::string k = op.HasMember("kind") && op["kind"].IsString() ? op["kind"].GetString() : "";
      if (k != "counter" && k != "gauge" && k != "histogram") return InvalidArgument(who + "kind '" + k + "'");
      st = Declare(name, help, k == "counter" ? Kind::kCounter : k == "gauge" ? Kind::kGauge : Kind::kHistogram);
    } else if (kind == "add") {
      st = Add(name, labels, value);
    } else if (kind == "set") {
      st = Set(name, labels, value);
    } else if (kind == "observe") {
      std::vector<double> buckets;
      if (auto b = op.FindMember("buckets"); b != op.MemberEnd() && b->value.IsArray()) {
        for (const auto& v : b->value.GetArray()) buckets.push_back(v.IsNumber() ? v.GetDouble() : NAN);
      }
      if (auto c = op.FindMember("counts"); c != op.MemberEnd()) {  // observations gathered: per bucket, +Inf last
        std::vector<uint64_t> counts;
        bool whole = c->value.IsArray() && c->value.Size() <= kMaxBuckets + 1;
        if (whole) {
          for (const auto& v : c->value.GetArray()) {
            whole = whole && v.IsUint64();
            counts.push_back(whole ? v.GetUint64() : 0);
          }
        }
        st = whole ? ObserveCounts(name, labels, buckets, counts, value)
                   : InvalidArgument("histogram '" + name + "': counts are whole numbers, one per bucket and +Inf");
      } else {
        st = Observe(name, labels, buckets, value);
      }
    } else {
      return InvalidArgument(who + "operation '" + kind.substr(0, 32) + "'");
    }
    if (!st.ok() && first.ok()) first = Status(st.code(), who + st.message());  // the others still apply
  }
  return first;
}

void CustomMetrics::AddRefresher(const void* key, std::function<void()> f) {
  MutexLock lock(refresh_mu_);
  refreshers_[key] = std::move(f);
}

void CustomMetrics::RemoveRefresher(const void* key) {
  MutexLock lock(refresh_mu_);
  refreshers_.erase(key);
}

void CustomMetrics::Render(std::string& out) {
  {
    MutexLock refresh(refresh_mu_);
    for (auto& [key, f] : refreshers_) f();
  }
  MutexLock lock(mu_);
  for (const auto& [name, f] : families_) {
    out += "# HELP " + name + " ";
    for (char c : f.help) out += c == '\n' ? std::string("\\n") : c == '\\' ? std::string("\\\\") : std::string(1, c);
    out += "\n# TYPE " + name + " " + KindName(f.kind) + "\n";
    for (const auto& [labels, s] : f.series) {
      if (f.kind != Kind::kHistogram) {
        AppendMetricSeries(out, name, labels);
        out += ' ';
        AppendMetricValue(out, s.value);
        out += '\n';
        continue;
      }
      uint64_t cumulative = 0;
      for (size_t i = 0; i <= s.buckets.size(); ++i) {
        cumulative += s.counts[i];
        MetricLabels with = labels;
        std::string le;
        if (i < s.buckets.size()) {
          AppendMetricValue(le, s.buckets[i]);
        } else {
          le = "+Inf";
        }
        with.emplace_back("le", le);
        AppendMetricSeries(out, name + "_bucket", with);
        out += ' ' + std::to_string(cumulative) + '\n';
      }
      AppendMetricSeries(out, name + "_sum", labels);
      out += ' ';
      AppendMetricValue(out, s.value);
      out += '\n';
      AppendMetricSeries(out, name + "_count", labels);
      out += ' ' + std::to_string(s.count) + '\n';
    }
  }
}

}  // namespace quern
