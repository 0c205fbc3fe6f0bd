// HttpServer: HTTP/1.1 on Boost.Beast with one io_context per I/O thread,
// keep-alive, bounded header and body sizes (431 / 413 before the body is
// read), idle and read timeouts, a limit on open connections (the oldest
// idle connection makes room for a new one), and optional TLS.
//
// A response is written by whichever thread produces it (usually an engine
// worker): a non-blocking send that almost always completes at once, so no
// hop back to the I/O thread is needed. While a request is in flight its
// connection is watched for readability; a client that closes it cancels
// the request, and the next request's arrival starts the next read. Over
// TLS, responses are written by the I/O thread and the next read starts as
// soon as a response is out (a client that disconnects is noticed then).
//
// Thread safety: Start/Stop from one thread; the handler runs on I/O threads
// and its HttpDone may be called from any thread, exactly once.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "frontends/http/http_types.h"
#include "quern/clock.h"
#include "quern/status.h"

namespace quern {

// One response, as an access log records it (HttpServerOptions::access_log).
struct HttpAccess {
  std::string_view method;
  std::string_view target;
  int status = 0;
  size_t request_bytes = 0;     // the body as received (before any Content-Encoding was undone)
  size_t response_bytes = 0;    // the body sent
  int64_t duration_ns = 0;      // from the request's headers to its response
  std::string_view client;      // the peer's address
  std::string_view request_id;  // HttpRequest::request_id
};

struct HttpServerOptions {
  std::string host = "0.0.0.0";
  int port = 8000;  // 0 = pick a free port (see HttpServer::port)
  int io_threads = 1;
  size_t max_body_bytes = 64 << 20;    // larger: 413, answered from Content-Length
  size_t max_header_bytes = 16 << 10;  // request line + headers; larger: 431
  // More: the connection longest without a complete request head (idle, or
  // its head still arriving) is closed; none such: 503.
  int max_connections = 4096;
  int idle_timeout_s = 60;    // keep-alive connection with no request
  int read_timeout_s = 30;    // from a request's first byte to its last; also bounds a write
  int header_timeout_s = 10;  // from a request's first byte to the end of its head
  // A request body must arrive at this many bytes a second on average
  // (from 5 s after it began): a body trickling in slower (slowloris on the
  // body) closes its connection. 0 = no minimum.
  size_t min_body_bytes_per_s = 1024;
  // TLS (HTTPS): PEM certificate chain and private key files; both empty =
  // plaintext. TLS 1.2 and later.
  std::string tls_cert_file;
  std::string tls_key_file;
  // PEM CA certificates to verify client certificates against; when set,
  // clients must present a certificate signed by one of them.
  std::string tls_client_ca_file;
  // Called once per response, on any thread, as it is written: an access
  // log. Must be quick and thread-safe. Empty = none.
  std::function<void(const HttpAccess&)> access_log;
  // On a machine with one usable core, each I/O thread makes a loop with
  // this (on itself) and runs its requests' batches (HttpRequest::loop);
  // empty: never (e.g. Engine::NewCallerLoop).
  std::function<std::unique_ptr<CallerLoop>()> caller_loop;
  // What the connection timeouts above are read on; null = the real clock.
  const Clock* clock = nullptr;
};

class HttpServer {
 public:
  // `head_check`, when set, sees every request's line and headers (body
  // empty) on the I/O thread before the body is read; a response it returns
  // is sent at once and the request goes no further (its body is skipped,
  // or the connection closes when the body's length is not known). It must
  // be quick: a key check, a flag, a queue's state.
  static Result<std::unique_ptr<HttpServer>> Start(HttpServerOptions options, HttpHandler handler,
                                                   HttpHeadCheck head_check = nullptr);
  ~HttpServer();  // Stop(), then frees the connections

  // Stops the I/O threads: no request reaches the handler afterwards.
  // Responses still arriving are written if the socket takes them at once.
  // Idempotent. Callers must let in-flight handlers finish (drain the
  // engine) before destroying the server.
  void Stop();

  int port() const;
  int open_connections() const;
  // Responses given to the server and not yet written out (large ones, and
  // every one over TLS, are written by the I/O threads): a draining server
  // waits for 0 before it stops.
  int pending_writes() const;

  class Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace quern
