// The vision service: one image through its model's pipeline — decode,
// pre-process, infer (in the model's batcher), post-process — with bounded
// admission, beside the engine and apart from any transport. The HTTP vision
// routes (CodeProject.AI, /predict) call it; gRPC, jobs or Python can too.
//
// Admission ("the glass of water") is synchronous and per model: Submit
// refuses at once (returning the refusal) when the model's queue is full,
// when as many of the model's images are in the service as it can finish
// within its time budget (the request timeout, or the engine's
// queue-waiting bound when smaller, over the model's own measured time per
// image: a cheap classification is not refused behind slow detections), or
// when admitted images hold more memory than allowed. An admitted image always gets exactly one result; one whose
// caller has gone (its cancellation token) or whose timeout has passed is
// dropped before decoding and before inference.
//
// Work: decoding, pre-processing and post-processing run on stage tasks
// (the service's own threads, or an executor the caller gives); inference
// runs in the engine. Time comes from the injected Clock.
//
// Thread safety: every method may be called from any thread. The destructor
// waits (up to 30 s) for admitted images to finish.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "core/mutex.h"
#include "metrics/registry.h"
#include "pipeline/vision_model.h"
#include "quern/clock.h"
#include "quern/engine.h"

namespace quern {

struct VisionServiceOptions {
  // Label files are read from <model_repository>/<model>/<label_filename>.
  std::filesystem::path model_repository;
  // Decode / pre-process / post-process threads; 0 = one per core.
  int stage_threads = 0;
  // Runs stage tasks instead of the service's own threads when set (tests,
  // embedders with their own pool). Urgent tasks (post-processing, which
  // frees an image's memory) should run before the others.
  std::function<void(std::function<void()> task, bool urgent)> executor;
  // An image not answered within this is dropped (before decoding or before
  // inference) and answered with DEADLINE_EXCEEDED.
  int64_t request_timeout_ms = 15000;
  // Images of one model admitted at once; 0 = the time budget over the
  // model's measured time per image (at least twice the stage threads).
  int queue_capacity = 0;
  // The engine's bound on queueing (EngineOptions::max_queue_wait_ms): the
  // service admits no more images than it can finish within it, so that
  // images are not decoded only to be refused by their model's queue.
  // 0 = none.
  int64_t max_queue_wait_ms = 0;
  // Larger images are refused before decoding.
  int64_t max_image_pixels = 50'000'000;
  // Memory admitted images may hold at once: each is charged what its caller
  // holds for it and its model input tensor (a 640x640 FP32 input is 4.9
  // MB); an image that would pass this is refused. 0 = no bound.
  int64_t max_in_flight_bytes = int64_t{1} << 30;
  // Null = the real clock.
  const Clock* clock = nullptr;
  // Where the quern_vision_* metrics are kept (must outlive the service);
  // null = a registry of the service's own (stats() still reads it).
  MetricsRegistry* metrics = nullptr;
};

// One image for a vision model.
struct VisionRequest {
  std::shared_ptr<const VisionModel> model;  // from VisionService::Model
  std::string_view image;                    // encoded: JPEG, PNG, BMP or WebP
  // Keeps `image` alive until the result is delivered (may be null when the
  // caller guarantees it).
  std::shared_ptr<const void> owner;
  // Bytes the caller holds for this image (its request body, say), charged
  // against max_in_flight_bytes with the model input.
  int64_t held_bytes = 0;
  float min_confidence = 0.4f;  // detection
  std::shared_ptr<CancellationToken> cancel;
  // Detection models: describe the most confident `max_described` boxes
  // found (faces) with this embedding model: each box made square, cut out
  // of the image decoded at full size, resized to the descriptor's input,
  // all of them in one request to its batcher. Null = no descriptions.
  std::shared_ptr<const VisionModel> descriptor;
  int max_described = 1;
};

// Where an image's time went (ns on the service's clock); the stage
// durations are set for images that reached them.
struct VisionTimings {
  int64_t received_ns = 0;     // Submit
  int64_t stage_start_ns = 0;  // a stage task took it; 0 = never
  int64_t decode_ns = 0, resize_ns = 0, queue_ns = 0, infer_ns = 0, post_ns = 0;
  // The CPU time the stage threads spent on it (their own clocks; the wall
  // times above also count waiting for a core).
  int64_t decode_cpu_ns = 0, resize_cpu_ns = 0, post_cpu_ns = 0;
};

struct LabelledDetection {
  Detection box;  // in the source image's pixels, clipped to it
  std::string label;
  std::vector<float> embedding;  // with a descriptor: unit length (L2); else empty
};

struct VisionResult {
  Status status;
  std::shared_ptr<const VisionModel> model;
  std::vector<LabelledDetection> detections;  // detection models, best first
  std::vector<Classification> classes;        // classification models, best first
  VisionTimings timings;
  bool timed = false;  // answered after every stage (its timings are complete)
};

using VisionCallback = std::function<void(VisionResult&&)>;

// An image for a model that takes it encoded and decodes it itself (input
// "image", BYTES [1]): the OCR ensemble, say.
struct EncodedImageRequest {
  std::string model;
  std::string_view image;             // encoded, sent as it is
  std::shared_ptr<const void> owner;  // keeps `image` alive until it is sent (may be null)
  int64_t held_bytes = 0;             // bytes the caller holds for it, as VisionRequest's
  std::shared_ptr<CancellationToken> cancel;
};
// The model's answer and the image's timings (received, stage start = sent,
// queue and infer from the engine).
using EncodedImageCallback = std::function<void(InferResponse&&, const VisionTimings&)>;

// The quern_vision_* metrics, read back; counters are cumulative.
struct VisionStats {
  uint64_t requests = 0;           // images admitted
  uint64_t rejected_overload = 0;  // refused at admission (capacity, memory or the model's queue)
  uint64_t dropped = 0;            // caller gone or timeout passed before inference
  uint64_t failed = 0;             // answered with an error (bad input, model errors, timeouts)
  int64_t in_flight = 0;
  int64_t capacity = 0;         // the models' capacities, summed (each model has its own)
  int64_t in_flight_bytes = 0;  // what admitted images hold (see max_in_flight_bytes)
  double ms_per_image = 0;      // measured time per image, every model together
  // Where answered images spent their time, summed over `timed_images`
  // (images that went through every stage): decoding, resizing and
  // normalising, waiting in the model's queue, running in a batch, and
  // post-processing (decoding outputs, NMS, top-k).
  uint64_t timed_images = 0;
  uint64_t decode_ns = 0, resize_ns = 0, queue_ns = 0, infer_ns = 0, post_ns = 0;
  // CPU time of the stages that run on the service's threads.
  uint64_t decode_cpu_ns = 0, resize_cpu_ns = 0, post_cpu_ns = 0;
};

class VisionService {
 public:
  // `engine` must outlive the service.
  VisionService(Engine* engine, VisionServiceOptions options);
  ~VisionService();
  VisionService(const VisionService&) = delete;
  VisionService& operator=(const VisionService&) = delete;

  // A ready vision model's pipeline (cached per version, and looked up
  // without asking the engine while its models are unchanged). NOT_FOUND,
  // UNAVAILABLE (not ready) or INVALID_ARGUMENT (no image pipeline, or one
  // that does not read).
  Result<std::shared_ptr<const VisionModel>> Model(const std::string& name);
  // Ready detection models, by name.
  std::vector<std::string> DetectionModels() { return Models(VisionTask::kDetection); }
  // Ready vision models of one task, by name.
  std::vector<std::string> Models(VisionTask task);

  // What Submit would answer now for an image of `bytes` for `model` ("" =
  // not known yet), from what is known before the image is read: the
  // refusal, counted as one, or OK.
  Status CheckAdmission(const std::string& model, int64_t bytes);

  // Admits the image or refuses it. Refused: the refusal is returned
  // (UNAVAILABLE), counted, and `done` is left with the caller, untouched.
  // Admitted: `done` is moved out and runs exactly once, on a stage task,
  // with the result (which may be an error: undecodable image, timeout,
  // caller gone, model failure).
  Status Submit(VisionRequest request, VisionCallback& done);

  // The same admission for an image its model decodes itself: the capacity,
  // the image's memory (its decoded size counted four times over: the
  // model's steps hold it decoded and as floats), the model's queue; the
  // same timeout (as the request's deadline) and cancellation. Nothing is
  // decoded here. Refused: the refusal is returned (UNAVAILABLE, counted;
  // or the engine's error: unknown model, bad input), and `done` is left
  // with the caller. Admitted: `done` is moved out and runs exactly once,
  // on an engine thread.
  Status SubmitEncoded(EncodedImageRequest request, EncodedImageCallback& done);

  // Counts a request that failed before it reached the service (a form
  // without an image, say), so that `failed` covers every failed request.
  void CountFailure() { failed_.Increment(); }

  VisionStats stats() const;
  const Clock& clock() const { return *clock_; }

 private:
  struct Job;
  // A model's images in the service and its measured time per image.
  struct ModelLoad {
    int64_t in_flight = 0;
    // The admitted images' work, in images of the model's usual size: an
    // image counts as its pixels over avg_pixels, from 1 to 4 (its decoding
    // and resizing grow with its pixels).
    double units = 0;
    double avg_pixels = 0;       // EWMA of the admitted images' pixels (0 = none yet)
    double ms_per_image = 20.0;  // EWMA of busy time per image
    int64_t last_completion_ns = 0;
    // Images begun (decoding, decoded, in the engine, post-processed) and
    // not yet answered, and those admitted that wait to begin: an image is
    // decoded only when it can soon reach an instance (DecodeAhead), so
    // that a burst waits as its small encoded files, not as model inputs.
    int64_t begun = 0;
    std::deque<std::shared_ptr<Job>> waiting;
  };
  // Whether `load` has no room for an image of `units` (one always fits).
  bool Full(const ModelLoad& load, double units) const;
  // Images of a model taking `ms_per_image` each admitted at once.
  int64_t Capacity(double ms_per_image) const;
  // The time admitted images may take: the request timeout, or the
  // engine's queueing bound when smaller.
  int64_t QueueBudgetMs() const;
  // OK when an image for `model` charged `bytes` fits beside the model's
  // `load` and the `held` bytes of every admitted image; else the refusal.
  Status Busy(const std::string& model, const ModelLoad& load, int64_t held, int64_t bytes, double units) const;
  Status Refused(Status status);
  // Claims a place and `bytes` for an image of `pixels` (0 = unknown) for
  // `model` (the model's queue asked first): OK with the work it counts as
  // in `units`, or the refusal (nothing claimed, not yet counted).
  Status Claim(const std::string& model, int64_t version, int64_t bytes, int64_t pixels, double& units);
  // Gives back an image's place in `model`'s load (admitted at
  // `received_ns`) once its answer is ready, before the answer is handed on
  // (a client that sends its next image as soon as it has the answer finds
  // the place free); measures the model's time per image.
  void ReleaseLoad(const std::string& model, int64_t received_ns, double units);
  // The most images of model `m` begun at once: those its instances can
  // take (one batch each, and one more for a wide instance) and one per
  // stage lane.
  int64_t DecodeAhead(const VisionModel& m) const;
  // Begins `job` (its decoding posted) when its model has room for it
  // (DecodeAhead) and no older image of it waits, else keeps it waiting for
  // an answered image's place.
  void Begin(const std::shared_ptr<Job>& job);
  // An answered image's place: the next waiting images of its model begin.
  void Ended(const Job& job);
  // Begins `model`'s waiting images while it has room, oldest first; those
  // at the front whose caller left or whose timeout passed are answered
  // instead (they hold no place). Called without load_mu_.
  void BeginWaiting(const std::string& model, int64_t ahead);
  // Gives back the image's bytes and its place in the pipeline, after its
  // answer was handed on (a draining server waits for these).
  void ReleaseHeld(int64_t charged_bytes);
  // Gives back a claim without an answer (nothing measured).
  void Unclaim(const std::string& model, int64_t bytes, double units);
  // The request timeout in nanoseconds (bounded: no overflow).
  int64_t TimeoutNs() const;
  void Post(std::function<void()> task, bool urgent);
  void StageLoop();
  void Process(const std::shared_ptr<Job>& job);
  void PostProcess(const std::shared_ptr<Job>& job, InferResponse&& response);
  // With a descriptor: the crops of the boxes found go to the descriptor
  // model; Described reads its answer into the detections.
  void Describe(const std::shared_ptr<Job>& job, VisionResult&& result);
  void Described(const std::shared_ptr<Job>& job, const std::shared_ptr<VisionResult>& result, InferResponse&& r);
  // The stage duration histograms of model `model`.
  struct StageHistograms {
    HistogramMetric *decode, *resize, *queue, *infer, *post;
  };
  StageHistograms HistogramsFor(const std::string& model);
  // Counts an answered image's stage times and delivers it.
  void Finish(const std::shared_ptr<Job>& job, VisionResult&& result);
  // Delivers the result and gives the job's admission back.
  void Deliver(const std::shared_ptr<Job>& job, VisionResult&& result);
  // An error result; `dropped`: the caller left or the timeout passed.
  void Fail(const std::shared_ptr<Job>& job, Status status, bool dropped);
  // A model's failure as the engine reports it (the model named), a missed
  // deadline tied to the request timeout that set it (`past_deadline`: the
  // request's deadline has passed; else the engine's words say "deadline").
  Status ModelFailed(const Status& st, bool past_deadline) const;
  // The same for an image's job: past its deadline now?
  Status ModelFailed(const Job& job, const Status& st) const;

  Engine* engine_;
  VisionServiceOptions options_;
  int lanes_ = 1;  // stage threads, or the cores an executor stands for: the capacity's floor is 2x
  int cores_ = 1;  // UsableCores() at construction (DecodeAhead)
  // Set once the destructor's wait for admitted images ends: waiting images
  // are answered UNAVAILABLE instead of begun.
  std::atomic<bool> closing_{false};
  const Clock* clock_;

  // Metric handles, in options_.metrics or own_metrics_.
  std::unique_ptr<MetricsRegistry> own_metrics_;
  MetricsRegistry& metrics_;
  Counter& requests_;
  Counter& rejected_;
  Counter& dropped_;
  Counter& failed_;
  Gauge& in_flight_;
  Gauge& in_flight_bytes_;
  Counter& timed_images_;
  Counter& decode_ns_;
  Counter& resize_ns_;
  Counter& queue_ns_;
  Counter& infer_ns_;
  Counter& post_ns_;
  Counter& decode_cpu_ns_;
  Counter& resize_cpu_ns_;
  Counter& post_cpu_ns_;

  // Each model's pipeline, and the models of each task, as the engine's
  // models were at `generation` (Engine::ModelsGeneration): a request finds
  // its model without copying a configuration while nothing changed.
  struct CachedModel {
    uint64_t generation = 0;
    std::shared_ptr<const VisionModel> model;
  };
  Mutex models_mu_;
  std::map<std::string, CachedModel> models_ QUERN_GUARDED_BY(models_mu_);
  std::map<int, std::pair<uint64_t, std::vector<std::string>>> model_lists_ QUERN_GUARDED_BY(models_mu_);
  // Per model, made at its first answered image; never removed (the
  // registry keeps every series), so references stay valid.
  Mutex histograms_mu_;
  std::map<std::string, StageHistograms> histograms_ QUERN_GUARDED_BY(histograms_mu_);

  // The stage pool (unless options_.executor): urgent tasks go first.
  Mutex pool_mu_;
  CondVar pool_cv_;
  std::deque<std::function<void()>> tasks_ QUERN_GUARDED_BY(pool_mu_);
  bool stopping_ QUERN_GUARDED_BY(pool_mu_) = false;
  std::vector<std::thread> threads_;

  // Admission, per model; a model's entry stays once made (models are few).
  mutable Mutex load_mu_;
  std::map<std::string, ModelLoad, std::less<>> loads_ QUERN_GUARDED_BY(load_mu_);
  std::atomic<int64_t> last_completion_ns_{0};
  std::atomic<double> ms_per_image_{20.0};  // EWMA of busy time per image, every model together
  // EWMA of decoding time per decoded byte, per ImageFormat (0 = none yet).
  std::array<std::atomic<double>, 4> decode_ns_per_byte_{};
  mutable std::atomic<int64_t> last_overload_log_ns_{0};
  Mutex idle_mu_;
  CondVar idle_cv_;
  // The capacity and ms_per_image gauges, read at scrape time; last, so
  // that it goes first.
  MetricsRegistry::Collection collection_;
};

}  // namespace quern
