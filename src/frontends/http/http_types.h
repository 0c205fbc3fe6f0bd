// Transport-neutral HTTP request/response values: handlers are functions of
// these, testable without a socket; the Beast server only moves bytes.
#pragma once

#include <boost/container/small_vector.hpp>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "quern/engine.h"

namespace quern {

struct HttpRequest {
  std::string method;                                        // "GET", "POST", ...
  std::string target;                                        // path and query, e.g. "/v2/models/m/infer"
  std::vector<std::pair<std::string, std::string>> headers;  // names in lower case
  std::string body;
  // The client's X-Request-ID (1 to 128 printable ASCII characters, no
  // quotes or backslashes), or one the server made because it keeps an
  // access log; empty otherwise. The response carries it back as
  // X-Request-ID, and the access log and the engine's log lines name it.
  std::string request_id;
  // Set by the server when the client disconnects before the response is
  // written; handlers pass it on so queued work is withdrawn.
  std::shared_ptr<CancellationToken> cancel;
  // Set by the server: the request its I/O thread handled before this one
  // came over this connection too. A client alone on that thread (one that
  // sends its next request when the answer arrives) has nothing waiting
  // behind it there, so a handler may do a short piece of work on the I/O
  // thread instead of handing it to another thread and back. While several
  // clients take turns, it stays false: their requests would wait unread.
  bool lone_client = false;
  // Set by the server while its I/O thread runs its requests' batches (one
  // usable core, HttpServerOptions::caller_loop): a handler that submits on
  // this thread passes it on (SubmitOptions::loop). Null otherwise.
  CallerLoop* loop = nullptr;

  // The value of header `name` (lower case), or "" when absent.
  std::string_view Header(std::string_view name) const {
    const std::string* v = FindHeader(name);
    return v ? std::string_view(*v) : std::string_view();
  }
  // The value of the first header `name` (lower case), or null when absent.
  const std::string* FindHeader(std::string_view name) const {
    for (const auto& [k, v] : headers) {
      if (k == name) return &v;
    }
    return nullptr;
  }
};

// The rest of a response body written as it comes (HttpResponse::stream):
// server-sent events, chunked. Any thread; the pieces leave in the order
// written.
class HttpBodyStream {
 public:
  virtual ~HttpBodyStream() = default;
  // Queues `piece`. While the client has more than a bound unread, waits
  // for it to read (which holds the writer, as a slow reader should), at
  // most a while. False, nothing queued, when the client has gone or did
  // not read in time: the writer should stop (and End).
  virtual bool Write(std::string piece) = 0;
  // The body is complete. A stream let go without End is cut off (the
  // connection closes: the client sees the body end early).
  virtual void End() = 0;
};

struct HttpResponse {
  int status = 200;
  // Content types and header names are literals (static storage): a
  // response names them without an allocation.
  std::string_view content_type = "application/json";
  // Up to two (an infer answer's Inference-Header-Content-Length and an
  // X-Request-ID) without an allocation.
  boost::container::small_vector<std::pair<std::string_view, std::string>, 2> headers;
  std::string body;
  // A body written as it comes: `body` is its first piece, and the server
  // hands the rest of it to this (once, on the responding thread, before
  // the response's done returns). Sent chunked (HTTP/1.0: until the
  // connection closes). Null: `body` is the whole body.
  std::function<void(std::shared_ptr<HttpBodyStream>)> stream;
};

// Receives the response exactly once, from any thread.
using HttpDone = std::function<void(HttpResponse)>;
using HttpHandler = std::function<void(HttpRequest&&, HttpDone)>;
// Decides a request from its line and headers alone (the body not read):
// a response settles it, nothing lets it go on.
using HttpHeadCheck = std::function<std::optional<HttpResponse>(const HttpRequest& head)>;

}  // namespace quern
