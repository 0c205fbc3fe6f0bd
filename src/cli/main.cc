// quern: the command-line entry point.
//   quern serve  --model-repository DIR   load a repository and serve it
//   quern models DIR                      list models, their tensors and load errors
//   quern infer  DIR MODEL --input NAME=FILE.npy|zeros|random   run one request
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <random>
#include <thread>

#include "core/npy.h"
#include "frontends/grpc/grpc_server.h"
#include "frontends/http/http_server.h"
#include "frontends/http/kserve_handler.h"
#include "frontends/jobs/job_handler.h"
#include "frontends/jobs/stream_consumer.h"
#include "frontends/vision/vision_handler.h"
#include "metrics/prometheus.h"
#include "pipeline/vision_model.h"
#include "quern/engine.h"
#include "server/api_keys.h"
#include "store/redis_store.h"
#include "store/result_store.h"

namespace {

volatile std::sig_atomic_t g_stop = 0;
void OnSignal(int) {
  g_stop = 1;
}

std::string Dims(const quern::ModelConfig& c, const quern::TensorConfig& t) {
  quern::Shape s = t.dims;
  if (c.max_batch_size > 0) s.insert(s.begin(), -1);
  return quern::ShapeToString(s);
}

void PrintModels(const quern::Engine& engine) {
  for (const auto& m : engine.ListModels()) {
    std::printf("%s v%lld  %s", m.name.c_str(), static_cast<long long>(m.version),
                std::string(quern::ModelStateName(m.state)).c_str());
    if (!m.reason.empty()) std::printf("  error: %s", m.reason.c_str());
    std::printf("\n");
    if (m.state != quern::ModelState::kReady) continue;
    const auto& c = m.config;
    std::printf("    max_batch_size %d, instances %d, dynamic batching %s\n", c.max_batch_size, c.instance_count,
                c.batching ? "on" : "off");
    for (const auto& t : c.inputs) {
      std::printf("    input  %-20s %-6s %s\n", t.name.c_str(), std::string(quern::DataTypeName(t.dtype)).c_str(),
                  Dims(c, t).c_str());
    }
    for (const auto& t : c.outputs) {
      std::printf("    output %-20s %-6s %s\n", t.name.c_str(), std::string(quern::DataTypeName(t.dtype)).c_str(),
                  Dims(c, t).c_str());
    }
  }
}

quern::Result<std::unique_ptr<quern::Engine>> Open(const std::string& repo, double poll, bool allow_links = false,
                                                   int64_t max_queue_wait_ms = 0) {
  quern::EngineOptions o;
  o.model_repository = repo;
  o.max_queue_wait_ms = max_queue_wait_ms;
  o.allow_links_outside_repository = allow_links;
  o.repository_poll_interval_s = poll;
  // A vision model's parameters and label files are checked while it loads,
  // not at its first image.
  o.check_model = [](const quern::ModelStatus& status, const std::string& model_dir) {
    if (!quern::IsVisionModel(status.config)) return quern::Status::Ok();
    auto vision = quern::VisionModelFromStatus(status, model_dir);
    return vision ? quern::Status::Ok() : vision.error();
  };
  return quern::Engine::Create(o);
}

template <typename T>
void PrintValues(const quern::Tensor& t, size_t limit) {
  auto v = t.values<T>();
  for (size_t i = 0; i < v.size() && i < limit; ++i) std::cout << (i ? " " : "") << +v[i];
  if (v.size() > limit) std::cout << " ...";
}

quern::Result<quern::Tensor> MakeInput(const quern::ModelConfig& c, const quern::TensorConfig& tc,
                                       const std::string& spec) {
  if (spec != "zeros" && spec != "random") return quern::ReadNpy(spec);
  quern::Shape shape = tc.dims;
  if (c.max_batch_size > 0) shape.insert(shape.begin(), 1);
  if (quern::ElementCount(shape) < 0) {
    return quern::Err(quern::InvalidArgument("input '" + tc.name + "' has a variable shape " +
                                             quern::ShapeToString(shape) + "; give a .npy file"));
  }
  if (tc.dtype == quern::DataType::kBytes) {
    return quern::Tensor::FromStrings(shape, std::vector<std::string>(quern::ElementCount(shape)));
  }
  const size_t bytes = quern::ElementCount(shape) * quern::DataTypeByteSize(tc.dtype);
  quern::Tensor t = quern::Tensor::Allocate(tc.dtype, shape, bytes);
  if (spec == "random" && tc.dtype == quern::DataType::kFp32) {
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> d(-1.f, 1.f);
    auto* f = reinterpret_cast<float*>(t.mutable_data());
    for (size_t i = 0; i < bytes / 4; ++i) f[i] = d(rng);
  }
  return t;
}

int Infer(const std::string& repo, const std::string& model, const std::vector<std::string>& specs) {
  auto engine = Open(repo, 0);
  if (!engine) {
    std::fprintf(stderr, "quern: %s\n", engine.error().ToString().c_str());
    return 1;
  }
  auto status = (*engine)->GetModel(model);
  if (!status) {
    std::fprintf(stderr, "quern: %s\n", status.error().ToString().c_str());
    return 1;
  }
  if (status->state != quern::ModelState::kReady) {
    std::fprintf(stderr, "quern: model '%s' is not ready: %s\n", model.c_str(), status->reason.c_str());
    return 1;
  }
  quern::InferRequest req;
  req.model = model;
  for (const auto& s : specs) {
    auto eq = s.find('=');
    if (eq == std::string::npos) {
      std::fprintf(stderr, "quern: --input '%s' is not NAME=FILE.npy|zeros|random\n", s.c_str());
      return 2;
    }
    const std::string name = s.substr(0, eq);
    const quern::TensorConfig* tc = status->config.FindInput(name);
    if (!tc) {
      std::fprintf(stderr, "quern: model '%s' has no input '%s'\n", model.c_str(), name.c_str());
      return 2;
    }
    auto t = MakeInput(status->config, *tc, s.substr(eq + 1));
    if (!t) {
      std::fprintf(stderr, "quern: %s\n", t.error().ToString().c_str());
      return 2;
    }
    req.inputs.push_back({name, std::move(*t)});
  }
  quern::InferResponse r = (*engine)->Infer(std::move(req)).get();
  if (!r.status.ok()) {
    std::fprintf(stderr, "quern: %s\n", r.status.ToString().c_str());
    return 1;
  }
  for (const auto& o : r.outputs) {
    const quern::Tensor& t = o.tensor;
    std::cout << o.name << " " << quern::DataTypeName(t.dtype()) << " " << quern::ShapeToString(t.shape()) << ": ";
    switch (t.dtype()) {
      case quern::DataType::kFp32: PrintValues<float>(t, 16); break;
      case quern::DataType::kFp64: PrintValues<double>(t, 16); break;
      case quern::DataType::kInt64: PrintValues<int64_t>(t, 16); break;
      case quern::DataType::kInt32: PrintValues<int32_t>(t, 16); break;
      case quern::DataType::kUint8: PrintValues<uint8_t>(t, 16); break;
      case quern::DataType::kInt8: PrintValues<int8_t>(t, 16); break;
      default: std::cout << t.byte_size() << " bytes";
    }
    std::cout << "\n";
  }
  std::printf("request %llu: batch %lld, queue %.3f ms, compute %.3f ms, total %.3f ms\n",
              static_cast<unsigned long long>(r.request_id), static_cast<long long>(r.telemetry.batch_size),
              r.telemetry.queue_ns() / 1e6, r.telemetry.compute_ns() / 1e6, r.telemetry.total_ns() / 1e6);
  return 0;
}

int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Connections need file descriptors; the usual soft limit (1024) is far
// below the hard one.
void RaiseOpenFileLimit(int wanted) {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur >= static_cast<rlim_t>(wanted)) return;
  lim.rlim_cur = std::min(lim.rlim_max, static_cast<rlim_t>(wanted));
  setrlimit(RLIMIT_NOFILE, &lim);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"quern: a fast model server for ONNX models"};
  app.require_subcommand(1);

  std::string repo;
  double poll = 0;
  auto* serve = app.add_subcommand("serve", "Load a model repository and serve it");
  serve->add_option("--model-repository", repo, "Triton-style model repository")->required();
  serve->add_option("--repository-poll-secs", poll, "Reload changed models every N seconds (0 = off)");
  bool allow_links = false;
  serve->add_flag("--allow-links-outside-repository", allow_links,
                  "Let a model folder be a symbolic link to a folder outside the repository (its files must stay "
                  "inside that folder); by default every model file must lie inside the repository");
  quern::HttpServerOptions http_opts;
  serve->add_option("--http-port", http_opts.port, "KServe v2 HTTP port (0 = pick a free one and log it)");
  serve->add_option("--host", http_opts.host, "Address to listen on");
  serve->add_option("--http-threads", http_opts.io_threads, "HTTP I/O threads");
  serve->add_option("--http-max-body-bytes", http_opts.max_body_bytes, "Largest request body (larger: 413)");
  serve->add_option("--http-max-header-bytes", http_opts.max_header_bytes,
                    "Largest request line + headers (larger: 431)");
  serve->add_option("--http-max-connections", http_opts.max_connections, "Open HTTP connections (more: 503)");
  serve->add_option("--http-idle-timeout-secs", http_opts.idle_timeout_s,
                    "Close a keep-alive connection idle for this long");
  serve->add_option("--http-read-timeout-secs", http_opts.read_timeout_s,
                    "Close a connection whose request (or response) takes longer than this to transfer");
  quern::GrpcServerOptions grpc_opts;
  serve->add_option("--grpc-port", grpc_opts.port, "KServe v2 gRPC port (0 = pick a free one and log it; -1 = off)");
  serve->add_option("--grpc-max-message-bytes", grpc_opts.max_receive_bytes,
                    "Largest gRPC request or response message (larger: RESOURCE_EXHAUSTED)");
  serve
      ->add_option("--grpc-max-concurrent-streams", grpc_opts.max_concurrent_streams,
                   "Calls one gRPC connection may have open at once; more wait on the client (0 = no limit)")
      ->check(CLI::Range(0, 1 << 30));
  quern::VisionOptions vision_opts;
  quern::VisionServiceOptions vision_service_opts;
  int vision_port = -1;
  serve->add_option("--detection-model", vision_opts.detection_model,
                    "Model behind POST /v1/vision/detection (default: the first detection model)");
  serve->add_option("--vision-port", vision_port,
                    "Also serve the vision routes on this port, e.g. CodeProject.AI's 32168 (-1 = off)");
  serve->add_option("--vision-api-key", vision_opts.api_key, "Require this api_key on CodeProject.AI requests");
  serve->add_option("--vision-timeout-ms", vision_service_opts.request_timeout_ms,
                    "Vision requests not answered within this are dropped (and answered with an error)");
  serve->add_option("--vision-queue-capacity", vision_service_opts.queue_capacity,
                    "Images admitted at once (0 = timeout / measured time per image)");
  serve->add_option("--vision-threads", vision_service_opts.stage_threads,
                    "Decode / pre- / post-processing threads (0 = one per core)");
  serve->add_option("--vision-max-image-pixels", vision_service_opts.max_image_pixels,
                    "Larger images are refused before decoding");
  int64_t vision_max_memory_mb = vision_service_opts.max_in_flight_bytes >> 20;
  serve
      ->add_option("--vision-max-memory-mb", vision_max_memory_mb,
                   "Memory the images admitted at once may hold (bodies and model inputs); more are refused "
                   "(0 = no bound)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  quern::MemoryResultStoreOptions store_opts;
  serve->add_option("--job-result-ttl-secs", store_opts.ttl_s,
                    "Seconds a finished job's result is kept (0 = until evicted)");
  serve->add_option("--job-store-max-bytes", store_opts.max_bytes,
                    "Bytes of finished job results kept in memory; the oldest are evicted beyond it");
  std::string redis_url;
  quern::RedisOptions redis_opts;
  serve->add_option("--redis-url", redis_url,
                    "Keep job results in Redis: redis://[[user]:password@]host[:port][/db], rediss:// for TLS "
                    "(the password may instead come from QUERN_REDIS_PASSWORD)");
  serve->add_option("--redis-tls-ca-file", redis_opts.tls_ca_file,
                    "CA certificates for rediss:// (default: the system's)");
  serve->add_option("--redis-tls-cert-file", redis_opts.tls_cert_file, "Client certificate for rediss://");
  serve->add_option("--redis-tls-key-file", redis_opts.tls_key_file, "Client key for rediss://");
  serve->add_flag("--redis-tls-skip-verify", redis_opts.tls_skip_verify,
                  "Do not check the Redis server's certificate (testing only)");
  bool consume = false;
  quern::StreamConsumerOptions consume_opts;
  serve->add_flag("--consume", consume,
                  "Take jobs from the Redis streams quern:jobs:{model} (XREADGROUP, group quern); needs --redis-url");
  serve->add_option("--consume-models", consume_opts.models, "Models whose streams to take jobs from (default: all)")
      ->delimiter(',');
  serve->add_option("--consumer-name", consume_opts.consumer,
                    "This instance's name in the consumer group (default: host-pid)");
  serve->add_option("--consume-claim-idle-ms", consume_opts.claim_idle_ms,
                    "Take over jobs another consumer left unacknowledged this long (it died)");
  serve->add_option("--consume-max-deliveries", consume_opts.max_deliveries,
                    "Deliveries of a failing job before it moves to quern:dead:{model}");
  serve->add_option("--consume-max-inflight", consume_opts.max_inflight,
                    "Jobs taken from the streams and not yet finished (0 = 2 x batch size x instances)");
  quern::HttpServerOptions metrics_opts;
  metrics_opts.port = 8002;
  serve->add_option("--metrics-port", metrics_opts.port, "Prometheus metrics port, /metrics (0 = pick a free one)");

  std::string model_control = "none";
  serve
      ->add_option("--model-control", model_control,
                   "none: the repository is loaded at start and never changed over the API (poll with "
                   "--repository-poll-secs); explicit: load and unload over the API as well")
      ->check(CLI::IsMember({"none", "poll", "explicit"}));
  quern::ApiKeyOptions key_opts;
  serve->add_option("--api-keys", key_opts.keys_file,
                    "File of API keys (one per line): every HTTP route and gRPC call then needs one "
                    "(Authorization: Bearer <key>); also from QUERN_API_KEYS (comma-separated)");
  serve->add_option("--admin-keys", key_opts.admin_keys_file,
                    "File of admin keys: the only keys that may load and unload models (also every other route); "
                    "also from QUERN_ADMIN_KEYS");
  serve->add_option("--api-key-rate-limit", key_opts.rate_limit_per_s,
                    "Requests per second each key may make (more: 429 / RESOURCE_EXHAUSTED); 0 = no limit");
  int64_t max_queue_wait_ms = 5000;
  serve
      ->add_option("--max-queue-wait-ms", max_queue_wait_ms,
                   "Refuse a request (503 / UNAVAILABLE) when the work queued for its model would take longer "
                   "than this to run (per model: parameter quern.max_queue_wait_ms); 0 = no bound")
      ->check(CLI::Range(int64_t{0}, int64_t{3'600'000}));
  double drain_timeout_s = 30;
  serve->add_option("--drain-timeout-secs", drain_timeout_s,
                    "On SIGTERM/SIGINT: readiness turns false, new requests get 503 / UNAVAILABLE, and requests "
                    "already taken finish for up to this long before the server exits");
  bool metrics_need_key = false;
  serve->add_flag("--metrics-need-key", metrics_need_key, "With API keys, /metrics needs a key too");
  serve->add_option("--tls-cert-file", http_opts.tls_cert_file,
                    "TLS for HTTP (and the vision port) and gRPC: PEM certificate chain");
  serve->add_option("--tls-key-file", http_opts.tls_key_file, "TLS: PEM private key");
  serve->add_option("--tls-client-ca-file", http_opts.tls_client_ca_file,
                    "TLS: require client certificates signed by these PEM CAs");
  serve->add_option("--grpc-tls-cert-file", grpc_opts.tls_cert_file,
                    "gRPC only: PEM certificate chain (default: --tls-cert-file)");
  serve->add_option("--grpc-tls-key-file", grpc_opts.tls_key_file,
                    "gRPC only: PEM private key (default: --tls-key-file)");
  serve->add_option("--grpc-tls-client-ca-file", grpc_opts.tls_client_ca_file,
                    "gRPC only: client certificate CAs (default: --tls-client-ca-file)");

  std::string models_repo;
  auto* models = app.add_subcommand("models", "List a repository's models, their tensors and load errors");
  models->add_option("repository", models_repo, "Model repository")->required();

  std::string infer_repo, infer_model;
  std::vector<std::string> inputs;
  auto* infer = app.add_subcommand("infer", "Run one request and print the outputs");
  infer->add_option("repository", infer_repo, "Model repository")->required();
  infer->add_option("model", infer_model, "Model name")->required();
  infer->add_option("--input,-i", inputs, "NAME=FILE.npy, NAME=zeros or NAME=random (batch of 1)");

  CLI11_PARSE(app, argc, argv);

  if (*models) {
    auto engine = Open(models_repo, 0);
    if (!engine) {
      std::fprintf(stderr, "quern: %s\n", engine.error().ToString().c_str());
      return 1;
    }
    PrintModels(**engine);
    for (const auto& m : (*engine)->ListModels()) {
      if (m.state != quern::ModelState::kReady) return 3;
    }
    return 0;
  }
  if (*infer) return Infer(infer_repo, infer_model, inputs);

  auto engine = Open(repo, poll, allow_links, max_queue_wait_ms);
  if (!engine) {
    std::fprintf(stderr, "quern: %s\n", engine.error().ToString().c_str());
    return 1;
  }
  PrintModels(**engine);
  RaiseOpenFileLimit(http_opts.max_connections + 64);
  if (const char* k = std::getenv("QUERN_API_KEYS")) key_opts.keys_env = k;
  if (const char* k = std::getenv("QUERN_ADMIN_KEYS")) key_opts.admin_keys_env = k;
  auto api_keys = quern::ApiKeys::Load(key_opts);
  if (!api_keys) {
    std::fprintf(stderr, "quern: %s\n", api_keys.error().message().c_str());
    return 2;
  }
  quern::ApiKeys* keys = api_keys->get();
  const bool explicit_control = model_control == "explicit";
  // HTTP: the key a request presents, checked before any handler sees it
  // (the vision routes check it themselves: CodeProject.AI clients send it
  // as a form field and expect errors as 200 with success false).
  auto http_denied = [keys](const quern::HttpRequest& r) -> std::optional<quern::HttpResponse> {
    if (!keys->enabled()) return std::nullopt;
    const auto parts = quern::SplitTargetPath(r.target);
    const bool admin = parts.size() == 5 && parts[0] == "v2" && parts[1] == "repository" && parts[2] == "models" &&
                       (parts[4] == "load" || parts[4] == "unload");
    quern::Status st =
        keys->Authorize(quern::PresentedKey(r.Header("authorization"), r.Header("x-api-key")), admin, SteadyNowNs());
    if (st.ok()) return std::nullopt;
    quern::HttpResponse resp = quern::ErrorResponse(st);
    resp.status = quern::AuthHttpStatus(st);
    if (resp.status == 401) resp.headers.emplace_back("WWW-Authenticate", "Bearer");
    return resp;
  };
  // Set on SIGTERM/SIGINT: the server answers what it has taken and refuses the rest.
  std::atomic<bool> draining{false};
  auto http_draining = [&draining](const quern::HttpRequest& r) -> std::optional<quern::HttpResponse> {
    if (!draining.load(std::memory_order_acquire)) return std::nullopt;
    const auto parts = quern::SplitTargetPath(r.target);
    if (parts.size() == 3 && parts[0] == "v2" && parts[1] == "health") return std::nullopt;  // answered below
    return quern::ErrorResponse(quern::Unavailable("the server is shutting down"));
  };
  quern::KServeHandler handler(engine->get());
  handler.set_model_control(explicit_control);
  vision_service_opts.model_repository = repo;
  vision_service_opts.max_in_flight_bytes = vision_max_memory_mb << 20;
  vision_service_opts.max_queue_wait_ms = max_queue_wait_ms;
  quern::VisionService vision_service(engine->get(), vision_service_opts);
  if (keys->enabled()) {
    vision_opts.authorize = [keys](std::string_view key) { return keys->Authorize(key, false, SteadyNowNs()); };
  }
  quern::VisionHandler vision(&vision_service, vision_opts);
  std::unique_ptr<quern::ResultStore> store;
  quern::RedisResultStore* redis_store = nullptr;
  if (!redis_url.empty()) {
    quern::RedisResultStoreOptions o;
    o.redis = redis_opts;
    if (auto s = quern::ParseRedisUrl(redis_url, o.redis); !s.ok()) {
      std::fprintf(stderr, "quern: %s\n", s.message().c_str());
      return 2;
    }
    if (const char* pw = std::getenv("QUERN_REDIS_PASSWORD"); pw != nullptr && o.redis.password.empty()) {
      o.redis.password = pw;
    }
    o.ttl_s = store_opts.ttl_s;
    o.max_backlog_bytes = store_opts.max_bytes;
    auto rs = std::make_unique<quern::RedisResultStore>(o);
    redis_store = rs.get();
    store = std::move(rs);
    handler.set_ready_check([redis_store, &draining] {
      if (draining.load(std::memory_order_acquire)) return quern::Unavailable("the server is shutting down");
      return redis_store->Health();
    });
  } else {
    store = std::make_unique<quern::MemoryResultStore>(store_opts);
  }
  if (!redis_store) {
    handler.set_ready_check([&draining] {
      return draining.load(std::memory_order_acquire) ? quern::Unavailable("the server is shutting down")
                                                      : quern::Status::Ok();
    });
  }
  quern::JobHandler jobs(engine->get(), store.get());
  std::unique_ptr<quern::StreamConsumer> consumer;
  if (consume && redis_store == nullptr) {
    std::fprintf(stderr, "quern: --consume takes jobs from Redis streams: give --redis-url too\n");
    return 2;
  }
  // Decided from a request's line and headers, before its body is read:
  // draining, keys (the vision routes check theirs themselves), and
  // inference requests whose model's queue is full.
  auto http_head = [&](const quern::HttpRequest& r) -> std::optional<quern::HttpResponse> {
    if (auto refused = http_draining(r)) return refused;
    if (quern::VisionHandler::Handles(r.target)) return vision.CheckHead(r);
    if (auto denied = http_denied(r)) return denied;
    return handler.CheckHead(r);
  };
  auto server = quern::HttpServer::Start(
      http_opts,
      [&](quern::HttpRequest&& r, quern::HttpDone done) {
        // Draining may have begun while the body arrived.
        if (auto refused = http_draining(r)) return done(std::move(*refused));
        if (quern::VisionHandler::Handles(r.target)) return vision.Handle(std::move(r), std::move(done));
        if (quern::JobHandler::Handles(r.target)) return jobs.Handle(std::move(r), std::move(done));
        handler.Handle(std::move(r), std::move(done));
      },
      http_head);
  if (!server) {
    std::fprintf(stderr, "quern: %s\n", server.error().ToString().c_str());
    return 1;
  }
  std::unique_ptr<quern::GrpcServer> grpc;
  if (grpc_opts.port >= 0) {
    grpc_opts.host = http_opts.host;
    grpc_opts.max_send_bytes = grpc_opts.max_receive_bytes;
    if (grpc_opts.tls_cert_file.empty() && grpc_opts.tls_key_file.empty()) {
      grpc_opts.tls_cert_file = http_opts.tls_cert_file;
      grpc_opts.tls_key_file = http_opts.tls_key_file;
      if (grpc_opts.tls_client_ca_file.empty()) grpc_opts.tls_client_ca_file = http_opts.tls_client_ca_file;
    }
    grpc_opts.model_control = explicit_control;
    grpc_opts.draining = &draining;
    if (keys->enabled()) {
      grpc_opts.authorize = [keys](std::string_view key, bool admin) {
        return keys->Authorize(key, admin, SteadyNowNs());
      };
    }
    auto started = quern::GrpcServer::Start(grpc_opts, engine->get());
    if (!started) {
      std::fprintf(stderr, "quern: gRPC: %s\n", started.error().ToString().c_str());
      return 1;
    }
    grpc = std::move(*started);
  }
  quern::Result<std::unique_ptr<quern::HttpServer>> vision_server = std::unique_ptr<quern::HttpServer>();
  if (vision_port >= 0) {
    quern::HttpServerOptions o = http_opts;
    o.port = vision_port;
    vision_server = quern::HttpServer::Start(
        o,
        [&](quern::HttpRequest&& r, quern::HttpDone done) {
          if (auto refused = http_draining(r)) return done(std::move(*refused));
          if (quern::VisionHandler::Handles(r.target)) return vision.Handle(std::move(r), std::move(done));
          quern::HttpResponse resp;
          resp.status = 404;
          resp.body =
              "{\"success\":false,\"error\":\"this port serves the vision routes (/v1/vision/..., /predict/...)\"}";
          done(std::move(resp));
        },
        [&](const quern::HttpRequest& r) -> std::optional<quern::HttpResponse> {
          if (auto refused = http_draining(r)) return refused;
          if (quern::VisionHandler::Handles(r.target)) return vision.CheckHead(r);
          return std::nullopt;
        });
    if (!vision_server) {
      std::fprintf(stderr, "quern: vision: %s\n", vision_server.error().ToString().c_str());
      return 1;
    }
  }
  metrics_opts.host = http_opts.host;
  const quern::Engine* engine_ptr = engine->get();
  auto metrics = quern::HttpServer::Start(
      metrics_opts, [engine_ptr, &vision_service, &jobs, redis_store, &consumer, metrics_need_key, &http_denied](
                        quern::HttpRequest&& r, quern::HttpDone done) {
        if (metrics_need_key) {
          if (auto denied = http_denied(r)) return done(std::move(*denied));
        }
        quern::HttpResponse resp;
        if (r.method != "GET" || r.target.rfind("/metrics", 0) != 0) {
          resp.status = 404;
          resp.body = "{\"error\":\"metrics are served at GET /metrics\"}";
          return done(std::move(resp));
        }
        resp.content_type = "text/plain; version=0.0.4";
        resp.body = quern::RenderPrometheus(*engine_ptr) + quern::RenderVisionPrometheus(vision_service.stats()) +
                    quern::RenderJobPrometheus(jobs.stats());
        if (redis_store) resp.body += quern::RenderRedisStorePrometheus(redis_store->stats());
        if (consumer) resp.body += quern::RenderStreamPrometheus(consumer->stats());
        done(std::move(resp));
      });
  if (!metrics) {
    std::fprintf(stderr, "quern: metrics: %s\n", metrics.error().ToString().c_str());
    return 1;
  }
  // Last: an early return above must not leave jobs in the engine that
  // complete into a consumer already destroyed.
  if (consume) {
    consume_opts.redis = redis_store->options().redis;
    auto started = quern::StreamConsumer::Start(consume_opts, engine->get(), redis_store);
    if (!started) {
      std::fprintf(stderr, "quern: %s\n", started.error().ToString().c_str());
      return 2;
    }
    consumer = std::move(*started);
  }
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  std::printf("quern: HTTP listening on %s:%d\n", http_opts.host.c_str(), (*server)->port());
  if (grpc) std::printf("quern: gRPC listening on %s:%d\n", grpc_opts.host.c_str(), grpc->port());
  if (*vision_server)
    std::printf("quern: vision listening on %s:%d\n", http_opts.host.c_str(), (*vision_server)->port());
  std::printf("quern: metrics listening on %s:%d\n", metrics_opts.host.c_str(), (*metrics)->port());
  if (consumer) {
    std::printf("quern: taking jobs from redis at %s as consumer %s\n", redis_store->options().redis.Address().c_str(),
                consumer->consumer_name().c_str());
  }
  std::printf("quern: serving %s (Ctrl-C to stop)\n", repo.c_str());
  std::fflush(stdout);
  while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  // Drain: not ready any more, new requests refused, requests already taken
  // (queued, running, or being decoded for the vision routes) answered.
  std::printf("quern: draining (up to %.0f s)\n", drain_timeout_s);
  std::fflush(stdout);
  draining.store(true, std::memory_order_release);
  (*engine)->StopRepositoryPolling();  // the models in service stay as they are
  if (consumer) consumer->Stop();      // takes no more stream jobs; those taken finish below
  const auto drain_deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(std::max(0.0, drain_timeout_s));
  while (((*engine)->InFlight() > 0 || vision_service.stats().in_flight > 0) &&
         std::chrono::steady_clock::now() < drain_deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const int64_t left = (*engine)->InFlight() + vision_service.stats().in_flight;
  if (left > 0) std::printf("quern: drain timeout: %lld requests still in flight\n", static_cast<long long>(left));
  // Answers the I/O threads still write (large ones, every one over TLS).
  auto writing = [&] {
    return (*server)->pending_writes() + (*vision_server ? (*vision_server)->pending_writes() : 0);
  };
  while (writing() > 0 && std::chrono::steady_clock::now() < drain_deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::printf("quern: stopping\n");
  (*metrics)->Stop();
  (*server)->Stop();  // no new requests reach the engine
  if (*vision_server) (*vision_server)->Stop();
  if (grpc) grpc->Stop();
  engine->reset();  // drains the queues; late responses are dropped with their connections
  server->reset();
  return 0;
}
