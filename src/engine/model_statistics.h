// Model statistics: what a served model records about its requests and
// batches (Triton's statistics extension, and Prometheus), kept under one
// lock and read as a ModelStatistics snapshot.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <map>

#include "core/mutex.h"
#include "quern/engine.h"

namespace quern {

class ModelStatisticsRecorder {
 public:
  // One request answered (or refused) with `status`, `now_ns` after it was
  // queued (telemetry.queue_start_ns); `input_ns` and `output_ns` are its
  // batch's gathering and splitting times.
  void RecordRequest(const Status& status, const Telemetry& telemetry, int64_t input_ns, int64_t output_ns,
                     int64_t now_ns);

  // One batch of `items` rows: gathered from `start_ns` to `gathered_ns`, run
  // until `end_ns`, split until `split_end_ns`; `wall_ms` is the date.
  void RecordBatch(int64_t items, int64_t start_ns, int64_t gathered_ns, int64_t end_ns, int64_t split_end_ns,
                   int64_t wall_ms);

  // Everything recorded so far (name, version, pending and batch_limit are
  // the caller's to fill).
  ModelStatistics Snapshot() const;

 private:
  mutable Mutex mu_;
  ModelStatistics stats_ QUERN_GUARDED_BY(mu_);
  std::map<int64_t, BatchSizeStats> batch_stats_ QUERN_GUARDED_BY(mu_);
};

}  // namespace quern
