// Prometheus text exposition: the lines every component's metrics are written
// with. Header-only and free of other Quern types, so that front ends and
// stores that sit below quern_metrics can render their own families.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

namespace quern {

// "# HELP <name> <help>" and "# TYPE <name> <type>".
inline void AppendMetricFamily(std::string& out, std::string_view name, std::string_view type, std::string_view help) {
  out.append("# HELP ").append(name).append(" ").append(help).append("\n# TYPE ").append(name).append(" ");
  out.append(type).append("\n");
}

// One sample: `series` is the metric name with its labels, if any.
inline void AppendMetricSample(std::string& out, std::string_view series, double value) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), " %.17g\n", value);
  out.append(series).append(buf);
}

// A family with a single unlabelled sample.
inline void AppendMetric(std::string& out, std::string_view name, std::string_view type, std::string_view help,
                         double value) {
  AppendMetricFamily(out, name, type, help);
  AppendMetricSample(out, name, value);
}

}  // namespace quern
