// Collectors for values that live outside the registry: every loaded model
// version's statistics (read from the engine at scrape time) and the
// process's CPU time and resident memory. Metric names and their Triton
// equivalents: docs/metrics.md.
#pragma once

#include "metrics/registry.h"
#include "quern/engine.h"

namespace quern {

// Declares the quern_* model families (counters, gauges, histograms labelled
// by model and version) and collects them from `engine`, which must outlive
// the returned Collection.
[[nodiscard]] MetricsRegistry::Collection AddEngineMetrics(MetricsRegistry& registry, const Engine& engine);

// process_cpu_seconds_total, process_resident_memory_bytes and
// process_start_time_seconds, from /proc.
[[nodiscard]] MetricsRegistry::Collection AddProcessMetrics(MetricsRegistry& registry);

}  // namespace quern
