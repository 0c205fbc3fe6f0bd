// EnsembleModel: an ensemble (config.pbtxt `platform: "ensemble"` with
// Triton's `ensemble_scheduling { step [...] }`) served as one model. It has
// no instances and no batcher: each step is a request to the step's own
// model, submitted when the tensors it reads are ready, so the requests of
// different callers meet in batches at every step. Tensors pass from step
// to step as they are (a step's output rows are a view of its batch's
// output; nothing is copied on the way).
//
// Fan-out: the rows of a tensor need not be the request's batch. A step may
// write N rows for one request (one per region found), and the steps that
// read them get the N rows as N items, which meet other requests' items in
// the step model's batches. Rows beyond a step model's max_batch_size go as
// several requests whose answers are joined in order; zero rows skip the
// step (its outputs have zero rows).
//
// Decoupled steps (a step model with model_transaction_policy { decoupled:
// true }, answering with any number of responses) make the ensemble
// decoupled itself: each response of the step runs the steps that read its
// answers (a branch, with the tensors the other steps wrote), and each branch
// that reaches the ensemble's outputs is one response to the caller
// (InferRequest::on_response), in the order the step sent them; the caller's
// callback gets the last, final_only, once every branch has ended. Branches
// of one request run one after another (the next response waits, at most
// kMaxQueuedResponses of them); the steps that do not read the decoupled
// step's answers run once, before the first branch. Several decoupled steps
// must form a chain (each reads the one before, transitively): two that do
// not are refused at load, as their responses cannot be paired. A call that
// takes one answer is refused (request_validation.h), as for any decoupled
// model. A failed request cancels its own token (the caller's cancels it
// too), which every step request carries: its decoupled steps stop sending
// and its branches start nothing more; steps already in their models end
// there (Shutdown waits for answers, not for those).
//
// Load-time checks (Create) name the step and the model: unknown or unready
// step models, names that are not the step model's inputs or outputs,
// tensors read but never written, written twice or written and never read,
// unused ensemble inputs, cycles, and type, shape or batch size mismatches.
// At run time a failed step fails the request with the step's status code
// and a message naming the step and its model; the caller's cancellation,
// deadline, priority and queue timeout go with every step request. A step
// model that is reloaded keeps serving the requests inside the ensemble
// (the registry keeps old versions until their requests finish, and each
// step resolves its model when it is submitted).
//
// Thread safety: as Servable. Step completions run on the step models'
// engine threads and submit the steps they make ready from there.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/mutex.h"
#include "core/repository.h"
#include "engine/model_statistics.h"
#include "engine/servable.h"
#include "quern/clock.h"

namespace quern {

class EnsembleModel final : public Servable, public std::enable_shared_from_this<EnsembleModel> {
 public:
  // How an ensemble reaches the models of its steps (the registry's).
  struct StepModels {
    // Engine::InferAsync's contract: a refusal is returned, `done` left.
    std::function<Status(InferRequest&& request, InferCallback& done, const SubmitOptions& options)> submit;
    // The configuration of the ready version `version` (-1 = the highest).
    std::function<Result<ModelConfig>(const std::string& name, int64_t version)> config;
    // Servable::CheckAdmission of that version.
    std::function<Status(const std::string& name, int64_t version)> check_admission;
  };

  // Checks `config` (an ensemble's, already through ValidateModelConfig)
  // against its step models as they are served now.
  // Its outputs' label files (label_filename) are read from `model_dir`
  // (the ensemble's own folder, as Triton reads them); none when empty.
  static Result<std::shared_ptr<EnsembleModel>> Create(ModelConfig config, int64_t version, StepModels models,
                                                       const Clock* clock, const std::filesystem::path& model_dir = {});
  ~EnsembleModel() override;

  Status Submit(InferRequest&& request, uint64_t request_id, InferCallback& done, const SubmitOptions& options,
                bool run_here) override;
  // Refuses while stopping, or when a model of a first step would refuse.
  Status CheckAdmission() override;
  void CountRefused(const Status& status) override;
  void Abandon() override {}  // its requests run in the step models, which are abandoned themselves
  // Stops intake and waits until every accepted request is answered (their
  // steps run in the step models, which must still be served).
  void Shutdown() override;
  bool stopping() const override;
  const ModelConfig& config() const override { return config_; }
  int64_t version() const override { return version_; }
  std::shared_ptr<const std::vector<std::string>> OutputLabels(const std::string& output) const override {
    return FindOutputLabels(labels_, output);
  }
  ModelStatistics Statistics() const override;
  int64_t in_flight() const override;

  // The most ensembles nested in one another (an ensemble whose step is an
  // ensemble whose step ...) that are served: the registry refuses to load
  // deeper ones, and Submit and CheckAdmission refuse a request that finds
  // itself nested deeper on its thread's stack (the walks recurse through
  // the step models), whatever the registry let through.
  static constexpr int kMaxNesting = 256;

  // The most requests one step of one ensemble request may be split into
  // (rows beyond the step model's max_batch_size); more fail the request.
  static constexpr int64_t kMaxStepRequests = 4096;

  // The most responses of a decoupled step one request holds while a branch
  // runs; more fail the request (RESOURCE_EXHAUSTED), so that a step that
  // sends faster than the steps after it keeps no unbounded memory.
  static constexpr size_t kMaxQueuedResponses = 4096;

 private:
  struct Step {
    std::string model;
    int64_t version = -1;
    std::vector<std::pair<std::string, int>> inputs;   // step model input -> ensemble tensor
    std::vector<std::pair<std::string, int>> outputs;  // step model output -> ensemble tensor
    std::vector<std::string> requested;                // the outputs' names, asked of the model
    // The step model's max_batch_size when the ensemble was loaded: rows
    // beyond it are sent as several requests (0 = it does not batch).
    int64_t max_batch = 0;
    std::vector<TensorConfig> output_configs;  // the requested outputs' (for zero rows)
    // A decoupled step model; `tail`: this step and the steps that read its
    // answers, transitively (those a branch runs).
    bool decoupled = false;
    int tail = 0;
  };
  class Run;

  EnsembleModel(ModelConfig config, int64_t version, StepModels models, const Clock* clock);
  Status Plan();
  // Plan's last part: the steps each waits for (waits_for_), those that
  // start (first_steps_), and no cycle among them. `writer`: the step that
  // writes each tensor (-1 an ensemble input).
  Status OrderSteps(const std::vector<int>& writer);
  // Plan's end for decoupled steps: their tails, and the chain they form
  // (chain_), or why they cannot.
  Status PlanDecoupled();
  // Submits `steps` of `run`. A refusal of the first of them while nothing
  // of the run was submitted before (`first_launch`) is returned instead of
  // answered, so that Submit can refuse the request; any other refusal
  // fails the run.
  Status Launch(const std::shared_ptr<Run>& run, const std::vector<int>& steps, bool first_launch,
                CallerLoop* loop = nullptr);
  // A step's answer; with `chunks` > 1, that of rows chunk `chunk` of it,
  // kept until every chunk has answered and then joined in order.
  void StepDone(const std::shared_ptr<Run>& run, int step, int chunk, int chunks, InferResponse&& response);
  // A response of run's decoupled step (`last`: the step's final one, to
  // its callback): queued for a branch, or the request failed.
  void StepResponse(const std::shared_ptr<Run>& run, int step, InferResponse&& response, bool last);
  // Starts run's next branch, once the steps that do not wait for its
  // decoupled step have answered and no branch of it runs; ends the run when
  // its step is closed and nothing is left.
  void NextBranch(const std::shared_ptr<Run>& run);
  void StartBranch(const std::shared_ptr<Run>& run);  // NextBranch's work for one run
  // A run whose work is done: its parent goes on; the request's own run
  // answers the caller last.
  void EndRun(const std::shared_ptr<Run>& run);
  // A branch that failed or reached the ensemble's outputs (one response).
  void FinishBranch(const std::shared_ptr<Run>& run, Status status);
  // The answer of a batching step given zero rows (it is not run).
  InferResponse NoRows(int step) const;
  void Finish(const std::shared_ptr<Run>& run, Status status);
  Status StepError(int step, const Status& status) const;
  void Release();

  ModelConfig config_;     // set by Create (decoupled when a step is), constant after
  OutputLabelSet labels_;  // read by Create
  const int64_t version_;
  const StepModels models_;
  const Clock* clock_;

  // The plan, made once by Create: tensors by index, which ensemble tensor
  // each configured input and output is, which steps read each tensor and
  // how many tensors each step waits for.
  std::vector<std::string> tensors_;
  std::vector<Step> steps_;
  std::vector<int> input_tensor_;   // by config input
  std::vector<int> output_tensor_;  // by config output
  std::vector<std::vector<int>> readers_;
  std::vector<int> waits_for_;
  std::vector<int> first_steps_;
  std::vector<int> chain_;  // the decoupled steps, each reading the one before

  mutable Mutex mu_;
  CondVar idle_;
  bool stopping_ QUERN_GUARDED_BY(mu_) = false;
  int64_t in_flight_ QUERN_GUARDED_BY(mu_) = 0;
  ModelStatisticsRecorder stats_;
};

}  // namespace quern
