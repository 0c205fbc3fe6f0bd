#include "store/redis_client.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/write.hpp>
#include <charconv>
#include <cstring>
#include <utility>

namespace quern {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

std::string RedisOptions::Address() const {
  return host + ":" + std::to_string(port);
}

namespace {

std::string PercentDecode(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size()) {
      int v = 0;
      auto [p, ec] = std::from_chars(s.data() + i + 1, s.data() + i + 3, v, 16);
      if (ec == std::errc() && p == s.data() + i + 3) {
        out.push_back(static_cast<char>(v));
        i += 2;
        continue;
      }
    }
    out.push_back(s[i]);
  }
  return out;
}

bool ParseInt(std::string_view s, int64_t& v) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  return ec == std::errc() && p == s.data() + s.size() && !s.empty();
}

}  // namespace

Status ParseRedisUrl(std::string_view url, RedisOptions& o) {
  auto bad = [&](const std::string& why) {
    return InvalidArgument("--redis-url: " + why +
                           " (expected redis://[[user]:password@]host[:port][/db] or rediss://...)");
  };
  std::string_view rest;
  if (url.starts_with("redis://")) {
    o.tls = false;
    rest = url.substr(8);
  } else if (url.starts_with("rediss://")) {
    o.tls = true;
    rest = url.substr(9);
  } else {
    return bad("the scheme must be redis:// or rediss://");
  }
  std::string_view path;
  if (auto slash = rest.find('/'); slash != std::string_view::npos) {
    path = rest.substr(slash + 1);
    rest = rest.substr(0, slash);
  }
  if (auto at = rest.rfind('@'); at != std::string_view::npos) {
    std::string_view userinfo = rest.substr(0, at);
    rest = rest.substr(at + 1);
    if (auto colon = userinfo.find(':'); colon != std::string_view::npos) {
      o.user = PercentDecode(userinfo.substr(0, colon));
      o.password = PercentDecode(userinfo.substr(colon + 1));
    } else {
      o.user.clear();
      o.password = PercentDecode(userinfo);  // redis://secret@host: a password alone
    }
  }
  std::string_view host = rest;
  std::string_view port;
  if (rest.starts_with('[')) {  // [::1]:6379
    const auto close = rest.find(']');
    if (close == std::string_view::npos) return bad("unterminated IPv6 address");
    host = rest.substr(1, close - 1);
    std::string_view after = rest.substr(close + 1);
    if (!after.empty()) {
      if (after[0] != ':') return bad("unexpected text after the address");
      port = after.substr(1);
    }
  } else if (auto colon = rest.rfind(':'); colon != std::string_view::npos) {
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
  }
  if (host.empty()) return bad("no host");
  o.host = std::string(host);
  o.port = 6379;
  if (!port.empty()) {
    int64_t p = 0;
    if (!ParseInt(port, p) || p <= 0 || p > 65535) return bad("port '" + std::string(port) + "' is not 1-65535");
    o.port = static_cast<int>(p);
  }
  o.db = 0;
  if (!path.empty()) {
    int64_t db = 0;
    if (!ParseInt(path, db) || db < 0 || db > 1 << 20) {
      return bad("database '" + std::string(path) + "' is not a number");
    }
    o.db = static_cast<int>(db);
  }
  return Status::Ok();
}

// ---- RESP ----

namespace {

// The line starting at `pos` (without CRLF); nullopt when incomplete.
std::optional<std::string_view> Line(std::string_view data, size_t pos, size_t& next) {
  const size_t end = data.find("\r\n", pos);
  if (end == std::string_view::npos) return std::nullopt;
  next = end + 2;
  return data.substr(pos, end - pos);
}

constexpr int kMaxDepth = 16;

// With build == false only checks that a whole reply is there (nothing is
// copied); the reply returned is then empty.
Result<std::optional<RedisReply>> ParseAt(std::string_view data, size_t& pos, int depth, bool build) {
  if (pos >= data.size()) return std::optional<RedisReply>();
  if (depth > kMaxDepth) return Err(InvalidArgument("redis reply nested too deeply"));
  const char kind = data[pos];
  size_t next = 0;
  auto line = Line(data, pos + 1, next);
  if (!line) return std::optional<RedisReply>();
  RedisReply r;
  int64_t n = 0;
  switch (kind) {
    case '+':
    case '-':
      r.type = kind == '+' ? RedisReply::Type::kStatus : RedisReply::Type::kError;
      r.str.assign(*line);
      pos = next;
      return std::optional<RedisReply>(std::move(r));
    case ':':
      if (!ParseInt(*line, n)) return Err(InvalidArgument("redis sent a bad integer reply"));
      r.type = RedisReply::Type::kInteger;
      r.integer = n;
      pos = next;
      return std::optional<RedisReply>(std::move(r));
    case '$':
      if (!ParseInt(*line, n) || n < -1) return Err(InvalidArgument("redis sent a bad bulk string length"));
      if (n == -1) {
        pos = next;
        return std::optional<RedisReply>(RedisReply{});
      }
      if (data.size() < next + static_cast<size_t>(n) + 2) return std::optional<RedisReply>();
      if (data.substr(next + static_cast<size_t>(n), 2) != "\r\n") {
        return Err(InvalidArgument("redis bulk string not followed by CRLF"));
      }
      r.type = RedisReply::Type::kString;
      if (build) r.str.assign(data.substr(next, static_cast<size_t>(n)));
      pos = next + static_cast<size_t>(n) + 2;
      return std::optional<RedisReply>(std::move(r));
    case '*': {
      if (!ParseInt(*line, n) || n < -1) return Err(InvalidArgument("redis sent a bad array length"));
      if (n == -1) {
        pos = next;
        return std::optional<RedisReply>(RedisReply{});
      }
      r.type = RedisReply::Type::kArray;
      size_t p = next;
      // Each element takes at least 3 bytes: do not reserve more than the
      // data could hold.
      if (build) r.elements.reserve(std::min<size_t>(static_cast<size_t>(n), (data.size() - p) / 3 + 1));
      for (int64_t i = 0; i < n; ++i) {
        auto e = ParseAt(data, p, depth + 1, build);
        if (!e) return Err(e.error());
        if (!*e) return std::optional<RedisReply>();
        if (build) r.elements.push_back(std::move(**e));
      }
      pos = p;
      return std::optional<RedisReply>(std::move(r));
    }
    default:
      return Err(InvalidArgument(std::string("redis sent an unknown reply type byte 0x") +
                                 "0123456789abcdef"[(static_cast<unsigned char>(kind) >> 4) & 0xf] +
                                 "0123456789abcdef"[static_cast<unsigned char>(kind) & 0xf]));
  }
}

}  // namespace

Result<std::optional<RedisReply>> ParseRedisReply(std::string_view data, size_t& consumed) {
  // Check first that the whole reply is there: a large reply arrives in many
  // reads, and building it on each try would copy it again and again.
  size_t pos = 0;
  auto whole = ParseAt(data, pos, 0, false);
  if (!whole || !*whole) return whole;
  pos = 0;
  auto r = ParseAt(data, pos, 0, true);
  if (r && *r) consumed = pos;
  return r;
}

void RedisPipeline::Begin(size_t n) {
  data_ += '*';
  data_ += std::to_string(n);
  data_ += "\r\n";
  ++count_;
}

void RedisPipeline::Arg(std::string_view a) {
  data_ += '$';
  data_ += std::to_string(a.size());
  data_ += "\r\n";
  data_.append(a);
  data_ += "\r\n";
}

void RedisPipeline::Add(std::initializer_list<std::string_view> args) {
  Begin(args.size());
  for (auto a : args) Arg(a);
}

void RedisPipeline::Add(const std::vector<std::string_view>& args) {
  Begin(args.size());
  for (auto a : args) Arg(a);
}

void RedisPipeline::Add(const std::vector<std::string>& args) {
  Begin(args.size());
  for (const auto& a : args) Arg(a);
}

// ---- connection ----

class RedisConnection::Impl {
 public:
  explicit Impl(RedisOptions options) : options_(std::move(options)), ssl_(asio::ssl::context::tls_client) {}

  Status Connect() {
    const auto deadline = std::chrono::steady_clock::now() + options_.connect_timeout;
    tcp::resolver resolver(io_);
    tcp::resolver::results_type endpoints;
    boost::system::error_code ec;
    bool done = false;
    resolver.async_resolve(options_.host, std::to_string(options_.port),
                           [&](const boost::system::error_code& e, tcp::resolver::results_type r) {
                             ec = e;
                             endpoints = std::move(r);
                             done = true;
                           });
    if (Status s = Run(done, deadline, [&] { resolver.cancel(); }); !s.ok()) return s;
    if (ec) return Unavailable("redis at " + options_.Address() + ": cannot resolve the host: " + ec.message());

    if (options_.tls) {
      if (Status s = SetUpTls(); !s.ok()) return s;
      tls_.emplace(io_, ssl_);
    } else {
      tcp_.emplace(io_);
    }
    done = false;
    asio::async_connect(socket(), endpoints, [&](const boost::system::error_code& e, const tcp::endpoint&) {
      ec = e;
      done = true;
    });
    if (Status s = Run(done, deadline, [&] { CloseSocket(); }); !s.ok()) return s;
    if (ec) return Unavailable("redis at " + options_.Address() + ": cannot connect: " + ec.message());
    socket().set_option(tcp::no_delay(true), ec);

    if (tls_) {
      if (!options_.tls_skip_verify) {
        SSL_set_tlsext_host_name(tls_->native_handle(), options_.host.c_str());
        tls_->set_verify_callback(asio::ssl::host_name_verification(options_.host), ec);
      }
      done = false;
      tls_->async_handshake(asio::ssl::stream_base::client, [&](const boost::system::error_code& e) {
        ec = e;
        done = true;
      });
      if (Status s = Run(done, deadline, [&] { CloseSocket(); }); !s.ok()) return s;
      if (ec) return Unavailable("redis at " + options_.Address() + ": TLS handshake failed: " + ec.message());
    }

    RedisPipeline hello;
    if (!options_.password.empty()) {
      if (options_.user.empty()) {
        hello.Add({"AUTH", options_.password});
      } else {
        hello.Add({"AUTH", options_.user, options_.password});
      }
    }
    const std::string db = std::to_string(options_.db);
    if (options_.db != 0) hello.Add({"SELECT", db});
    hello.Add({"PING"});
    auto replies = Execute(hello, std::chrono::milliseconds(0));
    if (!replies) return replies.error();
    size_t i = 0;
    if (!options_.password.empty()) {
      if ((*replies)[i].is_error()) {
        return PermissionDenied("redis at " + options_.Address() + " refused AUTH: " + (*replies)[i].str);
      }
      ++i;
    }
    for (; i < replies->size(); ++i) {
      const RedisReply& r = (*replies)[i];
      if (r.is_error()) {
        if (r.str.starts_with("NOAUTH")) {
          return PermissionDenied("redis at " + options_.Address() +
                                  " wants a password (redis://:PASSWORD@host:port): " + r.str);
        }
        return Unavailable("redis at " + options_.Address() + ": " + r.str);
      }
    }
    return Status::Ok();
  }

  Result<std::vector<RedisReply>> Execute(const RedisPipeline& pipeline, std::chrono::milliseconds block) {
    if (broken_) return Err(Unavailable("redis at " + options_.Address() + ": connection lost"));
    const auto deadline = std::chrono::steady_clock::now() + options_.io_timeout + block;
    boost::system::error_code ec;
    bool done = false;
    auto on_write = [&](const boost::system::error_code& e, size_t) {
      ec = e;
      done = true;
    };
    if (tls_) {
      asio::async_write(*tls_, asio::buffer(pipeline.data()), on_write);
    } else {
      asio::async_write(*tcp_, asio::buffer(pipeline.data()), on_write);
    }
    if (Status s = Run(done, deadline, [&] { CloseSocket(); }); !s.ok()) return Err(Broken(s));
    if (ec) return Err(Broken(Unavailable("redis at " + options_.Address() + ": write failed: " + ec.message())));

    std::vector<RedisReply> replies;
    replies.reserve(pipeline.size());
    while (replies.size() < pipeline.size()) {
      // Parse what is buffered; read more only when a reply is incomplete.
      while (replies.size() < pipeline.size()) {
        size_t consumed = 0;
        auto r = ParseRedisReply(std::string_view(rbuf_).substr(rpos_), consumed);
        if (!r) return Err(Broken(Unavailable("redis at " + options_.Address() + ": " + r.error().message())));
        if (!*r) break;
        rpos_ += consumed;
        replies.push_back(std::move(**r));
      }
      if (replies.size() == pipeline.size()) break;
      if (rpos_ > 0) {
        rbuf_.erase(0, rpos_);
        rpos_ = 0;
      }
      const size_t have = rbuf_.size();
      rbuf_.resize(have + kReadChunk);
      size_t got = 0;
      done = false;
      auto on_read = [&](const boost::system::error_code& e, size_t n) {
        ec = e;
        got = n;
        done = true;
      };
      if (tls_) {
        tls_->async_read_some(asio::buffer(rbuf_.data() + have, kReadChunk), on_read);
      } else {
        tcp_->async_read_some(asio::buffer(rbuf_.data() + have, kReadChunk), on_read);
      }
      Status s = Run(done, deadline, [&] { CloseSocket(); });
      rbuf_.resize(have + got);
      if (!s.ok()) return Err(Broken(s));
      if (ec) return Err(Broken(Unavailable("redis at " + options_.Address() + ": read failed: " + ec.message())));
    }
    if (rpos_ == rbuf_.size()) {
      rbuf_.clear();
      rpos_ = 0;
    }
    return replies;
  }

  bool broken() const { return broken_; }
  const RedisOptions& options() const { return options_; }

  ~Impl() { CloseSocket(); }

 private:
  static constexpr size_t kReadChunk = 64 << 10;

  tcp::socket::lowest_layer_type& socket() { return tls_ ? tls_->lowest_layer() : tcp_->lowest_layer(); }

  void CloseSocket() {
    boost::system::error_code ignored;
    if (tls_ || tcp_) socket().close(ignored);
  }

  Status SetUpTls() {
    boost::system::error_code ec;
    if (options_.tls_skip_verify) {
      ssl_.set_verify_mode(asio::ssl::verify_none, ec);
    } else {
      ssl_.set_verify_mode(asio::ssl::verify_peer, ec);
      if (options_.tls_ca_file.empty()) {
        ssl_.set_default_verify_paths(ec);
      } else {
        ssl_.load_verify_file(options_.tls_ca_file, ec);
      }
      if (ec) return InvalidArgument("redis TLS: cannot load CA file '" + options_.tls_ca_file + "': " + ec.message());
    }
    if (!options_.tls_cert_file.empty()) {
      ssl_.use_certificate_chain_file(options_.tls_cert_file, ec);
      if (ec)
        return InvalidArgument("redis TLS: cannot load certificate '" + options_.tls_cert_file + "': " + ec.message());
      ssl_.use_private_key_file(options_.tls_key_file.empty() ? options_.tls_cert_file : options_.tls_key_file,
                                asio::ssl::context::pem, ec);
      if (ec) return InvalidArgument("redis TLS: cannot load key '" + options_.tls_key_file + "': " + ec.message());
    }
    return Status::Ok();
  }

  // Runs the io_context until `done` or the deadline; on timeout `abort`
  // cancels the operation, which then completes with an error.
  template <typename Abort>
  Status Run(bool& done, std::chrono::steady_clock::time_point deadline, Abort abort) {
    io_.restart();
    while (!done && std::chrono::steady_clock::now() < deadline) {
      if (io_.run_one_until(deadline) == 0 && io_.stopped()) io_.restart();
    }
    if (done) return Status::Ok();
    abort();
    io_.restart();
    while (!done) io_.run_one();
    return Unavailable("redis at " + options_.Address() + ": timed out");
  }

  Status Broken(Status s) {
    broken_ = true;
    CloseSocket();
    return s;
  }

  RedisOptions options_;
  asio::io_context io_{1};
  asio::ssl::context ssl_;
  std::optional<tcp::socket> tcp_;
  std::optional<asio::ssl::stream<tcp::socket>> tls_;
  std::string rbuf_;
  size_t rpos_ = 0;
  bool broken_ = false;
};

RedisConnection::RedisConnection(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RedisConnection::~RedisConnection() = default;

Result<std::unique_ptr<RedisConnection>> RedisConnection::Connect(const RedisOptions& options) {
  // Asio and OpenSSL set-up report some failures (out of memory, a broken
  // OpenSSL) only by throwing: never let that end a thread.
  try {
    auto impl = std::make_unique<Impl>(options);
    if (Status s = impl->Connect(); !s.ok()) return Err(s);
    return std::unique_ptr<RedisConnection>(new RedisConnection(std::move(impl)));
  } catch (const std::exception& e) {
    return Err(Unavailable("redis at " + options.Address() + ": " + e.what()));
  }
}

Result<std::vector<RedisReply>> RedisConnection::Execute(const RedisPipeline& pipeline,
                                                         std::chrono::milliseconds block) {
  return impl_->Execute(pipeline, block);
}

Result<RedisReply> RedisConnection::Command(std::initializer_list<std::string_view> args,
                                            std::chrono::milliseconds block) {
  RedisPipeline p;
  p.Add(args);
  auto r = impl_->Execute(p, block);
  if (!r) return Err(r.error());
  RedisReply reply = std::move(r->front());
  if (reply.is_error()) return Err(Internal("redis at " + impl_->options().Address() + ": " + reply.str));
  return reply;
}

bool RedisConnection::broken() const {
  return impl_->broken();
}

const RedisOptions& RedisConnection::options() const {
  return impl_->options();
}

}  // namespace quern
