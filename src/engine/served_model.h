// ServedModel: one loaded version of one model. It validates requests against
// the configuration, queues them in its DynamicBatcher, and on each instance
// worker concatenates a batch's inputs, runs the instance, splits the outputs
// and completes every request with its own rows (padding rows never leave).
//
// Thread safety: Submit may be called from any thread. Shutdown drains the
// queue (every queued request completes) and must not be called from a
// completion callback. Ownership: holds its instances; requests hold no
// reference to it, so the engine calls Shutdown before dropping it.
#pragma once

#include <atomic>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "core/mutex.h"
#include "core/repository.h"
#include "engine/model_statistics.h"
#include "engine/servable.h"
#include "quern/clock.h"
#include "quern/engine.h"
#include "quern/model.h"
#include "scheduler/dynamic_batcher.h"
#include "scheduler/response_sequencer.h"

namespace quern {

// How a served model's instances may be run.
struct ServedModelRuns {
  // The last instance runs a batch with every core, alone, while the load
  // is light (DynamicBatcherOptions::wide_worker).
  bool wide = false;
  // A caller may run a short batch on its own thread (the backend's
  // Backend::RunsOnCallerThreads).
  bool on_caller_threads = false;
};

class ServedModel final : public Servable {
 public:
  // `instances` are loaded already. Runs the configured warm-up samples on
  // every instance (files are read from `model_dir`/warmup/) before returning.
  static Result<std::shared_ptr<ServedModel>> Create(ModelConfig config, int64_t version,
                                                     std::vector<std::unique_ptr<Model>> instances, const Clock* clock,
                                                     std::filesystem::path model_dir, ServedModelRuns runs = {});
  ~ServedModel() override;

  // Servable (see there). Abandon asks every instance (Model::Abandon);
  // CheckAdmission refuses while the queue is full.
  Status Submit(InferRequest&& request, uint64_t request_id, InferCallback& done, const SubmitOptions& options,
                bool run_here) override;
  void Abandon() override;
  void SendQueuedNow() override;
  Status CheckAdmission() override;
  void CountRefused(const Status& status) override;
  void Shutdown() override;
  bool stopping() const override;
  const ModelConfig& config() const override { return config_; }
  ModelStatistics Statistics() const override;
  // Queued, running or waiting for their turn to be answered.
  int64_t in_flight() const override { return in_flight_.load(std::memory_order_acquire); }
  int64_t version() const override { return version_; }
  std::shared_ptr<const std::vector<std::string>> OutputLabels(const std::string& output) const override;

 private:
  class Task;
  class BatchResponses;  // a decoupled model's batch: where its responses go
  // A batch's times (the engine clock) and sizes, stamped on its requests.
  struct BatchTimes {
    int64_t items, padded, start, gathered, end, split_end;
  };
  ServedModel(ModelConfig config, int64_t version, std::vector<std::unique_ptr<Model>> instances, const Clock* clock);
  Status Warmup(const std::filesystem::path& model_dir);
  void ExecuteBatch(int worker, std::vector<std::unique_ptr<BatchTask>>&& batch);
  void Finish(std::unique_ptr<Task> task, Status status, std::vector<NamedTensor> outputs);
  // A decoupled model's batch, run: each request answered with what the model sent last for it.
  void AnswerDecoupled(BatchResponses& responses, std::span<std::unique_ptr<Task>> tasks, const Status& st,
                       std::span<const Status> per_status, const BatchTimes& times);
  static void Stamp(Task& task, const BatchTimes& times);
  // A request refused at submission: counted, and its status returned.
  Status Refuse(const Task& task, Status status);
  void RecordOutcome(const Task& task, const Status& status);

  const ModelConfig config_;
  // Outputs with a label_filename: their labels, read by Create.
  OutputLabelSet labels_;
  const int64_t version_;
  const Clock* clock_;
  std::vector<std::unique_ptr<Model>> instances_;
  std::unique_ptr<DynamicBatcher> batcher_;
  ResponseSequencer sequencer_;
  const bool ordered_;
  bool on_caller_threads_ = false;  // ServedModelRuns::on_caller_threads; set by Create

  std::atomic<int64_t> in_flight_{0};

  // Requests not yet answered: in_flight_ less those whose callback runs
  // (a caller that submits its next request from the callback is alone).
  std::atomic<int64_t> unanswered_{0};
  ModelStatisticsRecorder stats_;

  // Requests the model failed are logged, at most kFailuresLoggedPerSecond
  // a second; the others are counted into the next line.
  static constexpr int kFailuresLoggedPerSecond = 10;
  void LogFailure(const InferResponse& r);
  Mutex failure_log_mu_;
  int64_t failure_log_second_ QUERN_GUARDED_BY(failure_log_mu_) = -1;
  int failures_logged_ QUERN_GUARDED_BY(failure_log_mu_) = 0;
  int64_t failures_unlogged_ QUERN_GUARDED_BY(failure_log_mu_) = 0;
};

}  // namespace quern
