// quern-perf: load on a running server (`quern perf` runs it).
//   quern-perf --url http://HOST:PORT|grpc://HOST:PORT --model MODEL [--concurrency N... | --rate R...]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <string>
#include <vector>

#include "tools/perf.h"

int main(int argc, char** argv) {
  CLI::App app{
      "quern perf: load a running server with KServe v2 infer requests; report throughput, latency and "
      "CPU per request"};
  quern::cli::PerfOptions perf_options;
  app.name("quern perf");
  CLI::App* perf = &app;
  perf->add_option("--url", perf_options.url, "The server: http://HOST:PORT[/PATH] or grpc://HOST:PORT")
      ->capture_default_str();
  perf->add_flag("--grpc-stream", perf_options.grpc_stream,
                 "gRPC: send over ModelStreamInfer, one stream per connection (default: unary ModelInfer)");
  perf->add_option("--stream-inflight", perf_options.stream_inflight,
                   "gRPC streams: requests kept in flight on each stream, answers matched by request id (closed "
                   "loop: -c counts streams; default 1)");
  perf->add_option("--model,-m", perf_options.model, "Model name")->required();
  perf->add_option("--model-version", perf_options.version, "Model version (default: the server's choice)");
  perf->add_option("--input,-i", perf_options.inputs, "NAME=random, NAME=zeros or NAME=FILE.npy (default random)");
  perf->add_option("--shape", perf_options.shapes,
                   "NAME=D,D,...: the shape of an input whose dimensions the model leaves open (default 1)");
  perf->add_flag("--json", perf_options.json, "Send tensors as JSON numbers (default: binary tensors)");
  perf->add_option("--concurrency,-c", perf_options.concurrency,
                   "Closed loop: requests kept in flight, one per connection; several values sweep (default 1)");
  perf->add_option("--rate,-r", perf_options.rates,
                   "Open loop: requests sent per second whatever the answers; several values sweep");
  perf->add_option("--max-inflight", perf_options.max_inflight, "Open loop: connections, the most in flight")
      ->capture_default_str();
  perf->add_option("--seconds,-s", perf_options.seconds, "Seconds measured per level")->capture_default_str();
  perf->add_option("--warmup", perf_options.warmup, "Seconds of load before each measurement")->capture_default_str();
  perf->add_option("--timeout", perf_options.timeout, "Seconds one request may take")->capture_default_str();
  perf->add_option("--deadline-ms", perf_options.deadline_ms,
                   "Each request's deadline: a gRPC call's deadline; over HTTP and gRPC streams the KServe `timeout` "
                   "parameter (the most it may wait in the server's queue). Answers after it are counted");
  perf->add_option("--metrics-url", perf_options.metrics_url,
                   "The server's metrics (e.g. http://127.0.0.1:8002/metrics): adds its CPU per request, queue "
                   "and compute times and batch size");
  perf->add_option("--format", perf_options.format, "table, csv or json")->capture_default_str();

  // `quern perf ARGS` runs `quern-perf perf ARGS`: the word is dropped.
  std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && args[0] == "perf") args.erase(args.begin());
  std::reverse(args.begin(), args.end());  // CLI11 takes them last first
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return quern::cli::Perf(perf_options);
}
