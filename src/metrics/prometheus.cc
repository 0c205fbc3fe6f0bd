#include "metrics/prometheus.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

namespace quern {
namespace {

std::string Labels(const ModelStatistics& s, const std::string& extra = "") {
  std::string l = "{model=\"" + s.name + "\",version=\"" + std::to_string(s.version) + "\"";
  if (!extra.empty()) l += "," + extra;
  return l + "}";
}

void Family(std::ostringstream& o, const char* name, const char* type, const char* help) {
  o << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n";
}

void WriteHistogram(std::ostringstream& o, const char* name, const ModelStatistics& s, const Histogram& h) {
  for (size_t i = 0; i < h.bounds.size(); ++i) {
    o << name << "_bucket" << Labels(s, "le=\"" + std::to_string(static_cast<long long>(h.bounds[i])) + "\"") << " "
      << h.counts[i] << "\n";
  }
  o << name << "_bucket" << Labels(s, "le=\"+Inf\"") << " " << h.counts.back() << "\n";
  o << name << "_sum" << Labels(s) << " " << h.sum << "\n";
  o << name << "_count" << Labels(s) << " " << h.count << "\n";
}

// CPU seconds (user + system) and resident bytes of this process, from /proc.
void ProcessMetrics(std::ostringstream& o) {
  std::ifstream stat("/proc/self/stat");
  std::string content((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  auto close = content.rfind(')');
  if (close != std::string::npos) {
    std::istringstream rest(content.substr(close + 2));
    std::string field;
    unsigned long long utime = 0, stime = 0;
    for (int i = 3; i <= 15 && rest >> field; ++i) {
      if (i == 14) utime = std::stoull(field);
      if (i == 15) stime = std::stoull(field);
    }
    Family(o, "process_cpu_seconds_total", "counter", "User and system CPU time of the process.");
    o << "process_cpu_seconds_total " << static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK))
      << "\n";
  }
  std::ifstream statm("/proc/self/statm");
  unsigned long long size = 0, resident = 0;
  if (statm >> size >> resident) {
    Family(o, "process_resident_memory_bytes", "gauge", "Resident memory of the process.");
    o << "process_resident_memory_bytes " << resident * static_cast<unsigned long long>(sysconf(_SC_PAGESIZE)) << "\n";
  }
}

}  // namespace

std::string RenderPrometheus(const Engine& engine) {
  std::ostringstream o;
  auto stats = engine.GetStatistics();
  const std::vector<ModelStatistics> all = stats ? *stats : std::vector<ModelStatistics>{};

  Family(o, "quern_request_success_total", "counter", "Requests answered successfully.");
  for (const auto& s : all) o << "quern_request_success_total" << Labels(s) << " " << s.success.count << "\n";
  Family(o, "quern_request_failure_total", "counter", "Requests that failed, by reason.");
  for (const auto& s : all) {
    for (auto [reason, n] : {std::pair{"rejected", s.fail_rejected}, std::pair{"cancelled", s.fail_cancelled},
                             std::pair{"timeout", s.fail_timeout}, std::pair{"invalid", s.fail_invalid},
                             std::pair{"backend", s.fail_backend}}) {
      o << "quern_request_failure_total" << Labels(s, std::string("reason=\"") + reason + "\"") << " " << n << "\n";
    }
  }
  Family(o, "quern_inference_count_total", "counter", "Items (batch rows) computed, without padding.");
  for (const auto& s : all) o << "quern_inference_count_total" << Labels(s) << " " << s.inference_count << "\n";
  Family(o, "quern_execution_count_total", "counter", "Batches run.");
  for (const auto& s : all) o << "quern_execution_count_total" << Labels(s) << " " << s.execution_count << "\n";
  Family(o, "quern_pending_requests", "gauge", "Requests waiting in the model's queue.");
  for (const auto& s : all) o << "quern_pending_requests" << Labels(s) << " " << s.pending << "\n";
  Family(o, "quern_batch_size_limit", "gauge",
         "Largest batch formed now: max_batch_size, or less where the batch size tuner found a smaller batch "
         "faster.");
  for (const auto& s : all) o << "quern_batch_size_limit" << Labels(s) << " " << s.batch_limit << "\n";

  struct H {
    const char* name;
    const char* help;
    const Histogram ModelStatistics::*field;
  };
  for (const H& h :
       {H{"quern_request_duration_us", "Time from arrival to response, microseconds.", &ModelStatistics::request_us},
        H{"quern_queue_duration_us", "Time waiting for a batch to start, microseconds.", &ModelStatistics::queue_us},
        H{"quern_compute_input_duration_us", "Gathering a batch's inputs, microseconds.",
          &ModelStatistics::compute_input_us},
        H{"quern_compute_infer_duration_us", "Running the model on a batch, microseconds.",
          &ModelStatistics::compute_infer_us},
        H{"quern_compute_output_duration_us", "Splitting a batch's outputs, microseconds.",
          &ModelStatistics::compute_output_us},
        H{"quern_batch_size", "Items per executed batch.", &ModelStatistics::batch_size}}) {
    Family(o, h.name, "histogram", h.help);
    for (const auto& s : all) WriteHistogram(o, h.name, s, s.*(h.field));
  }
  ProcessMetrics(o);
  return o.str();
}

}  // namespace quern
