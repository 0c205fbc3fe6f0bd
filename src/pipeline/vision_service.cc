#include "pipeline/vision_service.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>

#include "core/cpus.h"
#include "core/log.h"

namespace quern {

namespace {

Counter& StageCounter(MetricsRegistry& metrics, const char* stage) {
  return metrics.AddCounter("quern_vision_stage_seconds_total",
                            "Time answered images spent in each stage: decode, resize (with normalisation), queue "
                            "(waiting in the model's batcher), infer (their batch's compute), post (decoding outputs, "
                            "NMS, top-k).",
                            {{"stage", stage}}, 1e-9);
}

Counter& StageCpuCounter(MetricsRegistry& metrics, const char* stage) {
  return metrics.AddCounter("quern_vision_stage_cpu_seconds_total",
                            "CPU time the vision threads spent on answered images in each stage: decode, resize (with "
                            "normalisation), post (decoding outputs, NMS, top-k, face crops).",
                            {{"stage", stage}}, 1e-9);
}

constexpr char kStageDurationFamily[] = "quern_vision_stage_duration_us";
constexpr char kStageDurationHelp[] =
    "Time an answered image spent in each stage, by model, microseconds: decode, resize (with normalisation), queue, "
    "infer (its batch's compute), post.";

// Shrinks `d`'s pixels (area-averaged) until neither side is over `most`;
// its source size, which boxes refer to, stays.
void KeepAtMost(DecodedImage& d, int most) {
  const int longer = std::max(d.image.width, d.image.height);
  if (longer <= most) return;
  ImageSpec spec;
  spec.width = std::max(1, static_cast<int>(std::lround(static_cast<double>(d.image.width) * most / longer)));
  spec.height = std::max(1, static_cast<int>(std::lround(static_cast<double>(d.image.height) * most / longer)));
  spec.resize = ResizeMode::kStretch;
  spec.layout = TensorLayout::kNhwc;
  spec.dtype = DataType::kUint8;  // RGB bytes, as decoded
  Image small;
  small.width = spec.width;
  small.height = spec.height;
  small.pixels.resize(PreprocessedBytes(spec));
  Preprocess(d, spec, small.pixels.data());
  d.image = std::move(small);
}

// This thread's CPU time.
int64_t ThreadCpuNs() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

}  // namespace

struct VisionService::Job {
  VisionRequest request;
  VisionCallback done;
  int64_t deadline_ns = 0;  // service clock
  int64_t charged_bytes = 0;
  double units = 1;           // its work in the model's usual images (Claim)
  int64_t decoded_bytes = 0;  // the header's full decode size (0 = not read)
  int format = 0;             // its ImageFormat
  ImageTransform transform;
  VisionTimings timings;
  int64_t post_start_ns = 0;
  std::optional<DecodedImage> decoded;  // kept for the descriptor's crops
  bool begun = false;                   // counted in its model's ModelLoad::begun
};

VisionService::VisionService(Engine* engine, VisionServiceOptions options)
    : engine_(engine),
      options_(std::move(options)),
      clock_(options_.clock ? options_.clock : &RealClockInstance()),
      own_metrics_(options_.metrics ? nullptr : std::make_unique<MetricsRegistry>()),
      metrics_(options_.metrics ? *options_.metrics : *own_metrics_),
      requests_(metrics_.AddCounter("quern_vision_requests_total", "Images admitted to the vision pipeline.")),
      rejected_(metrics_.AddCounter("quern_vision_rejected_overload_total",
                                    "Vision requests refused at once because the queue was at capacity.")),
      dropped_(metrics_.AddCounter("quern_vision_dropped_total",
                                   "Vision requests dropped before inference: client gone or timeout passed.")),
      failed_(metrics_.AddCounter("quern_vision_failed_total", "Vision requests answered with an error.")),
      in_flight_(metrics_.AddGauge("quern_vision_in_flight", "Images in the vision pipeline now.")),
      in_flight_bytes_(
          metrics_.AddGauge("quern_vision_in_flight_bytes",
                            "Memory held by the images in the vision pipeline (request bodies and model inputs).")),
      timed_images_(
          metrics_.AddCounter("quern_vision_timed_images_total",
                              "Answered images whose stage durations are summed in quern_vision_stage_seconds_total.")),
      decode_ns_(StageCounter(metrics_, "decode")),
      resize_ns_(StageCounter(metrics_, "resize")),
      queue_ns_(StageCounter(metrics_, "queue")),
      infer_ns_(StageCounter(metrics_, "infer")),
      post_ns_(StageCounter(metrics_, "post")),
      decode_cpu_ns_(StageCpuCounter(metrics_, "decode")),
      resize_cpu_ns_(StageCpuCounter(metrics_, "resize")),
      post_cpu_ns_(StageCpuCounter(metrics_, "post")) {
  cores_ = std::max(1, UsableCores());
  lanes_ = std::max(1, options_.stage_threads > 0 ? options_.stage_threads : cores_);
  if (!options_.executor) {
    const int n = options_.stage_threads > 0 ? options_.stage_threads : UsableCores();
    options_.stage_threads = n;
    for (int i = 0; i < n; ++i) {
      threads_.emplace_back([this] {
        NameThisThread("quern-vision");
        StageLoop();
      });
    }
  }
  // Its series come with each model's first answered image.
  metrics_.DeclareFamily(kStageDurationFamily, MetricType::kHistogram, kStageDurationHelp);
  metrics_.DeclareFamily("quern_vision_queue_capacity", MetricType::kGauge, "Images of the model admitted at once.");
  metrics_.DeclareFamily("quern_vision_ms_per_image", MetricType::kGauge,
                         "The model's measured pipeline time per image behind its capacity.");
  collection_ = metrics_.AddCollector([this](MetricWriter& w) {
    MutexLock lock(load_mu_);
    for (const auto& [model, load] : loads_) {
      w.Sample("quern_vision_queue_capacity", {{"model", model}}, static_cast<double>(Capacity(load.ms_per_image)));
      w.Sample("quern_vision_ms_per_image", {{"model", model}}, load.ms_per_image);
    }
  });
}

VisionService::~VisionService() {
  {
    MutexLock lock(idle_mu_);
    idle_cv_.WaitFor(lock, RealClockInstance(), std::chrono::seconds(30), [this] { return in_flight_.value() == 0; });
  }
  closing_.store(true);
  {
    MutexLock lock(pool_mu_);
    stopping_ = true;
  }
  pool_cv_.SignalAll();
  for (auto& t : threads_) t.join();
  // Images still waiting to begin after the wait above: answered, not lost.
  std::vector<std::shared_ptr<Job>> left;
  {
    MutexLock lock(load_mu_);
    for (auto& [model, load] : loads_) {
      for (auto& job : load.waiting) left.push_back(std::move(job));
      load.waiting.clear();
    }
  }
  for (const auto& job : left) Fail(job, Unavailable("the server stopped before the image was decoded"), false);
}

VisionStats VisionService::stats() const {
  VisionStats s;
  s.requests = requests_.value();
  s.rejected_overload = rejected_.value();
  s.dropped = dropped_.value();
  s.failed = failed_.value();
  s.in_flight = in_flight_.value();
  s.in_flight_bytes = in_flight_bytes_.value();
  {
    MutexLock lock(load_mu_);
    for (const auto& [model, load] : loads_) s.capacity += Capacity(load.ms_per_image);
  }
  s.ms_per_image = ms_per_image_.load();
  s.timed_images = timed_images_.value();
  s.decode_ns = decode_ns_.value();
  s.resize_ns = resize_ns_.value();
  s.queue_ns = queue_ns_.value();
  s.infer_ns = infer_ns_.value();
  s.post_ns = post_ns_.value();
  s.decode_cpu_ns = decode_cpu_ns_.value();
  s.resize_cpu_ns = resize_cpu_ns_.value();
  s.post_cpu_ns = post_cpu_ns_.value();
  return s;
}

int64_t VisionService::Capacity(double ms_per_image) const {
  if (options_.queue_capacity > 0) return options_.queue_capacity;
  const double per_image = std::max(0.01, ms_per_image);
  // Never below two images per core: one decoding or post-processing on
  // each while another runs in the model. Callers with a page each in flight
  // are not refused however slow the pages measure on a busy machine (four
  // OCR callers on two cores were, at a capacity of three).
  return std::max<int64_t>(2 * lanes_, static_cast<int64_t>(static_cast<double>(QueueBudgetMs()) / per_image));
}

int64_t VisionService::QueueBudgetMs() const {
  if (options_.max_queue_wait_ms > 0) return std::min(options_.request_timeout_ms, options_.max_queue_wait_ms);
  return options_.request_timeout_ms;
}

void VisionService::Post(std::function<void()> task, bool urgent) {
  if (options_.executor) return options_.executor(std::move(task), urgent);
  {
    MutexLock lock(pool_mu_);
    if (urgent) {
      tasks_.push_front(std::move(task));
    } else {
      tasks_.push_back(std::move(task));
    }
  }
  pool_cv_.Signal();
}

void VisionService::StageLoop() {
  while (true) {
    std::function<void()> task;
    {
      MutexLock lock(pool_mu_);
      pool_cv_.Wait(lock, [this]() QUERN_REQUIRES(pool_mu_) { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

Result<std::shared_ptr<const VisionModel>> VisionService::Model(const std::string& name) {
  // Read before the engine is asked: a change after it makes the next call
  // ask again.
  const uint64_t generation = engine_->ModelsGeneration();
  {
    MutexLock lock(models_mu_);
    auto it = models_.find(name);
    if (it != models_.end() && it->second.generation == generation) return it->second.model;
  }
  QUERN_ASSIGN_OR_RETURN(ModelStatus status, engine_->GetModel(name));
  if (status.state != ModelState::kReady) {
    return std::unexpected(Unavailable("model '" + name + "' is not ready (" +
                                       std::string(ModelStateName(status.state)) +
                                       (status.reason.empty() ? "" : ": " + status.reason) + ")"));
  }
  if (!IsVisionModel(status.config)) {
    return std::unexpected(InvalidArgument("model '" + name +
                                           "' has no image pipeline (declare one with quern.task / quern.image.* "
                                           "parameters in its config.pbtxt)"));
  }
  {
    MutexLock lock(models_mu_);
    auto it = models_.find(name);
    if (it != models_.end() && it->second.model->version == status.version) {
      it->second.generation = generation;
      return it->second.model;
    }
  }
  QUERN_ASSIGN_OR_RETURN(VisionModel m, VisionModelFromStatus(status, options_.model_repository / name));
  auto shared = std::make_shared<const VisionModel>(std::move(m));
  MutexLock lock(models_mu_);
  models_[name] = {generation, shared};
  return shared;
}

std::vector<std::string> VisionService::Models(VisionTask task) {
  const uint64_t generation = engine_->ModelsGeneration();
  {
    MutexLock lock(models_mu_);
    auto it = model_lists_.find(static_cast<int>(task));
    if (it != model_lists_.end() && it->second.first == generation) return it->second.second;
  }
  std::vector<std::string> out;
  for (const auto& m : engine_->ListModels()) {  // sorted by name
    if (m.state != ModelState::kReady || !IsVisionModel(m.config)) continue;
    if (!out.empty() && out.back() == m.name) continue;  // another version
    auto vm = Model(m.name);
    if (vm && (*vm)->task == task) out.push_back(m.name);
  }
  MutexLock lock(models_mu_);
  model_lists_[static_cast<int>(task)] = {generation, out};
  return out;
}

// The most places one image takes, however large against the usual ones: a
// stream of small images (or a client sending tiny ones) cannot lock large
// ones out.
constexpr double kMaxImageUnits = 4;

bool VisionService::Full(const ModelLoad& load, double units) const {
  return load.in_flight > 0 && load.units + units > static_cast<double>(Capacity(load.ms_per_image)) + 1e-9;
}

Status VisionService::Busy(const std::string& model, const ModelLoad& load, int64_t held, int64_t bytes,
                           double units) const {
  if (Full(load, units)) {
    std::string what = std::to_string(load.in_flight) + " images for model '" + model + "' are already waiting";
    if (units > 1) {
      char buf[128];
      std::snprintf(buf, sizeof buf, " (this one has %.1f times their usual pixels and counts as that many)", units);
      what += buf;
    }
    return Unavailable("the server is busy: " + what + ", as many as it can finish within " +
                       std::to_string(QueueBudgetMs()) + " ms; try again later");
  }
  // One image is always let in, however large (within the body limit).
  if (options_.max_in_flight_bytes > 0 && held > 0 && held + bytes > options_.max_in_flight_bytes) {
    return Unavailable("the server is busy: the images already admitted hold " + std::to_string(held >> 20) +
                       " MiB, and this one would pass the limit of " +
                       std::to_string(options_.max_in_flight_bytes >> 20) +
                       " MiB (--vision-max-memory-mb); try again later");
  }
  return Status::Ok();
}

Status VisionService::Refused(Status status) {
  rejected_.Increment();
  const int64_t now = clock_->NowNs();
  int64_t last = last_overload_log_ns_.load();
  if (now - last > 1'000'000'000 && last_overload_log_ns_.compare_exchange_strong(last, now)) {
    Log(LogLevel::kWarning, "vision pipeline full, refusing requests: " + status.message());
  }
  return status;
}

Status VisionService::CheckAdmission(const std::string& model, int64_t bytes) {
  Status st;
  bool own = false;
  {
    MutexLock lock(load_mu_);
    auto it = loads_.find(model);
    const ModelLoad& load = it == loads_.end() ? ModelLoad{} : it->second;
    st = Busy(model, load, in_flight_bytes_.value(), bytes, 1);
    own = Full(load, 1);
  }
  // The model's own refusals (its capacity, not the memory every model
  // shares) count in its statistics.
  if (own && !model.empty()) engine_->CountRefused(model, -1, st);
  if (st.ok() && !model.empty()) st = engine_->CheckAdmission(model);
  return st.ok() ? st : Refused(std::move(st));
}

Status VisionService::Claim(const std::string& model, int64_t version, int64_t bytes, int64_t pixels, double& units) {
  // The model's own queue is asked first: an image it would refuse is not
  // decoded and resized for nothing.
  Status st = engine_->CheckAdmission(model, version);
  if (!st.ok()) return st;
  // Checked and claimed under one lock: concurrent admissions cannot pass
  // the bounds together.
  MutexLock lock(load_mu_);
  auto it = loads_.find(model);
  if (it == loads_.end()) it = loads_.emplace(model, ModelLoad{}).first;
  ModelLoad& load = it->second;
  units = pixels > 0 && load.avg_pixels > 0
              ? std::clamp(static_cast<double>(pixels) / load.avg_pixels, 1.0, kMaxImageUnits)
              : 1.0;
  st = Busy(model, load, in_flight_bytes_.value(), bytes, units);
  if (!st.ok()) {
    const bool own = Full(load, units);
    lock.Unlock();
    if (own) engine_->CountRefused(model, version, st);  // in the model's statistics too (the engine counts its own)
    return st;
  }
  if (pixels > 0) {
    const auto p = static_cast<double>(pixels);
    load.avg_pixels = load.avg_pixels == 0 ? p : 0.9 * load.avg_pixels + 0.1 * p;
  }
  ++load.in_flight;
  load.units += units;
  in_flight_.Add(1);
  in_flight_bytes_.Add(bytes);
  return st;
}

void VisionService::Unclaim(const std::string& model, int64_t bytes, double units) {
  {
    MutexLock lock(load_mu_);
    if (auto it = loads_.find(model); it != loads_.end()) {
      --it->second.in_flight;
      it->second.units = it->second.in_flight == 0 ? 0 : std::max(0.0, it->second.units - units);
    }
  }
  ReleaseHeld(bytes);
}

void VisionService::ReleaseHeld(int64_t charged_bytes) {
  in_flight_bytes_.Add(-charged_bytes);
  if (in_flight_.Add(-1) == 1) {
    MutexLock lock(idle_mu_);
    idle_cv_.SignalAll();
  }
}

int64_t VisionService::TimeoutNs() const {
  constexpr int64_t kMaxMs = int64_t{30} * 24 * 3600 * 1000;  // 30 days: nanoseconds stay far from overflow
  return std::clamp<int64_t>(options_.request_timeout_ms, 0, kMaxMs) * 1'000'000;
}

void VisionService::ReleaseLoad(const std::string& model, int64_t received_ns, double units) {
  const int64_t now = clock_->NowNs();
  // The time per image behind a model's capacity: the time this image kept
  // the model's pipeline busy (since it arrived or since the model's
  // previous image finished, whichever is later) — under load, 1 /
  // throughput. The same over every model, for the service's figures.
  {
    MutexLock lock(load_mu_);
    if (auto it = loads_.find(model); it != loads_.end()) {
      ModelLoad& load = it->second;
      const double busy_ms = static_cast<double>(now - std::max(received_ns, load.last_completion_ns)) / 1e6;
      load.ms_per_image = 0.9 * load.ms_per_image + 0.1 * busy_ms;
      load.last_completion_ns = now;
      --load.in_flight;
      load.units = load.in_flight == 0 ? 0 : std::max(0.0, load.units - units);
    }
  }
  const int64_t last = last_completion_ns_.exchange(now);
  const double busy_ms = static_cast<double>(now - std::max(received_ns, last)) / 1e6;
  ms_per_image_.store(0.9 * ms_per_image_.load() + 0.1 * busy_ms);
}

Status VisionService::SubmitEncoded(EncodedImageRequest request, EncodedImageCallback& done) {
  if (request.model.empty()) return InvalidArgument("an encoded image request needs a model");
  const std::optional<ImageHeader> header = ReadImageHeader(request.image);
  // The pixel bound the decoder applies to every other image, applied here
  // (the model decodes it): a small file may claim a huge image.
  if (header && header->width > 0 && header->height > 0 && header->width * header->height > options_.max_image_pixels) {
    return InvalidArgument("the image is " + std::to_string(header->width) + " x " + std::to_string(header->height) +
                           " pixels, over the limit of " + std::to_string(options_.max_image_pixels) +
                           " (--vision-max-image-pixels)");
  }
  const int64_t decoded = header && header->width > 0 && header->height > 0 ? header->decoded_bytes() : 0;
  const int64_t bytes = request.held_bytes + static_cast<int64_t>(request.image.size()) + 4 * decoded;
  const int64_t pixels = decoded > 0 ? header->width * header->height : 0;
  double units = 1;
  if (Status st = Claim(request.model, -1, bytes, pixels, units); !st.ok()) return Refused(std::move(st));
  VisionTimings timings;
  timings.received_ns = timings.stage_start_ns = clock_->NowNs();
  InferRequest ir;
  ir.model = request.model;
  ir.inputs.push_back({"image", Tensor::FromStrings({1}, {std::string(request.image)})});
  ir.cancel = std::move(request.cancel);
  ir.deadline_ns = engine_->clock().NowNs() + TimeoutNs();
  request.owner.reset();  // the image is copied into the request
  auto answered = std::make_shared<EncodedImageCallback>(std::move(done));
  InferCallback infer_done = [this, answered, timings, bytes, units, model = request.model,
                              deadline = ir.deadline_ns](InferResponse&& r) mutable {
    const auto& tm = r.telemetry;
    timings.infer_ns = tm.compute_end_ns > tm.compute_start_ns ? tm.compute_ns() : 0;
    timings.queue_ns = tm.compute_start_ns > tm.queue_start_ns ? tm.queue_ns() : 0;
    if (r.status.code() == StatusCode::kCancelled || r.status.code() == StatusCode::kDeadlineExceeded) {
      dropped_.Increment();
    }
    ReleaseLoad(model, timings.received_ns, units);
    if (!r.status.ok()) r.status = ModelFailed(r.status, engine_->clock().NowNs() >= deadline);
    (*answered)(std::move(r), timings);
    ReleaseHeld(bytes);
  };
  // Admitted by Claim, within this service's own bounds.
  if (Status st = engine_->InferAsync(std::move(ir), infer_done, {.admitted = true}); !st.ok()) {
    // Refused by the engine after all (its queue filled meanwhile, no such
    // model): given back without measuring a time per image, and the
    // callback returned to the caller.
    done = std::move(*answered);
    Unclaim(request.model, bytes, units);
    return st.code() == StatusCode::kUnavailable ? Refused(std::move(st)) : st;
  }
  requests_.Increment();
  return Status::Ok();
}

Status VisionService::Submit(VisionRequest request, VisionCallback& done) {
  const std::shared_ptr<const VisionModel>& m = request.model;
  if (!m) return InvalidArgument("a vision request needs a model");
  // The decoded image's memory counts from admission on (a small file may
  // decode to much), within the pixel bound the decoder applies.
  const std::optional<ImageHeader> header = ReadImageHeader(request.image);
  const int64_t decoded =
      header && header->width > 0 && header->height > 0 && header->width * header->height <= options_.max_image_pixels
          ? header->decoded_bytes()
          : 0;
  int64_t bytes = request.held_bytes + decoded + static_cast<int64_t>(PreprocessedBytes(m->image));
  if (request.descriptor) {
    if (m->task != VisionTask::kDetection || request.descriptor->task != VisionTask::kEmbedding) {
      return InvalidArgument("model '" + m->name + "' cannot be described by '" + request.descriptor->name +
                             "': a detection model's boxes are described by an embedding model");
    }
    request.max_described = std::clamp(request.max_described, 1, std::max(request.descriptor->max_batch_size, 1));
    bytes += request.max_described * static_cast<int64_t>(PreprocessedBytes(request.descriptor->image));
  }
  double units = 1;
  if (Status st = Claim(m->name, m->version, bytes, decoded > 0 ? header->width * header->height : 0, units);
      !st.ok()) {
    return Refused(std::move(st));
  }
  auto job = std::make_shared<Job>();
  job->units = units;
  job->request = std::move(request);
  job->done = std::move(done);
  job->charged_bytes = bytes;
  if (decoded > 0) {
    job->decoded_bytes = decoded;
    job->format = static_cast<int>(header->format);
  }
  job->timings.received_ns = clock_->NowNs();
  job->deadline_ns = job->timings.received_ns + TimeoutNs();
  requests_.Increment();
  Begin(job);
  return Status::Ok();
}

int64_t VisionService::DecodeAhead(const VisionModel& m) const {
  // Its instances (one per core when not known) and a wide one it may have.
  const int64_t instances = m.instances > 0 ? m.instances : cores_;
  return lanes_ + (instances + 1) * std::max(1, m.max_batch_size);
}

void VisionService::Begin(const std::shared_ptr<Job>& job) {
  {
    MutexLock lock(load_mu_);
    loads_[job->request.model->name].waiting.push_back(job);
  }
  BeginWaiting(job->request.model->name, DecodeAhead(*job->request.model));
}

void VisionService::Ended(const Job& job) {
  if (!job.begun) return;
  {
    MutexLock lock(load_mu_);
    auto it = loads_.find(job.request.model->name);
    if (it == loads_.end()) return;
    --it->second.begun;
  }
  BeginWaiting(job.request.model->name, DecodeAhead(*job.request.model));
}

void VisionService::BeginWaiting(const std::string& model, int64_t ahead) {
  const bool closing = closing_.load();
  const int64_t now = clock_->NowNs();
  std::vector<std::shared_ptr<Job>> begin, gone;
  {
    MutexLock lock(load_mu_);
    auto it = loads_.find(model);
    if (it == loads_.end()) return;
    ModelLoad& load = it->second;
    // The dead ones at the front first, up to the first live one (the
    // waiting images' deadlines come in their order: one timeout for all),
    // so that what waits costs nothing per arrival; one whose caller left
    // further back is answered once it reaches the front.
    while (!load.waiting.empty()) {
      const Job& j = *load.waiting.front();
      if (!closing && !(j.request.cancel && j.request.cancel->cancelled()) && now <= j.deadline_ns) break;
      gone.push_back(std::move(load.waiting.front()));
      load.waiting.pop_front();
    }
    while (load.begun < ahead && !load.waiting.empty()) {
      begin.push_back(std::move(load.waiting.front()));
      load.waiting.pop_front();
      begin.back()->begun = true;
      ++load.begun;
    }
  }
  for (auto& job : begin) Post([this, job] { Process(job); }, false);
  for (auto& job : gone) {
    if (closing) {
      Fail(job, Unavailable("the server stopped before the image was decoded"), false);
    } else if (job->request.cancel && job->request.cancel->cancelled()) {
      Fail(job, Cancelled("the client closed the request"), /*dropped=*/true);
    } else {
      Fail(job,
           DeadlineExceeded("the image waited " + std::to_string((now - job->timings.received_ns) / 1'000'000) +
                            " ms for its model, over the request timeout of " +
                            std::to_string(options_.request_timeout_ms) + " ms"),
           /*dropped=*/true);
    }
  }
}

void VisionService::Process(const std::shared_ptr<Job>& job) {
  VisionTimings& t = job->timings;
  t.stage_start_ns = clock_->NowNs();
  if (job->request.cancel && job->request.cancel->cancelled()) {
    return Fail(job, Cancelled("the client closed the request"), /*dropped=*/true);
  }
  if (t.stage_start_ns > job->deadline_ns) {
    return Fail(job,
                DeadlineExceeded("the image waited " + std::to_string((t.stage_start_ns - t.received_ns) / 1'000'000) +
                                 " ms before decoding, over the request timeout of " +
                                 std::to_string(options_.request_timeout_ms) + " ms"),
                /*dropped=*/true);
  }
  // An image whose decode would end past its timeout (by the time per
  // decoded byte measured for its format) is not begun.
  if (job->decoded_bytes > 0) {
    const double ns_per_byte = decode_ns_per_byte_[job->format].load(std::memory_order_relaxed);
    const auto expected_ns = static_cast<int64_t>(ns_per_byte * static_cast<double>(job->decoded_bytes));
    if (ns_per_byte > 0 && t.stage_start_ns + expected_ns > job->deadline_ns) {
      // Each refusal lowers the estimate a little, so that one slow image
      // (or a busy moment) cannot keep its format refused for good: an
      // image is decoded again, and measured, soon enough.
      decode_ns_per_byte_[job->format].store(ns_per_byte * 0.9, std::memory_order_relaxed);
      return Fail(
          job,
          DeadlineExceeded("decoding this image would take about " + std::to_string(expected_ns / 1'000'000) +
                           " ms, past the request timeout of " + std::to_string(options_.request_timeout_ms) +
                           " ms (it waited " + std::to_string((t.stage_start_ns - t.received_ns) / 1'000'000) + " ms)"),
          /*dropped=*/true);
    }
  }
  const VisionModel& m = *job->request.model;
  const int64_t c0 = ThreadCpuNs();
  DecodeOptions dopt;
  // A large JPEG is shrunk while decoding to what the model needs; crops for
  // a descriptor need more: the image as a 2048x2048 letterbox would hold it.
  static const ImageSpec kCropSource = [] {
    ImageSpec s;
    s.width = s.height = 2048;
    s.resize = ResizeMode::kLetterbox;
    return s;
  }();
  dopt.target = job->request.descriptor ? &kCropSource : &m.image;
  dopt.max_pixels = options_.max_image_pixels;
  auto decoded = DecodeImage(job->request.image, dopt);
  if (!decoded) return Fail(job, decoded.error(), false);
  const int64_t t1 = clock_->NowNs();
  const int64_t c1 = ThreadCpuNs();
  if (job->decoded_bytes > 0) {
    // The decode's time per byte of the full image (a JPEG shrunk while it
    // decodes costs less, and says so), a moving average per format: wall
    // time, as the timeout is (a busy machine decodes slower), but no more
    // than twice its CPU time (one decode stalled by the machine does not
    // weigh like a slow image).
    auto& avg = decode_ns_per_byte_[job->format];
    const double sample =
        static_cast<double>(std::min(t1 - t.stage_start_ns, 2 * (c1 - c0))) / static_cast<double>(job->decoded_bytes);
    const double before = avg.load(std::memory_order_relaxed);
    avg.store(before == 0 ? sample : 0.8 * before + 0.2 * sample, std::memory_order_relaxed);
  }
  Tensor input = Tensor::AllocateUninitialized(m.image.dtype, m.input_shape, PreprocessedBytes(m.image));
  job->transform = Preprocess(*decoded, m.image, input.mutable_data());
  const int64_t t2 = clock_->NowNs();
  t.decode_ns = t1 - t.stage_start_ns;
  t.resize_ns = t2 - t1;
  t.decode_cpu_ns = c1 - c0;
  t.resize_cpu_ns = ThreadCpuNs() - c1;
  if (job->request.descriptor) {
    // Kept until the crops are cut, at most as large as the crops need (a
    // PNG or WebP is not shrunk while decoding), and charged like the rest
    // of the image's memory, so that admission sees it.
    KeepAtMost(*decoded, kCropSource.width);
    const auto held = static_cast<int64_t>(decoded->image.pixels.size());
    in_flight_bytes_.Add(held);
    job->charged_bytes += held;
    job->decoded = std::move(*decoded);
  }

  InferRequest ir;
  ir.model = m.name;
  ir.version = m.version;
  ir.inputs.push_back({m.input_name, std::move(input)});
  ir.cancel = job->request.cancel;
  ir.deadline_ns = engine_->clock().NowNs() + std::max<int64_t>(job->deadline_ns - t2, 1);
  InferCallback infer_done = [this, job](InferResponse&& r) {
    auto response = std::make_shared<InferResponse>(std::move(r));
    Post([this, job, response] { PostProcess(job, std::move(*response)); }, true);
  };
  // Admitted by Submit, within this service's own bounds.
  if (Status st = engine_->InferAsync(std::move(ir), infer_done, {.admitted = true}); !st.ok()) {
    Fail(job, ModelFailed(*job, st), false);
  }
}

Status VisionService::ModelFailed(const Job& job, const Status& st) const {
  return ModelFailed(st, clock_->NowNs() >= job.deadline_ns);
}

Status VisionService::ModelFailed(const Status& st, bool past_deadline) const {
  // The engine's own drops for the request's deadline say "deadline"; a queue policy's timeout or a
  // backend's run time limit are other settings.
  if (st.code() != StatusCode::kDeadlineExceeded) return st;
  if (!past_deadline && st.message().find("deadline") == std::string::npos) return st;
  return Status(st.code(), st.message() + " (the request timeout is " + std::to_string(options_.request_timeout_ms) +
                               " ms, --vision-timeout-ms)");
}

void VisionService::PostProcess(const std::shared_ptr<Job>& job, InferResponse&& r) {
  job->post_start_ns = clock_->NowNs();
  const int64_t c0 = ThreadCpuNs();
  job->timings.infer_ns = r.telemetry.compute_ns();
  job->timings.queue_ns = r.telemetry.queue_ns();
  if (!r.status.ok()) {
    const bool dropped = r.status.code() == StatusCode::kCancelled || r.status.code() == StatusCode::kDeadlineExceeded;
    return Fail(job, ModelFailed(*job, r.status), dropped);
  }
  const VisionModel& m = *job->request.model;
  VisionResult result;
  if (m.task == VisionTask::kClassification) {
    if (r.outputs.empty()) return Fail(job, Internal("model '" + m.name + "' returned no output"), false);
    auto scores = OutputAsFloats(r.outputs[0]);
    if (!scores) return Fail(job, scores.error(), false);
    result.classes = TopK(*scores, m.top_k, m.softmax, m.labels);
  } else {
    auto found = DecodeDetections(r.outputs, m.detection, job->request.min_confidence, m.image.width, m.image.height);
    if (!found) {
      return Fail(job, Status(found.error().code(), "model '" + m.name + "': " + found.error().message()), false);
    }
    result.detections.reserve(found->size());
    for (const auto& d : *found) {
      const std::string& label = m.Label(d.class_id);
      result.detections.push_back({MapToSource(d, job->transform), label.empty() ? std::to_string(d.class_id) : label});
    }
  }
  job->timings.post_ns = clock_->NowNs() - job->post_start_ns;
  job->timings.post_cpu_ns = ThreadCpuNs() - c0;
  if (job->request.descriptor && !result.detections.empty()) return Describe(job, std::move(result));
  Finish(job, std::move(result));
}

void VisionService::Describe(const std::shared_ptr<Job>& job, VisionResult&& result) {
  const int64_t start = clock_->NowNs(), cpu_start = ThreadCpuNs();
  const VisionModel& d = *job->request.descriptor;
  const size_t n = std::min(result.detections.size(), static_cast<size_t>(job->request.max_described));
  const size_t one = PreprocessedBytes(d.image);
  Shape shape = d.input_shape;
  shape[0] = static_cast<int64_t>(n);
  Tensor input = Tensor::AllocateUninitialized(d.image.dtype, shape, n * one);
  for (size_t i = 0; i < n; ++i) {
    const Detection& b = result.detections[i].box;
    Preprocess(CropSquare(*job->decoded, b.x_min, b.y_min, b.x_max, b.y_max), d.image, input.mutable_data() + i * one);
  }
  job->decoded.reset();
  job->timings.post_ns += clock_->NowNs() - start;
  job->timings.post_cpu_ns += ThreadCpuNs() - cpu_start;
  InferRequest ir;
  ir.model = d.name;
  ir.version = d.version;
  ir.inputs.push_back({d.input_name, std::move(input)});
  ir.cancel = job->request.cancel;
  ir.deadline_ns = engine_->clock().NowNs() + std::max<int64_t>(job->deadline_ns - clock_->NowNs(), 1);
  auto shared = std::make_shared<VisionResult>(std::move(result));
  InferCallback done = [this, job, shared](InferResponse&& r) {
    auto response = std::make_shared<InferResponse>(std::move(r));
    Post([this, job, shared, response] { Described(job, shared, std::move(*response)); }, true);
  };
  if (Status st = engine_->InferAsync(std::move(ir), done, {.admitted = true}); !st.ok()) {  // charged by Submit
    Fail(job, ModelFailed(*job, Status(st.code(), "face descriptor '" + d.name + "': " + st.message())), false);
  }
}

void VisionService::Described(const std::shared_ptr<Job>& job, const std::shared_ptr<VisionResult>& result,
                              InferResponse&& r) {
  const int64_t start = clock_->NowNs(), cpu_start = ThreadCpuNs();
  const VisionModel& d = *job->request.descriptor;
  job->timings.queue_ns += r.telemetry.queue_ns();
  job->timings.infer_ns += r.telemetry.compute_ns();
  if (!r.status.ok()) {
    const bool dropped = r.status.code() == StatusCode::kCancelled || r.status.code() == StatusCode::kDeadlineExceeded;
    return Fail(job, ModelFailed(*job, r.status), dropped);
  }
  const NamedTensor* out = nullptr;
  for (const auto& o : r.outputs) {
    if (o.name == d.embedding_output) out = &o;
  }
  if (!out) return Fail(job, Internal("model '" + d.name + "' returned no output '" + d.embedding_output + "'"), false);
  auto values = OutputAsFloats(*out);
  if (!values) return Fail(job, values.error(), false);
  const size_t n = std::min(result->detections.size(), static_cast<size_t>(job->request.max_described));
  if (n == 0 || values->empty() || values->size() % n != 0) {
    return Fail(job,
                Internal("model '" + d.name + "' answered " + std::to_string(values->size()) + " values for " +
                         std::to_string(n) + " crops"),
                false);
  }
  const size_t dim = values->size() / n;
  for (size_t i = 0; i < n; ++i) {
    std::vector<float>& e = result->detections[i].embedding;
    e.assign(values->begin() + static_cast<std::ptrdiff_t>(i * dim),
             values->begin() + static_cast<std::ptrdiff_t>((i + 1) * dim));
    double norm = 0;
    for (float v : e) norm += static_cast<double>(v) * v;
    const float scale = norm > 0 ? static_cast<float>(1.0 / std::sqrt(norm)) : 0.0f;
    for (float& v : e) v *= scale;
  }
  job->timings.post_ns += clock_->NowNs() - start;
  job->timings.post_cpu_ns += ThreadCpuNs() - cpu_start;
  Finish(job, std::move(*result));
}

VisionService::StageHistograms VisionService::HistogramsFor(const std::string& model) {
  MutexLock lock(histograms_mu_);
  auto it = histograms_.find(model);
  if (it != histograms_.end()) return it->second;
  // Microseconds, as the models' own duration histograms.
  static const std::vector<double> kBounds = {100,   250,   500,    1000,   2500,   5000,   10000,
                                              25000, 50000, 100000, 250000, 500000, 1000000};
  auto stage = [&](const char* name) {
    return &metrics_.AddHistogram(kStageDurationFamily, kStageDurationHelp, {{"model", model}, {"stage", name}},
                                  kBounds);
  };
  StageHistograms h{stage("decode"), stage("resize"), stage("queue"), stage("infer"), stage("post")};
  return histograms_.emplace(model, h).first->second;
}

void VisionService::Finish(const std::shared_ptr<Job>& job, VisionResult&& result) {
  result.timed = true;
  VisionTimings& t = job->timings;
  const StageHistograms h = HistogramsFor(job->request.model->name);
  h.decode->Observe(static_cast<double>(t.decode_ns) / 1e3);
  h.resize->Observe(static_cast<double>(t.resize_ns) / 1e3);
  h.queue->Observe(static_cast<double>(t.queue_ns) / 1e3);
  h.infer->Observe(static_cast<double>(t.infer_ns) / 1e3);
  h.post->Observe(static_cast<double>(t.post_ns) / 1e3);
  timed_images_.Increment(1);
  decode_ns_.Increment(static_cast<uint64_t>(t.decode_ns));
  resize_ns_.Increment(static_cast<uint64_t>(t.resize_ns));
  queue_ns_.Increment(static_cast<uint64_t>(t.queue_ns));
  infer_ns_.Increment(static_cast<uint64_t>(t.infer_ns));
  post_ns_.Increment(static_cast<uint64_t>(t.post_ns));
  decode_cpu_ns_.Increment(static_cast<uint64_t>(t.decode_cpu_ns));
  resize_cpu_ns_.Increment(static_cast<uint64_t>(t.resize_cpu_ns));
  post_cpu_ns_.Increment(static_cast<uint64_t>(t.post_cpu_ns));
  Deliver(job, std::move(result));
}

void VisionService::Fail(const std::shared_ptr<Job>& job, Status status, bool dropped) {
  if (dropped) dropped_.Increment();
  // An image dropped because its caller left is answered to nobody.
  if (!(dropped && status.code() == StatusCode::kCancelled)) failed_.Increment();
  VisionResult result;
  result.status = std::move(status);
  Deliver(job, std::move(result));
}

void VisionService::Deliver(const std::shared_ptr<Job>& job, VisionResult&& result) {
  result.model = job->request.model;
  result.timings = job->timings;
  VisionCallback done = std::move(job->done);
  // The model's place given back before the answer goes, so that the client's next image finds it
  // free; the bytes and the pipeline's count after the callback, so that whoever waits for the
  // service to be idle (a draining server) finds the answer already handed on.
  ReleaseLoad(job->request.model->name, job->timings.received_ns, job->units);
  Ended(*job);
  if (done) done(std::move(result));
  job->request.owner.reset();
  ReleaseHeld(job->charged_bytes);
}

}  // namespace quern
