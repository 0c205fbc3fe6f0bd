// Vision routes on the HTTP server: the CodeProject.AI / DeepStack detection
// API that Blue Iris, Agent DVR and Home Assistant call, and /predict for
// classification.
//
//   POST /v1/vision/detection        multipart: image (file), min_confidence (0-1, default 0.4), api_key
//   POST /v1/vision/custom/{model}   the same for any detection model
//   POST /v1/vision/custom/list      {success, models: [...]}
//   GET  /v1/status/ping             {success: true}
//   POST /predict/{model}            JSON {"image": "<base64>"} → top-5 classes
//
// CodeProject.AI routes answer errors as HTTP 200 with success:false and a
// clear `error` (what its clients expect); /predict answers with HTTP error
// codes and {"error": ...}. Answered images carry a Server-Timing header
// with their decode, resize, queue, infer and post durations (ms).
//
// Work: the I/O thread only parses the form and admits the request; decoding,
// pre-processing and post-processing run on the handler's stage threads,
// inference in the engine's batcher. Admission is bounded ("the glass of
// water"): at most `queue_capacity` images in the handler at once, by default
// request_timeout / measured time per image; over it a request is refused at
// once. A request whose client has gone or whose timeout has passed is
// dropped before decoding and before inference.
//
// Thread safety: Handle may be called from any number of threads. The
// destructor waits for requests in the handler to finish.
#pragma once

#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "frontends/http/http_types.h"
#include "pipeline/vision_model.h"
#include "quern/engine.h"

namespace quern {

struct VisionOptions {
  // Label files are read from <model_repository>/<model>/<label_filename>.
  std::filesystem::path model_repository;
  // The model behind /v1/vision/detection; "" = the first detection model
  // (by name) in the repository.
  std::string detection_model;
  // When set, CodeProject.AI requests must carry it in the api_key field.
  std::string api_key;
  // When set, every vision request must present a key this accepts (its
  // error is the answer): from "Authorization: Bearer <key>", "X-API-Key",
  // the api_key query parameter or, on CodeProject.AI routes, the api_key
  // form field. Replaces `api_key`.
  std::function<Status(std::string_view key)> authorize;
  // Decode / pre-process / post-process threads; 0 = one per core.
  int stage_threads = 0;
  // A request not answered within this is dropped (before decoding or
  // before inference) and answered with an error.
  int64_t request_timeout_ms = 15000;
  // Images admitted at once; 0 = the smaller of request_timeout_ms and
  // max_queue_wait_ms over the measured ms per image (at least the number
  // of stage threads).
  int queue_capacity = 0;
  // The engine's bound on queueing (EngineOptions::max_queue_wait_ms): the
  // pipeline admits no more images than it can finish within it, so that
  // images are not decoded only to be refused by their model's queue.
  // 0 = none.
  int64_t max_queue_wait_ms = 0;
  // Larger images are refused before decoding.
  int64_t max_image_pixels = 50'000'000;
  // Memory admitted images may hold at once: each is charged its request
  // body and its model input tensor (a 640x640 FP32 input is 4.9 MB); an
  // image that would pass this is refused as the capacity is. 0 = no bound.
  int64_t max_in_flight_bytes = int64_t{1} << 30;
};

// Counters for the metrics endpoint; cumulative.
struct VisionStats {
  uint64_t requests = 0;           // images admitted
  uint64_t rejected_overload = 0;  // refused at admission (capacity reached)
  uint64_t dropped = 0;            // client gone or timeout passed before inference
  uint64_t failed = 0;             // bad input or model errors
  int64_t in_flight = 0;
  int64_t capacity = 0;
  int64_t in_flight_bytes = 0;  // what admitted images hold (see max_in_flight_bytes)
  double ms_per_image = 0;      // the measure behind the derived capacity
  // Where answered images spent their time, summed over `timed_images`
  // (images that went through every stage): decoding, resizing and
  // normalising, waiting in the model's queue, running in a batch, and
  // post-processing (decoders, NMS, top-k, JSON).
  uint64_t timed_images = 0;
  uint64_t decode_ns = 0, resize_ns = 0, queue_ns = 0, infer_ns = 0, post_ns = 0;
};

// Prometheus text for the vision counters (quern_vision_*).
std::string RenderVisionPrometheus(const VisionStats& stats);

class VisionHandler {
 public:
  // `engine` must outlive the handler.
  VisionHandler(Engine* engine, VisionOptions options);
  ~VisionHandler();
  VisionHandler(const VisionHandler&) = delete;
  VisionHandler& operator=(const VisionHandler&) = delete;

  // True for the paths this handler serves (/v1/..., /predict/...).
  static bool Handles(std::string_view target);

  void Handle(HttpRequest&& request, HttpDone done);

  // Given a request's line and headers alone: the refusal an image request
  // would get because the pipeline is full (by count or by memory), or
  // nothing. Not used when keys are checked here (a CodeProject.AI form may
  // carry its key in a field): such requests are refused after the check.
  std::optional<HttpResponse> CheckHead(const HttpRequest& head);

  VisionStats stats() const;

 private:
  struct Job;
  Result<std::shared_ptr<const VisionModel>> Model(const std::string& name);
  std::string DefaultDetectionModel();
  std::vector<std::string> DetectionModels();  // ready detection models, by name
  void WriteCpaiMeta(rapidjson::Writer<rapidjson::StringBuffer>& w, const Job& job) const;
  void Admit(std::shared_ptr<Job> job);
  // Status::Ok when an image charged `bytes` fits beside `in_flight` images
  // holding `held` bytes, under `capacity`; else the refusal.
  Status Busy(int64_t in_flight, int64_t capacity, int64_t held, int64_t bytes) const;
  // The time admitted images may take: the request timeout, or the
  // engine's queueing bound when smaller.
  int64_t QueueBudgetMs() const;
  HttpResponse Refusal(const Job& job, const Status& status) const;
  HttpResponse CpaiError(const Job& job, const Status& status) const;
  void Process(const std::shared_ptr<Job>& job);
  void Finish(const std::shared_ptr<Job>& job, InferResponse&& response);
  void Fail(const std::shared_ptr<Job>& job, const Status& status);
  void Respond(const std::shared_ptr<Job>& job, HttpResponse response);
  int64_t Capacity() const;
  void Post(std::function<void()> task, bool urgent);
  void StageLoop();

  Engine* engine_;
  VisionOptions options_;
  std::string hostname_;

  std::mutex models_mu_;
  std::map<std::string, std::shared_ptr<const VisionModel>> models_;
  std::string last_default_model_;  // DefaultDetectionModel's last answer; guarded by models_mu_

  // The stage pool: urgent tasks (post-processing) go first.
  std::mutex pool_mu_;
  std::condition_variable pool_cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;

  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> in_flight_bytes_{0};
  std::atomic<uint64_t> requests_{0}, rejected_{0}, dropped_{0}, failed_{0};
  std::atomic<uint64_t> timed_images_{0}, decode_ns_{0}, resize_ns_{0}, queue_ns_{0}, infer_ns_{0}, post_ns_{0};
  std::atomic<int64_t> last_completion_ns_{0};
  std::atomic<double> ms_per_image_{20.0};  // EWMA of busy time per image
  mutable std::atomic<int64_t> last_overload_log_ns_{0};
  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
};

}  // namespace quern
