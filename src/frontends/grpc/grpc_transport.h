// GrpcTransport: gRPC's wire protocol (gRPC over HTTP/2: length-prefixed
// messages, grpc-status/grpc-message trailers, grpc-timeout, grpc-encoding)
// on nghttp2 and Asio, for the services in grpc_server.cc. It knows no
// service: a call's :path picks a GrpcMethod, whose handler is given the
// call once its headers have arrived and before any byte of its messages is
// read (so a call can be refused with nothing of its body in memory).
//
// Every resource a client can make the server hold has a bound, and is
// released when its call or its connection ends:
//  - connections: max_connections in all and max_connections_per_client per
//    peer address (plaintext and TLS alike); at either bound the connection
//    longest without an open call is closed to make room, else the new one
//    is refused;
//  - calls per connection: SETTINGS_MAX_CONCURRENT_STREAMS;
//  - request bytes: a call's messages arrive only while its handler reads
//    (Read), held back by HTTP/2 flow control otherwise; a message may be at
//    most max_message_bytes (after decompression, which also stops at 100x
//    the compressed size); a message started must end within
//    message_timeout_s, and a unary call's message must arrive within it;
//  - answer bytes: at most max_unsent_bytes per connection wait for a client
//    that does not read (Write refuses beyond; new calls are refused while
//    it is over); answers that do not move for write_timeout_s close the
//    connection;
//  - header bytes per call (max_header_bytes), CONTINUATION frames per
//    header block, outstanding PING/SETTINGS acknowledgements, and streams a
//    client resets (a token bucket: past it GOAWAY and the connection ends —
//    CVE-2023-44487's pattern);
//  - a connection with no open call for idle_timeout_s is closed (GOAWAY).
//
// Threading: each connection lives on one of io_threads event loops; a
// method's handler is created and its callbacks run on that loop's thread.
// GrpcCall's Read, Write and Finish may be called from any thread (an engine
// thread answering): they are carried out on the loop.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "quern/clock.h"
#include "quern/status.h"

namespace quern {

class GrpcCall;

// What a method does with one call. Created on the call's loop thread when
// its headers have arrived; its callbacks run on that thread, one at a
// time; destroyed when the call has ended and nothing holds the call.
class GrpcHandler {
 public:
  virtual ~GrpcHandler() = default;
  // One whole request message (decompressed), after a Read().
  virtual void OnMessage(std::string message) = 0;
  // The client sent its last message; no OnMessage follows. (After a
  // Read() that no message answered, or at once if none was asked for.)
  virtual void OnHalfClose() {}
  // A message written with Write has been taken for sending.
  virtual void OnWritten() {}
  // The call ended before the handler finished it: the client reset it,
  // its connection closed or timed out, or the server stops. Nothing the
  // handler writes afterwards is sent.
  virtual void OnCancel() {}
};

// One call (an HTTP/2 stream) as its method sees it.
class GrpcCall {
 public:
  virtual ~GrpcCall() = default;

  // Read on the loop thread, and from any thread after the handler exists
  // (they do not change during the call).
  virtual std::string_view path() const = 0;
  // The first value of request metadata `key` (lower case), "" if absent.
  virtual std::string_view Metadata(std::string_view key) const = 0;
  // The client's address ("127.0.0.1", "::1").
  virtual const std::string& peer() const = 0;
  // The client's deadline on the transport's clock (grpc-timeout from the
  // call's start); 0 = none.
  virtual int64_t deadline_ns() const = 0;

  // Any thread. Asks for the next request message (OnMessage), or
  // OnHalfClose when there is none. One Read at a time.
  virtual void Read() = 0;
  // Any thread. Queues `message` (serialized) to be sent. False, with
  // nothing queued, when the connection already holds max_unsent_bytes of
  // answers its client has not read, or the call has ended.
  virtual bool Write(std::string message) = 0;
  // Any thread. Ends the call with `status` (grpc-status and grpc-message)
  // once what was written is sent. Later calls do nothing.
  virtual void Finish(const Status& status) = 0;
  // Answer bytes this call has queued that are not yet taken for sending.
  virtual size_t unsent_bytes() const = 0;
  // What the access log names as the call's model and request id (the
  // handler sets them on the loop thread, before the call ends).
  virtual void set_log_fields(std::string model, std::string request_id) = 0;
};

// The handler for a new call; may Finish the call at once (a refusal) and
// return a handler that does nothing. A handler keeps the call by raw
// pointer or weak_ptr (the call owns it); what outlives a callback (an
// engine request's answer) holds the shared_ptr.
using GrpcMethod = std::function<std::unique_ptr<GrpcHandler>(const std::shared_ptr<GrpcCall>&)>;

struct GrpcMethodSpec {
  std::string path;               // "/inference.GRPCInferenceService/ModelInfer"
  bool client_streaming = false;  // false: the call's one message must arrive within message_timeout_s
  // A call that may stay open for good (a health watch): it does not keep
  // its connection from counting as idle, so at a connection bound it may be
  // closed to make room.
  bool long_lived = false;
  GrpcMethod make;
};

// One call, as an access log records it.
struct GrpcCallRecord {
  std::string_view method;  // the :path
  StatusCode code = StatusCode::kCancelled;
  bool finished = false;  // false: the call broke off (reset, connection closed)
  int64_t duration_ns = 0;
  std::string_view client;
  std::string_view model;
  std::string_view request_id;
};

struct GrpcTransportOptions {
  std::string host = "0.0.0.0";
  int port = 8001;  // 0 = a free one (GrpcTransport::port)
  int io_threads = 1;
  size_t max_message_bytes = 64 << 20;  // a request message, decompressed: RESOURCE_EXHAUSTED beyond
  int max_concurrent_streams = 256;     // SETTINGS_MAX_CONCURRENT_STREAMS
  int max_connections = 1024;
  // 0 = half of max_connections (at least 1): one address cannot hold every
  // connection. Behind a load balancer every client has its address: raise it.
  int max_connections_per_client = 0;
  int idle_timeout_s = 60;
  int message_timeout_s = 30;
  int write_timeout_s = 30;
  int handshake_timeout_s = 10;  // TLS handshake and the client's connection preface
  size_t max_header_bytes = 16 << 10;
  size_t max_unsent_bytes = 32 << 20;
  // Streams a client may reset: a burst, then this many per second.
  int reset_burst = 200;
  int resets_per_second = 50;
  // TLS: both empty = plaintext. ALPN "h2".
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;  // set: client certificates are required
  const Clock* clock = nullptr;    // null: the real clock
  // Called once per call as it ends, on its loop thread.
  std::function<void(const GrpcCallRecord&)> on_call_end;
};

// Serves `methods` (by :path). Thread safety: Start/Stop from one thread.
class GrpcTransport {
 public:
  static Result<std::unique_ptr<GrpcTransport>> Start(GrpcTransportOptions options,
                                                      std::vector<GrpcMethodSpec> methods);
  ~GrpcTransport();  // Stop()

  // Sends GOAWAY on every connection, cancels the calls still open after
  // `grace_ms` (their handlers' OnCancel), closes the connections and
  // stops the loops. No handler callback runs afterwards. Idempotent.
  void Stop(int grace_ms = 1000);

  int port() const;
  int open_connections() const;

  class Impl;

 private:
  explicit GrpcTransport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// grpc-timeout's value ("100m", "5S": 1-8 digits and a unit of H M S m u n)
// in nanoseconds; -1 when malformed.
int64_t ParseGrpcTimeout(std::string_view value);

// grpc-message's percent-encoding of a status message.
std::string PercentEncodeGrpcMessage(std::string_view message);

}  // namespace quern
