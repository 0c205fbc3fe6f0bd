#include "store/redis_client.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/write.hpp>
#include <charconv>
#include <cstring>
#include <tuple>
#include <utility>

#include "core/host_port.h"

namespace quern {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

std::string RedisOptions::Address() const {
  if (sentinels.empty()) return host + ":" + std::to_string(port);
  std::string out = "master '" + sentinel_master + "' via sentinel";
  out += sentinels.size() > 1 ? "s " : " ";
  for (size_t i = 0; i < sentinels.size(); ++i) {
    if (i > 0) out += ',';
    out += sentinels[i].host + ":" + std::to_string(sentinels[i].port);
  }
  return out;
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
                           " (expected redis://[[user]:password@]host[:port][/db], rediss://..., or "
                           "redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/master[/db], "
                           "each with an optional ?wait_replicas=N&wait_timeout_ms=T&sentinel_password=P)");
  };
  std::string_view rest;
  bool sentinel = false, known = false;
  for (auto [scheme, tls, sent] :
       {std::tuple{"redis://", false, false}, std::tuple{"rediss://", true, false},
        std::tuple{"redis+sentinel://", false, true}, std::tuple{"rediss+sentinel://", true, true}}) {
    if (url.starts_with(scheme)) {
      o.tls = tls;
      sentinel = sent;
      rest = url.substr(std::string_view(scheme).size());
      known = true;
      break;
    }
  }
  if (!known) return bad("the scheme must be redis://, rediss://, redis+sentinel:// or rediss+sentinel://");
  // authority [/path] [?query]; a password holding '/', '?' or '@' is
  // percent-encoded (RFC 3986).
  std::string_view authority = rest, path, query;
  if (auto q = rest.find('?'); q != std::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
    authority = rest;
  }
  if (auto slash = rest.find('/'); slash != std::string_view::npos) {
    path = rest.substr(slash + 1);
    authority = rest.substr(0, slash);
  }
  o.user.clear();
  o.password.clear();
  if (auto at = authority.rfind('@'); at != std::string_view::npos) {
    std::string_view userinfo = authority.substr(0, at);
    authority = authority.substr(at + 1);
    if (auto colon = userinfo.find(':'); colon != std::string_view::npos) {
      o.user = PercentDecode(userinfo.substr(0, colon));
      o.password = PercentDecode(userinfo.substr(colon + 1));
    } else {
      o.password = PercentDecode(userinfo);  // redis://secret@host: a password alone
    }
  }

  o.sentinels.clear();
  o.sentinel_master.clear();
  o.sentinel_password.clear();
  o.sentinel_first.reset();
  if (sentinel) {
    std::string_view hosts = authority;
    while (true) {
      const auto comma = hosts.find(',');
      RedisOptions::Endpoint e;
      if (std::string why = ParseHostPort(hosts.substr(0, comma), 26379, e.host, e.port); !why.empty()) {
        return bad("sentinel " + std::to_string(o.sentinels.size() + 1) + ": " + why);
      }
      o.sentinels.push_back(std::move(e));
      if (comma == std::string_view::npos) break;
      hosts = hosts.substr(comma + 1);
    }
    if (o.sentinels.size() > 64) return bad("more than 64 sentinels");
    std::string_view master = path.substr(0, path.find('/'));
    if (master.empty()) return bad("no master name after the sentinels (.../mymaster)");
    o.sentinel_master = PercentDecode(master);
    path = master.size() < path.size() ? path.substr(master.size() + 1) : std::string_view();
    o.sentinel_first = std::make_shared<std::atomic<size_t>>(0);
    o.host = o.sentinels.front().host;  // not used to connect: the sentinels name the master
    o.port = o.sentinels.front().port;
  } else {
    if (authority.find(',') != std::string_view::npos) {
      return bad("several hosts are sentinels: write redis+sentinel://h1,h2,h3/master");
    }
    if (std::string why = ParseHostPort(authority, 6379, o.host, o.port); !why.empty()) return bad(why);
  }
  o.db = 0;
  if (!path.empty()) {
    int64_t db = 0;
    if (!ParseInt(path, db) || db < 0 || db > 1 << 20) {
      return bad("database '" + std::string(path) + "' is not a number");
    }
    o.db = static_cast<int>(db);
  }

  o.wait_replicas = 0;
  o.wait_timeout = std::chrono::milliseconds(100);
  while (!query.empty()) {
    const auto amp = query.find('&');
    std::string_view item = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    if (item.empty()) continue;
    const auto eq = item.find('=');
    std::string_view key = item.substr(0, eq);
    std::string value = eq == std::string_view::npos ? std::string() : PercentDecode(item.substr(eq + 1));
    int64_t n = 0;
    if (key == "wait_replicas") {
      if (!ParseInt(value, n) || n < 0 || n > 1000) return bad("wait_replicas '" + value + "' is not 0-1000");
      o.wait_replicas = static_cast<int>(n);
    } else if (key == "wait_timeout_ms") {
      if (!ParseInt(value, n) || n < 1 || n > 60000) return bad("wait_timeout_ms '" + value + "' is not 1-60000");
      o.wait_timeout = std::chrono::milliseconds(n);
    } else if (key == "sentinel_password") {
      if (!sentinel) return bad("sentinel_password is only for redis+sentinel:// URLs");
      o.sentinel_password = value;
    } else {
      return bad("unknown option '" + std::string(key) + "'");
    }
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
// Not a RESP2 or RESP3 type byte: written over the '$' of a bulk string
// whose bytes are dropped.
constexpr char kOversizeMarker = '\x01';

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
    case kOversizeMarker:
      // A bulk string dropped as it arrived (MarkOversizeBulks): its length.
      if (!ParseInt(*line, n) || n < 0) return Err(InvalidArgument("bad oversize marker"));
      r.type = RedisReply::Type::kString;
      r.oversize = n;
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

size_t MarkOversizeBulks(std::string& buf, size_t& scan, size_t& skip, size_t max_bulk) {
  size_t dropped = 0;
  auto drop = [&](size_t at, size_t n) {
    buf.erase(at, n);
    dropped += n;
  };
  if (skip > 0) {
    const size_t n = std::min(skip, buf.size() - std::min(scan, buf.size()));
    drop(scan, n);
    skip -= n;
    if (skip > 0) return dropped;
  }
  while (scan < buf.size()) {
    size_t next = 0;
    auto line = Line(buf, scan + 1, next);
    if (!line) break;  // the token's line is not all here yet
    if (buf[scan] != '$') {
      scan = next;  // arrays, integers, simple strings, markers: the line is the token
      continue;
    }
    int64_t n = 0;
    if (!ParseInt(*line, n) || n < 0) {
      scan = next;  // nil, or garbage the parser will refuse
      continue;
    }
    if (static_cast<uint64_t>(n) <= max_bulk) {
      if (buf.size() < next + static_cast<size_t>(n) + 2) break;  // the payload is not all here yet
      scan = next + static_cast<size_t>(n) + 2;
      continue;
    }
    buf[scan] = kOversizeMarker;
    const size_t total = static_cast<size_t>(n) + 2;  // the payload and its CRLF
    const size_t here = std::min(total, buf.size() - next);
    drop(next, here);
    scan = next;
    skip = total - here;
    if (skip > 0) break;
  }
  return dropped;
}

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

void RedisPipeline::AddViewing(std::initializer_list<std::string_view> args, std::string_view viewed,
                               std::shared_ptr<const void> owner) {
  AddViewing(std::vector<std::string_view>(args), viewed, std::move(owner));
}

void RedisPipeline::AddViewing(const std::vector<std::string_view>& args, std::string_view viewed,
                               std::shared_ptr<const void> owner) {
  Begin(args.size() + 1);
  for (auto a : args) Arg(a);
  data_ += '$';
  data_ += std::to_string(viewed.size());
  data_ += "\r\n";
  views_.push_back({data_.size(), viewed, std::move(owner)});
  viewed_bytes_ += viewed.size();
  data_ += "\r\n";
}

void RedisPipeline::Append(const RedisPipeline& other) {
  const size_t base = data_.size();
  data_ += other.data_;
  for (const View& v : other.views_) views_.push_back({base + v.at, v.bytes, v.owner});
  viewed_bytes_ += other.viewed_bytes_;
  count_ += other.count_;
}

std::string RedisPipeline::Joined() const {
  std::string out;
  out.reserve(bytes());
  for (std::string_view piece : Pieces()) out.append(piece);
  return out;
}

std::vector<std::string_view> RedisPipeline::Pieces() const {
  std::vector<std::string_view> out;
  out.reserve(2 * views_.size() + 1);
  const std::string_view all(data_);
  size_t from = 0;
  for (const View& v : views_) {
    if (v.at > from) out.push_back(all.substr(from, v.at - from));
    if (!v.bytes.empty()) out.push_back(v.bytes);
    from = v.at;
  }
  if (from < all.size()) out.push_back(all.substr(from));
  return out;
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
    std::vector<asio::const_buffer> buffers;
    for (std::string_view piece : pipeline.Pieces()) buffers.emplace_back(piece.data(), piece.size());
    if (tls_) {
      asio::async_write(*tls_, buffers, on_write);
    } else {
      asio::async_write(*tcp_, buffers, on_write);
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
        scan_ = scan_ > rpos_ ? scan_ - rpos_ : 0;
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
      if (options_.max_bulk_bytes > 0 && got > 0) {
        if (scan_ < rpos_) scan_ = rpos_;
        (void)MarkOversizeBulks(rbuf_, scan_, skip_, options_.max_bulk_bytes);
      }
      if (!s.ok()) return Err(Broken(s));
      if (ec) return Err(Broken(Unavailable("redis at " + options_.Address() + ": read failed: " + ec.message())));
    }
    if (rpos_ == rbuf_.size()) {
      rbuf_.clear();
      rpos_ = 0;
      scan_ = 0;
    }
    // A replica now (a failover demoted this server): the master is
    // elsewhere; the owner connects again (with sentinels, to the new one).
    for (const RedisReply& r : replies) {
      if (r.is_error() && r.str.starts_with("READONLY")) {
        broken_ = true;
        CloseSocket();
        break;
      }
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
  // With max_bulk_bytes: where MarkOversizeBulks goes on in rbuf_, and the
  // bytes of a dropped bulk string still to come.
  size_t scan_ = 0, skip_ = 0;
  size_t rpos_ = 0;
  bool broken_ = false;
};

RedisConnection::RedisConnection(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RedisConnection::~RedisConnection() = default;

namespace {

Result<std::unique_ptr<RedisConnection::Impl>> ConnectTo(const RedisOptions& options) {
  // Asio and OpenSSL set-up report some failures (out of memory, a broken
  // OpenSSL) only by throwing: never let that end a thread.
  try {
    auto impl = std::make_unique<RedisConnection::Impl>(options);
    if (Status s = impl->Connect(); !s.ok()) return Err(s);
    return impl;
  } catch (const std::exception& e) {
    return Err(Unavailable("redis at " + options.Address() + ": " + e.what()));
  }
}

// One reply to a command, or what went wrong as text.
Result<RedisReply> Ask(RedisConnection::Impl& c, std::initializer_list<std::string_view> args) {
  RedisPipeline p;
  p.Add(args);
  auto r = c.Execute(p, std::chrono::milliseconds(0));
  if (!r) return Err(r.error());
  if (r->front().is_error()) return Err(Unavailable(r->front().str));
  return std::move(r->front());
}

}  // namespace

// Sentinel clients as Redis documents them: ask each sentinel in turn (the
// one that answered last first) for the master's address, connect, and
// check with ROLE that the server is the master (during a failover a
// sentinel can still name the old one).
Result<std::unique_ptr<RedisConnection>> RedisConnection::Connect(const RedisOptions& options) {
  if (options.sentinels.empty()) {
    auto impl = ConnectTo(options);
    if (!impl) return Err(impl.error());
    return std::unique_ptr<RedisConnection>(new RedisConnection(std::move(*impl)));
  }
  const size_t n = options.sentinels.size();
  const size_t first = options.sentinel_first ? options.sentinel_first->load(std::memory_order_relaxed) % n : 0;
  std::string why;
  auto note = [&](const std::string& s) { why += (why.empty() ? "" : "; ") + s; };
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (first + k) % n;
    RedisOptions so = options;
    so.sentinels.clear();
    so.host = options.sentinels[i].host;
    so.port = options.sentinels[i].port;
    so.db = 0;
    so.user = options.sentinel_user;
    so.password = options.sentinel_password;
    const std::string sentinel = "sentinel " + so.Address();
    auto sc = ConnectTo(so);
    if (!sc) {
      if (sc.error().code() == StatusCode::kPermissionDenied) {
        note(sc.error().message() + " (a sentinel's password goes in ?sentinel_password=)");
      } else {
        note(sc.error().message());
      }
      continue;
    }
    auto addr = Ask(**sc, {"SENTINEL", "get-master-addr-by-name", options.sentinel_master});
    if (!addr) {
      note(sentinel + ": " + addr.error().message());
      continue;
    }
    int64_t port = 0;
    if (addr->is_nil()) {
      note(sentinel + " does not know a master named '" + options.sentinel_master + "'");
      continue;
    }
    if (!addr->is_array() || addr->elements.size() != 2 || !addr->elements[0].is_string() ||
        !ParseInt(addr->elements[1].str, port) || port <= 0 || port > 65535) {
      note(sentinel + " answered get-master-addr-by-name with something that is not an address");
      continue;
    }
    if (options.sentinel_first) options.sentinel_first->store(i, std::memory_order_relaxed);
    RedisOptions mo = options;
    mo.sentinels.clear();
    mo.sentinel_first.reset();
    mo.host = addr->elements[0].str;
    mo.port = static_cast<int>(port);
    auto mc = ConnectTo(mo);
    if (!mc) {
      return Err(Status(mc.error().code(), "redis " + options.Address() + ": " + sentinel + " names " + mo.Address() +
                                               ", which failed: " + mc.error().message()));
    }
    auto role = Ask(**mc, {"ROLE"});
    if (!role || !role->is_array() || role->elements.empty() || role->elements[0].str != "master") {
      return Err(Unavailable("redis " + options.Address() + ": " + sentinel + " names " + mo.Address() +
                             ", which is not a master (" +
                             (!role                                         ? role.error().message()
                              : role->is_array() && !role->elements.empty() ? role->elements[0].str
                                                                            : std::string("no role")) +
                             "): a failover is under way"));
    }
    return std::unique_ptr<RedisConnection>(new RedisConnection(std::move(*mc)));
  }
  return Err(Unavailable("redis " + options.Address() + ": no sentinel named the master: " + why));
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
