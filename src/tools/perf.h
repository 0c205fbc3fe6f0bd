// `quern perf`: load on a running server, the way Triton's perf_analyzer
// measures one: KServe v2 infer requests over HTTP (binary tensors, or JSON)
// or gRPC (unary calls, or one bidirectional stream per connection),
// in a closed loop (N requests always in flight, one per connection; a sweep
// of N) or an open loop (requests sent at a constant rate, whatever the
// answers; latency counted from when each was due, so a server that falls
// behind shows it). Per level it reports throughput, latency percentiles,
// errors by kind, the client's own CPU per request and, given the server's
// /metrics, the server's CPU per request, its queue and compute times and the
// mean batch size.
#pragma once

#include <string>
#include <vector>

namespace quern::cli {

struct PerfOptions {
  std::string url = "http://127.0.0.1:8000";  // http://HOST:PORT[/PATH] or grpc://HOST:PORT
  bool grpc_stream = false;                   // gRPC: ModelStreamInfer, one stream per connection
  // gRPC streams: requests kept in flight on each stream (closed loop: the
  // concurrency counts streams).
  int stream_inflight = 1;
  std::string model;
  std::string version;              // "" = the server's choice
  std::vector<std::string> inputs;  // NAME=random|zeros|FILE.npy (default random)
  std::vector<std::string> shapes;  // NAME=D,D,... for dimensions the model leaves open (default 1)
  bool json = false;                // tensors as JSON instead of binary
  std::vector<int> concurrency;     // closed loop: requests in flight (default {1})
  std::vector<double> rates;        // open loop: requests per second (instead of concurrency)
  int max_inflight = 64;            // open loop: at most this many in flight (connections)
  double seconds = 5;               // measured per level
  double warmup = 1;                // before each level's measurement
  double timeout = 30;              // seconds one request may take
  // Each request's deadline in ms (0 = none): a gRPC call's deadline; over
  // HTTP and gRPC streams, which carry no deadline of their own, the KServe
  // `timeout` parameter (how long it may wait in the server's queue).
  // Answers that come after it are counted as past the deadline.
  double deadline_ms = 0;
  std::string metrics_url;       // e.g. http://127.0.0.1:8002/metrics; "" = no server figures
  std::string format = "table";  // table, csv or json
};

// Runs every level and prints the report on stdout. 0 when requests were
// answered; 1 when a level had no successful request; 2 for bad options or
// a model the server does not describe.
int Perf(const PerfOptions& options);

}  // namespace quern::cli
