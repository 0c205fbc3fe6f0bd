#include "engine/model_registry.h"

#include <algorithm>
#include <random>
#include <set>

#include "core/cpus.h"
#include "core/gpus.h"
#include "core/log.h"
#include "core/memory.h"
#include "core/model_config_parser.h"
#include "engine/ensemble_model.h"
#include "engine/instance_placement.h"
#include "engine/served_model.h"

namespace quern {
namespace {

// The reason a serving version shows after a reload of its model failed.
constexpr std::string_view kReloadFailedNote = "a reload failed, the version loaded before serves on: ";
// The most of another model's load error a lookup's error quotes.
constexpr size_t kMaxQuotedReason = 240;
// The first `n` bytes of `s`, fewer so as not to cut a UTF-8 character.
std::string CutAtCharacter(const std::string& s, size_t n) {
  if (s.size() <= n) return s;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  return s.substr(0, n);
}
// How long a poll waits before its second look at the models that changed.
constexpr int kSettleMs = 200;
// How often a poll looks at every model whatever the file events said.
constexpr int kFullLookS = 60;
}  // namespace

ModelRegistry::ModelRegistry(EngineOptions options, const std::function<void(BackendRegistry&)>& install)
    : options_(std::move(options)) {
  clock_ = options_.clock ? options_.clock : &RealClockInstance();
  cores_ = options_.cores > 0 ? options_.cores : UsableCores();
  if (install) install(backends_);
  ModelServices services;
  services.submit = [this](InferRequest&& r, InferCallback& done, const SubmitOptions& o) {
    return Submit(std::move(r), NextId(), done, o);
  };
  services.compare_answers = options_.compare_answers;
  backends_.SetServices(services);
  std::random_device rd;
  next_id_ = (static_cast<uint64_t>(rd()) << 32 | rd()) & 0x7fffffffffffffffULL;
  if (next_id_ == 0) next_id_ = 1;
}

ModelRegistry::~ModelRegistry() {
  StopPolling();
  if (poll_thread_.joinable()) poll_thread_.join();
  std::map<std::string, Entry> models;
  {
    WriterLock lock(mu_);
    models.swap(models_);
    for (auto& [name, e] : models) HoldRetiringLocked(e.versions);
  }
  // Ensembles first: their requests still run steps in the other models.
  for (auto& [name, e] : models) {
    const bool ensemble = std::any_of(e.versions.begin(), e.versions.end(), [](const auto& v) {
      return v.second.served && v.second.served->config().is_ensemble();
    });
    if (ensemble) RetireVersions(e.versions);
  }
  for (auto& [name, e] : models) RetireVersions(e.versions);
}

Status ModelRegistry::Start() {
  if (options_.model_repository.empty()) return Status::Ok();
  auto names = ListRepositoryModels(options_.model_repository);
  if (!names) return names.error();
  if (options_.load_all_models) LoadInOrder(*names);
  if (options_.repository_poll_interval_s > 0) {
    poll_thread_ = std::thread([this] {
      NameThisThread("quern-poll");
      PollLoop();
    });
  }
  return Status::Ok();
}

Status ModelRegistry::Submit(InferRequest&& request, uint64_t id, InferCallback& done, const SubmitOptions& options,
                             bool run_here) {
  // A version replaced between the lookup and the submission (a reload)
  // refuses as it stops and hands the request back: it goes to the version
  // that replaced it. Bounded, in case reloads follow one another.
  std::shared_ptr<Servable> previous;
  for (int attempt = 0;; ++attempt) {
    auto served = Resolve(request.model, request.version);
    if (!served) return served.error();
    if (*served == previous) return Unavailable("model '" + request.model + "' is stopping");
    Status st = (*served)->Submit(std::move(request), id, done, options, run_here);
    if (st.ok() || attempt == 3 || !(*served)->stopping()) return st;
    previous = std::move(*served);
  }
}

Result<std::shared_ptr<Servable>> ModelRegistry::Resolve(const std::string& name, int64_t version) const {
  ReaderLock lock(mu_);
  auto it = models_.find(name);
  if (it == models_.end()) return Err(NotFound("unknown model '" + name + "'"));
  const auto& versions = it->second.versions;
  if (version >= 0) {
    auto v = versions.find(version);
    if (v == versions.end()) {
      return Err(NotFound("model '" + name + "' has no version " + std::to_string(version)));
    }
    if (!v->second.served) {
      return Err(Unavailable("model '" + name + "' version " + std::to_string(version) +
                             " is not ready: " + std::string(ModelStateName(v->second.status.state)) +
                             (v->second.status.reason.empty()
                                  ? ""
                                  : " (" + CutAtCharacter(v->second.status.reason, kMaxQuotedReason) + ")")));
    }
    return v->second.served;
  }
  for (auto v = versions.rbegin(); v != versions.rend(); ++v) {
    if (v->second.served) return v->second.served;
  }
  std::string reason;
  for (const auto& [n, slot] : versions) {
    if (!slot.status.reason.empty()) reason = slot.status.reason;
  }
  // Bounded: an ensemble's load error quotes this, and a chain of them
  // would quote each other's whole.
  if (reason.size() > kMaxQuotedReason) reason = CutAtCharacter(reason, kMaxQuotedReason) + "...";
  return Err(Unavailable("model '" + name + "' is not ready" + (reason.empty() ? "" : ": " + reason)));
}

Status ModelRegistry::LoadModel(const std::string& name) {
  QUERN_RETURN_IF_ERROR(CheckModelName(name));
  MutexLock load_lock(load_mu_);
  if (options_.model_repository.empty()) return FailedPrecondition("the engine has no model repository");
  bool known = false;
  {
    WriterLock lock(mu_);
    auto it = models_.find(name);
    if (it != models_.end() && it->second.custom) {
      return FailedPrecondition("model '" + name + "' is registered in code, not in the repository");
    }
    known = it != models_.end();
  }
  std::error_code ec;
  const auto entry_status =
      std::filesystem::symlink_status(std::filesystem::path(options_.model_repository) / name, ec);
  // Only a name the repository surely lacks is absent (an I/O error on a
  // served model's folder must not unload it).
  if (entry_status.type() == std::filesystem::file_type::not_found) {
    // Not in the repository: a request to load it leaves no trace, and a
    // model whose folder is gone is unloaded (as a repository poll would).
    if (known) UnloadLocked(name);
    return NotFound("unknown model '" + name + "': not in the model repository");
  }
  auto repo_model = ReadRepositoryModel(options_.model_repository, name, options_.allow_links_outside_repository);
  if (!known) {
    // Visible as LOADING until the load below finishes; a reload keeps serving the old versions.
    WriterLock lock(mu_);
    VersionSlot loading;
    loading.status = {name, 0, ModelState::kLoading, "", {}};
    loading.status.config.name = name;
    models_[name].versions[0] = std::move(loading);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  Entry entry;
  Status overall;
  if (!repo_model) {
    overall = repo_model.error();
    VersionSlot slot;
    slot.status = {name, 0, ModelState::kUnavailable, overall.message(), {}};
    slot.status.config.name = name;
    entry.versions[0] = std::move(slot);
    entry.fingerprint = FingerprintModelDir(std::filesystem::path(options_.model_repository) / name);
  } else {
    entry.fingerprint = repo_model->fingerprint;
    for (const auto& v : repo_model->versions) {
      VersionSlot slot;
      auto served = LoadVersionSafely(*repo_model, v);
      if (served) {
        slot.served = *served;
        slot.status = {name, v.version, ModelState::kReady, "", slot.served->config()};
      } else {
        overall = served.error();
        slot.status = {name, v.version, ModelState::kUnavailable, served.error().message(), repo_model->config};
      }
      entry.versions[v.version] = std::move(slot);
    }
  }
  if (!overall.ok()) entry.failed_fingerprint = entry.fingerprint;
  if (known && !overall.ok()) KeepServingWhatFailed(name, entry, overall);
  Replace(name, std::move(entry));
  return overall;
}

void ModelRegistry::ForgetReloadFailures(const std::vector<std::string>& names) {
  WriterLock lock(mu_);
  for (const auto& n : names) {
    auto it = models_.find(n);
    if (it == models_.end()) continue;
    it->second.failed_fingerprint.clear();
    for (auto& [v, slot] : it->second.versions) {
      if (slot.served && slot.status.reason.starts_with(kReloadFailedNote)) slot.status.reason.clear();
    }
  }
}

void ModelRegistry::KeepServingWhatFailed(const std::string& name, Entry& entry, const Status& failure) {
  ReaderLock lock(mu_);
  auto it = models_.find(name);
  if (it == models_.end()) return;
  const Entry& old = it->second;
  const auto serving = [](const std::map<int64_t, VersionSlot>& versions) {
    return std::any_of(versions.begin(), versions.end(), [](const auto& v) { return v.second.served != nullptr; });
  };
  if (!serving(old.versions)) return;
  const std::string note = std::string(kReloadFailedNote) + failure.message();
  if (!serving(entry.versions)) {
    // Nothing of the new load serves: the old versions serve on, and a
    // poll loads again once the files change from those that failed.
    entry.versions = old.versions;
    entry.fingerprint = old.fingerprint;
    for (auto& [v, slot] : entry.versions) {
      if (slot.served) slot.status.reason = note;
    }
  } else {
    // Versions that failed and served before serve on.
    for (auto& [v, slot] : entry.versions) {
      auto before = old.versions.find(v);
      if (slot.served || before == old.versions.end() || !before->second.served) continue;
      slot = before->second;
      slot.status.reason = note;
      entry.fingerprint = old.fingerprint;
    }
  }
  if (old.last_failure != failure.message()) {
    Log(LogLevel::kWarning, note, {{"model", name}});
  }
  entry.last_failure = failure.message();
}

Result<std::shared_ptr<Servable>> ModelRegistry::LoadVersionSafely(const RepositoryModel& m,
                                                                   const RepositoryVersion& v) {
  Result<std::shared_ptr<Servable>> served = Err(Internal("model '" + m.name + "' did not load"));
  try {
    served = LoadVersion(m, v);
    if (served && options_.check_model) {
      ModelStatus status{m.name, v.version, ModelState::kReady, "", (*served)->config()};
      Status st = options_.check_model(status, m.dir.string());
      if (!st.ok()) {
        (*served)->Shutdown();
        return Err(st);
      }
    }
  } catch (const std::exception& e) {
    if (served) (*served)->Shutdown();
    return Err(
        Unavailable("model '" + m.name + "' version " + std::to_string(v.version) + " failed to load: " + e.what()));
  }
  return served;
}

void ModelRegistry::LoadInOrder(const std::vector<std::string>& names) {
  // Each model's configuration is read once; ensembles load after the
  // ensembles among `names` that they use (Kahn's order: linear in the
  // models and steps, whatever order the names come in).
  std::map<std::string, std::vector<std::string>> uses;  // ensemble -> ensembles in `names` it uses
  for (const auto& n : names) {
    auto m = ReadRepositoryModel(options_.model_repository, n, options_.allow_links_outside_repository);
    if (!m || !m->config.is_ensemble()) {
      (void)LoadModel(n);
      continue;
    }
    auto& u = uses[n];
    for (const EnsembleStep& step : m->config.ensemble_steps) u.push_back(step.model_name);
  }
  std::map<std::string, int> waits;
  std::map<std::string, std::vector<std::string>> used_by;
  for (auto& [n, u] : uses) {
    std::sort(u.begin(), u.end());
    u.erase(std::unique(u.begin(), u.end()), u.end());
    std::erase_if(u, [&](const std::string& d) { return !uses.count(d); });
    waits[n] = static_cast<int>(u.size());
    for (const auto& d : u) used_by[d].push_back(n);
  }
  std::vector<std::string> ready;
  for (const auto& [n, w] : waits) {
    if (w == 0) ready.push_back(n);
  }
  while (!ready.empty()) {
    const std::string n = std::move(ready.back());
    ready.pop_back();
    (void)LoadModel(n);
    waits.erase(n);
    for (const auto& user : used_by[n]) {
      if (--waits[user] == 0) ready.push_back(user);
    }
  }
  // What is left is on a cycle or uses one. A cycle's members that serve
  // nothing yet (at start) fail naming it; the others are loaded, so that
  // the load's own check decides against what is served (on a reload, a
  // served version keeps serving what it served) and the rest fail naming
  // the step model that is not ready.
  std::map<std::string, std::vector<std::string>> left;
  for (const auto& [n, w] : waits) left[n] = uses[n];
  std::vector<std::string> rest;
  for (const auto& [n, u] : left) {
    std::vector<std::string> cycle = FindCycle(n, [&](const std::string& m) -> std::vector<std::string> {
      auto it = left.find(m);
      return it == left.end() ? std::vector<std::string>{} : it->second;
    });
    if (!cycle.empty() && !Resolve(n, -1)) {
      RecordLoadFailure(n, InvalidArgument("ensemble '" + n + "' is part of a cycle of ensembles: " + JoinPath(cycle)));
    } else {
      rest.push_back(n);
    }
  }
  for (const auto& n : rest) (void)LoadModel(n);
}

std::vector<std::string> ModelRegistry::FindCycle(
    const std::string& from, const std::function<std::vector<std::string>(const std::string&)>& uses) {
  // Depth-first, iterative (no recursion however deep the graph): the path
  // from `from` to the step that leads back to it.
  struct Frame {
    std::string model;
    std::vector<std::string> next;
    size_t i = 0;
  };
  std::vector<Frame> path;
  std::set<std::string> seen;
  path.push_back({from, uses(from), 0});
  seen.insert(from);
  while (!path.empty()) {
    Frame& top = path.back();
    if (top.i == top.next.size()) {
      path.pop_back();
      continue;
    }
    std::string m = top.next[top.i++];
    if (m == from) {
      std::vector<std::string> cycle;
      for (const auto& f : path) cycle.push_back(f.model);
      cycle.push_back(from);
      return cycle;
    }
    if (!seen.insert(m).second) continue;
    auto next = uses(m);
    path.push_back({std::move(m), std::move(next), 0});
  }
  return {};
}

std::string ModelRegistry::JoinPath(const std::vector<std::string>& models) {
  std::string s;
  for (const auto& m : models) s += (s.empty() ? "'" : " -> '") + m + "'";
  return s;
}

void ModelRegistry::RecordLoadFailure(const std::string& name, const Status& status) {
  MutexLock load_lock(load_mu_);
  Entry entry;
  VersionSlot slot;
  slot.status = {name, 0, ModelState::kUnavailable, status.message(), {}};
  slot.status.config.name = name;
  entry.versions[0] = std::move(slot);
  entry.fingerprint = FingerprintModelDir(std::filesystem::path(options_.model_repository) / name);
  Replace(name, std::move(entry));
}

Status ModelRegistry::CheckEnsembleGraph(const std::string& name, const ModelConfig& config) const {
  // The models each served ensemble uses (every served version's steps),
  // with `name`'s taken from `config`, the configuration it is to serve.
  std::map<std::string, std::vector<std::string>> uses;
  {
    ReaderLock lock(mu_);
    for (const auto& [n, e] : models_) {
      if (n == name) continue;
      for (const auto& [v, slot] : e.versions) {
        if (!slot.served || !slot.served->config().is_ensemble()) continue;
        for (const EnsembleStep& step : slot.served->config().ensemble_steps) uses[n].push_back(step.model_name);
      }
    }
  }
  for (const EnsembleStep& step : config.ensemble_steps) uses[name].push_back(step.model_name);
  auto next = [&](const std::string& m) {
    auto it = uses.find(m);
    return it == uses.end() ? std::vector<std::string>{} : it->second;
  };
  std::vector<std::string> cycle = FindCycle(name, next);
  if (!cycle.empty()) {
    return InvalidArgument("ensemble '" + name + "' would make a cycle of ensembles: " + JoinPath(cycle));
  }
  // The nesting depth below `name` (ensembles within ensembles): bounded,
  // as every walk over it at run time is (EnsembleModel::kMaxNesting).
  // Longest path in a graph without cycles, iteratively (memoised).
  std::map<std::string, int> depth;
  std::vector<std::pair<std::string, bool>> todo{{name, false}};
  while (!todo.empty()) {
    auto [m, expanded] = todo.back();
    todo.pop_back();
    if (depth.count(m)) continue;
    const auto u = next(m);
    if (!expanded) {
      todo.emplace_back(m, true);
      for (const auto& d : u) {
        if (!depth.count(d)) todo.emplace_back(d, false);
      }
      continue;
    }
    int d = uses.count(m) ? 1 : 0;
    for (const auto& s : u) d = std::max(d, 1 + depth[s]);
    depth[m] = d;
  }
  if (depth[name] > EnsembleModel::kMaxNesting) {
    return InvalidArgument("ensemble '" + name + "' nests ensembles " + std::to_string(depth[name]) +
                           " deep; at most " + std::to_string(EnsembleModel::kMaxNesting) + " are served");
  }
  return Status::Ok();
}

Result<std::shared_ptr<Servable>> ModelRegistry::LoadVersion(const RepositoryModel& m, const RepositoryVersion& v) {
  ModelConfig config = m.config;
  if (config.is_ensemble()) {
    QUERN_RETURN_IF_ERROR(ValidateModelConfig(config));
    const ModelConfig asked = config;
    EnsembleModel::StepModels steps;
    steps.submit = [this](InferRequest&& r, InferCallback& done, const SubmitOptions& options) {
      return Submit(std::move(r), NextId(), done, options);
    };
    steps.config = [this](const std::string& name, int64_t version) -> Result<ModelConfig> {
      auto served = Resolve(name, version);
      if (!served) return Err(served.error());
      return (*served)->config();
    };
    steps.check_admission = [this](const std::string& name, int64_t version) {
      auto served = Resolve(name, version);
      return served ? (*served)->CheckAdmission() : served.error();
    };
    QUERN_ASSIGN_OR_RETURN(auto ensemble,
                           EnsembleModel::Create(std::move(config), v.version, std::move(steps), clock_, m.dir));
    // Each step checked on its own, then the whole graph (nothing has
    // reached the new version yet).
    QUERN_RETURN_IF_ERROR(CheckEnsembleGraph(m.name, asked));
    return std::shared_ptr<Servable>(std::move(ensemble));
  }
  if (!config.max_queue_wait_ms) config.max_queue_wait_ms = options_.max_queue_wait_ms;
  if (!config.memory_budget_mb) config.memory_budget_mb = options_.memory_budget_mb;
  Backend* backend = backends_.Find(config.backend);
  if (!backend) {
    return Err(InvalidArgument("model '" + m.name + "': backend '" + config.backend + "' is not in this build"));
  }
  // Where the instances run: instance_group against this machine's GPUs.
  // CUDA's driver is asked only when a group names KIND_GPU, or when the
  // backend could take KIND_AUTO or the automatic layout onto a GPU.
  const bool automatic = config.instance_count == 0 && config.instance_groups.empty();
  bool explicit_gpu = false, auto_group = false;
  for (const InstanceGroup& g : config.instance_groups) {
    explicit_gpu |= g.kind == InstanceGroup::Kind::kGpu;
    auto_group |= g.kind == InstanceGroup::Kind::kAuto;
  }
  const bool gpu_by_default = automatic || auto_group;
  GpuAvailability gpus;
  if (explicit_gpu || gpu_by_default) {
    gpus.why_no_backend = backend->WhyNoGpu();
    gpus.auto_to_gpu = backend->GpuByDefault();
    if (gpus.why_no_backend.empty()) {
      const GpuCount& visible = VisibleGpus();
      gpus.devices = visible.count;
      gpus.why_no_devices = visible.why_none;
    }
  }
  const ModelConfig asked = config;
  auto served = LoadInstances(m, v, *backend, std::move(config), gpus);
  // Whether only the defaults (KIND_AUTO, the automatic layout) put
  // instances on a GPU (PlaceInstances' rules).
  const bool defaults_on_gpu = !explicit_gpu && gpus.devices > 0 && gpus.why_no_backend.empty() &&
                               (auto_group || (automatic && gpus.auto_to_gpu));
  if (!served && defaults_on_gpu) {
    // The GPU failed (a CUDA that does not match the driver, a library
    // missing): the model serves on the CPU.
    Log(LogLevel::kWarning, "loading on the GPU failed (" + served.error().message() + "); trying the CPU",
        {{"model", m.name}});
    served = LoadInstances(m, v, *backend, asked, GpuAvailability{});
  }
  return served;
}

Result<std::shared_ptr<Servable>> ModelRegistry::LoadInstances(const RepositoryModel& m, const RepositoryVersion& v,
                                                               Backend& backend, ModelConfig config,
                                                               const GpuAvailability& gpus) {
  QUERN_ASSIGN_OR_RETURN(std::vector<InstanceDevice> placed, PlaceInstances(config, gpus));
  // An automatic layout on the CPU: one instance per core for concurrent
  // requests, and a wide one for a lone request.
  const bool automatic = placed.empty();
  if (automatic) {
    config.instance_count = std::min(cores_, kMaxInstances);
    placed.assign(config.instance_count, InstanceDevice{});
  }
  const bool want_wide = automatic && config.instance_count > 1 && config.wide_instance.value_or(true);
  config.model_dir = m.dir.string();
  // Opening the file completes the configuration (the model's own inputs
  // and outputs fill what it leaves out) before it is validated.
  QUERN_ASSIGN_OR_RETURN(auto opened, backend.Open(config, v.model_file, m.has_config_file, cores_,
                                                   CpuInstances(config) + (want_wide ? 1 : 0)));
  QUERN_RETURN_IF_ERROR(ValidateModelConfig(config));
  std::vector<std::unique_ptr<Model>> instances;
  for (const InstanceDevice& device : placed) {
    QUERN_ASSIGN_OR_RETURN(auto inst, opened->NewInstance(config, device));
    instances.push_back(std::move(inst));
  }
  bool wide = false;
  if (want_wide) {
    QUERN_ASSIGN_OR_RETURN(auto inst, opened->NewWideInstance(config));
    if (inst) {
      instances.push_back(std::move(inst));
      wide = true;
    }
  }
  opened.reset();
  // Loading freed more than it keeps (parsed files, optimizer copies): give
  // it back to the system rather than leave it in the allocator's free lists.
  ReturnFreedMemory();
  QUERN_ASSIGN_OR_RETURN(auto served,
                         ServedModel::Create(std::move(config), v.version, std::move(instances), clock_, m.dir,
                                             {.wide = wide, .on_caller_threads = backend.RunsOnCallerThreads()}));
  return std::shared_ptr<Servable>(std::move(served));
}

Status ModelRegistry::RegisterModel(ModelConfig config, ModelFactory factory) {
  MutexLock load_lock(load_mu_);
  if (!factory) return InvalidArgument("model '" + config.name + "': no factory given");
  if (config.backend.empty()) config.backend = "custom";
  if (config.instance_count == 0) config.instance_count = std::min(cores_, kMaxInstances);
  if (!config.max_queue_wait_ms) config.max_queue_wait_ms = options_.max_queue_wait_ms;
  if (!config.memory_budget_mb) config.memory_budget_mb = options_.memory_budget_mb;
  QUERN_RETURN_IF_ERROR(ValidateModelConfig(config));
  std::vector<std::unique_ptr<Model>> instances;
  for (int i = 0; i < config.instance_count; ++i) {
    auto inst = factory();
    if (!inst) return Internal("model '" + config.name + "': the factory returned no model");
    Status st = inst->Load();
    if (!st.ok()) return Status(st.code(), "model '" + config.name + "' failed to load: " + st.message());
    instances.push_back(std::move(inst));
  }
  const std::string name = config.name;
  auto served = ServedModel::Create(std::move(config), 1, std::move(instances), clock_, {});
  if (!served) return served.error();
  Entry entry;
  entry.custom = true;
  VersionSlot slot;
  slot.served = *served;
  slot.status = {name, 1, ModelState::kReady, "", slot.served->config()};
  entry.versions[1] = std::move(slot);
  Replace(name, std::move(entry));
  return Status::Ok();
}

Status ModelRegistry::UnloadModel(const std::string& name) {
  MutexLock load_lock(load_mu_);
  return UnloadLocked(name);
}

Status ModelRegistry::UnloadLocked(const std::string& name) {
  std::map<int64_t, VersionSlot> old;
  {
    WriterLock lock(mu_);
    auto it = models_.find(name);
    if (it == models_.end()) return NotFound("unknown model '" + name + "'");
    generation_.fetch_add(1, std::memory_order_acq_rel);
    old.swap(it->second.versions);
    models_.erase(it);
    HoldRetiringLocked(old);
  }
  RetireVersions(old);
  return Status::Ok();
}

Status ModelRegistry::PollRepository() {
  return PollRepository(nullptr, nullptr);
}

Status ModelRegistry::PollRepository(const RepositoryWatch::Changes* changes, std::set<std::string>* unsettled) {
  if (options_.model_repository.empty()) return FailedPrecondition("the engine has no model repository");
  const bool everything = !changes || changes->everything;
  if (!everything && !changes->listing && changes->models.empty()) return Status::Ok();  // nothing happened
  std::vector<std::string> names;
  // A model the watch names that is not served yet (its folder being filled
  // in when the repository was last listed) is found by listing again.
  bool list = everything || changes->listing;
  if (!list) {
    ReaderLock lock(mu_);
    for (const auto& n : changes->models) list = list || !models_.count(n);
  }
  if (list) {
    auto listed = ListRepositoryModels(options_.model_repository);
    if (!listed) return listed.error();
    names = std::move(*listed);
  } else {
    ReaderLock lock(mu_);
    for (const auto& [n, e] : models_) {
      if (!e.custom) names.push_back(n);  // sorted: the map's order
    }
  }
  const std::filesystem::path repo(options_.model_repository);
  std::vector<std::string> changed, to_unload, recovered;
  std::map<std::string, std::string> first_look;
  {
    ReaderLock lock(mu_);
    for (const auto& n : names) {
      auto it = models_.find(n);
      if (it != models_.end() && it->second.custom) continue;
      // Only what the watch says may have changed is looked at.
      if (!everything && it != models_.end() && !changes->models.count(n)) continue;
      std::string fingerprint = FingerprintModelDir(repo / n);
      // Back to the files that loaded after a reload failed (the broken
      // version taken away): the failure no longer stands.
      if (it != models_.end() && !it->second.failed_fingerprint.empty() && fingerprint == it->second.fingerprint) {
        recovered.push_back(n);
      }
      // New, or changed since it loaded and not the files a reload failed on.
      if (it == models_.end() ||
          (fingerprint != it->second.fingerprint && fingerprint != it->second.failed_fingerprint)) {
        changed.push_back(n);
        first_look[n] = std::move(fingerprint);
      }
    }
    for (const auto& [n, e] : models_) {
      if (!e.custom && !std::binary_search(names.begin(), names.end(), n)) to_unload.push_back(n);
    }
  }
  if (!recovered.empty()) ForgetReloadFailures(recovered);
  // A model whose files are still being written (sizes or times moving
  // between two looks) is left for a later poll: a copy in progress is
  // never loaded half-written.
  std::vector<std::string> to_load;
  if (!changed.empty()) {
    {
      MutexLock lock(poll_mu_);
      // Real time: another process's copy proceeds at its own pace.
      poll_cv_.WaitFor(lock, RealClockInstance(), std::chrono::milliseconds(kSettleMs),
                       [this]() QUERN_REQUIRES(poll_mu_) { return stopping_; });
      if (stopping_) return Status::Ok();
    }
    for (const auto& n : changed) {
      if (FingerprintModelDir(repo / n) == first_look[n]) {
        to_load.push_back(n);
      } else if (unsettled) {
        unsettled->insert(n);
      }
    }
  }
  LoadInOrder(to_load);
  for (const auto& n : to_unload) (void)UnloadModel(n);
  return Status::Ok();
}

std::vector<ModelStatus> ModelRegistry::ListModels() const {
  ReaderLock lock(mu_);
  std::vector<ModelStatus> out;
  for (const auto& [n, e] : models_) {
    for (const auto& [v, slot] : e.versions) out.push_back(slot.status);
  }
  return out;
}

bool ModelRegistry::AllReady() const {
  ReaderLock lock(mu_);
  for (const auto& [n, e] : models_) {
    for (const auto& [v, slot] : e.versions) {
      if (slot.status.state != ModelState::kReady) return false;
    }
  }
  return true;
}

Result<ModelStatus> ModelRegistry::GetModel(const std::string& name, int64_t version) const {
  ReaderLock lock(mu_);
  auto it = models_.find(name);
  if (it == models_.end() || it->second.versions.empty()) return Err(NotFound("unknown model '" + name + "'"));
  const auto& versions = it->second.versions;
  if (version >= 0) {
    auto v = versions.find(version);
    if (v == versions.end()) return Err(NotFound("model '" + name + "' has no version " + std::to_string(version)));
    return v->second.status;
  }
  for (auto v = versions.rbegin(); v != versions.rend(); ++v) {
    if (v->second.served) return v->second.status;
  }
  return versions.rbegin()->second.status;
}

Result<std::vector<ModelStatistics>> ModelRegistry::GetStatistics(const std::string& name, int64_t version) const {
  ReaderLock lock(mu_);
  std::vector<ModelStatistics> out;
  if (!name.empty()) {
    auto it = models_.find(name);
    if (it == models_.end()) return Err(NotFound("unknown model '" + name + "'"));
    if (version >= 0 && !it->second.versions.count(version)) {
      return Err(NotFound("model '" + name + "' has no version " + std::to_string(version)));
    }
  }
  for (const auto& [n, e] : models_) {
    if (!name.empty() && n != name) continue;
    for (const auto& [v, slot] : e.versions) {
      if ((version < 0 || v == version) && slot.served) out.push_back(slot.served->Statistics());
    }
  }
  return out;
}

void ModelRegistry::StopPolling() {
  MutexLock lock(poll_mu_);
  stopping_ = true;
  poll_cv_.SignalAll();  // the thread is joined at destruction
  // A poll in progress finishes first (what it loads or unloads is done when
  // this returns), unless this is that poll's own thread.
  if (std::this_thread::get_id() == poll_thread_.get_id()) return;
  poll_cv_.Wait(lock, [this]() QUERN_REQUIRES(poll_mu_) { return !polling_; });
}

std::vector<std::shared_ptr<Servable>> ModelRegistry::EveryServedLocked() const {
  std::vector<std::shared_ptr<Servable>> all;
  for (const auto& [name, e] : models_) {
    for (const auto& [v, slot] : e.versions) {
      if (slot.served) all.push_back(slot.served);
    }
  }
  all.insert(all.end(), retiring_.begin(), retiring_.end());
  return all;
}

void ModelRegistry::Abandon() {
  std::vector<std::shared_ptr<Servable>> all;
  {
    ReaderLock lock(mu_);
    all = EveryServedLocked();
  }
  for (const auto& served : all) served->Abandon();
}

void ModelRegistry::SendQueuedNow() {
  std::vector<std::shared_ptr<Servable>> all;
  {
    // With the flag set under the same lock as the list is taken, a version published later
    // (Replace) is told by its publisher.
    WriterLock lock(mu_);
    send_queued_now_ = true;
    all = EveryServedLocked();
  }
  for (const auto& served : all) served->SendQueuedNow();
}

int64_t ModelRegistry::InFlight() const {
  ReaderLock lock(mu_);
  int64_t n = 0;
  for (const auto& [name, e] : models_) {
    for (const auto& [v, slot] : e.versions) {
      if (slot.served) n += slot.served->in_flight();
    }
  }
  for (const auto& served : retiring_) n += served->in_flight();
  return n;
}

void ModelRegistry::HoldRetiringLocked(const std::map<int64_t, VersionSlot>& versions) {
  for (const auto& [v, slot] : versions) {
    if (slot.served) retiring_.push_back(slot.served);
  }
}

void ModelRegistry::Replace(const std::string& name, Entry entry) {
  std::map<int64_t, VersionSlot> old;
  {
    WriterLock lock(mu_);
    auto& e = models_[name];
    old.swap(e.versions);
    e = std::move(entry);
    generation_.fetch_add(1, std::memory_order_acq_rel);
    // Published after SendQueuedNow (a load it overtook): sends at once too.
    if (send_queued_now_) {
      for (const auto& [v, slot] : e.versions) {
        if (slot.served) slot.served->SendQueuedNow();
      }
    }
    // Versions the new entry keeps serving (a reload that failed) go on.
    std::erase_if(old, [&](const auto& v) {
      auto kept = e.versions.find(v.first);
      return v.second.served && kept != e.versions.end() && kept->second.served == v.second.served;
    });
    HoldRetiringLocked(old);
  }
  RetireVersions(old);  // in-flight requests of the old versions finish first
}

void ModelRegistry::RetireVersions(std::map<int64_t, VersionSlot>& versions) {
  for (auto& [v, slot] : versions) {
    if (slot.served) slot.served->Shutdown();
  }
  {
    WriterLock lock(mu_);
    for (const auto& [v, slot] : versions) {
      if (!slot.served) continue;
      auto it = std::find(retiring_.begin(), retiring_.end(), slot.served);
      if (it != retiring_.end()) retiring_.erase(it);
    }
  }
  versions.clear();
}

void ModelRegistry::PollLoop() {
  // Between full looks (every kFullLookS, for what file events miss: a
  // network file system, a link's target), a poll looks only at what the
  // kernel reported changed.
  std::unique_ptr<RepositoryWatch> watch = RepositoryWatch::Start(options_.model_repository);
  std::set<std::string> watched;
  // Models to look at on the next poll whatever the events say: those whose
  // files were still changing, and those just watched (what happened before
  // their watch began reached none).
  std::set<std::string> again;
  auto rewatch = [&](const std::vector<std::string>& names, bool all) {
    if (!watch) return;
    std::set<std::string> now(names.begin(), names.end());
    for (const auto& n : watched) {
      if (!now.count(n)) watch->Forget(n);
    }
    for (const auto& n : now) {
      if (all || !watched.count(n)) {
        watch->Watch(n);
        again.insert(n);
      }
    }
    watched = std::move(now);
  };
  if (auto names = ListRepositoryModels(options_.model_repository); names) rewatch(*names, true);
  const auto interval = std::chrono::duration<double>(options_.repository_poll_interval_s);
  const int64_t full_every_ns = int64_t{kFullLookS} * 1'000'000'000;
  // The first poll looks at everything: what changed between the start's
  // listing and the watch's start reached no watch.
  bool first = true;
  int64_t last_full_ns = clock_->NowNs();
  MutexLock lock(poll_mu_);
  while (!stopping_) {
    poll_cv_.WaitFor(lock, *clock_, interval, [this]() QUERN_REQUIRES(poll_mu_) { return stopping_; });
    if (stopping_) break;
    polling_ = true;
    lock.Unlock();
    const int64_t now = clock_->NowNs();
    RepositoryWatch::Changes changes;
    const bool full = first || !watch || now - last_full_ns >= full_every_ns;
    first = false;
    if (watch) changes = watch->Take();
    changes.models.merge(again);
    again.clear();
    if (full || changes.everything) {
      last_full_ns = now;
      (void)PollRepository(nullptr, &again);
      if (auto names = ListRepositoryModels(options_.model_repository); names) rewatch(*names, changes.everything);
    } else {
      (void)PollRepository(&changes, &again);
      if (changes.listing) {
        if (auto names = ListRepositoryModels(options_.model_repository); names) rewatch(*names, false);
      }
      // A model whose folder was made again is watched anew, and looked at
      // again next time (events queued for its old watches are dropped).
      for (const auto& n : changes.replaced) {
        if (watched.count(n)) {
          watch->Watch(n);
          again.insert(n);
        }
      }
    }
    lock.Lock();
    polling_ = false;
    poll_cv_.SignalAll();
  }
}

}  // namespace quern
