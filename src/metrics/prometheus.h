// Prometheus text exposition of the engine's statistics plus process CPU and
// memory. Metric names and their Triton equivalents: docs/metrics.md.
#pragma once

#include <string>

#include "quern/engine.h"

namespace quern {

// Renders every loaded model version's counters, gauges and histograms.
std::string RenderPrometheus(const Engine& engine);

}  // namespace quern
