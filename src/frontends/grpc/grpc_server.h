// GrpcServer: the KServe v2 GRPCInferenceService (Triton's flavour) and the
// standard grpc.health.v1.Health service over a quern::Engine, on Quern's
// own gRPC transport (grpc_transport.h: gRPC over HTTP/2 on nghttp2, every
// per-connection and per-call resource bounded).
//
// Every call is admitted (its key, the server draining) from its headers,
// before any byte of its message is read. ModelInfer takes
// raw_input_contents (the tensors view the parsed request until the
// response is sent) or typed contents; answers carry raw_output_contents. A client deadline becomes the request's
// deadline in the batcher, and a cancelled call withdraws its request.
// ModelStreamInfer runs many requests on one stream and writes each
// response as soon as it is ready; a failed request yields an error_message
// response and the stream goes on.
//
// Thread safety: Start/Stop from one thread.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "quern/engine.h"
#include "quern/status.h"

namespace quern {

// One call, as an access log records it (GrpcServerOptions::access_log).
struct GrpcAccess {
  std::string_view method;      // "/inference.GRPCInferenceService/ModelInfer"
  std::string_view status;      // the gRPC status code's name: "OK", "INVALID_ARGUMENT", ...
  int64_t duration_ns = 0;      // from the call's start to its status
  std::string_view client;      // the peer's address
  std::string_view model;       // ModelInfer's model_name ("" for other calls)
  std::string_view request_id;  // ModelInfer's id, else the "x-request-id" metadata
};

struct GrpcServerOptions {
  std::string host = "0.0.0.0";
  int port = 8001;                   // 0 = pick a free port (see GrpcServer::port)
  int io_threads = 1;                // event loops (connections are spread over them)
  int max_receive_bytes = 64 << 20;  // larger requests: RESOURCE_EXHAUSTED
  // Calls a connection may have open at once (HTTP/2
  // SETTINGS_MAX_CONCURRENT_STREAMS): a client with more waits for one to
  // finish, so an open-loop client cannot pile unbounded work and memory
  // into the server ahead of admission. 0 = no limit.
  int max_concurrent_streams = 256;
  int max_send_bytes = 64 << 20;  // larger responses: RESOURCE_EXHAUSTED
  // Open connections, plaintext and TLS: at the limit the connection
  // longest without an open call is closed to make room; none such: the new
  // one is closed at once.
  int max_connections = 1024;
  // The same bound for one client address; 0 = half of max_connections.
  int max_connections_per_client = 0;
  // A connection with no call for this long is closed (GOAWAY; clients
  // reconnect when they next call).
  int idle_timeout_s = 60;
  // A request message must arrive within this (from its first byte, and
  // for a unary call from the call's start): else DEADLINE_EXCEEDED.
  int message_timeout_s = 30;
  // Answers that wait for a client that does not read: at most this many
  // bytes per connection (more: RESOURCE_EXHAUSTED), and a connection whose
  // answers do not move for write_timeout_s is closed.
  size_t max_unsent_bytes = size_t{32} << 20;
  int write_timeout_s = 30;
  int health_poll_ms = 500;  // how often the health service re-reads readiness
  // Model control (RepositoryModelLoad / Unload); off: FAILED_PRECONDITION.
  bool model_control = true;
  // When set, every call must present a key this accepts, in the metadata
  // "authorization: Bearer <key>" (or "x-api-key: <key>"); `admin` is true
  // for model control. Its error is the call's status. grpc.health.v1 stays
  // open for load balancers.
  std::function<Status(std::string_view key, bool admin)> authorize;
  // When set and true, the server is draining (shutting down): ServerReady
  // and grpc.health.v1 answer not ready, and new calls other than liveness
  // and readiness get UNAVAILABLE.
  const std::atomic<bool>* draining = nullptr;
  // When set and false, the server has not finished starting (another of
  // its ports does not listen yet): ServerReady and grpc.health.v1 answer
  // not ready until it is true and RefreshHealth() (or the next poll) runs.
  const std::atomic<bool>* started = nullptr;
  // TLS: PEM certificate chain and private key files; both empty = plaintext.
  std::string tls_cert_file;
  std::string tls_key_file;
  // PEM CA certificates to verify client certificates against; when set,
  // clients must present a certificate signed by one of them.
  std::string tls_client_ca_file;
  // When set, called once per call (a stream is one call), on a gRPC
  // I/O thread, when it ends: an access log.
  std::function<void(const GrpcAccess&)> access_log;
};

class GrpcServer {
 public:
  // `engine` must outlive the server.
  static Result<std::unique_ptr<GrpcServer>> Start(GrpcServerOptions options, Engine* engine);
  ~GrpcServer();  // Stop()

  // Stops accepting calls, cancels those in flight and waits for them.
  // Idempotent.
  void Stop();

  int port() const;

  // Re-reads readiness now (not at the next poll): grpc.health.v1's status,
  // and its watchers are told of a change.
  void RefreshHealth();

  class Impl;

 private:
  explicit GrpcServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace quern
