#include "engine/model_statistics.h"

#include <algorithm>
#include <utility>

namespace quern {

void ModelStatisticsRecorder::RecordRequest(const Status& status, const Telemetry& t, int64_t input_ns,
                                            int64_t output_ns, int64_t now_ns) {
  MutexLock lock(mu_);
  DurationStat& outcome = status.ok() ? stats_.success : stats_.fail;
  const int64_t total_ns = std::max<int64_t>(now_ns - t.queue_start_ns, 0);
  ++outcome.count;
  outcome.ns += static_cast<uint64_t>(total_ns);
  stats_.request_us.Observe(static_cast<double>(total_ns) / 1e3);
  switch (status.code()) {
    case StatusCode::kOk: break;
    case StatusCode::kUnavailable: ++stats_.fail_rejected; break;
    case StatusCode::kCancelled: ++stats_.fail_cancelled; break;
    case StatusCode::kDeadlineExceeded: ++stats_.fail_timeout; break;
    case StatusCode::kInvalidArgument: ++stats_.fail_invalid; break;
    default: ++stats_.fail_backend; break;
  }
  if (t.compute_start_ns > 0) {
    stats_.queue.count++;
    stats_.queue.ns += static_cast<uint64_t>(t.compute_start_ns - t.queue_start_ns);
    stats_.queue_us.Observe(static_cast<double>(t.compute_start_ns - t.queue_start_ns) / 1e3);
    const int64_t infer_ns = t.compute_end_ns - t.compute_start_ns - input_ns;
    for (auto [stat, ns] : {std::pair{&stats_.compute_input, input_ns}, std::pair{&stats_.compute_infer, infer_ns},
                            std::pair{&stats_.compute_output, output_ns}}) {
      stat->count++;
      stat->ns += static_cast<uint64_t>(std::max<int64_t>(ns, 0));
    }
  }
}

void ModelStatisticsRecorder::RecordBatch(int64_t items, int64_t start, int64_t gathered, int64_t end,
                                          int64_t split_end, int64_t wall_ms) {
  MutexLock lock(mu_);
  stats_.execution_count++;
  stats_.inference_count += static_cast<uint64_t>(items);
  stats_.batch_size.Observe(static_cast<double>(items));
  stats_.compute_input_us.Observe(static_cast<double>(gathered - start) / 1e3);
  stats_.compute_infer_us.Observe(static_cast<double>(end - gathered) / 1e3);
  stats_.compute_output_us.Observe(static_cast<double>(split_end - end) / 1e3);
  stats_.last_inference_ms = static_cast<uint64_t>(wall_ms);
  BatchSizeStats& b = batch_stats_[items];
  b.batch_size = items;
  for (auto [stat, ns] : {std::pair{&b.compute_input, gathered - start}, std::pair{&b.compute_infer, end - gathered},
                          std::pair{&b.compute_output, split_end - end}}) {
    stat->count++;
    stat->ns += static_cast<uint64_t>(std::max<int64_t>(ns, 0));
  }
}

ModelStatistics ModelStatisticsRecorder::Snapshot() const {
  MutexLock lock(mu_);
  ModelStatistics s = stats_;
  for (const auto& [size, b] : batch_stats_) s.batch_stats.push_back(b);
  return s;
}

}  // namespace quern
