#include "engine/ensemble_model.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <optional>

#include "engine/batch_assembly.h"
#include "engine/request_validation.h"

namespace quern {

class EnsembleModel::Run {
 public:
  uint64_t id = 0;
  InferRequest request;  // without its inputs (they are in `values`)
  // The caller's name for the request (metadata "request_id"), given to
  // every step; empty = none. Set before the first step is launched.
  std::string request_id;
  // The caller's SubmitOptions::admitted and on_start, and whether on_start
  // was called (by the first step to run).
  bool admitted = false;
  std::function<void()> on_start;
  std::atomic<bool> started{false};
  OutputIndices output_indices;
  InferCallback done;
  Mutex mu;
  std::vector<Tensor> values QUERN_GUARDED_BY(mu);
  // Per tensor: 0 not yet written, 1 written, 2 an optional input left out.
  std::vector<char> state QUERN_GUARDED_BY(mu);
  std::vector<int> waiting QUERN_GUARDED_BY(mu);  // per step: tensors it still waits for
  int steps_left QUERN_GUARDED_BY(mu) = 0;
  bool finished QUERN_GUARDED_BY(mu) = false;
  Telemetry telemetry QUERN_GUARDED_BY(mu);
  std::vector<StepTelemetry> steps QUERN_GUARDED_BY(mu);
  // Steps sent as several requests: their answers so far, by chunk.
  struct Gather {
    int pending = 0;
    std::vector<InferResponse> parts;
  };
  std::map<int, Gather> gathers QUERN_GUARDED_BY(mu);

  // Decoupled ensembles. A branch is a run made from its parent's state and
  // one response of the parent's decoupled step; `root` is the request's own
  // run (null in it), which holds the caller's callback and answers last.
  std::shared_ptr<Run> root, parent;
  size_t chain_pos = 0;  // chain_[chain_pos]: this run's decoupled step (none past the end)
  std::deque<InferResponse> queued QUERN_GUARDED_BY(mu);  // its responses not yet branched
  bool step_closed QUERN_GUARDED_BY(mu) = false;          // it sent its final response
  bool branch_running QUERN_GUARDED_BY(mu) = false;
  // The root's: held while a branch hands its response to the caller, so
  // that the last answer (or an error) never overtakes one.
  Mutex emit;
  // The root's, in a decoupled ensemble: the caller's token, which cancels
  // the request's own (request.cancel, given to every step) and which the
  // request's failure cancels too, ending the decoupled steps and branches.
  std::shared_ptr<CancellationToken> caller_cancel;

  // Whether the request has been answered (the root finished): nothing more
  // of it is started.
  bool over() {
    Run& t = top();
    MutexLock lock(t.mu);
    return t.finished;
  }

  Run& top() { return root ? *root : *this; }
};

namespace {
// How many ensembles' Submit or CheckAdmission are on this thread's stack
// (each enters its first steps' models, which may be ensembles).
thread_local int stack_nesting = 0;

class NestingScope {
 public:
  NestingScope() { ++stack_nesting; }
  ~NestingScope() { --stack_nesting; }
  NestingScope(const NestingScope&) = delete;
  NestingScope& operator=(const NestingScope&) = delete;
  bool too_deep() const { return stack_nesting > EnsembleModel::kMaxNesting; }
};

// The runs whose next branch NextBranch on this thread is to look at (a
// branch that ends at once would otherwise start its parent's next one a
// frame deeper, for every response queued); null when none runs here.
thread_local void* branch_queue = nullptr;

Status TooDeep(const std::string& name) {
  return FailedPrecondition("ensemble '" + name + "': ensembles nested more than " +
                            std::to_string(EnsembleModel::kMaxNesting) + " deep (a cycle of ensembles?)");
}

// The shape a tensor has in requests: the batch dimension (-1) first when
// the configuration batches.
Shape RequestShape(const TensorConfig& t, bool batched) {
  Shape s = t.dims;
  if (batched) s.insert(s.begin(), -1);
  return s;
}

bool ShapesAgree(const Shape& a, const Shape& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != -1 && b[i] != -1 && a[i] != b[i]) return false;
  }
  return true;
}

std::string Names(const std::vector<TensorConfig>& tensors) {
  std::string out;
  for (const auto& t : tensors) out += (out.empty() ? "" : ", ") + t.name;
  return out;
}

}  // namespace

Result<std::shared_ptr<EnsembleModel>> EnsembleModel::Create(ModelConfig config, int64_t version, StepModels models,
                                                             const Clock* clock,
                                                             const std::filesystem::path& model_dir) {
  std::shared_ptr<EnsembleModel> m(new EnsembleModel(std::move(config), version, std::move(models), clock));
  QUERN_RETURN_IF_ERROR(m->Plan());
  if (!model_dir.empty()) {
    QUERN_ASSIGN_OR_RETURN(m->labels_, ReadOutputLabels(m->config_, model_dir));
  }
  return m;
}

EnsembleModel::EnsembleModel(ModelConfig config, int64_t version, StepModels models, const Clock* clock)
    : config_(std::move(config)), version_(version), models_(std::move(models)), clock_(clock) {}

EnsembleModel::~EnsembleModel() {
  Shutdown();
}

Status EnsembleModel::Plan() {
  const std::string e = "ensemble '" + config_.name + "'";
  const bool batched = config_.max_batch_size > 0;
  std::map<std::string, int> index;
  auto tensor = [&](const std::string& name) {
    auto [it, added] = index.emplace(name, static_cast<int>(tensors_.size()));
    if (added) tensors_.push_back(name);
    return it->second;
  };
  // Who writes each tensor (-1 = an ensemble input), with its type and the
  // shape it has in requests.
  struct Source {
    int step = -2;  // -2 = nobody
    DataType dtype = DataType::kFp32;
    Shape shape;
  };
  std::vector<Source> source;
  auto source_of = [&](int t) -> Source& {
    if (source.size() <= static_cast<size_t>(t)) source.resize(static_cast<size_t>(t) + 1);
    return source[static_cast<size_t>(t)];
  };
  for (const TensorConfig& in : config_.inputs) {
    const int t = tensor(in.name);
    input_tensor_.push_back(t);
    source_of(t) = {-1, in.dtype, RequestShape(in, batched)};
  }

  std::vector<ModelConfig> step_configs;
  for (size_t i = 0; i < config_.ensemble_steps.size(); ++i) {
    const EnsembleStep& s = config_.ensemble_steps[i];
    const std::string where = e + " step " + std::to_string(i) + " (model '" + s.model_name + "')";
    if (s.model_name == config_.name) return InvalidArgument(where + ": an ensemble cannot be a step of itself");
    auto sc = models_.config(s.model_name, s.model_version);
    if (!sc) return Status(StatusCode::kUnavailable, where + ": " + sc.error().message());
    const ModelConfig& c = *sc;
    Step step;
    step.decoupled = c.decoupled;
    step.model = s.model_name;
    step.version = s.model_version;
    step.max_batch = c.max_batch_size;
    for (const auto& [name, t] : s.input_map) {
      if (!c.FindInput(name)) {
        return InvalidArgument(where + ": input_map names '" + name +
                               "', which is not an input of the model (inputs: " + Names(c.inputs) + ")");
      }
      step.inputs.emplace_back(name, tensor(t));
    }
    for (const TensorConfig& in : c.inputs) {
      if (!in.optional && !s.input_map.count(in.name)) {
        return InvalidArgument(where + ": the model's input '" + in.name + "' is not in input_map");
      }
    }
    for (const auto& [name, t] : s.output_map) {
      const TensorConfig* out = c.FindOutput(name);
      if (!out) {
        return InvalidArgument(where + ": output_map names '" + name +
                               "', which is not an output of the model (outputs: " + Names(c.outputs) + ")");
      }
      const int ti = tensor(t);
      Source& src = source_of(ti);
      if (src.step == -1) {
        return InvalidArgument(where + ": writes tensor '" + t + "', which is an input of the ensemble");
      }
      if (src.step >= 0) {
        return InvalidArgument(where + ": writes tensor '" + t + "', which step " + std::to_string(src.step) +
                               " writes too");
      }
      src = {static_cast<int>(i), out->dtype, RequestShape(*out, c.max_batch_size > 0)};
      step.outputs.emplace_back(name, ti);
      step.requested.push_back(name);
      step.output_configs.push_back(*out);
    }
    if (step.outputs.empty()) return InvalidArgument(where + ": output_map is empty");
    steps_.push_back(std::move(step));
    step_configs.push_back(c);
  }
  source.resize(tensors_.size());

  // Every read tensor has a writer of the same type and a compatible shape.
  readers_.assign(tensors_.size(), {});
  for (size_t i = 0; i < steps_.size(); ++i) {
    const std::string where = e + " step " + std::to_string(i) + " (model '" + steps_[i].model + "')";
    const ModelConfig& c = step_configs[i];
    for (const auto& [name, t] : steps_[i].inputs) {
      const Source& src = source[static_cast<size_t>(t)];
      const std::string& tn = tensors_[static_cast<size_t>(t)];
      if (src.step == -2) {
        return InvalidArgument(where + ": reads tensor '" + tn +
                               "', which no step writes and which is not an input of the ensemble");
      }
      const std::string from = src.step == -1
                                   ? "ensemble input '" + tn + "'"
                                   : "tensor '" + tn + "' (written by step " + std::to_string(src.step) + ")";
      const TensorConfig& in = *c.FindInput(name);
      if (in.dtype != src.dtype) {
        return InvalidArgument(where + ": input '" + name + "' takes " + std::string(DataTypeName(in.dtype)) + ", " +
                               from + " is " + std::string(DataTypeName(src.dtype)));
      }
      const Shape want = RequestShape(in, c.max_batch_size > 0);
      if (!ShapesAgree(want, src.shape)) {
        return InvalidArgument(where + ": input '" + name + "' takes shape " + ShapeToString(want) + ", " + from +
                               " has shape " + ShapeToString(src.shape));
      }
      readers_[static_cast<size_t>(t)].push_back(static_cast<int>(i));
    }
  }
  for (const TensorConfig& out : config_.outputs) {
    const auto it = index.find(out.name);
    const Source* src = it == index.end() ? nullptr : &source[static_cast<size_t>(it->second)];
    if (!src || src->step < 0) {
      return InvalidArgument(e + ": output '" + out.name + "' is written by no step");
    }
    if (out.dtype != src->dtype) {
      return InvalidArgument(e + ": output '" + out.name + "' is " + std::string(DataTypeName(out.dtype)) + ", step " +
                             std::to_string(src->step) + " writes it as " + std::string(DataTypeName(src->dtype)));
    }
    if (!ShapesAgree(RequestShape(out, batched), src->shape)) {
      return InvalidArgument(e + ": output '" + out.name + "' has shape " + ShapeToString(RequestShape(out, batched)) +
                             ", step " + std::to_string(src->step) + " writes shape " + ShapeToString(src->shape));
    }
    output_tensor_.push_back(it->second);
  }
  for (size_t t = 0; t < tensors_.size(); ++t) {
    const bool is_output =
        std::find(output_tensor_.begin(), output_tensor_.end(), static_cast<int>(t)) != output_tensor_.end();
    if (readers_[t].empty() && !is_output) {
      return InvalidArgument(source[t].step == -1
                                 ? e + ": input '" + tensors_[t] + "' is read by no step"
                                 : e + " step " + std::to_string(source[t].step) + ": tensor '" + tensors_[t] +
                                       "' is read by no step and is not an output of the ensemble");
    }
  }

  std::vector<int> writer(tensors_.size());
  for (size_t t = 0; t < tensors_.size(); ++t) writer[t] = source[t].step;
  QUERN_RETURN_IF_ERROR(OrderSteps(writer));
  return PlanDecoupled();
}

Status EnsembleModel::PlanDecoupled() {
  // Each decoupled step's tail: itself and every step reading its answers.
  std::vector<std::vector<char>> in_tail;  // by chain candidate
  for (size_t i = 0; i < steps_.size(); ++i) {
    if (!steps_[i].decoupled) continue;
    std::vector<char> reached(steps_.size(), 0);
    std::vector<int> todo{static_cast<int>(i)};
    reached[i] = 1;
    while (!todo.empty()) {
      const int s = todo.back();
      todo.pop_back();
      for (const auto& [name, t] : steps_[static_cast<size_t>(s)].outputs) {
        for (int r : readers_[static_cast<size_t>(t)]) {
          if (!reached[static_cast<size_t>(r)]) {
            reached[static_cast<size_t>(r)] = 1;
            todo.push_back(r);
          }
        }
      }
    }
    steps_[i].tail = static_cast<int>(std::count(reached.begin(), reached.end(), 1));
    chain_.push_back(static_cast<int>(i));
    in_tail.push_back(std::move(reached));
  }
  if (chain_.empty()) return Status::Ok();
  // The longest tail first: each next step must be in the tail before it.
  std::vector<size_t> order(chain_.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return steps_[static_cast<size_t>(chain_[a])].tail > steps_[static_cast<size_t>(chain_[b])].tail;
  });
  std::vector<int> chain;
  for (size_t k = 0; k < order.size(); ++k) {
    const int s = chain_[order[k]];
    if (k > 0 && !in_tail[order[k - 1]][static_cast<size_t>(s)]) {
      const int before = chain.back();
      return InvalidArgument("ensemble '" + config_.name + "': steps " + std::to_string(std::min(before, s)) +
                             " (model '" + steps_[static_cast<size_t>(std::min(before, s))].model + "') and " +
                             std::to_string(std::max(before, s)) + " (model '" +
                             steps_[static_cast<size_t>(std::max(before, s))].model +
                             "') are decoupled and neither reads the other's answers: their responses cannot be "
                             "paired (decoupled steps must each read, through the steps between, the one before)");
    }
    chain.push_back(s);
  }
  chain_ = std::move(chain);
  config_.decoupled = true;  // its caller takes many responses, as from any decoupled model
  return Status::Ok();
}

// Every step becomes ready: no cycles (Kahn's order from the inputs).
Status EnsembleModel::OrderSteps(const std::vector<int>& writer) {
  waits_for_.assign(steps_.size(), 0);
  for (size_t i = 0; i < steps_.size(); ++i) {
    for (const auto& [name, t] : steps_[i].inputs) {
      if (writer[static_cast<size_t>(t)] >= 0) ++waits_for_[i];
    }
    if (waits_for_[i] == 0) first_steps_.push_back(static_cast<int>(i));
  }
  std::vector<int> waiting = waits_for_, ready = first_steps_;
  size_t reached = 0;
  while (!ready.empty()) {
    const int s = ready.back();
    ready.pop_back();
    ++reached;
    for (const auto& [name, t] : steps_[static_cast<size_t>(s)].outputs) {
      for (int r : readers_[static_cast<size_t>(t)]) {
        if (--waiting[static_cast<size_t>(r)] == 0) ready.push_back(r);
      }
    }
  }
  if (reached != steps_.size()) {
    std::string stuck;
    for (size_t i = 0; i < steps_.size(); ++i) {
      if (waiting[i] > 0) stuck += (stuck.empty() ? "" : ", ") + std::to_string(i);
    }
    return InvalidArgument("ensemble '" + config_.name + "': steps " + stuck +
                           " wait for one another's tensors (a cycle)");
  }
  return Status::Ok();
}

Status EnsembleModel::StepError(int step, const Status& status) const {
  const Step& s = steps_[static_cast<size_t>(step)];
  return Status(status.code(), "ensemble '" + config_.name + "' step " + std::to_string(step) + " (model '" + s.model +
                                   "'): " + status.message());
}

Status EnsembleModel::Submit(InferRequest&& request, uint64_t request_id, InferCallback& done,
                             const SubmitOptions& options, bool /*run_here: steps are submitted as answers arrive*/) {
  NestingScope nesting;
  Telemetry arrival;
  arrival.queue_start_ns = clock_->NowNs();
  {
    MutexLock lock(mu_);
    if (stopping_ || nesting.too_deep()) {
      Status st = stopping_ ? Unavailable("model '" + config_.name + "' is stopping") : TooDeep(config_.name);
      stats_.RecordRequest(st, arrival, 0, 0, arrival.queue_start_ns);
      return st;
    }
    ++in_flight_;
  }
  auto run = std::make_shared<Run>();
  int64_t items = 0;
  uint64_t key = 0;
  Status st = ValidateRequest(config_, request, items, key, run->output_indices);
  if (!st.ok()) {
    stats_.RecordRequest(st, arrival, 0, 0, clock_->NowNs());
    Release();
    return st;
  }
  run->id = request_id;
  run->admitted = options.admitted;
  run->on_start = options.on_start;
  for (const auto& [k, v] : request.metadata) {
    if (k == "request_id") run->request_id = v;
  }
  std::vector<NamedTensor> inputs = std::move(request.inputs);
  request.inputs.clear();
  run->request = std::move(request);
  if (!chain_.empty()) {
    // The request's own token: the caller's cancels it, and so does the
    // request's failure (its decoupled steps would send on otherwise).
    auto own = std::make_shared<CancellationToken>();
    run->caller_cancel = std::move(run->request.cancel);
    if (run->caller_cancel) run->caller_cancel->AddOnCancel(run.get(), [own] { own->Cancel(); });
    run->request.cancel = std::move(own);
  }
  {
    MutexLock lock(run->mu);
    run->values.resize(tensors_.size());
    run->state.assign(tensors_.size(), 0);
    for (size_t i = 0; i < config_.inputs.size(); ++i) {
      const size_t t = static_cast<size_t>(input_tensor_[i]);
      NamedTensor* nt = nullptr;
      for (auto& in : inputs) {
        if (in.name == config_.inputs[i].name) nt = &in;
      }
      if (nt) {
        run->values[t] = std::move(nt->tensor);
        run->state[t] = 1;
      } else {
        run->state[t] = 2;  // optional, left out: the steps that read it go without
      }
    }
    run->waiting = waits_for_;
    run->steps_left = static_cast<int>(steps_.size());
    run->telemetry = arrival;
    run->telemetry.batch_size = items;
    run->telemetry.padded_batch_size = items;
  }
  run->done = std::move(done);
  // The caller's loop may run the first steps' batches (they are submitted
  // on its thread, now); later steps are submitted as answers arrive.
  st = Launch(run, first_steps_, /*first_launch=*/true, options.loop);
  if (!st.ok()) {
    // Nothing was submitted: the request is refused, its callback handed back.
    done = std::move(run->done);
    stats_.RecordRequest(st, arrival, 0, 0, clock_->NowNs());
    Release();
    return st;
  }
  return Status::Ok();
}

Status EnsembleModel::Launch(const std::shared_ptr<Run>& run, const std::vector<int>& steps, bool first_launch,
                             CallerLoop* loop) {
  for (size_t k = 0; k < steps.size(); ++k) {
    const int s = steps[k];
    const Step& step = steps_[static_cast<size_t>(s)];
    std::vector<NamedTensor> inputs;
    if (run->root && run->over()) return Status::Ok();  // a branch of a request already answered
    {
      MutexLock lock(run->mu);
      if (run->finished) return Status::Ok();
      for (const auto& [name, t] : step.inputs) {
        if (run->state[static_cast<size_t>(t)] == 1) inputs.push_back({name, run->values[static_cast<size_t>(t)]});
      }
    }
    // A batching step's rows: all its inputs agree on them (else the model
    // refuses the request and says why).
    int64_t rows = -1;
    if (step.max_batch > 0) {
      for (const auto& in : inputs) {
        const int64_t r = in.tensor.shape().empty() ? -2 : in.tensor.shape()[0];
        rows = rows == -1 || rows == r ? r : -2;
      }
    }
    // This run's decoupled step: its responses come to StepResponse.
    const bool streams = step.decoupled && run->chain_pos < chain_.size() && chain_[run->chain_pos] == s;
    if (rows == 0) {
      if (streams) {
        StepResponse(run, s, NoRows(s), /*last=*/true);  // not run: one response of zero rows
      } else {
        StepDone(run, s, 0, 1, NoRows(s));
      }
      continue;
    }
    const int64_t chunk_rows = rows > step.max_batch ? step.max_batch : std::max<int64_t>(rows, 1);
    const int64_t split = rows > step.max_batch ? (rows + chunk_rows - 1) / chunk_rows : 1;
    if (split > kMaxStepRequests) {
      // Rows a request brought or a step wrote must not become an unbounded
      // number of requests.
      Status st = StepError(
          s, InvalidArgument(std::to_string(rows) + " rows would take " + std::to_string(split) +
                             " requests of at most " + std::to_string(step.max_batch) +
                             " rows (the model's max_batch_size); at most " + std::to_string(kMaxStepRequests)));
      if (first_launch && k == 0) return st;
      Finish(run, std::move(st));
      return Status::Ok();
    }
    if (streams && split > 1) {
      // Each part would send its own responses: there is no pairing them.
      Status st = StepError(
          s, InvalidArgument(std::to_string(rows) + " rows exceed the model's max_batch_size (" +
                             std::to_string(step.max_batch) + "), and a decoupled step takes its rows in one request"));
      if (first_launch && k == 0) return st;
      Finish(run, std::move(st));
      return Status::Ok();
    }
    const int chunks = static_cast<int>(split);
    if (chunks > 1) {
      MutexLock lock(run->mu);
      auto& g = run->gathers[s];
      g.pending = chunks;
      g.parts.assign(static_cast<size_t>(chunks), InferResponse());
    }
    for (int c = 0; c < chunks; ++c) {
      InferRequest r;
      r.model = step.model;
      r.version = step.version;
      r.requested_outputs = step.requested;
      Run& top = run->top();
      r.priority = top.request.priority;
      r.timeout_us = top.request.timeout_us;
      r.deadline_ns = top.request.deadline_ns;
      r.cancel = top.request.cancel;
      r.parameters = top.request.parameters;  // the caller's, to every step
      // A step is the caller's request, under its name (a Python step's
      // request_id()); the first step to run starts the ensemble's request.
      if (!top.request_id.empty()) r.metadata.emplace_back("request_id", top.request_id);
      SubmitOptions o;
      if (top.on_start) {
        o.on_start = [root = run->root ? run->root : run] {
          if (!root->started.exchange(true, std::memory_order_relaxed)) root->on_start();
        };
      }
      // Admission is decided at the first steps: a request inside the
      // ensemble is not refused later for the queue's length (that would
      // throw away the work done), though queue sizes, timeouts and
      // deadlines still apply.
      o.admitted = top.admitted || !first_launch;
      o.loop = loop;
      Status st;
      if (chunks == 1) {
        r.inputs = std::move(inputs);
      } else {
        const int64_t first = c * chunk_rows;
        for (const auto& in : inputs) {
          auto part = SliceRows(in.tensor, first, std::min(chunk_rows, rows - first));
          if (!part) {
            st = part.error();
            break;
          }
          r.inputs.push_back({in.name, std::move(*part)});
        }
      }
      if (st.ok() && r.cancel && r.cancel->cancelled()) st = Cancelled("the request was cancelled");
      if (st.ok()) {
        InferCallback done;
        if (streams) {
          r.on_response = [self = shared_from_this(), run, s](InferResponse&& response) {
            self->StepResponse(run, s, std::move(response), /*last=*/false);
          };
          done = [self = shared_from_this(), run, s](InferResponse&& response) {
            self->StepResponse(run, s, std::move(response), /*last=*/true);
          };
        } else {
          done = [self = shared_from_this(), run, s, c, chunks](InferResponse&& response) {
            self->StepDone(run, s, c, chunks, std::move(response));
          };
        }
        st = models_.submit(std::move(r), done, o);
      }
      if (!st.ok()) {
        st = StepError(s, st);
        if (first_launch && k == 0 && c == 0) return st;
        Finish(run, std::move(st));
        return Status::Ok();
      }
    }
  }
  return Status::Ok();
}

InferResponse EnsembleModel::NoRows(int step) const {
  const Step& s = steps_[static_cast<size_t>(step)];
  InferResponse r;
  r.model = s.model;
  for (const TensorConfig& out : s.output_configs) {
    Shape shape = out.dims;
    for (auto& d : shape) d = std::max<int64_t>(d, 0);  // a dimension of any size: none
    shape.insert(shape.begin(), 0);
    r.outputs.push_back({out.name, Tensor::Allocate(out.dtype, std::move(shape), 0)});
  }
  return r;
}

void EnsembleModel::StepDone(const std::shared_ptr<Run>& run, int step, int chunk, int chunks,
                             InferResponse&& response) {
  if (!response.status.ok()) {
    Finish(run, StepError(step, response.status));
    return;
  }
  const Step& s = steps_[static_cast<size_t>(step)];
  if (chunks > 1) {
    // Joined in order once every chunk has answered.
    std::vector<InferResponse> parts;
    {
      MutexLock lock(run->mu);
      if (run->finished) return;
      auto& g = run->gathers[step];
      g.parts[static_cast<size_t>(chunk)] = std::move(response);
      if (--g.pending > 0) return;
      parts = std::move(g.parts);
      run->gathers.erase(step);
    }
    InferResponse joined;
    joined.model = std::move(parts[0].model);
    joined.version = parts[0].version;
    joined.telemetry = parts[0].telemetry;
    for (const auto& p : parts) {
      Telemetry& t = joined.telemetry;
      t.compute_start_ns = std::min(t.compute_start_ns, p.telemetry.compute_start_ns);
      t.compute_end_ns = std::max(t.compute_end_ns, p.telemetry.compute_end_ns);
    }
    for (const auto& name : s.requested) {
      std::vector<const Tensor*> pieces;
      int64_t rows = 0;
      for (const auto& p : parts) {
        const Tensor* t = p.FindOutput(name);
        const bool alike = t && !t->shape().empty() &&
                           (pieces.empty() || (t->dtype() == pieces[0]->dtype() &&
                                               Shape(t->shape().begin() + 1, t->shape().end()) ==
                                                   Shape(pieces[0]->shape().begin() + 1, pieces[0]->shape().end())));
        if (!alike) {
          Finish(run, StepError(step, Internal("output '" + name +
                                               "' came back unlike for the parts of the request (type or shape)")));
          return;
        }
        pieces.push_back(t);
        rows += t->shape()[0];
      }
      joined.outputs.push_back({name, ConcatenateRows(pieces, rows)});
    }
    StepDone(run, step, 0, 1, std::move(joined));
    return;
  }
  std::vector<int> ready;
  bool complete = false;
  {
    MutexLock lock(run->mu);
    if (run->finished) return;
    Telemetry& t = run->telemetry;
    const Telemetry& st = response.telemetry;
    if (st.compute_start_ns > 0 && (t.compute_start_ns == 0 || st.compute_start_ns < t.compute_start_ns)) {
      t.compute_start_ns = st.compute_start_ns;
    }
    t.compute_end_ns = std::max(t.compute_end_ns, st.compute_end_ns);
    if (st.queue_start_ns > 0) run->steps.push_back({step, std::move(response.model), response.version, st});
    for (const auto& [name, ti] : s.outputs) {
      const Tensor* out = response.FindOutput(name);
      if (!out) {
        lock.Unlock();
        Finish(run, StepError(step, Internal("the model did not return output '" + name + "'")));
        return;
      }
      run->values[static_cast<size_t>(ti)] = *out;
      run->state[static_cast<size_t>(ti)] = 1;
      for (int r : readers_[static_cast<size_t>(ti)]) {
        if (--run->waiting[static_cast<size_t>(r)] == 0) ready.push_back(r);
      }
    }
    complete = --run->steps_left == 0;
  }
  if (complete) {
    Finish(run, Status::Ok());
    return;
  }
  if (!ready.empty()) (void)Launch(run, ready, /*first_launch=*/false);
  if (run->chain_pos < chain_.size()) NextBranch(run);  // the steps before a branch may all have answered
}

void EnsembleModel::StepResponse(const std::shared_ptr<Run>& run, int step, InferResponse&& response, bool last) {
  if (!response.status.ok()) {
    Finish(run, StepError(step, response.status));
    return;
  }
  if (run->over()) return;
  {
    MutexLock lock(run->mu);
    if (run->finished || run->step_closed) return;
    if (!(last && response.final_only)) {
      if (!last && run->queued.size() >= kMaxQueuedResponses) {
        lock.Unlock();
        Finish(run,
               StepError(step, ResourceExhausted("the model sent more than " + std::to_string(kMaxQueuedResponses) +
                                                 " responses that the steps after it have not taken yet")));
        return;
      }
      run->queued.push_back(std::move(response));
    }
    if (last) run->step_closed = true;
  }
  NextBranch(run);
}

void EnsembleModel::NextBranch(const std::shared_ptr<Run>& run) {
  // (Several ensembles' runs: an ensemble's branch may answer a step of another.)
  using Queue = std::deque<std::pair<EnsembleModel*, std::shared_ptr<Run>>>;
  if (branch_queue) {  // an outer call on this thread takes it (a loop, not a recursion)
    static_cast<Queue*>(branch_queue)->emplace_back(this, run);
    return;
  }
  Queue queue;
  queue.emplace_back(this, run);
  branch_queue = &queue;
  while (!queue.empty()) {
    auto [model, next] = std::move(queue.front());
    queue.pop_front();
    model->StartBranch(next);
  }
  branch_queue = nullptr;
}

void EnsembleModel::StartBranch(const std::shared_ptr<Run>& run) {
  if (run->over()) return;
  const int s = chain_[run->chain_pos];
  auto branch = std::make_shared<Run>();
  InferResponse response;
  {
    MutexLock lock(run->mu);
    if (run->finished || run->branch_running) return;
    // The steps that do not read the decoupled step's answers have all
    // answered (their tensors go to every branch).
    if (run->steps_left != steps_[static_cast<size_t>(s)].tail) return;
    if (run->queued.empty()) {
      if (!run->step_closed) return;
      lock.Unlock();
      EndRun(run);
      return;
    }
    response = std::move(run->queued.front());
    run->queued.pop_front();
    run->branch_running = true;
    branch->root = run->root ? run->root : run;
    branch->parent = run;
    branch->chain_pos = run->chain_pos + 1;
    branch->id = run->id;
    branch->output_indices = run->output_indices;
    MutexLock b(branch->mu);
    branch->values = run->values;
    branch->state = run->state;
    branch->waiting = run->waiting;
    branch->steps_left = run->steps_left;
    branch->telemetry = run->telemetry;
    branch->steps = run->steps;
  }
  // In the branch the step has answered, with this response.
  StepDone(branch, s, 0, 1, std::move(response));
}

void EnsembleModel::EndRun(const std::shared_ptr<Run>& run) {
  if (!run->parent) {
    Finish(run, Status::Ok());  // the request's own run: the last answer
    return;
  }
  {
    MutexLock lock(run->mu);
    if (run->finished) return;
    run->finished = true;
    run->values.clear();
  }
  {
    MutexLock lock(run->parent->mu);
    run->parent->branch_running = false;
  }
  NextBranch(run->parent);
}

void EnsembleModel::FinishBranch(const std::shared_ptr<Run>& run, Status status) {
  if (!status.ok()) {
    {
      MutexLock lock(run->mu);
      if (run->finished) return;
      run->finished = true;
      run->values.clear();
    }
    Finish(run->root, std::move(status));  // the request fails, with its branches
    return;
  }
  InferResponse r;
  {
    MutexLock lock(run->mu);
    if (run->finished) return;
    for (int idx : run->output_indices) {
      const size_t t = static_cast<size_t>(output_tensor_[static_cast<size_t>(idx)]);
      r.outputs.push_back({config_.outputs[static_cast<size_t>(idx)].name, run->values[t]});
    }
    r.telemetry = run->telemetry;
    r.steps = run->steps;
  }
  Run& top = *run->root;
  MutexLock emitting(top.emit);
  bool over = false;
  {
    MutexLock lock(top.mu);
    over = top.finished;
  }
  if (!over && top.request.on_response) {
    r.request_id = run->id;
    r.model = config_.name;
    r.version = version_;
    r.metadata = top.request.metadata;
    r.decoupled = true;
    r.telemetry.response_ns = clock_->NowNs();
    top.request.on_response(std::move(r));
  }
  emitting.Unlock();
  EndRun(run);
}

void EnsembleModel::Finish(const std::shared_ptr<Run>& run, Status status) {
  if (run->root) {
    FinishBranch(run, std::move(status));
    return;
  }
  InferResponse r;
  {
    MutexLock lock(run->mu);
    if (run->finished) return;
    run->finished = true;
    run->queued.clear();
    if (status.ok() && !chain_.empty()) {
      // Every branch has answered (on_response): the last answer says only that.
      r.final_only = true;
      r.decoupled = true;
    } else if (status.ok()) {
      for (int idx : run->output_indices) {
        const size_t t = static_cast<size_t>(output_tensor_[static_cast<size_t>(idx)]);
        r.outputs.push_back({config_.outputs[static_cast<size_t>(idx)].name, std::move(run->values[t])});
      }
    }
    run->values.clear();
    r.telemetry = run->telemetry;
    r.steps = std::move(run->steps);
  }
  if (r.status = std::move(status);
      r.status.code() == StatusCode::kCancelled || r.status.code() == StatusCode::kDeadlineExceeded) {
    if (r.status.message().find(config_.name) == std::string::npos) {
      r.status = Status(r.status.code(), "model '" + config_.name + "': " + r.status.message());
    }
  }
  r.request_id = run->id;
  r.model = config_.name;
  r.version = version_;
  // (A decoupled ensemble's branches may still read it: copied.)
  r.metadata = chain_.empty() ? std::move(run->request.metadata) : run->request.metadata;
  const int64_t now = clock_->NowNs();
  if (r.telemetry.compute_start_ns == 0) r.telemetry.compute_start_ns = now;
  if (r.telemetry.compute_end_ns == 0) r.telemetry.compute_end_ns = now;
  r.telemetry.response_ns = now;
  stats_.RecordRequest(r.status, r.telemetry, 0, 0, now);
  if (config_.decoupled) r.decoupled = true;  // its last answer, an error too (triton_final_response)
  if (!chain_.empty()) {
    // (Once cancelled, the caller's token runs its functions, this one's
    // perhaps on this very thread, and never again: nothing to remove.)
    if (run->caller_cancel && !run->caller_cancel->cancelled()) run->caller_cancel->RemoveOnCancel(run.get());
    if (!r.status.ok()) run->request.cancel->Cancel();  // its steps and branches end
    run->emit.Lock();                                   // a branch's response under way goes first
    run->emit.Unlock();
  }
  InferCallback done = std::move(run->done);
  done(std::move(r));
  Release();
}

void EnsembleModel::Release() {
  MutexLock lock(mu_);
  if (--in_flight_ == 0) idle_.SignalAll();
}

void EnsembleModel::CountRefused(const Status& status) {
  Telemetry refused;
  refused.queue_start_ns = clock_->NowNs();
  stats_.RecordRequest(status, refused, 0, 0, refused.queue_start_ns);
}

Status EnsembleModel::CheckAdmission() {
  NestingScope nesting;
  if (nesting.too_deep()) return TooDeep(config_.name);
  {
    MutexLock lock(mu_);
    if (stopping_) return Unavailable("model '" + config_.name + "' is stopping");
  }
  for (int s : first_steps_) {
    const Step& step = steps_[static_cast<size_t>(s)];
    Status st = models_.check_admission(step.model, step.version);
    if (!st.ok()) return StepError(s, st);
  }
  return Status::Ok();
}

void EnsembleModel::Shutdown() {
  MutexLock lock(mu_);
  stopping_ = true;
  idle_.Wait(lock, [this]() QUERN_REQUIRES(mu_) { return in_flight_ == 0; });
}

bool EnsembleModel::stopping() const {
  MutexLock lock(mu_);
  return stopping_;
}

int64_t EnsembleModel::in_flight() const {
  MutexLock lock(mu_);
  return in_flight_;
}

ModelStatistics EnsembleModel::Statistics() const {
  ModelStatistics s = stats_.Snapshot();
  s.name = config_.name;
  s.version = version_;
  return s;
}

}  // namespace quern
