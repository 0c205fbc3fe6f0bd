#include "quern/engine.h"

#include "core/cpus.h"
#include "core/mutex.h"
#include "engine/engine_factory.h"
#include "engine/model_registry.h"
#include "engine/request_validation.h"
#include "scheduler/loop_lender.h"

namespace quern {

std::string_view ModelStateName(ModelState state) {
  switch (state) {
    case ModelState::kLoading: return "LOADING";
    case ModelState::kReady: return "READY";
    case ModelState::kUnavailable: return "UNAVAILABLE";
  }
  return "UNKNOWN";
}

const Tensor* InferResponse::FindOutput(std::string_view name) const {
  for (const auto& o : outputs) {
    if (o.name == name) return &o.tensor;
  }
  return nullptr;
}

std::optional<InferResponse> CompletionQueue::TryPoll() {
  std::lock_guard<std::mutex> lock(mu_);
  if (ready_.empty()) return std::nullopt;
  InferResponse r = std::move(ready_.front());
  ready_.pop_front();
  return r;
}

InferResponse CompletionQueue::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !ready_.empty(); });
  InferResponse r = std::move(ready_.front());
  ready_.pop_front();
  return r;
}

size_t CompletionQueue::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ready_.size();
}

void CompletionQueue::Push(InferResponse&& response) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ready_.push_back(std::move(response));
  }
  cv_.notify_one();
}

Result<std::unique_ptr<Engine>> EngineFactory::Create(EngineOptions options,
                                                      const std::function<void(BackendRegistry&)>& install) {
  auto impl = std::make_unique<ModelRegistry>(std::move(options), install);
  QUERN_RETURN_IF_ERROR(impl->Start());
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::Engine(std::unique_ptr<ModelRegistry> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

namespace {

// What a refused request's response repeats of it, taken before the request
// is handed over (a refusal need not give it back).
struct RequestEcho {
  explicit RequestEcho(const InferRequest& r) : model(r.model), version(r.version), metadata(r.metadata) {}
  // The response the request gets when it is refused with `status`.
  InferResponse Refusal(Status status, uint64_t id, int64_t now_ns) && {
    InferResponse r;
    r.status = std::move(status);
    r.request_id = id;
    r.model = std::move(model);
    r.version = version;
    r.metadata = std::move(metadata);
    r.telemetry.queue_start_ns = r.telemetry.response_ns = now_ns;
    return r;
  }
  std::string model;
  int64_t version;
  std::vector<std::pair<std::string, std::string>> metadata;
};

}  // namespace

const char* Version() {
  return QUERN_VERSION_STRING;
}

std::future<InferResponse> Engine::Infer(InferRequest request, const SubmitOptions& options) {
  auto promise = std::make_shared<std::promise<InferResponse>>();
  auto future = promise->get_future();
  const uint64_t id = impl_->NextId();
  RequestEcho echo(request);
  InferCallback done = [promise](InferResponse&& r) { promise->set_value(std::move(r)); };
  if (Status st = impl_->Submit(std::move(request), id, done, options); !st.ok()) {
    promise->set_value(std::move(echo).Refusal(std::move(st), id, clock().NowNs()));
  }
  return future;
}

InferResponse Engine::Run(InferRequest request) {
  // The answer usually arrives on this thread, inside Submit (its batch ran
  // here); otherwise an engine thread delivers it and wakes this one. No
  // promise: its shared state costs an allocation and a wake-up call.
  struct Slot {
    Mutex mu;
    CondVar cv;
    bool answered QUERN_GUARDED_BY(mu) = false;
    InferResponse response QUERN_GUARDED_BY(mu);
  } slot;
  const uint64_t id = impl_->NextId();
  RequestEcho echo(request);
  InferCallback done = [&slot](InferResponse&& r) {
    MutexLock lock(slot.mu);
    slot.response = std::move(r);
    slot.answered = true;
    slot.cv.Signal();  // under the lock: the slot lives until the waiter has seen it
  };
  if (Status st = impl_->Submit(std::move(request), id, done, {}, /*run_here=*/true); !st.ok()) {
    return std::move(echo).Refusal(std::move(st), id, clock().NowNs());
  }
  MutexLock lock(slot.mu);
  slot.cv.Wait(lock, [&slot]() QUERN_REQUIRES(slot.mu) { return slot.answered; });
  return std::move(slot.response);
}

Status Engine::InferAsync(InferRequest request, InferCallback& done, const SubmitOptions& options) {
  return impl_->Submit(std::move(request), impl_->NextId(), done, options);
}

std::unique_ptr<CallerLoop> Engine::NewCallerLoop() {
  return std::make_unique<LoopLender>();
}

Result<uint64_t> Engine::InferAsync(InferRequest request, CompletionQueue* queue) {
  const uint64_t id = impl_->NextId();
  InferCallback done = [queue](InferResponse&& r) { queue->Push(std::move(r)); };
  QUERN_RETURN_IF_ERROR(impl_->Submit(std::move(request), id, done));
  return id;
}

// Models load on the caller's thread, and their threads (the engine's, ONNX
// Runtime's) and processes (Python models) inherit its scheduling: a load
// asked over HTTP (an I/O thread with short slices) or gRPC (SCHED_BATCH)
// runs with the attributes of the thread that created the engine.
Status Engine::RegisterModel(ModelConfig config, ModelFactory factory) {
  ScopedScheduling home(impl_->home_scheduling());
  return impl_->RegisterModel(std::move(config), std::move(factory));
}
Status Engine::LoadModel(const std::string& name) {
  ScopedScheduling home(impl_->home_scheduling());
  return impl_->LoadModel(name);
}
Status Engine::UnloadModel(const std::string& name) {
  ScopedScheduling home(impl_->home_scheduling());
  return impl_->UnloadModel(name);
}
Status Engine::PollRepository() {
  ScopedScheduling home(impl_->home_scheduling());
  return impl_->PollRepository();
}
std::vector<ModelStatus> Engine::ListModels() const {
  return impl_->ListModels();
}
uint64_t Engine::ModelsGeneration() const {
  return impl_->Generation();
}
Result<ModelStatus> Engine::GetModel(const std::string& name, int64_t version) const {
  return impl_->GetModel(name, version);
}
std::shared_ptr<const std::vector<std::string>> Engine::OutputLabels(const std::string& name, int64_t version,
                                                                     const std::string& output) const {
  auto served = impl_->Resolve(name, version);
  return served ? (*served)->OutputLabels(output) : nullptr;
}
bool Engine::ModelReady(const std::string& name, int64_t version) const {
  return impl_->Resolve(name, version).has_value();
}
bool Engine::AllModelsReady() const {
  return impl_->AllReady();
}
Status Engine::CheckAdmission(const std::string& name, int64_t version) const {
  auto served = impl_->Resolve(name, version);
  if (!served) return Status::Ok();
  return (*served)->CheckAdmission();
}

void Engine::CountRefused(const std::string& name, int64_t version, const Status& status) const {
  if (auto served = impl_->Resolve(name, version); served) (*served)->CountRefused(status);
}

Status Engine::Validate(const InferRequest& request) const {
  QUERN_ASSIGN_OR_RETURN(std::shared_ptr<Servable> served, impl_->Resolve(request.model, request.version));
  int64_t items = 0;
  uint64_t key = 0;
  OutputIndices outputs;
  return ValidateRequest(served->config(), request, items, key, outputs);
}

void Engine::StopRepositoryPolling() {
  impl_->StopPolling();
}

int64_t Engine::InFlight() const {
  return impl_->InFlight();
}
void Engine::SendQueuedNow() {
  impl_->SendQueuedNow();
}
void Engine::Abandon() {
  impl_->Abandon();
}
const Clock& Engine::clock() const {
  return impl_->clock();
}

Result<std::vector<ModelStatistics>> Engine::GetStatistics(const std::string& name, int64_t version) const {
  return impl_->GetStatistics(name, version);
}

}  // namespace quern
