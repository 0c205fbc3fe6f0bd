#include "server/serve_flags.h"

#include <toml++/toml.h>

#include <algorithm>
#include <sstream>

#include "core/model_config_parser.h"

namespace quern {
namespace {

bool Numeric(const CLI::Option& opt) {
  const std::string t = opt.get_type_name();
  return t == "INT" || t == "UINT" || t == "FLOAT";
}

// Whether `args` (after "serve") set the option named --`name`.
bool Given(const std::vector<std::string>& args, const std::string& name) {
  const std::string flag = "--" + name;
  return std::any_of(args.begin(), args.end(),
                     [&](const std::string& a) { return a == flag || a.starts_with(flag + "="); });
}

// The repository and its configuration file.
void AddRepositoryFlags(CLI::App* serve, ServerOptions& o) {
  serve->add_option("--config",
                    "Read settings from this TOML file (keys: these flags' names without the dashes); "
                    "flags given here override it");
  serve->add_option("--model-repository", o.model_repository, "Triton-style model repository")->required();
  serve->add_option("--repository-poll-secs", o.repository_poll_secs,
                    "Reload changed models every N seconds (0 = off)");
  serve->add_flag("--allow-links-outside-repository", o.allow_links_outside_repository,
                  "Let a model folder be a symbolic link to a folder outside the repository (its files must stay "
                  "inside that folder); by default every model file must lie inside the repository");
}

// HTTP and gRPC: ports, threads and limits.
void AddNetworkFlags(CLI::App* serve, ServerOptions& o) {
  serve->add_option("--http-port", o.http.port, "KServe v2 HTTP port (0 = pick a free one and log it)");
  serve->add_option("--host", o.http.host, "Address to listen on");
  serve->add_option("--http-threads", o.http.io_threads, "HTTP I/O threads");
  serve->add_option("--http-max-body-bytes", o.http.max_body_bytes, "Largest request body (larger: 413)");
  serve->add_option("--http-max-header-bytes", o.http.max_header_bytes, "Largest request line + headers (larger: 431)");
  serve->add_option("--http-max-connections", o.http.max_connections, "Open HTTP connections (more: 503)");
  serve->add_option("--http-idle-timeout-secs", o.http.idle_timeout_s,
                    "Close a keep-alive connection idle for this long");
  serve->add_option("--http-read-timeout-secs", o.http.read_timeout_s,
                    "Close a connection whose request (or response) takes longer than this to transfer");
  serve->add_option("--http-header-timeout-secs", o.http.header_timeout_s,
                    "Close a connection whose request head takes longer than this to arrive");
  serve->add_option("--http-min-body-rate", o.http.min_body_bytes_per_s,
                    "Close a connection whose request body arrives slower than this many bytes a second on average "
                    "(from 5 s after it began; 0 = no minimum)");
  serve->add_option("--grpc-port", o.grpc.port, "KServe v2 gRPC port (0 = pick a free one and log it; -1 = off)");
  serve->add_option("--grpc-max-connections", o.grpc.max_connections,
                    "Open gRPC connections, plaintext and TLS (more: the one longest without a call closes, "
                    "else the new one)");
  serve->add_option("--grpc-max-connections-per-client", o.grpc.max_connections_per_client,
                    "Open gRPC connections from one client address (0 = half of --grpc-max-connections; "
                    "raise it behind a load balancer)");
  serve->add_option("--grpc-idle-timeout-secs", o.grpc.idle_timeout_s,
                    "Close a gRPC connection with no call for this long");
  serve->add_option("--grpc-message-timeout-secs", o.grpc.message_timeout_s,
                    "A gRPC request message must arrive within this (else DEADLINE_EXCEEDED)");
  serve->add_option("--grpc-write-timeout-secs", o.grpc.write_timeout_s,
                    "Close a gRPC connection whose answers have not moved for this long (a client that does not "
                    "read)");
  serve->add_option("--grpc-max-message-bytes", o.grpc.max_receive_bytes,
                    "Largest gRPC request or response message (larger: RESOURCE_EXHAUSTED)");
  serve
      ->add_option("--grpc-max-concurrent-streams", o.grpc.max_concurrent_streams,
                   "Calls one gRPC connection may have open at once; more wait on the client (0 = no limit)")
      ->check(CLI::Range(0, 1 << 30));
}

// The vision routes: their models, port, key and bounds.
void AddVisionFlags(CLI::App* serve, ServerOptions& o) {
  serve->add_option("--detection-model", o.vision.detection_model,
                    "Model behind POST /v1/vision/detection (default: the first detection model)");
  serve->add_option("--face-model", o.vision.face_model,
                    "Face detection model behind POST /v1/vision/face (default: the first in the CenterFace layout)");
  serve->add_option("--ocr-model", o.vision.ocr_model,
                    "Model behind POST /v1/vision/ocr and /v1/image/ocr: an encoded image in (BYTES 'image'), "
                    "'text', 'confidence' and 'boxes' out, as examples/models/ocr (default: ocr)");
  serve->add_option("--scene-model", o.vision.scene_model,
                    "Classification model behind POST /v1/vision/scene (default: none)");
  serve->add_option("--face-descriptor-model", o.vision.face_descriptor_model,
                    "Embedding model that describes faces for /v1/vision/face/register, recognize and match "
                    "(default: the first model with quern.task embedding)");
  serve->add_option("--data-dir", o.data_dir,
                    "Directory for what the server keeps: registered faces (faces.bin; with --redis-url they are "
                    "kept in Redis instead); default: in memory only");
  serve->add_option("--runtime-cache", o.runtime_cache_dir,
                    "Directory where the runtime measured fastest for each ONNX model of backend \"auto\" (the "
                    "default) is kept, so that a restart does not measure again (default: <data-dir>/runtimes with "
                    "--data-dir, else none: measured at every load)");
  serve->add_option("--vision-port", o.vision_port,
                    "Also serve the vision routes on this port, e.g. CodeProject.AI's 32168 (-1 = off)");
  serve->add_option("--vision-api-key", o.keys.vision_key,
                    "One more user key (CodeProject.AI clients send it as the api_key field): with it, every route "
                    "that reveals or computes anything needs a key");
  serve
      ->add_option("--vision-max-predictions", o.vision.max_predictions,
                   "The most predictions a detection answer lists, the most confident first (0 = all)")
      ->check(CLI::Range(0, 1 << 20));
  serve->add_option("--vision-timeout-ms", o.vision_service.request_timeout_ms,
                    "Vision requests not answered within this are dropped (and answered with an error)");
  serve->add_option("--vision-queue-capacity", o.vision_service.queue_capacity,
                    "Images of one model admitted at once (0 = timeout / the model's measured time per image)");
  serve->add_option("--vision-threads", o.vision_service.stage_threads,
                    "Decode / pre- / post-processing threads (0 = one per core)");
  serve->add_option("--vision-max-image-pixels", o.vision_service.max_image_pixels,
                    "Larger images are refused before decoding");
  serve
      ->add_option("--vision-max-memory-mb", o.vision_max_memory_mb,
                   "Memory the images admitted at once may hold (bodies and model inputs); more are refused "
                   "(0 = no bound)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
}

// Asynchronous jobs: where results live, Redis, the job streams.
void AddJobFlags(CLI::App* serve, ServerOptions& o) {
  serve->add_option("--job-result-ttl-secs", o.store.ttl_s,
                    "Seconds a finished job's result is kept (0 = until evicted)");
  serve->add_option("--job-store-max-bytes", o.store.max_bytes,
                    "Bytes of finished job results kept in memory; the oldest are evicted beyond it");
  serve->add_option("--redis-url", o.redis_url,
                    "Keep job results in Redis: redis://[[user]:password@]host[:port][/db], rediss:// for TLS, "
                    "or redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/master[/db] to follow "
                    "Redis Sentinel failovers; options ?wait_replicas=N&wait_timeout_ms=T (results count as "
                    "written once N replicas have them) and &sentinel_password=P (the passwords may instead "
                    "come from QUERN_REDIS_PASSWORD and QUERN_REDIS_SENTINEL_PASSWORD)");
  serve->add_option("--redis-tls-ca-file", o.redis.tls_ca_file,
                    "CA certificates for rediss:// (default: the system's)");
  serve->add_option("--redis-tls-cert-file", o.redis.tls_cert_file, "Client certificate for rediss://");
  serve->add_option("--redis-tls-key-file", o.redis.tls_key_file, "Client key for rediss://");
  serve->add_flag("--redis-tls-skip-verify", o.redis.tls_skip_verify,
                  "Do not check the Redis server's certificate (testing only)");
  serve->add_flag("--consume", o.consume,
                  "Take jobs from the Redis streams quern:jobs:{model} (XREADGROUP, group quern): the default "
                  "with --redis-url");
  serve->add_flag("--no-consume", o.no_consume,
                  "With --redis-url, take no jobs from the streams (HTTP jobs accepted here are written to them "
                  "and run by the instances that consume)");
  serve->add_option("--consume-models", o.consumer.models, "Models whose streams to take jobs from (default: all)")
      ->delimiter(',');
  serve->add_option("--consumer-name", o.consumer.consumer,
                    "This instance's name in the consumer group (default: host-pid)");
  serve->add_option("--consume-claim-idle-ms", o.consumer.claim_idle_ms,
                    "Take over jobs another consumer left unacknowledged this long (it died)");
  serve->add_option("--consume-max-deliveries", o.consumer.max_deliveries,
                    "Deliveries of a failing job before it moves to quern:dead:{model}");
  serve->add_option("--consume-max-inflight", o.consumer.max_inflight,
                    "Jobs taken from the streams and not yet finished (0 = 2 x batch size x instances)");
  serve
      ->add_option_function<int64_t>(
          "--stream-retain-secs", [&o](int64_t secs) { o.consumer.stream_retain_ms = secs * 1000; },
          "Keep job stream entries every consumer group acknowledged this long before trimming them (0 = trim "
          "at once)")
      ->default_str("0")
      ->check(CLI::Range(int64_t{0}, int64_t{10} * 365 * 24 * 3600));
}

// Metrics, model control, keys, admission, logs, draining and TLS.
void AddOperationFlags(CLI::App* serve, ServerOptions& o) {
  serve->add_option("--metrics-port", o.metrics.port, "Prometheus metrics port, /metrics (0 = pick a free one)");

  serve
      ->add_option("--model-control", o.model_control,
                   "none: the repository is loaded at start and never changed over the API (poll with "
                   "--repository-poll-secs); explicit: load and unload over the API as well")
      ->check(CLI::IsMember({"none", "poll", "explicit"}));
  serve->add_option("--api-keys", o.keys.keys_file,
                    "File of API keys (one per line): every HTTP route and gRPC call then needs one "
                    "(Authorization: Bearer <key>); also from QUERN_API_KEYS (comma-separated)");
  serve->add_option("--admin-keys", o.keys.admin_keys_file,
                    "File of admin keys: the only keys that may load and unload models (also every other route); "
                    "also from QUERN_ADMIN_KEYS");
  serve->add_option("--api-key-rate-limit", o.keys.rate_limit_per_s,
                    "Requests per second each key may make (more: 429 / RESOURCE_EXHAUSTED); 0 = no limit");
  serve
      ->add_option("--max-queue-wait-ms", o.max_queue_wait_ms,
                   "Refuse a request (503 / UNAVAILABLE) when the work queued for its model would take longer "
                   "than this to run (per model: parameter quern.max_queue_wait_ms); 0 = no bound")
      ->check(CLI::Range(int64_t{0}, int64_t{3'600'000}));
  serve
      ->add_option("--memory-budget-mb", o.memory_budget_mb,
                   "Run memory each batching model's batches may hold at once (MiB, its instances together): "
                   "batches are kept as large as the measured memory of its runs lets fit (ONNX Runtime models; "
                   "per model: parameter quern.memory_budget_mb); 0 = no budget")
      ->check(CLI::Range(int64_t{0}, kMaxMemoryBudgetMb));
  serve->add_option("--log-level", o.log_level, "Log lines at this level and above: debug, info, warning, error")
      ->check(CLI::IsMember({"debug", "info", "warning", "warn", "error"}));
  serve
      ->add_option("--log-format", o.log_format,
                   "text (quern: warning: ... model=m), or json (one object per line: time, level, msg, fields)")
      ->check(CLI::IsMember({"text", "json"}));
  serve->add_option("--access-log", o.access_log,
                    "One line per HTTP request (time, client, method, path, status, bytes in and out, ms, model), "
                    "in the log format: '-' = stdout, else a file appended to (default: none)");
  serve->add_option("--drain-timeout-secs", o.drain_timeout_s,
                    "On SIGTERM/SIGINT: readiness turns false, new requests get 503 / UNAVAILABLE, and requests "
                    "already taken finish for up to this long before the server exits (queued ones leave at once, "
                    "without waiting out a batching delay)");
  serve->add_flag("--metrics-need-key", o.metrics_need_key, "With API keys, /metrics needs a key too");
  serve->add_option("--tls-cert-file", o.http.tls_cert_file,
                    "TLS for HTTP (and the vision port) and gRPC: PEM certificate chain");
  serve->add_option("--tls-key-file", o.http.tls_key_file, "TLS: PEM private key");
  serve->add_option("--tls-client-ca-file", o.http.tls_client_ca_file,
                    "TLS: require client certificates signed by these PEM CAs");
  serve->add_option("--grpc-tls-cert-file", o.grpc.tls_cert_file,
                    "gRPC only: PEM certificate chain (default: --tls-cert-file)");
  serve->add_option("--grpc-tls-key-file", o.grpc.tls_key_file, "gRPC only: PEM private key (default: --tls-key-file)");
  serve->add_option("--grpc-tls-client-ca-file", o.grpc.tls_client_ca_file,
                    "gRPC only: client certificate CAs (default: --tls-client-ca-file)");
}

}  // namespace

void AddServeFlags(CLI::App* serve, ServerOptions& o) {
  serve->option_defaults()->always_capture_default();  // --help shows each option's default
  AddRepositoryFlags(serve, o);
  AddNetworkFlags(serve, o);
  AddVisionFlags(serve, o);
  AddJobFlags(serve, o);
  AddOperationFlags(serve, o);
}

std::string ConfigFileArgument(const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--config" && i + 1 < args.size()) return args[i + 1];
    if (args[i].starts_with("--config=")) return args[i].substr(9);
  }
  return {};
}

Result<std::vector<std::string>> ConfigFileArguments(const CLI::App& serve, const std::string& path,
                                                     const std::vector<std::string>& given) {
  toml::table file;
  try {
    file = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    return Err(
        InvalidArgument(path + ":" + std::to_string(e.source().begin.line) + ": " + std::string(e.description())));
  }
  std::vector<std::string> args;
  for (const auto& [k, node] : file) {
    const std::string key(k.str());
    const std::string where = path + ":" + std::to_string(node.source().begin.line) + ": '" + key + "'";
    const CLI::Option* opt = key == "config" ? nullptr : serve.get_option_no_throw("--" + key);
    if (opt == nullptr) {
      return Err(InvalidArgument(where + " is not a setting of quern serve (keys are the flags' names without "
                                         "the dashes; see quern serve --help)"));
    }
    if (Given(given, key)) continue;                       // the command line overrides the file
    const bool flag = opt->get_items_expected_max() == 0;  // a switch: no value of its own
    auto scalar = [&](const toml::node& v) -> Result<std::string> {
      if (auto b = v.value_exact<bool>()) {
        if (!flag) return Err(InvalidArgument(where + " takes a value, not true or false"));
        return std::string(*b ? "true" : "false");
      }
      if (flag) return Err(InvalidArgument(where + " is a switch: give true or false"));
      if (auto s = v.value_exact<std::string>()) {
        if (Numeric(*opt)) return Err(InvalidArgument(where + " takes a number, not the text \"" + *s + "\""));
        return *s;
      }
      if (auto i = v.value_exact<int64_t>()) return std::to_string(*i);
      if (auto d = v.value_exact<double>()) {
        std::ostringstream out;
        out << *d;
        return out.str();
      }
      return Err(InvalidArgument(where + " must be text, a number or true/false"));
    };
    if (const toml::array* list = node.as_array()) {
      if (opt->get_items_expected_max() <= 1) return Err(InvalidArgument(where + " takes one value, not a list"));
      std::string joined;
      for (const auto& item : *list) {
        QUERN_ASSIGN_OR_RETURN(std::string v, scalar(item));
        joined += (joined.empty() ? "" : ",") + v;
      }
      args.push_back("--" + key);
      args.push_back(joined);
      continue;
    }
    if (node.is_table()) {
      return Err(InvalidArgument(where + " is a table; settings are top-level keys named after the flags"));
    }
    QUERN_ASSIGN_OR_RETURN(std::string v, scalar(node));
    if (flag) {
      args.push_back("--" + key + "=" + v);
    } else {
      args.push_back("--" + key);
      args.push_back(v);
    }
  }
  return args;
}

}  // namespace quern
