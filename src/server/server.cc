#include "server/server.h"

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>

#include "core/log.h"
#include "core/mutex.h"
#include "frontends/http/kserve_handler.h"
#include "frontends/jobs/job_handler.h"
#include "metrics/collectors.h"
#include "metrics/registry.h"
#include "pipeline/answer_agreement.h"
#include "pipeline/vision_model.h"
#include "server/dashboard.h"
#include "server/routes.h"
#include "server/systemd_notify.h"
#include "store/redis_face_store.h"

namespace quern {
namespace {

std::string Dims(const ModelConfig& c, const TensorConfig& t) {
  Shape s = t.dims;
  if (c.max_batch_size > 0) s.insert(s.begin(), -1);
  return ShapeToString(s);
}

// Connections need file descriptors; the usual soft limit (1024) is far
// below the hard one.
void RaiseOpenFileLimit(int wanted) {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur >= static_cast<rlim_t>(wanted)) return;
  lim.rlim_cur = std::min(lim.rlim_max, static_cast<rlim_t>(wanted));
  setrlimit(RLIMIT_NOFILE, &lim);
}

// "vision detection, 416x416 BGR stretch; 80 labels: person, bicycle, ..."
void PrintVisionModel(const ModelStatus& status, const std::filesystem::path& model_dir) {
  auto vision = VisionModelFromStatus(status, model_dir);
  if (!vision) return;  // checked while the model loaded; it changed on disk since
  const ImageSpec& im = vision->image;
  static constexpr std::string_view kResize[] = {"stretch", "letterbox", "center crop"};
  static constexpr std::string_view kTask[] = {"classification", "detection", "embedding"};
  std::printf("    vision %s, %dx%d %s %s", kTask[static_cast<size_t>(vision->task)].data(), im.width, im.height,
              im.channels == ChannelOrder::kRgb ? "RGB" : "BGR", kResize[static_cast<size_t>(im.resize)].data());
  if (!vision->labels.empty()) {
    std::printf("; %zu labels:", vision->labels.size());
    constexpr size_t kShown = 8;
    for (size_t i = 0; i < vision->labels.size() && i < kShown; ++i) {
      std::printf("%s %s", i ? "," : "", vision->labels[i].c_str());
    }
    if (vision->labels.size() > kShown) std::printf(", ...");
  }
  std::printf("\n");
}

}  // namespace

Result<std::unique_ptr<Engine>> OpenEngine(const ServerOptions& options, bool load_all_models) {
  EngineOptions o;
  o.model_repository = options.model_repository;
  o.load_all_models = load_all_models;
  o.max_queue_wait_ms = options.max_queue_wait_ms;
  o.memory_budget_mb = options.memory_budget_mb;
  o.allow_links_outside_repository = options.allow_links_outside_repository;
  o.repository_poll_interval_s = options.repository_poll_secs;
  o.runtime_cache_dir = options.runtime_cache_dir;
  o.measure_runtimes = options.measure_runtimes;
  if (o.runtime_cache_dir.empty() && !options.data_dir.empty()) {
    o.runtime_cache_dir = (std::filesystem::path(options.data_dir) / "runtimes").string();
  }
  // A vision model's parameters and label files are checked while it loads,
  // not at its first image.
  o.check_model = [](const ModelStatus& status, const std::string& model_dir) {
    if (!IsVisionModel(status.config)) return Status::Ok();
    auto vision = VisionModelFromStatus(status, model_dir);
    return vision ? Status::Ok() : vision.error();
  };
  // Backend "auto" compares a detector's boxes too, not only its numbers.
  o.compare_answers = CompareVisionAnswers;
  return Engine::Create(o);
}

void PrintModels(const Engine& engine, const std::filesystem::path& repository) {
  if (CurrentLogOptions().format == LogFormat::kJson) {
    // One event per model version.
    for (const auto& m : engine.ListModels()) {
      const std::string version = std::to_string(m.version);
      const std::string state(ModelStateName(m.state));
      LogTo(stdout, m.state == ModelState::kReady ? LogLevel::kInfo : LogLevel::kError, "model " + state,
            {{"model", m.name}, {"version", version}, {"state", state}, {"error", m.reason}});
    }
    return;
  }
  for (const auto& m : engine.ListModels()) {
    std::printf("%s v%lld  %s", m.name.c_str(), static_cast<long long>(m.version),
                std::string(ModelStateName(m.state)).c_str());
    if (!m.reason.empty()) std::printf("  error: %s", m.reason.c_str());
    std::printf("\n");
    if (m.state != ModelState::kReady) continue;
    const auto& c = m.config;
    std::printf("    max_batch_size %d, instances %d, dynamic batching %s\n", c.max_batch_size, c.instance_count,
                c.batching ? "on" : "off");
    for (const auto& t : c.inputs) {
      std::printf("    input  %-20s %-6s %s\n", t.name.c_str(), std::string(DataTypeName(t.dtype)).c_str(),
                  Dims(c, t).c_str());
    }
    for (const auto& t : c.outputs) {
      std::printf("    output %-20s %-6s %s\n", t.name.c_str(), std::string(DataTypeName(t.dtype)).c_str(),
                  Dims(c, t).c_str());
    }
    if (IsVisionModel(c)) PrintVisionModel(m, repository / m.name);
  }
}

// The access log (--access-log): one line per HTTP response, in the log's
// format, written whole.
class AccessLog {
 public:
  static Result<std::shared_ptr<AccessLog>> Open(const std::string& where) {
    if (where == "-") return std::shared_ptr<AccessLog>(new AccessLog(stdout, false));
    std::FILE* f = std::fopen(where.c_str(), "ae");
    if (!f) return Err(InvalidArgument("--access-log " + where + ": " + std::strerror(errno)));
    return std::shared_ptr<AccessLog>(new AccessLog(f, true));
  }
  ~AccessLog() {
    if (owned_) std::fclose(file_);
  }
  // `model`: the model the request's route names ("" for none).
  void Write(const HttpAccess& a, const std::string& model) {
    Write(a.client, a.method, a.target, std::to_string(a.status), std::to_string(a.request_bytes),
          std::to_string(a.response_bytes), a.duration_ns, model, a.request_id);
  }
  // A gRPC call: method "GRPC", the path its method's name, the status the
  // code's name; message sizes are not counted ("-").
  void Write(const GrpcAccess& a) {
    Write(a.client, "GRPC", a.method, std::string(a.status), "-", "-", a.duration_ns, std::string(a.model),
          a.request_id);
  }

 private:
  void Write(std::string_view client, std::string_view method, std::string_view path, const std::string& status,
             const std::string& in, const std::string& out, int64_t duration_ns, const std::string& model,
             std::string_view request_id) {
    char ms[32];
    std::snprintf(ms, sizeof ms, "%.3f", static_cast<double>(duration_ns) / 1e6);
    const LogFormat format = CurrentLogOptions().format;
    // A JSON line has its time already; a text line gets it as a field.
    const std::string time = format == LogFormat::kText ? LogTimestamp() : std::string();
    std::vector<LogField> fields;
    if (!time.empty()) fields.emplace_back("time", time);
    fields.insert(fields.end(), {{"client", client},
                                 {"method", method},
                                 {"path", path},
                                 {"status", status},
                                 {"bytes_in", in},
                                 {"bytes_out", out},
                                 {"ms", ms},
                                 {"model", model},
                                 {"request_id", request_id}});
    std::string line = FormatLogLine(format, LogLevel::kInfo, "access", fields);
    line += '\n';
    MutexLock lock(mu_);
    std::fwrite(line.data(), 1, line.size(), file_);
    std::fflush(file_);
  }

  AccessLog(std::FILE* file, bool owned) : file_(file), owned_(owned) {}
  std::FILE* file_;
  const bool owned_;
  Mutex mu_;
};

// Declared in the order they are made; Shutdown takes them down in the order
// the top of server.h gives.
struct Server::Parts {
  ServerOptions options;
  // Every component's metrics; first, so that it outlives them all.
  MetricsRegistry registry;
  std::unique_ptr<Engine> engine;
  MetricsRegistry::Collection engine_metrics, process_metrics;
  std::unique_ptr<ApiKeys> keys;
  // Set when draining begins: the server answers what it has taken and
  // refuses the rest.
  std::atomic<bool> draining{false};
  // Set once every port listens (Server::Start's end): until then readiness
  // (HTTP and gRPC) says not ready, so that a load balancer or probe that
  // finds one port ready never sends to another that is not listening yet.
  std::atomic<bool> all_listening{false};
  std::unique_ptr<KServeHandler> kserve;
  std::unique_ptr<VisionService> vision_service;
  std::unique_ptr<FaceGallery> faces;
  std::unique_ptr<VisionHandler> vision;
  std::unique_ptr<ResultStore> store;
  RedisResultStore* redis_store = nullptr;  // = store when results go to Redis
  // Jobs accepted into the streams, kept parsed for this instance's consumer.
  std::unique_ptr<LocalJobInputs> local_inputs;
  std::unique_ptr<JobHandler> jobs;
  std::shared_ptr<AccessLog> access_log;  // null: none
  DashboardSources dashboard;
  // Each port's routes: HTTP (KServe, jobs, vision, the dashboard), the
  // vision port (vision, the dashboard), metrics.
  std::unique_ptr<Router> router, vision_router, metrics_router;
  std::unique_ptr<HttpServer> http;
  std::unique_ptr<GrpcServer> grpc;
  std::unique_ptr<HttpServer> vision_http;
  std::unique_ptr<HttpServer> metrics;
  std::unique_ptr<StreamConsumer> consumer;
  std::atomic<const StreamConsumer*> consumer_taking{nullptr};  // = consumer, once it runs (read by the I/O threads)
  bool shut_down = false;

  int64_t NowNs() const { return engine->clock().NowNs(); }

  // Server::Start's steps, in order; each reads `options` and makes its parts.
  Status OpenVision(const RedisOptions& redis);  // the vision service, registered faces, the vision routes
  void OpenJobs(const RedisOptions& redis);      // the result store and the job handler
  Status StartGrpc(bool explicit_control);
  Status StartVisionPort();
  Status StartConsumer(bool consume_asked);  // the job streams
  void AnnounceServing() const;              // the start-up lines, and systemd

  // The routers' options: keys (when any is configured) and draining.
  RouterOptions Routing(bool drains) {
    RouterOptions r;
    if (keys->enabled()) {
      r.authorize = [this](std::string_view key, bool admin) { return keys->Authorize(key, admin, NowNs()); };
    }
    if (drains) r.draining = &draining;
    return r;
  }
  Status MakeRouters();
};

// Redis, when there is one (results, job streams, registered faces): the
// URL's settings, with passwords from the environment when the URL has none.
Result<RedisOptions> RedisSettings(const ServerOptions& o) {
  RedisOptions redis = o.redis;
  if (o.redis_url.empty()) return redis;
  if (Status s = ParseRedisUrl(o.redis_url, redis); !s.ok()) return Err(InvalidArgument(s.message()));
  if (const char* pw = std::getenv("QUERN_REDIS_PASSWORD"); pw != nullptr && redis.password.empty()) {
    redis.password = pw;
  }
  if (const char* pw = std::getenv("QUERN_REDIS_SENTINEL_PASSWORD");
      pw != nullptr && !redis.sentinels.empty() && redis.sentinel_password.empty()) {
    redis.sentinel_password = pw;
  }
  return redis;
}

Status Server::Parts::OpenVision(const RedisOptions& redis) {
  ServerOptions& o = options;
  o.vision_service.model_repository = o.model_repository;
  o.vision_service.max_in_flight_bytes = o.vision_max_memory_mb << 20;
  o.vision_service.max_queue_wait_ms = o.max_queue_wait_ms;
  o.vision_service.clock = &engine->clock();
  o.vision_service.metrics = &registry;
  vision_service = std::make_unique<VisionService>(engine.get(), o.vision_service);
  // Registered faces: in Redis when there is one (shared by the instances
  // that use it), else in the data directory, else in memory.
  std::unique_ptr<FaceGalleryStore> faces_store;
  if (!o.redis_url.empty()) {
    faces_store = std::make_unique<RedisFaceStore>(redis, "quern:faces", &engine->clock());
  } else if (!o.data_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(o.data_dir, ec);
    if (ec) return InvalidArgument("--data-dir " + o.data_dir + " cannot be made: " + ec.message());
    faces_store = FileFaceStore(std::filesystem::path(o.data_dir) / "faces.bin");
  }
  auto gallery = FaceGallery::Open({.clock = &engine->clock()}, std::move(faces_store));
  if (!gallery) return gallery.error();
  faces = std::move(*gallery);
  o.vision.faces = faces.get();
  vision = std::make_unique<VisionHandler>(vision_service.get(), o.vision);
  return Status::Ok();
}

void Server::Parts::OpenJobs(const RedisOptions& redis) {
  ServerOptions& o = options;
  Parts* parts = this;
  if (!o.redis_url.empty()) {
    RedisResultStoreOptions ro;
    ro.redis = redis;
    ro.ttl_s = o.store.ttl_s;
    ro.max_backlog_bytes = o.store.max_bytes;
    ro.clock = &engine->clock();
    ro.metrics = &registry;
    auto rs = std::make_unique<RedisResultStore>(ro);
    redis_store = rs.get();
    store = std::move(rs);
  } else {
    o.store.clock = &engine->clock();
    store = std::make_unique<MemoryResultStore>(o.store);
  }
  kserve->set_ready_check([parts] {
    if (parts->draining.load(std::memory_order_acquire)) return Unavailable("the server is shutting down");
    if (!parts->all_listening.load(std::memory_order_acquire)) return Unavailable("the server is starting");
    return parts->redis_store ? parts->redis_store->Health() : Status::Ok();
  });
  jobs = std::make_unique<JobHandler>(engine.get(), store.get(), &registry);
  if (redis_store) {
    // Durable jobs, through the streams: for the models this instance takes
    // jobs for (others run here, as without Redis), or all with --no-consume
    // (the instances that consume run them).
    jobs->set_stream_prefix(o.consumer.stream_prefix, [parts, all = o.no_consume](const std::string& model) {
      if (all) return true;
      const StreamConsumer* c = parts->consumer_taking.load(std::memory_order_acquire);
      return c != nullptr && c->Consumes(model);
    });
    if (o.consume) {
      LocalJobInputsOptions lo;
      lo.clock = &engine->clock();
      local_inputs = std::make_unique<LocalJobInputs>(lo);
      jobs->set_local_inputs(local_inputs.get());
    }
  }
  if (keys->enabled()) {
    jobs->set_owner_of(
        [](const HttpRequest& r) { return JobOwner(PresentedKey(r.Header("authorization"), r.Header("x-api-key"))); });
  }
}

Status Server::Parts::StartGrpc(bool explicit_control) {
  const ServerOptions& o = options;
  Parts* parts = this;
  GrpcServerOptions g = o.grpc;
  g.host = o.http.host;
  g.io_threads = o.http.io_threads;
  g.max_send_bytes = g.max_receive_bytes;
  if (g.tls_cert_file.empty() && g.tls_key_file.empty()) {
    g.tls_cert_file = o.http.tls_cert_file;
    g.tls_key_file = o.http.tls_key_file;
    if (g.tls_client_ca_file.empty()) g.tls_client_ca_file = o.http.tls_client_ca_file;
  }
  g.model_control = explicit_control;
  g.draining = &draining;
  g.started = &all_listening;
  if (access_log) g.access_log = [log = access_log](const GrpcAccess& a) { log->Write(a); };
  if (keys->enabled()) {
    g.authorize = [parts](std::string_view key, bool admin) {
      return parts->keys->Authorize(key, admin, parts->NowNs());
    };
  }
  auto started = GrpcServer::Start(g, engine.get());
  if (!started) return Status(started.error().code(), "gRPC: " + started.error().message());
  grpc = std::move(*started);
  return Status::Ok();
}

Status Server::Parts::MakeRouters() {
  dashboard = {engine.get(), vision_service.get(), &registry};
  const HttpFrontEnds front_ends{kserve.get(), jobs.get(), vision.get(), &dashboard};
  router = std::make_unique<Router>(Routing(/*drains=*/true));
  QUERN_RETURN_IF_ERROR(AddHttpPortRoutes(*router, front_ends));
  vision_router = std::make_unique<Router>(Routing(/*drains=*/true));
  QUERN_RETURN_IF_ERROR(AddVisionPortRoutes(*vision_router, front_ends));
  metrics_router = std::make_unique<Router>(Routing(/*drains=*/false));  // served while draining
  return AddMetricsPortRoutes(*metrics_router, &registry, options.metrics_need_key);
}

namespace {

// An HttpServer for `router`.
Result<std::unique_ptr<HttpServer>> StartHttp(const HttpServerOptions& options, const Router* router) {
  return HttpServer::Start(
      options, [router](HttpRequest&& r, HttpDone done) { router->Dispatch(std::move(r), std::move(done)); },
      [router](const HttpRequest& r) { return router->Head(r); });
}

}  // namespace

Status Server::Parts::StartVisionPort() {
  HttpServerOptions vo = options.http;
  vo.port = options.vision_port;
  auto started = StartHttp(vo, vision_router.get());
  if (!started) return Status(started.error().code(), "vision: " + started.error().message());
  vision_http = std::move(*started);
  return Status::Ok();
}

Status Server::Parts::StartConsumer(bool consume_asked) {
  StreamConsumerOptions co = options.consumer;
  co.redis = redis_store->options().redis;
  co.max_entry_bytes = options.http.max_body_bytes;
  co.metrics = &registry;
  co.local = local_inputs.get();
  auto started = StreamConsumer::Start(co, engine.get(), redis_store);
  if (started) {
    consumer = std::move(*started);
    consumer_taking.store(consumer.get(), std::memory_order_release);
  } else if (consume_asked) {
    return InvalidArgument(started.error().message());
  } else {
    // Implied by --redis-url: a repository with no model ready yet takes
    // no jobs (its HTTP jobs wait in the streams for an instance that does).
    Log(LogLevel::kWarning, "taking no jobs from the redis streams: " + started.error().message());
  }
  return Status::Ok();
}

namespace {
std::string Shortest(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
}  // namespace

void Server::Parts::AnnounceServing() const {
  const ServerOptions& o = options;
  // The start-up lines go to stdout (scripts read the ports from them).
  auto listening = [](const char* what, const std::string& host, int port) {
    LogTo(stdout, LogLevel::kInfo, std::string(what) + " listening on " + host + ":" + std::to_string(port));
  };
  listening("HTTP", o.http.host, http->port());
  if (grpc) listening("gRPC", o.http.host, grpc->port());
  if (vision_http) listening("vision", o.http.host, vision_http->port());
  listening("metrics", o.metrics.host, metrics->port());
  if (consumer) {
    LogTo(stdout, LogLevel::kInfo,
          "taking jobs from redis at " + redis_store->options().redis.Address() + " as consumer " +
              consumer->consumer_name());
  }
  // What a newcomer (or an operator reading the log) needs to know next:
  // who may call, whether the wire is encrypted, where jobs go.
  if (keys->enabled()) {
    const size_t admin = keys->admin_count();
    LogTo(stdout, LogLevel::kInfo,
          "API keys: " + std::to_string(keys->size()) + " (" + std::to_string(admin) + " admin); every request " +
              "needs one" +
              (keys->rate_limit_per_s() > 0 ? ", at most " + Shortest(keys->rate_limit_per_s()) + "/s per key"
                                            : std::string()));
  } else {
    LogTo(stdout, LogLevel::kInfo, "API keys: none; every request is served without one");
  }
  const bool http_tls = !o.http.tls_cert_file.empty();
  const bool grpc_tls = grpc && (!o.grpc.tls_cert_file.empty() || http_tls);
  std::string tls = http_tls ? "HTTP" : "";
  if (grpc_tls) tls += tls.empty() ? "gRPC" : " and gRPC";
  if (tls.empty()) {
    LogTo(stdout, LogLevel::kInfo, "TLS: off; plaintext on every port");
  } else {
    // gRPC takes the HTTP certificate, and its client CAs, unless given its own (StartGrpc).
    const bool grpc_own = !o.grpc.tls_cert_file.empty();
    const bool http_ca = http_tls && !o.http.tls_client_ca_file.empty();
    const bool grpc_ca =
        grpc_tls && (!o.grpc.tls_client_ca_file.empty() || (!grpc_own && !o.http.tls_client_ca_file.empty()));
    const std::string ca = http_ca && grpc_ca ? ", client certificates required"
                           : http_ca          ? ", client certificates required on HTTP"
                           : grpc_ca          ? ", client certificates required on gRPC"
                                              : "";
    LogTo(stdout, LogLevel::kInfo, "TLS: on for " + tls + ca);
  }
  LogTo(stdout, LogLevel::kInfo,
        redis_store ? "jobs: kept in redis at " + redis_store->options().redis.Address() + " (durable)"
                    : "jobs: kept in this process's memory (lost if it stops)");
  size_t ready = 0, failed = 0;
  for (const auto& m : engine->ListModels()) (m.state == ModelState::kReady ? ready : failed) += 1;
  LogTo(stdout, LogLevel::kInfo,
        "models: " + std::to_string(ready) + " ready" +
            (failed ? ", " + std::to_string(failed) + " not (their errors are above)" : std::string()));
  LogTo(stdout, LogLevel::kInfo, "serving " + o.model_repository + " (Ctrl-C to stop)");
  if (!NotifySystemd("READY=1\nSTATUS=serving")) {
    Log(LogLevel::kWarning, "could not tell systemd (NOTIFY_SOCKET) that the server is ready");
  }
}

Result<std::unique_ptr<Server>> Server::Start(ServerOptions options) {
  auto p = std::make_unique<Parts>();
  p->options = std::move(options);
  ServerOptions& o = p->options;
  LogOptions log;
  QUERN_ASSIGN_OR_RETURN(log.level, ParseLogLevel(o.log_level));
  QUERN_ASSIGN_OR_RETURN(log.format, ParseLogFormat(o.log_format));
  SetLogOptions(log);
  if (o.consume && o.redis_url.empty()) {
    return Err(InvalidArgument("--consume takes jobs from Redis streams: give --redis-url too"));
  }
  if (o.consume && o.no_consume) return Err(InvalidArgument("--consume and --no-consume together"));
  const bool consume_asked = o.consume;
  if (!o.redis_url.empty() && !o.no_consume) o.consume = true;
  QUERN_ASSIGN_OR_RETURN(p->engine, OpenEngine(o));
  p->engine_metrics = AddEngineMetrics(p->registry, *p->engine);
  p->process_metrics = AddProcessMetrics(p->registry);
  PrintModels(*p->engine, o.model_repository);
  // Descriptors for every connection the limits allow (HTTP, the vision
  // port, gRPC) and some for models, files and Redis.
  RaiseOpenFileLimit(o.http.max_connections * (o.vision_port >= 0 ? 2 : 1) +
                     (o.grpc.port >= 0 ? o.grpc.max_connections : 0) + 256);
  if (const char* k = std::getenv("QUERN_API_KEYS")) o.keys.keys_env = k;
  if (const char* k = std::getenv("QUERN_ADMIN_KEYS")) o.keys.admin_keys_env = k;
  auto keys = ApiKeys::Load(o.keys);
  if (!keys) return Err(InvalidArgument(keys.error().message()));
  p->keys = std::move(*keys);
  const bool explicit_control = o.model_control == "explicit";

  p->kserve = std::make_unique<KServeHandler>(p->engine.get());
  p->kserve->set_model_control(explicit_control);
  QUERN_ASSIGN_OR_RETURN(const RedisOptions redis, RedisSettings(o));
  QUERN_RETURN_IF_ERROR(p->OpenVision(redis));
  p->OpenJobs(redis);

  QUERN_RETURN_IF_ERROR(p->MakeRouters());
  o.http.caller_loop = &Engine::NewCallerLoop;  // on one core the I/O threads run their requests' batches
  o.http.clock = &p->engine->clock();
  if (!o.access_log.empty()) {
    QUERN_ASSIGN_OR_RETURN(p->access_log, AccessLog::Open(o.access_log));
    o.http.access_log = [log = p->access_log, router = p->router.get()](const HttpAccess& a) {
      log->Write(a, router->ModelOf(a.target));
    };
  }
  QUERN_ASSIGN_OR_RETURN(p->http, StartHttp(o.http, p->router.get()));
  if (o.grpc.port >= 0) QUERN_RETURN_IF_ERROR(p->StartGrpc(explicit_control));
  if (o.vision_port >= 0) QUERN_RETURN_IF_ERROR(p->StartVisionPort());
  o.metrics.host = o.http.host;
  o.metrics.clock = o.http.clock;
  auto metrics = StartHttp(o.metrics, p->metrics_router.get());
  if (!metrics) return Err(Status(metrics.error().code(), "metrics: " + metrics.error().message()));
  p->metrics = std::move(*metrics);
  // Last: a failure above must not leave jobs in the engine that complete
  // into a consumer already destroyed.
  if (o.consume) QUERN_RETURN_IF_ERROR(p->StartConsumer(consume_asked));
  p->all_listening.store(true, std::memory_order_release);
  if (p->grpc) p->grpc->RefreshHealth();
  p->AnnounceServing();
  return std::unique_ptr<Server>(new Server(std::move(p)));
}

Server::Server(std::unique_ptr<Parts> parts) : parts_(std::move(parts)) {}

Server::~Server() {
  Shutdown();
}

void Server::Shutdown() {
  Parts& p = *parts_;
  if (p.shut_down) return;
  p.shut_down = true;
  // Drain: not ready any more, new requests refused, requests already taken
  // (queued, running, or being decoded for the vision routes) answered.
  LogTo(stdout, LogLevel::kInfo,
        "draining (up to " + std::to_string(static_cast<int64_t>(p.options.drain_timeout_s)) + " s)");
  (void)NotifySystemd("STOPPING=1");
  p.draining.store(true, std::memory_order_release);
  p.engine->StopRepositoryPolling();   // the models in service stay as they are
  p.engine->SendQueuedNow();           // no arrival will keep a queued request company now
  if (p.consumer) p.consumer->Stop();  // takes no more stream jobs; those taken finish below
  const Clock& clock = p.engine->clock();
  // A timeout too large for the clock (or infinite) waits until done.
  const double drain_ns = std::max(0.0, p.options.drain_timeout_s) * 1e9;
  const int64_t start_ns = clock.NowNs();
  const int64_t deadline_ns =
      drain_ns >= static_cast<double>(INT64_MAX - start_ns) ? INT64_MAX : start_ns + static_cast<int64_t>(drain_ns);
  auto in_flight = [&p] { return p.engine->InFlight() + p.vision_service->stats().in_flight + p.jobs->submitting(); };
  while (in_flight() > 0 && clock.NowNs() < deadline_ns) SleepFor(clock, std::chrono::milliseconds(10));
  if (const int64_t left = in_flight(); left > 0) {
    LogTo(stdout, LogLevel::kWarning, "drain timeout: " + std::to_string(left) + " requests still in flight");
    p.engine->Abandon();  // a batch that never ends (a hung Python execute) must not hold the stop
  }
  // Answers the I/O threads still write (large ones, every one over TLS).
  auto writing = [&p] { return p.http->pending_writes() + (p.vision_http ? p.vision_http->pending_writes() : 0); };
  while (writing() > 0 && clock.NowNs() < deadline_ns) SleepFor(clock, std::chrono::milliseconds(5));
  LogTo(stdout, LogLevel::kInfo, "stopping");
  std::fflush(stdout);
  p.metrics->Stop();
  p.engine_metrics.Reset();
  p.http->Stop();                     // no new requests reach the engine
  if (p.jobs) p.jobs->StopLookups();  // before the store and the connections they answer on go
  if (p.vision_http) p.vision_http->Stop();
  if (p.grpc) p.grpc->Stop();
  // Images still in the vision service need the engine to finish; their
  // answers need the handler.
  p.vision.reset();
  p.vision_service.reset();
  p.engine.reset();  // drains the queues; late responses are dropped with their connections
  p.consumer_taking.store(nullptr, std::memory_order_release);
  p.consumer.reset();
  // Redis: writes what is queued; the answers to jobs being submitted go
  // to the handler and the connections, both still here.
  p.redis_store = nullptr;
  p.store.reset();
  p.http.reset();
  p.vision_http.reset();
  p.grpc.reset();
  p.metrics.reset();
  p.jobs.reset();
}

}  // namespace quern
