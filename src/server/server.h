// A serving process's wiring: the engine, the vision service, the job store,
// the front ends (KServe HTTP and gRPC, the vision routes, jobs, the stream
// consumer, /metrics) and the order in which they start and stop.
//
//   auto server = Server::Start(options);   // loads, listens, prints where
//   ... until SIGTERM ...
//   server->Shutdown();                      // drains, then stops in order
//
// Shutdown order: readiness turns false and new requests are refused; the
// repository is no longer polled and the consumer takes no more stream jobs;
// requests already taken (queued, running, being decoded) finish for up to
// the drain timeout; responses still being written go out; then the
// listeners stop, the engine drains its queues, and the stores flush.
//
// Thread safety: Shutdown may be called from any one thread.
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include "auth/api_keys.h"
#include "frontends/grpc/grpc_server.h"
#include "frontends/http/http_server.h"
#include "frontends/jobs/stream_consumer.h"
#include "frontends/vision/vision_handler.h"
#include "pipeline/vision_service.h"
#include "quern/status.h"
#include "store/redis_store.h"
#include "store/result_store.h"

namespace quern {

// Every setting of `quern serve` (see serve_flags.h for their flags).
struct ServerOptions {
  std::string model_repository;
  // The log (core/log.h): "debug", "info", "warning" or "error"; "text" or "json".
  std::string log_level = "info";
  std::string log_format = "text";
  // One line per HTTP request (method, path, status, sizes, time, model):
  // "" = none, "-" = stdout, else a file appended to.
  std::string access_log;
  double repository_poll_secs = 0;
  bool allow_links_outside_repository = false;
  // "none" (or "poll"): the repository is loaded at start and changed only
  // by polling; "explicit": models load and unload over the API as well.
  std::string model_control = "none";
  int64_t max_queue_wait_ms = 5000;
  int64_t memory_budget_mb = 0;  // EngineOptions::memory_budget_mb
  double drain_timeout_s = 30;

  HttpServerOptions http;
  GrpcServerOptions grpc;
  HttpServerOptions metrics = [] {
    HttpServerOptions o;
    o.port = 8002;
    return o;
  }();
  bool metrics_need_key = false;
  ApiKeyOptions keys;

  VisionOptions vision;
  VisionServiceOptions vision_service;
  int vision_port = -1;  // -1 = off
  int64_t vision_max_memory_mb = (int64_t{1} << 30) >> 20;
  // Where what the server keeps lives: registered faces in faces.bin (in
  // Redis instead when redis_url is set). "" = in memory only (lost when the
  // server stops).
  std::string data_dir;
  // Where backend "auto" keeps its choices; "" = <data_dir>/runtimes when
  // data_dir is set, else none.
  std::string runtime_cache_dir;
  // False: backend "auto" opens ONNX Runtime unmeasured (`quern models`).
  bool measure_runtimes = true;

  MemoryResultStoreOptions store;
  std::string redis_url;  // "" = results in memory
  RedisOptions redis;
  // Take jobs from the Redis streams: with --consume, or with a Redis URL
  // unless no_consume (HTTP jobs then go to the streams: someone must run
  // them).
  bool consume = false;
  bool no_consume = false;
  StreamConsumerOptions consumer;
};

// The engine as `quern serve` opens it: vision pipelines are checked while
// their models load. With load_all_models false it loads none of the
// repository's models (Engine::LoadModel loads them one by one).
Result<std::unique_ptr<Engine>> OpenEngine(const ServerOptions& options, bool load_all_models = true);

// Each model with its state, tensors and load error (stdout); a vision model
// also with its image pipeline and labels, read from `repository`.
void PrintModels(const Engine& engine, const std::filesystem::path& repository);

class Server {
 public:
  // Loads the repository and starts every listener; prints the models and
  // where it listens. INVALID_ARGUMENT for settings that do not fit
  // together (keys files, Redis URL, --consume without --redis-url); other
  // codes when a listener or the consumer cannot start.
  static Result<std::unique_ptr<Server>> Start(ServerOptions options);
  ~Server();  // Shutdown()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Drains, then stops everything in order (see the top of this file).
  // Idempotent.
  void Shutdown();

 private:
  struct Parts;
  explicit Server(std::unique_ptr<Parts> parts);
  std::unique_ptr<Parts> parts_;
};

}  // namespace quern
