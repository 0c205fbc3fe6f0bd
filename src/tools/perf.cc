// `quern perf`: see perf.h.
#include "tools/perf.h"

// Beast's response parser trips GCC's maybe-uninitialized under the
// sanitizers (a boost::optional in basic_parser::do_field, reached only once
// set); the server's request parser does not.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <grpcpp/grpcpp.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/cpus.h"
#include "core/host_port.h"
#include "core/json.h"
#include "core/npy.h"
#include "grpc_service.grpc.pb.h"
#include "quern/status.h"
#include "quern/tensor.h"

namespace quern::cli {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using SteadyClock = std::chrono::steady_clock;

// ---- HTTP: one keep-alive connection, blocking calls with a timeout ----

struct Endpoint {
  std::string host, port, prefix;  // prefix: a path the server sits under ("" or "/x")
};

Result<Endpoint> ParseHttpUrl(const std::string& url, const char* flag) {
  if (!url.starts_with("http://")) {
    return Err(InvalidArgument(std::string(flag) + " '" + url + "': expected http://HOST:PORT[/PATH]"));
  }
  std::string_view rest = std::string_view(url).substr(7);
  Endpoint e;
  if (auto slash = rest.find('/'); slash != std::string_view::npos) {
    e.prefix = std::string(rest.substr(slash));
    rest = rest.substr(0, slash);
    while (!e.prefix.empty() && e.prefix.back() == '/') e.prefix.pop_back();
  }
  int port = 0;
  if (std::string why = ParseHostPort(rest, 80, e.host, port); !why.empty()) {
    return Err(InvalidArgument(std::string(flag) + " '" + url + "': " + why));
  }
  e.port = std::to_string(port);
  return e;
}

struct Reply {
  int status = 0;  // 0: no answer (see error)
  std::string body;
  std::string error;  // transport failure
};

// A connected socket as Beast's synchronous reads and writes see it, each
// bounded by the socket's SO_RCVTIMEO / SO_SNDTIMEO: asio's own blocking
// calls, told "not yet" by the kernel when the time is up, wait on forever.
// One system call per read or write, as asio's.
class TimedSocket {
 public:
  explicit TimedSocket(tcp::socket& s) : fd_(s.native_handle()) {}

  template <class Buffers>
  std::size_t read_some(const Buffers& b, boost::system::error_code& ec) {
    for (auto it = asio::buffer_sequence_begin(b); it != asio::buffer_sequence_end(b); ++it) {
      asio::mutable_buffer m(*it);
      if (m.size() == 0) continue;
      while (true) {
        const ssize_t n = ::recv(fd_, m.data(), m.size(), 0);
        if (n > 0) {
          ec = {};
          return static_cast<std::size_t>(n);
        }
        if (n == 0) {
          ec = asio::error::eof;
          return 0;
        }
        if (errno != EINTR) return Failed(ec);
      }
    }
    ec = {};
    return 0;
  }
  template <class Buffers>
  std::size_t write_some(const Buffers& b, boost::system::error_code& ec) {
    iovec iov[16];
    int count = 0;
    for (auto it = asio::buffer_sequence_begin(b); it != asio::buffer_sequence_end(b) && count < 16; ++it) {
      asio::const_buffer c(*it);
      if (c.size() == 0) continue;
      iov[count++] = {const_cast<void*>(c.data()), c.size()};
    }
    if (count == 0) {
      ec = {};
      return 0;
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(count);
    while (true) {
      const ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
      if (n >= 0) {
        ec = {};
        return static_cast<std::size_t>(n);
      }
      if (errno != EINTR) return Failed(ec);
    }
  }
  template <class Buffers>
  std::size_t read_some(const Buffers& b) {
    return Throwing([&](boost::system::error_code& ec) { return read_some(b, ec); });
  }
  template <class Buffers>
  std::size_t write_some(const Buffers& b) {
    return Throwing([&](boost::system::error_code& ec) { return write_some(b, ec); });
  }

 private:
  static std::size_t Failed(boost::system::error_code& ec) {
    ec = errno == EAGAIN || errno == EWOULDBLOCK ? boost::system::error_code(asio::error::timed_out)
                                                 : boost::system::error_code(errno, boost::system::system_category());
    return 0;
  }
  template <class Op>
  static std::size_t Throwing(Op op) {
    boost::system::error_code ec;
    const std::size_t n = op(ec);
    if (ec) throw boost::system::system_error(ec);
    return n;
  }

  int fd_;
};

class HttpConnection {
 public:
  HttpConnection(Endpoint e, double timeout_s) : e_(std::move(e)), timeout_s_(timeout_s) {}

  Reply Send(http::verb verb, const std::string& target, const std::string& body,
             const std::vector<std::pair<std::string, std::string>>& headers) {
    Reply r;
    for (int attempt = 0; attempt < 2; ++attempt) {
      const bool reused = socket_.has_value();
      if (!socket_ && !Connect(r.error)) return r;
      try {
        http::request<http::string_body> req(verb, e_.prefix + target, 11);
        req.set(http::field::host, e_.host);
        req.set(http::field::connection, "keep-alive");
        for (const auto& [k, v] : headers) req.set(k, v);
        req.body() = body;
        req.prepare_payload();
        TimedSocket s(*socket_);
        http::write(s, req);
        http::response_parser<http::string_body> parser;
        parser.body_limit(std::uint64_t{4} << 30);
        parser.header_limit(1 << 20);
        http::read(s, buffer_, parser);
        auto res = parser.release();
        r.status = static_cast<int>(res.result_int());
        r.body = std::move(res.body());
        if (!res.keep_alive()) Close();
        return r;
      } catch (const boost::system::system_error& err) {
        Close();
        r.error = err.code() == asio::error::would_block || err.code() == asio::error::timed_out ? "timeout"
                                                                                                 : err.code().message();
        // A kept-alive connection the server closed meanwhile: once more on a new one.
        if (!reused || r.error == "timeout") return r;
      }
    }
    return r;
  }

 private:
  bool Connect(std::string& error) {
    try {
      tcp::resolver resolver(io_);
      auto endpoints = resolver.resolve(e_.host, e_.port);
      socket_.emplace(io_);
      asio::connect(*socket_, endpoints);
      socket_->set_option(tcp::no_delay(true));
      timeval tv{};  // TimedSocket's bound on each read and write
      tv.tv_sec = static_cast<time_t>(timeout_s_);
      tv.tv_usec = static_cast<suseconds_t>((timeout_s_ - std::floor(timeout_s_)) * 1e6);
      setsockopt(socket_->native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
      setsockopt(socket_->native_handle(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
      return true;
    } catch (const boost::system::system_error& err) {
      socket_.reset();
      error = "connect: " + err.code().message();
      return false;
    }
  }

  void Close() {
    if (!socket_) return;
    boost::system::error_code ignored;
    socket_->close(ignored);
    socket_.reset();
    buffer_.clear();
  }

  Endpoint e_;
  double timeout_s_;
  asio::io_context io_;
  std::optional<tcp::socket> socket_;
  beast::flat_buffer buffer_;
};

// ---- gRPC: one channel (one connection) per caller, blocking calls ----

struct GrpcEndpoint {
  std::string target;  // host:port
};

std::shared_ptr<grpc::Channel> NewChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own, not one shared
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

std::string GrpcCodeName(grpc::StatusCode c) {
  static const char* const kNames[] = {
      "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
      "DATA_LOSS", "UNAUTHENTICATED"};
  const auto i = static_cast<size_t>(c);
  return i < std::size(kNames) ? kNames[i] : "code " + std::to_string(i);
}

// ---- one request, over whichever protocol ----

struct Outcome {
  bool ok = false;
  std::string kind;     // of a failure: "HTTP 503", "gRPC UNAVAILABLE", "timeout", ...
  std::string message;  // the first part of what the server or transport said
  // When the answered request was sent, for a caller that keeps several in
  // flight (the closed loop otherwise times the call itself).
  std::optional<SteadyClock::time_point> sent;
};

// Sends the level's request again and again on one connection; used by one
// thread.
class Caller {
 public:
  virtual ~Caller() = default;
  virtual Outcome Call() = 0;
};

class HttpCaller : public Caller {
 public:
  HttpCaller(const Endpoint& e, double timeout_s, const std::string& path, const std::string& body,
             const std::vector<std::pair<std::string, std::string>>& headers)
      : c_(e, timeout_s), path_(path), body_(body), headers_(headers) {}

  Outcome Call() override {
    Reply r = c_.Send(http::verb::post, path_, body_, headers_);
    Outcome out;
    if (r.status == 200) {
      out.ok = true;
    } else if (r.status == 0) {
      out.message = r.error;
      out.kind = r.error == "timeout" ? "timeout" : "connection";
    } else {
      out.message = r.body.substr(0, 200);
      out.kind = "HTTP " + std::to_string(r.status);
    }
    return out;
  }

 private:
  HttpConnection c_;
  const std::string& path_;
  const std::string& body_;
  const std::vector<std::pair<std::string, std::string>>& headers_;
};

class GrpcUnaryCaller : public Caller {
 public:
  GrpcUnaryCaller(std::shared_ptr<grpc::Channel> channel, double timeout_s, double deadline_ms,
                  const inference::ModelInferRequest& request)
      : stub_(inference::GRPCInferenceService::NewStub(std::move(channel))),
        wait_(std::chrono::duration_cast<std::chrono::system_clock::duration>(
            std::chrono::duration<double>(deadline_ms > 0 ? std::min(timeout_s, deadline_ms / 1e3) : timeout_s))),
        request_(request) {}

  Outcome Call() override {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + wait_);
    inference::ModelInferResponse response;
    const grpc::Status st = stub_->ModelInfer(&ctx, request_, &response);
    Outcome out;
    out.ok = st.ok();
    if (!st.ok()) {
      out.kind = "gRPC " + GrpcCodeName(st.error_code());
      out.message = st.error_message().substr(0, 200);
    }
    return out;
  }

 private:
  std::unique_ptr<inference::GRPCInferenceService::Stub> stub_;
  std::chrono::system_clock::duration wait_;
  const inference::ModelInferRequest& request_;
};

// `inflight` requests in flight on its stream (the closed loop's
// connection): each call reads one answer and sends the next request; with
// more than one in flight, requests carry their number as their id and an
// answer is matched to its request by it (a server answers in the order its
// batches finish). A stream that breaks is opened again for the next call.
// A stream has one deadline for its whole life, `until` (the level's end
// plus --timeout): a server that stops answering ends it then.
class GrpcStreamCaller : public Caller {
 public:
  GrpcStreamCaller(std::shared_ptr<grpc::Channel> channel, const inference::ModelInferRequest& request,
                   std::chrono::system_clock::time_point until, int inflight)
      : stub_(inference::GRPCInferenceService::NewStub(std::move(channel))),
        request_(request),
        until_(until),
        inflight_(inflight) {
    if (inflight_ > 1) numbered_ = request;
  }

  ~GrpcStreamCaller() override { Close(/*cancel=*/true); }

  Outcome Call() override {
    Outcome out;
    if (!stream_) {
      ctx_ = std::make_unique<grpc::ClientContext>();
      ctx_->set_deadline(until_);
      stream_ = stub_->ModelStreamInfer(ctx_.get());
      sent_.clear();
    }
    inference::ModelStreamInferResponse response;
    bool written = true;
    while (written && static_cast<int>(sent_.size()) < inflight_) written = Send();
    if (!written || !stream_->Read(&response)) {
      const grpc::Status st = Close(/*cancel=*/false);  // the server's word on why it ended
      out.kind = "gRPC " + GrpcCodeName(st.error_code());
      out.message = st.error_message().substr(0, 200);
      if (st.ok()) out.kind = "stream closed";
      return out;
    }
    if (inflight_ > 1) {
      const auto it = sent_.find(response.infer_response().id());
      if (it == sent_.end()) {
        out.kind = "unmatched answer";
        out.message = "an answer with id '" + response.infer_response().id().substr(0, 64) + "', sent by no request";
        Close(/*cancel=*/true);
        return out;
      }
      out.sent = it->second;
      sent_.erase(it);
    } else {
      sent_.clear();
    }
    out.ok = response.error_message().empty();
    if (!out.ok) {
      out.kind = "stream error";
      out.message = response.error_message().substr(0, 200);
    }
    return out;
  }

 private:
  bool Send() {
    if (inflight_ == 1) {
      sent_.emplace(std::string(), SteadyClock::now());
      return stream_->Write(request_);
    }
    std::string id = std::to_string(next_id_++);
    numbered_.set_id(id);
    sent_.emplace(std::move(id), SteadyClock::now());
    return stream_->Write(numbered_);
  }

  grpc::Status Close(bool cancel) {
    if (!stream_) return grpc::Status::OK;
    if (cancel) ctx_->TryCancel();
    grpc::Status st = stream_->Finish();
    stream_.reset();
    ctx_.reset();
    sent_.clear();
    return st;
  }

  std::unique_ptr<inference::GRPCInferenceService::Stub> stub_;
  const inference::ModelInferRequest& request_;
  std::chrono::system_clock::time_point until_;
  int inflight_ = 1;
  inference::ModelInferRequest numbered_;  // inflight_ > 1: the request with its number as id
  uint64_t next_id_ = 0;
  std::unordered_map<std::string, SteadyClock::time_point> sent_;  // id -> when sent, for those in flight
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<inference::ModelInferRequest, inference::ModelStreamInferResponse>> stream_;
};

// ---- the request ----

struct InputSpec {
  std::string name;
  DataType dtype = DataType::kInvalid;
  Shape shape;
  std::string bytes;                 // binary layout (BYTES: 4-byte length + bytes, per element)
  std::vector<std::string> strings;  // BYTES only, for JSON
};

uint16_t HalfBits(float f) {  // [0, 1) and normal halves only: what random inputs use
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const int exp = static_cast<int>((x >> 23) & 0xff) - 127 + 15;
  if (exp <= 0) return 0;
  return static_cast<uint16_t>((exp << 10) | ((x >> 13) & 0x3ff));
}

template <typename T>
void FillInts(std::string& out, size_t n, std::mt19937_64& rng, int64_t lo, int64_t hi) {
  std::uniform_int_distribution<int64_t> d(lo, hi);
  out.resize(n * sizeof(T));
  for (size_t i = 0; i < n; ++i) {
    const T v = static_cast<T>(d(rng));
    std::memcpy(out.data() + i * sizeof(T), &v, sizeof(T));
  }
}

Status MakeData(InputSpec& in, const std::string& how, uint64_t seed) {
  const int64_t n = ElementCount(in.shape);
  if (n < 0) return InvalidArgument("input '" + in.name + "': shape " + ShapeToString(in.shape) + " is not fixed");
  const auto count = static_cast<size_t>(n);
  // What the server's metadata or --shape asks for is made in memory, once.
  if (in.dtype != DataType::kBytes && count > (size_t{1} << 30) / DataTypeByteSize(in.dtype)) {
    return InvalidArgument("input '" + in.name + "': shape " + ShapeToString(in.shape) + " is over 1 GiB");
  }
  if (in.dtype == DataType::kBytes && count > (size_t{1} << 26)) {
    return InvalidArgument("input '" + in.name + "': shape " + ShapeToString(in.shape) + " has over 2^26 strings");
  }
  std::mt19937_64 rng(seed);
  const bool zeros = how == "zeros";
  if (in.dtype == DataType::kBytes) {
    in.strings.assign(count, std::string());
    std::uniform_int_distribution<int> letter('a', 'z');
    for (auto& s : in.strings) {
      if (!zeros)
        for (int k = 0; k < 8; ++k) s.push_back(static_cast<char>(letter(rng)));
    }
    Tensor t = Tensor::FromStrings(in.shape, in.strings);
    in.bytes.assign(reinterpret_cast<const char*>(t.data()), t.byte_size());
    return Status::Ok();
  }
  const size_t size = DataTypeByteSize(in.dtype);
  if (zeros) {
    in.bytes.assign(count * size, '\0');
    return Status::Ok();
  }
  std::uniform_real_distribution<float> uf(0.f, 1.f);
  switch (in.dtype) {
    case DataType::kFp32: {
      in.bytes.resize(count * 4);
      for (size_t i = 0; i < count; ++i) {
        const float v = uf(rng);
        std::memcpy(in.bytes.data() + i * 4, &v, 4);
      }
      break;
    }
    case DataType::kFp64: {
      in.bytes.resize(count * 8);
      for (size_t i = 0; i < count; ++i) {
        const double v = uf(rng);
        std::memcpy(in.bytes.data() + i * 8, &v, 8);
      }
      break;
    }
    case DataType::kFp16:
    case DataType::kBf16: {
      in.bytes.resize(count * 2);
      for (size_t i = 0; i < count; ++i) {
        const float f = uf(rng);
        uint32_t x;
        std::memcpy(&x, &f, 4);
        const uint16_t v = in.dtype == DataType::kFp16 ? HalfBits(f) : static_cast<uint16_t>(x >> 16);
        std::memcpy(in.bytes.data() + i * 2, &v, 2);
      }
      break;
    }
    case DataType::kBool: FillInts<uint8_t>(in.bytes, count, rng, 0, 1); break;
    case DataType::kUint8: FillInts<uint8_t>(in.bytes, count, rng, 0, 255); break;
    case DataType::kInt8: FillInts<int8_t>(in.bytes, count, rng, 0, 100); break;
    case DataType::kUint16: FillInts<uint16_t>(in.bytes, count, rng, 0, 100); break;
    case DataType::kInt16: FillInts<int16_t>(in.bytes, count, rng, 0, 100); break;
    case DataType::kUint32: FillInts<uint32_t>(in.bytes, count, rng, 0, 100); break;
    case DataType::kInt32: FillInts<int32_t>(in.bytes, count, rng, 0, 100); break;
    case DataType::kUint64: FillInts<uint64_t>(in.bytes, count, rng, 0, 100); break;
    case DataType::kInt64: FillInts<int64_t>(in.bytes, count, rng, 0, 100); break;
    default: return InvalidArgument("input '" + in.name + "': cannot make data of this type");
  }
  return Status::Ok();
}

template <typename T>
void WriteNumbers(rapidjson::Writer<rapidjson::StringBuffer>& w, const std::string& bytes) {
  const size_t n = bytes.size() / sizeof(T);
  for (size_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, bytes.data() + i * sizeof(T), sizeof(T));
    if constexpr (std::is_floating_point_v<T>) {
      w.Double(static_cast<double>(v));
    } else if constexpr (std::is_signed_v<T>) {
      w.Int64(static_cast<int64_t>(v));
    } else {
      w.Uint64(static_cast<uint64_t>(v));
    }
  }
}

// The request body and its headers, made once and sent again and again.
Result<std::pair<std::string, std::vector<std::pair<std::string, std::string>>>> BuildBody(
    const std::vector<InputSpec>& inputs, bool json, uint64_t timeout_us) {
  rapidjson::StringBuffer sb;
  rapidjson::Writer<rapidjson::StringBuffer> w(sb);
  w.StartObject();
  w.Key("inputs");
  w.StartArray();
  for (const auto& in : inputs) {
    w.StartObject();
    w.Key("name");
    w.String(in.name.c_str(), static_cast<rapidjson::SizeType>(in.name.size()));
    w.Key("shape");
    w.StartArray();
    for (int64_t d : in.shape) w.Int64(d);
    w.EndArray();
    w.Key("datatype");
    const std::string_view type = DataTypeName(in.dtype);
    w.String(type.data(), static_cast<rapidjson::SizeType>(type.size()));
    if (json) {
      w.Key("data");
      w.StartArray();
      switch (in.dtype) {
        case DataType::kBytes:
          for (const auto& s : in.strings) w.String(s.c_str(), static_cast<rapidjson::SizeType>(s.size()));
          break;
        case DataType::kBool: {
          for (char c : in.bytes) w.Bool(c != 0);
          break;
        }
        case DataType::kFp32: WriteNumbers<float>(w, in.bytes); break;
        case DataType::kFp64: WriteNumbers<double>(w, in.bytes); break;
        case DataType::kUint8: WriteNumbers<uint8_t>(w, in.bytes); break;
        case DataType::kInt8: WriteNumbers<int8_t>(w, in.bytes); break;
        case DataType::kUint16: WriteNumbers<uint16_t>(w, in.bytes); break;
        case DataType::kInt16: WriteNumbers<int16_t>(w, in.bytes); break;
        case DataType::kUint32: WriteNumbers<uint32_t>(w, in.bytes); break;
        case DataType::kInt32: WriteNumbers<int32_t>(w, in.bytes); break;
        case DataType::kUint64: WriteNumbers<uint64_t>(w, in.bytes); break;
        case DataType::kInt64: WriteNumbers<int64_t>(w, in.bytes); break;
        default:
          return Err(InvalidArgument("input '" + in.name + "' is " + std::string(type) +
                                     ", which JSON cannot carry: leave out --json"));
      }
      w.EndArray();
    } else {
      w.Key("parameters");
      w.StartObject();
      w.Key("binary_data_size");
      w.Uint64(in.bytes.size());
      w.EndObject();
    }
    w.EndObject();
  }
  w.EndArray();
  if (!json || timeout_us > 0) {
    w.Key("parameters");
    w.StartObject();
    if (!json) {
      w.Key("binary_data_output");  // outputs as binary too: no JSON numbers to print on the server
      w.Bool(true);
    }
    if (timeout_us > 0) {
      w.Key("timeout");
      w.Uint64(timeout_us);
    }
    w.EndObject();
  }
  w.EndObject();
  std::string body(sb.GetString(), sb.GetSize());
  std::vector<std::pair<std::string, std::string>> headers;
  if (json) {
    headers.emplace_back("Content-Type", "application/json");
  } else {
    headers.emplace_back("Inference-Header-Content-Length", std::to_string(body.size()));
    headers.emplace_back("Content-Type", "application/octet-stream");
    for (const auto& in : inputs) body += in.bytes;
  }
  return std::make_pair(std::move(body), std::move(headers));
}

// The same request as a ModelInferRequest (raw contents; BYTES in the binary
// layout, which raw contents share).
inference::ModelInferRequest BuildGrpcRequest(const PerfOptions& o, const std::vector<InputSpec>& inputs,
                                              uint64_t timeout_us) {
  inference::ModelInferRequest r;
  r.set_model_name(o.model);
  r.set_model_version(o.version);
  for (const auto& in : inputs) {
    auto* t = r.add_inputs();
    t->set_name(in.name);
    t->set_datatype(std::string(DataTypeName(in.dtype)));
    for (int64_t d : in.shape) t->add_shape(d);
    r.add_raw_input_contents(in.bytes);
  }
  if (timeout_us > 0) (*r.mutable_parameters())["timeout"].set_int64_param(static_cast<int64_t>(timeout_us));
  return r;
}

// An input as the server's metadata describes it.
struct InputMeta {
  std::string name, datatype;
  Shape shape;  // -1: a dimension the model leaves open
};

// GET /v2/models/{m}
Result<std::vector<InputMeta>> HttpInputs(const PerfOptions& o, const Endpoint& e, const std::string& model_path) {
  HttpConnection c(e, o.timeout);
  Reply r = c.Send(http::verb::get, model_path, "", {});
  const std::string where = "model '" + o.model + "' at " + o.url;
  if (r.status == 0) return Err(Unavailable(where + ": " + r.error));
  if (r.status != 200) {
    return Err(NotFound(where + ": HTTP " + std::to_string(r.status) + ": " + r.body.substr(0, 300)));
  }
  rapidjson::Document doc;
  JsonParseError bad;
  if (!ParseJson(doc, r.body.data(), r.body.size(), bad) || !doc.IsObject() || !doc.HasMember("inputs") ||
      !doc["inputs"].IsArray()) {
    return Err(Internal(where + ": the model's metadata has no inputs list"));
  }
  std::vector<InputMeta> metas;
  for (const auto& m : doc["inputs"].GetArray()) {
    if (!m.IsObject() || !m.HasMember("name") || !m["name"].IsString() || !m.HasMember("datatype") ||
        !m["datatype"].IsString() || !m.HasMember("shape") || !m["shape"].IsArray()) {
      return Err(Internal(where + ": an input in the metadata lacks name, datatype or shape"));
    }
    InputMeta in{m["name"].GetString(), m["datatype"].GetString(), {}};
    for (const auto& d : m["shape"].GetArray()) in.shape.push_back(d.IsInt64() ? d.GetInt64() : -1);
    metas.push_back(std::move(in));
  }
  return metas;
}

// ModelMetadata
Result<std::vector<InputMeta>> GrpcInputs(const PerfOptions& o, const std::string& target) {
  auto stub = inference::GRPCInferenceService::NewStub(NewChannel(target));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                                          std::chrono::duration<double>(o.timeout)));
  inference::ModelMetadataRequest request;
  request.set_name(o.model);
  request.set_version(o.version);
  inference::ModelMetadataResponse response;
  const grpc::Status st = stub->ModelMetadata(&ctx, request, &response);
  const std::string where = "model '" + o.model + "' at " + o.url;
  if (st.error_code() == grpc::StatusCode::NOT_FOUND || st.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
    return Err(NotFound(where + ": " + st.error_message()));
  }
  if (!st.ok()) return Err(Unavailable(where + ": gRPC " + GrpcCodeName(st.error_code()) + ": " + st.error_message()));
  std::vector<InputMeta> metas;
  for (const auto& m : response.inputs()) {
    metas.push_back({m.name(), m.datatype(), Shape(m.shape().begin(), m.shape().end())});
  }
  return metas;
}

// The model's inputs with the user's shapes and data.
Result<std::vector<InputSpec>> DescribeInputs(const PerfOptions& o, const std::vector<InputMeta>& metas) {
  const std::string where = "model '" + o.model + "' at " + o.url;
  std::map<std::string, std::string> how, shapes;
  for (const auto& [flag, list, into] : {std::tuple{"--input", &o.inputs, &how}, {"--shape", &o.shapes, &shapes}}) {
    for (const auto& s : *list) {
      const auto eq = s.find('=');
      if (eq == std::string::npos || eq == 0) {
        return Err(InvalidArgument(std::string(flag) + " '" + s + "': expected NAME=VALUE"));
      }
      (*into)[s.substr(0, eq)] = s.substr(eq + 1);
    }
  }
  std::vector<InputSpec> inputs;
  uint64_t seed = 1;
  for (const InputMeta& m : metas) {
    InputSpec in;
    in.name = m.name;
    auto dtype = DataTypeFromName(m.datatype);
    if (!dtype) return Err(Internal(where + ": input '" + in.name + "' has an unknown datatype"));
    in.dtype = *dtype;
    in.shape = m.shape;
    const std::string spec = how.count(in.name) ? how[in.name] : "random";
    how.erase(in.name);
    if (spec != "random" && spec != "zeros") {
      auto t = ReadNpy(spec);
      if (!t) return Err(InvalidArgument("--input " + in.name + "=" + spec + ": " + t.error().message()));
      if (t->dtype() != in.dtype) {
        return Err(InvalidArgument("--input " + in.name + "=" + spec + ": the file holds " +
                                   std::string(DataTypeName(t->dtype())) + ", the model wants " +
                                   std::string(DataTypeName(in.dtype))));
      }
      in.shape = t->shape();
      in.bytes.assign(reinterpret_cast<const char*>(t->data()), t->byte_size());
      if (in.dtype == DataType::kBytes) {
        return Err(InvalidArgument("--input " + in.name + ": BYTES inputs come from random or zeros"));
      }
    } else {
      if (auto it = shapes.find(in.name); it != shapes.end()) {
        Shape given;
        std::string_view rest = it->second;
        while (!rest.empty()) {
          const auto comma = rest.find(',');
          std::string_view part = rest.substr(0, comma);
          int64_t d = 0;
          auto [p, ec] = std::from_chars(part.data(), part.data() + part.size(), d);
          if (ec != std::errc() || p != part.data() + part.size() || d < 0) {
            return Err(InvalidArgument("--shape " + in.name + "=" + it->second + ": not a list of sizes"));
          }
          given.push_back(d);
          rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
        }
        if (given.size() != in.shape.size()) {
          return Err(InvalidArgument("--shape " + in.name + "=" + it->second + ": the model's shape is " +
                                     ShapeToString(in.shape) + " (" + std::to_string(in.shape.size()) +
                                     " dimensions)"));
        }
        in.shape = std::move(given);
        shapes.erase(it);
      }
      for (auto& d : in.shape) {
        if (d < 0) d = 1;  // the batch dimension, or one the model leaves open
      }
      QUERN_RETURN_IF_ERROR(MakeData(in, spec, seed++));
    }
    inputs.push_back(std::move(in));
  }
  for (const auto& [flag, left] : {std::pair{"--input", &how}, {"--shape", &shapes}}) {
    if (!left->empty()) {
      return Err(InvalidArgument(std::string(flag) + " " + left->begin()->first + ": the model has no such input"));
    }
  }
  return inputs;
}

// ---- the server's figures, from /metrics ----

struct ServerFigures {
  double cpu_s = 0, success = 0, queue_us_sum = 0, queue_count = 0, compute_us_sum = 0, compute_count = 0, items = 0,
         executions = 0;
};

std::optional<ServerFigures> Scrape(HttpConnection& c, const Endpoint& e, const std::string& model) {
  Reply r = c.Send(http::verb::get, e.prefix.empty() ? "/metrics" : "", "", {});
  if (r.status != 200) return std::nullopt;
  ServerFigures f;
  const std::string label = "model=\"" + model + "\"";
  size_t pos = 0;
  while (pos < r.body.size()) {
    size_t end = r.body.find('\n', pos);
    if (end == std::string::npos) end = r.body.size();
    std::string_view line(r.body.data() + pos, end - pos);
    pos = end + 1;
    if (line.empty() || line[0] == '#') continue;
    const size_t name_end = line.find_first_of("{ ");
    if (name_end == std::string_view::npos) continue;
    std::string_view name = line.substr(0, name_end);
    const size_t value_at = line.rfind(' ');
    double v = 0;
    auto [p, ec] = std::from_chars(line.data() + value_at + 1, line.data() + line.size(), v);
    if (ec != std::errc()) continue;
    if (name == "process_cpu_seconds_total") {
      f.cpu_s += v;
      continue;
    }
    if (line[name_end] != '{') continue;
    std::string_view labels = line.substr(name_end, line.find('}', name_end) - name_end);
    // model="m" exactly: the label ends at its quote (a model "m2" is another).
    const size_t at = labels.find(label);
    if (at == std::string_view::npos || (at > 1 && labels[at - 1] != ',' && labels[at - 1] != '{')) continue;
    if (name == "quern_request_success_total") f.success += v;
    if (name == "quern_queue_duration_us_sum") f.queue_us_sum += v;
    if (name == "quern_queue_duration_us_count") f.queue_count += v;
    if (name == "quern_compute_infer_duration_us_sum") f.compute_us_sum += v;
    if (name == "quern_compute_infer_duration_us_count") f.compute_count += v;
    if (name == "quern_inference_count_total") f.items += v;
    if (name == "quern_execution_count_total") f.executions += v;
  }
  return f;
}

// ---- the load ----

struct Level {
  std::string mode;  // "concurrency" or "rate"
  double value = 0;
};

struct LevelRun {
  Level level;
  double wall_s = 0;
  int64_t ok = 0, errors = 0, completed_total = 0;                     // completed_total: warm-up included, every 2xx
  std::map<std::string, std::pair<int64_t, std::string>> error_kinds;  // kind -> count, first message
  std::vector<int64_t> latencies_ns;                                   // ok requests in the window
  double client_cpu_us = 0;
  std::optional<ServerFigures> server;  // deltas over the window
  int64_t late = 0;                     // open loop: sent more than 1 ms after due
  int64_t past_deadline = 0;            // ok answers that came after --deadline-ms
};

using CallerFactory = std::function<std::unique_ptr<Caller>()>;

LevelRun RunLevel(const PerfOptions& o, const CallerFactory& make_caller, const Level& level,
                  std::optional<HttpConnection>& metrics, const Endpoint& metrics_e) {
  LevelRun res;
  res.level = level;
  const bool open = level.mode == "rate";
  const int threads = open ? o.max_inflight : static_cast<int>(level.value);
  const auto start = SteadyClock::now();
  const auto window_from =
      start + std::chrono::duration_cast<SteadyClock::duration>(std::chrono::duration<double>(o.warmup));
  const auto window_to =
      window_from + std::chrono::duration_cast<SteadyClock::duration>(std::chrono::duration<double>(o.seconds));
  std::atomic<int64_t> ticket{0};
  std::atomic<int64_t> completed{0};
  std::mutex mu;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      std::unique_ptr<Caller> c = make_caller();
      std::vector<int64_t> lat;
      std::map<std::string, std::pair<int64_t, std::string>> kinds;
      int64_t ok = 0, errors = 0, late = 0, done = 0, past_deadline = 0;
      const int64_t deadline_ns = static_cast<int64_t>(o.deadline_ms * 1e6);
      while (true) {
        SteadyClock::time_point due;
        if (open) {
          const int64_t k = ticket.fetch_add(1, std::memory_order_relaxed);
          due = start + std::chrono::duration_cast<SteadyClock::duration>(
                            std::chrono::duration<double>(static_cast<double>(k) / level.value));
          if (due >= window_to) break;
          std::this_thread::sleep_until(due);
          if (SteadyClock::now() - due > std::chrono::milliseconds(1) && due >= window_from) ++late;
        } else {
          due = SteadyClock::now();
          if (due >= window_to) break;
        }
        auto sent = SteadyClock::now();
        Outcome r = c->Call();
        const auto end = SteadyClock::now();
        if (r.sent) sent = due = *r.sent;  // sent before this call (several in flight)
        if (r.ok) ++done;
        // In the window: the closed loop counts what was answered in it (a
        // request sent during the warm-up too: with latencies near the
        // window's length, counting only those sent in it would miss most);
        // the open loop what was due in it and answered by its end.
        const bool counted = end <= window_to && (open ? due >= window_from : end >= window_from);
        if (!counted) continue;
        if (r.ok) {
          ++ok;
          lat.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(end - due).count());
          if (deadline_ns > 0 &&
              std::chrono::duration_cast<std::chrono::nanoseconds>(end - sent).count() > deadline_ns) {
            ++past_deadline;
          }
        } else {
          ++errors;
          auto& k = kinds[r.kind];
          if (k.first++ == 0) k.second = std::move(r.message);
        }
      }
      completed.fetch_add(done);
      std::lock_guard<std::mutex> lock(mu);
      res.ok += ok;
      res.errors += errors;
      res.late += late;
      res.past_deadline += past_deadline;
      res.latencies_ns.insert(res.latencies_ns.end(), lat.begin(), lat.end());
      for (auto& [kind, v] : kinds) {
        auto& into = res.error_kinds[kind];
        if (into.first == 0) into.second = v.second;
        into.first += v.first;
      }
    });
  }
  std::this_thread::sleep_until(window_from);
  const double cpu0 = ProcessCpuSeconds();
  std::optional<ServerFigures> before;
  if (metrics) before = Scrape(*metrics, metrics_e, o.model);
  std::this_thread::sleep_until(window_to);
  const double cpu1 = ProcessCpuSeconds();
  std::optional<ServerFigures> after;
  if (metrics) after = Scrape(*metrics, metrics_e, o.model);
  res.wall_s = std::chrono::duration<double>(window_to - window_from).count();
  for (auto& t : pool) t.join();
  res.completed_total = completed.load();
  const int64_t n = std::max<int64_t>(res.ok + res.errors, 1);
  res.client_cpu_us = (cpu1 - cpu0) / static_cast<double>(n) * 1e6;
  if (before && after) {
    ServerFigures d;
    d.cpu_s = after->cpu_s - before->cpu_s;
    d.success = after->success - before->success;
    d.queue_us_sum = after->queue_us_sum - before->queue_us_sum;
    d.queue_count = after->queue_count - before->queue_count;
    d.compute_us_sum = after->compute_us_sum - before->compute_us_sum;
    d.compute_count = after->compute_count - before->compute_count;
    d.items = after->items - before->items;
    d.executions = after->executions - before->executions;
    res.server = d;
  }
  std::sort(res.latencies_ns.begin(), res.latencies_ns.end());
  return res;
}

double Percentile(const std::vector<int64_t>& sorted, double q) {
  if (sorted.empty()) return std::nan("");
  const size_t i = std::min(sorted.size() - 1,
                            static_cast<size_t>(std::ceil(q * static_cast<double>(sorted.size()))) - (q > 0 ? 1 : 0));
  return static_cast<double>(sorted[i]) / 1e6;
}

struct Row {
  std::string mode;
  double value, throughput, mean, p50, p90, p95, p99, client_us, server_us, queue_us, compute_us, batch;
  int64_t ok, errors, completed_total, late, past_deadline;
  std::map<std::string, std::pair<int64_t, std::string>> kinds;
};

Row ToRow(const LevelRun& r) {
  Row row;
  row.mode = r.level.mode;
  row.value = r.level.value;
  row.throughput = static_cast<double>(r.ok) / r.wall_s;
  row.mean = r.latencies_ns.empty()
                 ? std::nan("")
                 : static_cast<double>(std::accumulate(r.latencies_ns.begin(), r.latencies_ns.end(), int64_t{0})) /
                       static_cast<double>(r.latencies_ns.size()) / 1e6;
  row.p50 = Percentile(r.latencies_ns, 0.50);
  row.p90 = Percentile(r.latencies_ns, 0.90);
  row.p95 = Percentile(r.latencies_ns, 0.95);
  row.p99 = Percentile(r.latencies_ns, 0.99);
  row.client_us = r.client_cpu_us;
  const double nan = std::nan("");
  row.server_us = row.queue_us = row.compute_us = row.batch = nan;
  if (r.server) {
    const ServerFigures& s = *r.server;
    if (s.success > 0) row.server_us = s.cpu_s / s.success * 1e6;
    if (s.queue_count > 0) row.queue_us = s.queue_us_sum / s.queue_count;
    if (s.compute_count > 0) row.compute_us = s.compute_us_sum / s.compute_count;
    if (s.executions > 0) row.batch = s.items / s.executions;
  }
  row.ok = r.ok;
  row.errors = r.errors;
  row.completed_total = r.completed_total;
  row.late = r.late;
  row.past_deadline = r.past_deadline;
  row.kinds = r.error_kinds;
  return row;
}

std::string Num(double v, int digits) {
  if (std::isnan(v)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string PercentEncode(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      char buf[4];
      std::snprintf(buf, sizeof buf, "%%%02X", c);
      out += buf;
    }
  }
  return out;
}

// The options' own consistency, before anything is sent.
Status CheckOptions(const PerfOptions& o) {
  if (o.model.empty()) return InvalidArgument("--model is required");
  if (o.format != "table" && o.format != "csv" && o.format != "json") {
    return InvalidArgument("--format must be table, csv or json");
  }
  if (!o.rates.empty() && !o.concurrency.empty()) {
    return InvalidArgument("give --concurrency (closed loop) or --rate (open loop), not both");
  }
  for (int c : o.concurrency) {
    if (c < 1 || c > 4096) return InvalidArgument("--concurrency values are 1-4096");
  }
  for (double r : o.rates) {
    if (!(r > 0) || r > 1e7) return InvalidArgument("--rate values are above 0 and at most 10^7");
  }
  if (o.max_inflight < 1 || o.max_inflight > 4096) return InvalidArgument("--max-inflight is 1-4096");
  if (!(o.seconds > 0) || !(o.warmup >= 0) || !(o.timeout > 0)) {
    return InvalidArgument("--seconds and --timeout must be above 0, --warmup at least 0");
  }
  if (!(o.deadline_ms >= 0) || o.deadline_ms > 1e9) return InvalidArgument("--deadline-ms is 0 to 10^9");
  const bool grpc = o.url.starts_with("grpc://");
  if (!grpc && o.grpc_stream) return InvalidArgument("--grpc-stream needs a grpc://HOST:PORT --url");
  if (o.stream_inflight < 1 || o.stream_inflight > 1024) {
    return InvalidArgument("--stream-inflight is 1-1024");
  }
  if (o.stream_inflight > 1 && !o.grpc_stream) return InvalidArgument("--stream-inflight needs --grpc-stream");
  if (o.stream_inflight > 1 && !o.rates.empty()) {
    return InvalidArgument("--stream-inflight is for the closed loop (-c), not --rate");
  }
  if (grpc && o.json) return InvalidArgument("--json is for HTTP: gRPC sends raw tensor contents");
  return Status::Ok();
}

// The table's or the CSV's head (JSON has none).
void PrintHeader(const PerfOptions& o, const std::vector<InputSpec>& inputs, const char* tensors,
                 const std::string& mode) {
  if (o.format == "table") {
    std::printf("model %s at %s, %s tensors, inputs:", o.model.c_str(), o.url.c_str(), tensors);
    for (const auto& in : inputs) {
      std::printf(" %s %s %s", in.name.c_str(), std::string(DataTypeName(in.dtype)).c_str(),
                  ShapeToString(in.shape).c_str());
    }
    std::printf("; %.3g s per level after %.3g s of warm-up", o.seconds, o.warmup);
    if (o.deadline_ms > 0) std::printf("; deadline %.6g ms", o.deadline_ms);
    std::printf("\n");
    std::printf("%12s %10s %9s %9s %9s %9s %7s %10s %10s %9s %10s %6s\n", mode.c_str(), "req/s", "p50 ms", "p90 ms",
                "p95 ms", "p99 ms", "errors", "client µs", "server µs", "queue µs", "compute µs", "batch");
  } else if (o.format == "csv") {
    std::printf(
        "mode,value,requests_per_s,p50_ms,p90_ms,p95_ms,p99_ms,ok,errors,client_cpu_us_per_request,"
        "server_cpu_us_per_request,server_queue_us,server_compute_us,server_batch_size,late,past_deadline\n");
  }
}

// One level's line in the table or the CSV (JSON: at the end).
void PrintRow(const PerfOptions& o, const Level& level, const Row& row) {
  if (o.format == "table") {
    std::printf("%12s %10.1f %9s %9s %9s %9s %7lld %10s %10s %9s %10s %6s\n",
                Num(level.value, level.mode == "rate" ? 1 : 0).c_str(), row.throughput, Num(row.p50, 3).c_str(),
                Num(row.p90, 3).c_str(), Num(row.p95, 3).c_str(), Num(row.p99, 3).c_str(),
                static_cast<long long>(row.errors), Num(row.client_us, 1).c_str(), Num(row.server_us, 1).c_str(),
                Num(row.queue_us, 1).c_str(), Num(row.compute_us, 1).c_str(), Num(row.batch, 2).c_str());
    for (const auto& [kind, v] : row.kinds) {
      std::printf("%12s   %lld x %s: %s\n", "", static_cast<long long>(v.first), kind.c_str(), v.second.c_str());
    }
    if (row.late > 0) {
      std::printf(
          "%12s   %lld requests sent over 1 ms after they were due (the client busy, or every connection in use: see "
          "--max-inflight)\n",
          "", static_cast<long long>(row.late));
    }
    if (o.deadline_ms > 0) {
      std::printf("%12s   %lld answers came after the %.6g ms deadline\n", "",
                  static_cast<long long>(row.past_deadline), o.deadline_ms);
    }
    std::fflush(stdout);
  } else if (o.format == "csv") {
    std::printf("%s,%g,%.3f,%s,%s,%s,%s,%lld,%lld,%s,%s,%s,%s,%s,%lld,%lld\n", level.mode.c_str(), level.value,
                row.throughput, Num(row.p50, 4).c_str(), Num(row.p90, 4).c_str(), Num(row.p95, 4).c_str(),
                Num(row.p99, 4).c_str(), static_cast<long long>(row.ok), static_cast<long long>(row.errors),
                Num(row.client_us, 2).c_str(), Num(row.server_us, 2).c_str(), Num(row.queue_us, 2).c_str(),
                Num(row.compute_us, 2).c_str(), Num(row.batch, 3).c_str(), static_cast<long long>(row.late),
                static_cast<long long>(row.past_deadline));
    std::fflush(stdout);
  }
}

// Every level as one JSON document.
void PrintJson(const PerfOptions& o, const std::vector<Row>& rows, const char* tensors) {
  rapidjson::StringBuffer sb;
  rapidjson::Writer<rapidjson::StringBuffer> w(sb);
  w.StartObject();
  w.Key("model");
  w.String(o.model.c_str());
  w.Key("url");
  w.String(o.url.c_str());
  w.Key("tensors");
  w.String(tensors);
  w.Key("deadline_ms");
  if (o.deadline_ms > 0) {
    w.Double(o.deadline_ms);
  } else {
    w.Null();
  }
  w.Key("levels");
  w.StartArray();
  auto number = [&](const char* key, double v) {
    w.Key(key);
    if (std::isnan(v)) {
      w.Null();
    } else {
      w.Double(v);
    }
  };
  auto count = [&](const char* key, int64_t v) {
    w.Key(key);
    w.Int64(v);
  };
  for (const Row& r : rows) {
    w.StartObject();
    w.Key("mode");
    w.String(r.mode.c_str());
    number("value", r.value);
    number("requests_per_s", r.throughput);
    w.Key("latency_ms");
    w.StartObject();
    number("mean", r.mean);
    number("p50", r.p50);
    number("p90", r.p90);
    number("p95", r.p95);
    number("p99", r.p99);
    w.EndObject();
    count("ok", r.ok);
    count("errors", r.errors);
    w.Key("error_kinds");
    w.StartObject();
    for (const auto& [kind, v] : r.kinds) {
      w.Key(kind.c_str());
      w.StartObject();
      count("count", v.first);
      w.Key("first");
      w.String(v.second.c_str(), static_cast<rapidjson::SizeType>(v.second.size()));
      w.EndObject();
    }
    w.EndObject();
    count("completed_total", r.completed_total);
    count("late", r.late);
    count("past_deadline", r.past_deadline);
    number("client_cpu_us_per_request", r.client_us);
    number("server_cpu_us_per_request", r.server_us);
    number("server_queue_us", r.queue_us);
    number("server_compute_us", r.compute_us);
    number("server_batch_size", r.batch);
    w.EndObject();
  }
  w.EndArray();
  w.EndObject();
  std::printf("%s\n", sb.GetString());
}

}  // namespace

int Perf(const PerfOptions& o) {
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "quern perf: %s\n", s.message().c_str());
    return s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kNotFound ? 2 : 1;
  };
  if (Status s = CheckOptions(o); !s.ok()) return fail(s);
  const bool grpc = o.url.starts_with("grpc://");
  const auto timeout_us = static_cast<uint64_t>(std::llround(o.deadline_ms * 1e3));
  // The deadline travels as the KServe `timeout` parameter where the
  // protocol has no deadline of its own.
  const uint64_t timeout_param_us = grpc && !o.grpc_stream ? 0 : timeout_us;

  Endpoint e;
  std::string grpc_target, infer_path;
  Result<std::vector<InputMeta>> metas = std::vector<InputMeta>{};
  if (grpc) {
    grpc_target = o.url.substr(7);
    while (!grpc_target.empty() && grpc_target.back() == '/') grpc_target.pop_back();
    std::string host;
    int port = 0;
    if (std::string why = ParseHostPort(grpc_target, 0, host, port); !why.empty() || port == 0) {
      return fail(InvalidArgument("--url '" + o.url + "': " + (why.empty() ? "expected grpc://HOST:PORT" : why)));
    }
    metas = GrpcInputs(o, grpc_target);
  } else {
    auto parsed = ParseHttpUrl(o.url, "--url");
    if (!parsed) return fail(parsed.error());
    e = *parsed;
    std::string model_path = "/v2/models/" + PercentEncode(o.model);
    if (!o.version.empty()) model_path += "/versions/" + PercentEncode(o.version);
    infer_path = model_path + "/infer";
    metas = HttpInputs(o, e, model_path);
  }
  if (!metas) return fail(metas.error());
  auto inputs = DescribeInputs(o, *metas);
  if (!inputs) return fail(inputs.error());
  auto body = BuildBody(*inputs, o.json, timeout_param_us);
  if (!body) return fail(body.error());
  const inference::ModelInferRequest grpc_request =
      grpc ? BuildGrpcRequest(o, *inputs, timeout_param_us) : inference::ModelInferRequest();
  // gRPC: callers share up to kGrpcConnections connections (HTTP/2 carries
  // many calls on one); a connection each costs the client more than the
  // calls past a few dozen callers.
  constexpr size_t kGrpcConnections = 8;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::mutex channels_mu;
  size_t next_channel = 0;
  CallerFactory make_caller = [&]() -> std::unique_ptr<Caller> {
    if (!grpc) return std::make_unique<HttpCaller>(e, o.timeout, infer_path, body->first, body->second);
    std::shared_ptr<grpc::Channel> channel;
    {
      std::lock_guard<std::mutex> lock(channels_mu);
      if (channels.size() < kGrpcConnections) channels.push_back(NewChannel(grpc_target));
      channel = channels[next_channel++ % channels.size()];
    }
    if (o.grpc_stream) {
      // Callers are made as each level starts.
      const auto until =
          std::chrono::system_clock::now() + std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                                 std::chrono::duration<double>(o.warmup + o.seconds + o.timeout));
      return std::make_unique<GrpcStreamCaller>(std::move(channel), grpc_request, until, o.stream_inflight);
    }
    return std::make_unique<GrpcUnaryCaller>(std::move(channel), o.timeout, o.deadline_ms, grpc_request);
  };
  const char* tensors = grpc ? (o.grpc_stream ? "gRPC stream" : "gRPC") : o.json ? "JSON" : "binary";

  std::optional<HttpConnection> metrics;
  Endpoint metrics_e;
  if (!o.metrics_url.empty()) {
    auto me = ParseHttpUrl(o.metrics_url, "--metrics-url");
    if (!me) return fail(me.error());
    metrics_e = *me;
    metrics.emplace(metrics_e, o.timeout);
    if (!Scrape(*metrics, metrics_e, o.model)) {
      return fail(Unavailable("--metrics-url " + o.metrics_url + " did not answer with metrics"));
    }
  }

  std::vector<Level> levels;
  for (double r : o.rates) levels.push_back({"rate", r});
  for (int c : o.concurrency) levels.push_back({"concurrency", static_cast<double>(c)});
  if (levels.empty()) levels.push_back({"concurrency", 1});

  std::vector<Row> rows;
  bool every_level_answered = true;
  PrintHeader(o, *inputs, tensors, levels[0].mode);
  for (const Level& level : levels) {
    Row row = ToRow(RunLevel(o, make_caller, level, metrics, metrics_e));
    if (row.ok == 0) every_level_answered = false;
    PrintRow(o, level, row);
    rows.push_back(std::move(row));
  }
  if (o.format == "json")
    PrintJson(o, rows, grpc ? (o.grpc_stream ? "grpc_stream" : "grpc") : o.json ? "json" : "binary");
  return every_level_answered ? 0 : 1;
}

}  // namespace quern::cli
