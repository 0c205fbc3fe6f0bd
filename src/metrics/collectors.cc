#include "metrics/collectors.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "core/model_runtime.h"

namespace quern {
namespace {

MetricLabels Labels(const ModelStatistics& s) {
  return {{"model", s.name}, {"version", std::to_string(s.version)}};
}

MetricLabels Labels(const ModelStatistics& s, const char* key, const char* value) {
  MetricLabels l = Labels(s);
  l.emplace_back(key, value);
  return l;
}

struct HistogramFamily {
  const char* name;
  const char* help;
  const Histogram ModelStatistics::*field;
};

constexpr HistogramFamily kHistograms[] = {
    {"quern_request_duration_us", "Time from arrival to response, microseconds.", &ModelStatistics::request_us},
    {"quern_queue_duration_us", "Time waiting for a batch to start, microseconds.", &ModelStatistics::queue_us},
    {"quern_compute_input_duration_us", "Gathering a batch's inputs, microseconds.",
     &ModelStatistics::compute_input_us},
    {"quern_compute_infer_duration_us", "Running the model on a batch, microseconds.",
     &ModelStatistics::compute_infer_us},
    {"quern_compute_output_duration_us", "Splitting a batch's outputs, microseconds.",
     &ModelStatistics::compute_output_us},
    {"quern_batch_size", "Items per executed batch.", &ModelStatistics::batch_size},
};

// From /proc: the boot time (btime in /proc/stat) plus the process's start
// in clock ticks after boot (field 22 of /proc/self/stat); 0 when unknown.
double ProcessStartTime() {
  std::ifstream stat("/proc/self/stat");
  const std::string content((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto close = content.rfind(')');
  if (close == std::string::npos || close + 2 > content.size()) return 0;
  std::istringstream rest(content.substr(close + 2));
  std::string field;
  unsigned long long ticks = 0;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
    if (i == 22) ticks = std::strtoull(field.c_str(), nullptr, 10);
  }
  std::ifstream system("/proc/stat");
  std::string line;
  while (std::getline(system, line)) {
    if (line.starts_with("btime ")) {
      const double boot = std::strtod(line.c_str() + 6, nullptr);
      return boot + static_cast<double>(ticks) / static_cast<double>(sysconf(_SC_CLK_TCK));
    }
  }
  return 0;
}

}  // namespace

MetricsRegistry::Collection AddEngineMetrics(MetricsRegistry& registry, const Engine& engine) {
  registry.DeclareFamily("quern_request_success_total", MetricType::kCounter, "Requests answered successfully.");
  registry.DeclareFamily("quern_request_failure_total", MetricType::kCounter, "Requests that failed, by reason.");
  registry.DeclareFamily("quern_inference_count_total", MetricType::kCounter,
                         "Items (batch rows) computed, without padding.");
  registry.DeclareFamily("quern_execution_count_total", MetricType::kCounter, "Batches run.");
  registry.DeclareFamily("quern_batches_total", MetricType::kCounter,
                         "Batches run, by the thread that ran them: engine (the engine's own threads), caller (the "
                         "submitting thread, lent for a short batch), loop (an event loop's thread between its "
                         "events), shared (a caller's thread beside a busy instance).");
  registry.DeclareFamily("quern_pending_requests", MetricType::kGauge, "Requests waiting in the model's queue.");
  registry.DeclareFamily("quern_batch_size_limit", MetricType::kGauge,
                         "Largest batch formed now: max_batch_size, or less where the batch size tuner found a "
                         "smaller batch faster or the memory budget holds it.");
  registry.DeclareFamily("quern_batch_memory_bytes", MetricType::kGauge,
                         "Run memory a batch at the limit is expected to hold, as measured on the batches run (the "
                         "large buffers ONNX Runtime's runs take from Quern's allocator); 0 before a batch ran or "
                         "where runs take none.");
  registry.DeclareFamily("quern_batch_leave", MetricType::kGauge,
                         "1 for the way batches leave, as measured online (models with a latency target and a "
                         "batching delay): at_once, everyone_here or after_delay.");
  for (const auto& h : kHistograms) registry.DeclareFamily(h.name, MetricType::kHistogram, h.help);
  registry.DeclareFamily("quern_model_runtime", MetricType::kGauge,
                         "1 for the runtime that runs a ready model: its backend and, where the configuration or "
                         "backend \"auto\" set one, its precision (\"openvino bf16\").");

  return registry.AddCollector([&engine](MetricWriter& w) {
    for (const ModelStatus& m : engine.ListModels()) {
      if (m.state != ModelState::kReady || m.config.backend.empty()) continue;
      w.Sample("quern_model_runtime",
               {{"model", m.name}, {"version", std::to_string(m.version)}, {"runtime", ModelRuntime(m.config)}}, 1);
    }
    auto stats = engine.GetStatistics();
    if (!stats) return;
    for (const ModelStatistics& s : *stats) {
      const MetricLabels labels = Labels(s);
      w.Sample("quern_request_success_total", labels, static_cast<double>(s.success.count));
      for (auto [reason, n] : {std::pair{"rejected", s.fail_rejected}, std::pair{"cancelled", s.fail_cancelled},
                               std::pair{"timeout", s.fail_timeout}, std::pair{"invalid", s.fail_invalid},
                               std::pair{"backend", s.fail_backend}}) {
        w.Sample("quern_request_failure_total", Labels(s, "reason", reason), static_cast<double>(n));
      }
      w.Sample("quern_inference_count_total", labels, static_cast<double>(s.inference_count));
      w.Sample("quern_execution_count_total", labels, static_cast<double>(s.execution_count));
      for (auto [where, n] : {std::pair{"engine", s.engine_batches}, std::pair{"caller", s.caller_batches},
                              std::pair{"loop", s.loop_batches}, std::pair{"shared", s.shared_batches}}) {
        w.Sample("quern_batches_total", Labels(s, "ran_on", where), static_cast<double>(n));
      }
      w.Sample("quern_pending_requests", labels, static_cast<double>(s.pending));
      w.Sample("quern_batch_size_limit", labels, static_cast<double>(s.batch_limit));
      w.Sample("quern_batch_memory_bytes", labels, static_cast<double>(s.batch_memory_bytes));
      if (!s.batch_leave.empty()) {
        for (const char* way : {"at_once", "everyone_here", "after_delay"}) {
          w.Sample("quern_batch_leave", Labels(s, "way", way), s.batch_leave == way ? 1 : 0);
        }
      }
      for (const auto& h : kHistograms) {
        const Histogram& v = s.*(h.field);
        w.Histogram(h.name, labels, v.bounds, v.counts, v.sum, v.count);
      }
    }
  });
}

MetricsRegistry::Collection AddProcessMetrics(MetricsRegistry& registry) {
  registry.DeclareFamily("process_cpu_seconds_total", MetricType::kCounter, "User and system CPU time of the process.");
  registry.DeclareFamily("process_resident_memory_bytes", MetricType::kGauge, "Resident memory of the process.");
  registry.DeclareFamily("process_start_time_seconds", MetricType::kGauge,
                         "Start time of the process since the Unix epoch, seconds.");
  const double started = ProcessStartTime();
  return registry.AddCollector([started](MetricWriter& w) {
    if (started > 0) w.Sample("process_start_time_seconds", {}, started);
    std::ifstream stat("/proc/self/stat");
    std::string content((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    // Fields after the command name, which is in parentheses and may hold
    // spaces: state is field 3, utime 14, stime 15.
    auto close = content.rfind(')');
    if (close != std::string::npos && close + 2 <= content.size()) {
      std::istringstream rest(content.substr(close + 2));
      std::string field;
      unsigned long long utime = 0, stime = 0;
      for (int i = 3; i <= 15 && rest >> field; ++i) {
        if (i == 14) utime = std::strtoull(field.c_str(), nullptr, 10);
        if (i == 15) stime = std::strtoull(field.c_str(), nullptr, 10);
      }
      w.Sample("process_cpu_seconds_total", {},
               static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK)));
    }
    std::ifstream statm("/proc/self/statm");
    unsigned long long size = 0, resident = 0;
    if (statm >> size >> resident) {
      w.Sample("process_resident_memory_bytes", {},
               static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)));
    }
  });
}

}  // namespace quern
