// HttpServer: HTTP/1.1 on Boost.Beast with a small pool of I/O threads,
// keep-alive, a body limit (a larger request gets 413 before its body is
// read) and a read timeout. Requests go to an HttpHandler; its response may
// arrive from any thread and is written back on the connection's strand.
//
// Thread safety: Start/Stop from one thread; the handler runs on I/O threads.
#pragma once

#include <memory>
#include <string>

#include "frontends/http/http_types.h"
#include "quern/status.h"

namespace quern {

struct HttpServerOptions {
  std::string host = "0.0.0.0";
  int port = 8000;  // 0 = pick a free port (see HttpServer::port)
  int io_threads = 1;
  size_t max_body_bytes = 64 << 20;
  int read_timeout_s = 60;  // a client that sends nothing for this long is disconnected
};

class HttpServer {
 public:
  static Result<std::unique_ptr<HttpServer>> Start(HttpServerOptions options, HttpHandler handler);
  ~HttpServer();  // Stop(), then frees the connections

  // Stops the I/O threads: no request reaches the handler afterwards, and
  // responses still arriving are dropped. Idempotent.
  void Stop();

  int port() const;

  class Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace quern
