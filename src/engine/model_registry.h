// The model registry: which models and versions the engine serves, and how
// they come and go — loading from the repository (through the backend
// registry), registering models made in code, unloading, polling the
// repository for changes, and retiring replaced versions once their
// requests have finished. The public Engine forwards to it.
//
// Thread safety: every public method may be called from any thread; loads,
// reloads and unloads are serialised (load_mu_), lookups take mu_ shared.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/cpus.h"
#include "core/mutex.h"
#include "core/repository.h"
#include "core/repository_watch.h"
#include "engine/backend.h"
#include "engine/instance_placement.h"
#include "engine/servable.h"
#include "quern/engine.h"

namespace quern {

class ModelRegistry {
 public:
  struct VersionSlot {
    ModelStatus status;
    std::shared_ptr<Servable> served;  // null unless ready
  };
  struct Entry {
    bool custom = false;
    std::string fingerprint;
    std::map<int64_t, VersionSlot> versions;
    std::string last_failure;  // of the last reload that failed, logged once
    // The files the last load failed on: a poll tries again once they change.
    std::string failed_fingerprint;
  };
  // With the backends `install` registers.
  ModelRegistry(EngineOptions options, const std::function<void(BackendRegistry&)>& install);
  ~ModelRegistry();  // stops polling, then finishes every version's requests

  // Loads the repository's models (each failure is that model's state) and
  // starts polling when asked. Fails only when the repository cannot be read.
  Status Start();

  uint64_t NextId() { return next_id_.fetch_add(1, std::memory_order_relaxed); }
  // Engine::InferAsync's contract: a refusal is returned, `done` left
  // (`run_here`: see Servable::Submit).
  Status Submit(InferRequest&& request, uint64_t id, InferCallback& done, const SubmitOptions& options = {},
                bool run_here = false);
  // The ready version `version` (-1 = the highest) of `name`.
  Result<std::shared_ptr<Servable>> Resolve(const std::string& name, int64_t version) const;

  Status LoadModel(const std::string& name);
  Status RegisterModel(ModelConfig config, ModelFactory factory);
  Status UnloadModel(const std::string& name);
  Status PollRepository();
  // The scheduling attributes of the thread that created the engine: loads
  // run with them, whichever thread asks (Engine::LoadModel).
  SchedulingAttributes home_scheduling() const { return home_scheduling_; }
  void StopPolling();

  std::vector<ModelStatus> ListModels() const;
  // Whether every version of every model is READY; copies nothing (the
  // readiness probes and the gRPC health service ask it often).
  bool AllReady() const;
  Result<ModelStatus> GetModel(const std::string& name, int64_t version) const;
  uint64_t Generation() const { return generation_.load(std::memory_order_acquire); }
  Result<std::vector<ModelStatistics>> GetStatistics(const std::string& name, int64_t version) const;
  // Model::Abandon on every instance of every version (retiring ones too).
  void Abandon();
  // Servable::SendQueuedNow on every version (retiring ones too).
  void SendQueuedNow();
  // Requests submitted and not answered, in every version (retiring ones too).
  int64_t InFlight() const;
  const Clock& clock() const { return *clock_; }

 private:
  // Every version served now (retiring ones too).
  std::vector<std::shared_ptr<Servable>> EveryServedLocked() const QUERN_REQUIRES_SHARED(mu_);
  // LoadVersion, with anything thrown on the way (threads or memory running
  // out, ONNX Runtime errors outside its own checks) made that version's
  // load error, and the optional extra check applied.
  Result<std::shared_ptr<Servable>> LoadVersionSafely(const RepositoryModel& m, const RepositoryVersion& v);
  Result<std::shared_ptr<Servable>> LoadVersion(const RepositoryModel& m, const RepositoryVersion& v);
  // Places `config`'s instances given `gpus` (see PlaceInstances) and loads them.
  Result<std::shared_ptr<Servable>> LoadInstances(const RepositoryModel& m, const RepositoryVersion& v,
                                                  Backend& backend, ModelConfig config, const GpuAvailability& gpus);

  Status UnloadLocked(const std::string& name) QUERN_REQUIRES(load_mu_);
  // A reload of `name` failed (`failure`): what served before serves on
  // (Triton's rule). When nothing of `entry` serves, `entry` becomes the
  // served versions as they are; else each version that failed and served
  // before is kept. Kept versions carry the failure as their reason (logged
  // once per distinct failure); a poll loads again once the files change
  // from those the load failed on (Entry::failed_fingerprint).
  void KeepServingWhatFailed(const std::string& name, Entry& entry, const Status& failure);
  // The models named were back to the files that loaded after a reload of
  // them failed: their serving versions' failure notes go.
  void ForgetReloadFailures(const std::vector<std::string>& names);

  // With mu_ held: versions taken out of models_ stay counted by InFlight
  // until RetireVersions has finished their requests.
  void HoldRetiringLocked(const std::map<int64_t, VersionSlot>& versions) QUERN_REQUIRES(mu_);

  // Finishes the requests of versions taken out of service (held first by
  // HoldRetiringLocked), then lets them go.
  void RetireVersions(std::map<int64_t, VersionSlot>& versions);
  // Puts `entry` in service under `name` and retires the versions it replaces.
  void Replace(const std::string& name, Entry entry);
  void PollLoop();
  // A poll: every model when `changes` is null or says everything, else
  // the models it names (and the listing when it says so). Models whose
  // files were still changing are added to `unsettled` (when not null).
  Status PollRepository(const RepositoryWatch::Changes* changes, std::set<std::string>* unsettled);
  // Loads `names`, ensembles after the ensembles among them that they use
  // (each configuration read once; linear in models and steps). Ensembles
  // on a cycle fail naming it; nothing of a cycle is loaded.
  void LoadInOrder(const std::vector<std::string>& names);
  // Refuses `config` as the ensemble `name` when the served ensembles and
  // it would make a cycle (named in the error), or nest ensembles deeper
  // than EnsembleModel::kMaxNesting. Called under load_mu_, so what it
  // checks stays true until the version is in service.
  Status CheckEnsembleGraph(const std::string& name, const ModelConfig& config) const;
  // `name`, serving nothing, failed before any version loaded: it is
  // listed UNAVAILABLE with `status`'s message.
  void RecordLoadFailure(const std::string& name, const Status& status);
  // A path of models from `from` back to itself following `uses`, or empty
  // when there is none. Iterative: bounded by the graph, not the stack.
  static std::vector<std::string> FindCycle(const std::string& from,
                                            const std::function<std::vector<std::string>(const std::string&)>& uses);
  static std::string JoinPath(const std::vector<std::string>& models);

  EngineOptions options_;
  const Clock* clock_ = nullptr;
  int cores_ = 1;
  const SchedulingAttributes home_scheduling_ = CurrentScheduling();
  BackendRegistry backends_;  // filled at construction, read-only after
  std::atomic<uint64_t> next_id_{1};
  mutable SharedMutex mu_;
  std::map<std::string, Entry> models_ QUERN_GUARDED_BY(mu_);
  // Counts the changes to models_ (each made with mu_ held for writing).
  std::atomic<uint64_t> generation_{0};
  // Versions out of service whose requests are finishing.
  std::vector<std::shared_ptr<Servable>> retiring_ QUERN_GUARDED_BY(mu_);
  bool send_queued_now_ QUERN_GUARDED_BY(mu_) = false;  // SendQueuedNow was called
  Mutex load_mu_;                                       // serialises loads, reloads and unloads

  Mutex poll_mu_;
  CondVar poll_cv_;
  bool stopping_ QUERN_GUARDED_BY(poll_mu_) = false;
  bool polling_ QUERN_GUARDED_BY(poll_mu_) = false;  // a poll runs (StopPolling waits it out)
  std::thread poll_thread_;
};

}  // namespace quern
