#include "frontends/http/http_server.h"

#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>

// GCC 12 with sanitizers reports a boost::optional inside Beast's parser as
// maybe-uninitialized (a false positive in Beast's own code).
#if defined(__clang__)
#include <boost/beast/http.hpp>
#else
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <boost/beast/http.hpp>
#pragma GCC diagnostic pop
#endif
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory_resource>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "core/cpus.h"
#include "core/log.h"
#include "core/memory.h"
#include "frontends/http/content_encoding.h"
#include "frontends/http/tls_context.h"

namespace quern {

namespace asio = boost::asio;
namespace ssl = boost::asio::ssl;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {

// A chunked body is read in pieces of this size (the read buffer of a
// connection grows to it only when a request needs it).
constexpr size_t kMaxReadChunk = 64 * 1024;
// Bodies from this size on are read with their head when the request before
// on the connection had the same head and body lengths (ReadLikeTheLast):
// smaller ones mostly arrive whole in the head's first read anyway.
constexpr size_t kPredictMinBody = 4096;
// Nor above this size: their copy outweighs the recv saved, and a wrong
// guess would reserve that much for a request that turns out smaller.
constexpr size_t kPredictMaxBody = 1 << 20;
// Connections over the limit are still answered (503) while there are fewer
// than this many of them; beyond, they are closed without a word.
constexpr int kMaxRejecting = 64;
// How long a closing connection may take to send its last bytes to us.
constexpr int64_t kLingerNs = 2'000'000'000;
constexpr auto kSweepInterval = std::chrono::milliseconds(500);
// A request body must average HttpServerOptions::min_body_bytes_per_s from
// this long after it began.
constexpr int64_t kBodyRateGraceNs = 5'000'000'000;
// Under connection pressure a body averaging less than this, a second or
// more after it began, is closed first (with idle connections).
constexpr size_t kEvictableBodyRate = 64 << 10;
constexpr int64_t kEvictableBodyGraceNs = 1'000'000'000;
// After the server refused a request (503, 429), its I/O threads preempt
// computation to read (and refuse) the next ones at once for this long.
constexpr int64_t kUrgentNs = 1'000'000'000;

std::string JsonError(const std::string& message) {
  std::string out = "{\"error\":\"";
  for (char c : message) {
    if (c == '"' || c == '\\') out += '\\';
    out += (static_cast<unsigned char>(c) < 0x20) ? ' ' : c;
  }
  return out + "\"}";
}

// A limited warning log: at most one line per second per call site.
void WarnRateLimited(std::atomic<int64_t>& last_ns, int64_t now, const char* message) {
  int64_t last = last_ns.load(std::memory_order_relaxed);
  if (now - last < 1'000'000'000 || !last_ns.compare_exchange_strong(last, now)) return;
  Log(LogLevel::kWarning, message);
}

class Session;

// One I/O thread with its own io_context: a connection's handlers all run on
// its loop's thread, so no strand is needed.
struct Loop {
  asio::io_context io{1};
  asio::steady_timer sweep_timer{io};
  std::vector<std::weak_ptr<Session>> sessions;  // loop thread only
  // The oldest idle sessions found by the last scan, oldest last; popped
  // (and checked again) to make room for new connections. Loop thread only.
  std::vector<std::pair<int64_t, std::weak_ptr<Session>>> evictable;
  // Sink for bytes read and dropped (bodies answered early, input while
  // closing): one read takes what a socket buffer holds.
  std::vector<char> discard = std::vector<char>(size_t{64} << 10);
  // The session whose request was handled last (compared, never followed;
  // see HttpRequest::lone_client). Loop thread only.
  const void* last_client = nullptr;
  // Whether this loop's thread preempts computation when it wakes (short
  // slices) or waits for it (SCHED_BATCH). Loop thread only.
  bool urgent = false;
  // This thread's lender while it runs batches (one usable core), and
  // when it last looked at their queues. Loop thread only.
  CallerLoop* lender = nullptr;
  int64_t lent_at_ns = 0;
  std::thread thread;

  // Loop thread, before each request is read: the queued batches run
  // between a pass's handlers too once the pass has taken kLendPassNs (a
  // connection that always has its next request ready, a flood of
  // pipelined cheap requests, keeps a pass going for as long as it lasts).
  static constexpr int64_t kLendPassNs = 1'000'000;
  void LendIfLate(int64_t now) {
    if (lender == nullptr || now - lent_at_ns < kLendPassNs) return;
    lent_at_ns = now;
    int64_t wait_ns = 0;
    lender->RunDue(&wait_ns);
  }

  // Loop thread, before each request is read and at each sweep: while the
  // server refuses work (overloaded, rate-limited) this thread runs at once on
  // a core busy with inference, so that refusals go out in a millisecond;
  // otherwise it waits for the running batch instead of preempting it (which
  // saves the batch its context switches: ~5 µs of CPU per 48 KiB request at
  // 16 connections on one core).
  void FollowRefusals(int64_t last_refusal_ns, int64_t now) {
    const bool want = last_refusal_ns != 0 && now - last_refusal_ns < kUrgentNs;
    if (want == urgent) return;
    urgent = want;
    urgent ? PreferShortSlices() : DeferToRunningThreads();
    // Refusals go out between batches: none runs here meanwhile.
    if (lender != nullptr) lender->set_paused(want);
  }
};

struct Shared {
  HttpServerOptions options;
  const Clock* clock = &RealClockInstance();  // options.clock when given
  int64_t NowNs() const { return clock->NowNs(); }
  HttpHandler handler;
  HttpHeadCheck head_check;       // may be empty
  std::atomic<int> open{0};       // served connections
  std::atomic<int> rejecting{0};  // over-limit connections being answered 503
  std::atomic<int64_t> last_limit_warning{0};
  std::atomic<int64_t> last_slow_body_warning{0};
  std::atomic<int64_t> last_refusal_ns{0};  // when a request was last answered 503 or 429
  std::unique_ptr<ssl::context> tls;        // null: plaintext
  std::atomic<int> writing{0};              // responses handed to a loop thread, not yet written
  // Compressed bodies are inflated here, one at a time, never on a loop
  // thread: a body that takes long to inflate delays no other connection
  // (only other compressed bodies).
  std::unique_ptr<asio::thread_pool> inflater = std::make_unique<asio::thread_pool>(1);
  // Request ids the server makes: a random prefix per server and a count.
  const uint32_t id_prefix = std::random_device{}();
  std::atomic<uint64_t> next_id{0};
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, Loop& loop, Shared& shared, bool reject)
      : fd_(socket.native_handle()), loop_(loop), shared_(shared), reject_(reject) {
    if (shared_.options.access_log) {
      beast::error_code ec;
      const auto peer = socket.remote_endpoint(ec);
      if (!ec) client_ = peer.address().to_string();
    }
    if (shared_.tls) {
      tls_.emplace(std::move(socket), *shared_.tls);
    } else {
      plain_.emplace(std::move(socket));
    }
  }

  ~Session() {
    if (counted_) (reject_ ? shared_.rejecting : shared_.open).fetch_sub(1, std::memory_order_relaxed);
  }

  void Start() {
    if (!tls_) return ReadNext();
    handshaking_ = true;
    const int64_t now = shared_.NowNs();
    idle_since_ns_.store(now, std::memory_order_relaxed);
    deadline_ns_.store(now + int64_t{shared_.options.read_timeout_s} * 1'000'000'000, std::memory_order_release);
    tls_->async_handshake(ssl::stream_base::server, [self = shared_from_this()](beast::error_code ec) {
      self->handshaking_ = false;
      if (ec) return self->HardClose();
      self->ReadNext();
    });
  }

  // Loop thread: when the connection waits for a request whose head has not
  // all arrived (none of it, or a part), since when (steady clock ns) it
  // waits for it; otherwise 0. The longest waiting make room first: a head
  // dripping in for long is as evictable as a connection that says nothing.
  int64_t IdleSince() const {
    if (reject_ || closing_ || closed_) return 0;
    if (handshaking_) return idle_since_ns_.load(std::memory_order_relaxed);
    // A body arriving slower than kEvictableBodyRate is as evictable as an
    // idle connection, from when it began: under connection pressure the
    // slowest uploads make room first.
    if (reading_ && body_started_ns_ > 0) {
      return BodyRateBelow(shared_.NowNs(), kEvictableBodyRate, kEvictableBodyGraceNs) ? body_started_ns_ : 0;
    }
    if (reading_) return parser_ && !parser_->is_header_done() ? idle_since_ns_.load(std::memory_order_relaxed) : 0;
    // Between requests a keep-alive connection waits on the watch: idle
    // once its response is out (nothing is sending on it any more).
    const uint32_t state = state_.load(std::memory_order_acquire);
    if ((state & kResponded) && !(state & kWatchFired) && !pipelined_) {
      return idle_since_ns_.load(std::memory_order_relaxed);
    }
    return 0;
  }

  // Loop thread: whether the body being read has come at less than `rate`
  // bytes a second on average since it began, `grace_ns` or more ago.
  bool BodyRateBelow(int64_t now, size_t rate, int64_t grace_ns) const {
    if (!reading_ || body_started_ns_ == 0 || rate == 0) return false;
    const int64_t elapsed = now - body_started_ns_;
    if (elapsed < grace_ns) return false;
    const size_t have = body_by_length_ ? body_have_ : (parser_ ? parser_->get().body().size() : 0);
    return static_cast<double>(have) < static_cast<double>(rate) * static_cast<double>(elapsed) * 1e-9;
  }

  // Loop thread: closes an idle connection to make room for a new one,
  // which takes over its place in the open-connection count.
  void Evict() {
    counted_ = false;
    HardClose();
  }

  // Loop thread: closes the connection when its idle, head, read or write
  // time is up.
  void Sweep(int64_t now) {
    if (closed_) return;
    int64_t deadline = deadline_ns_.load(std::memory_order_acquire);
    if (deadline == 0) return;  // a request is in flight: the engine's timeouts govern it
    const bool head_started = reading_ && parser_ && (parser_->got_some() || buffer_.size() > 0);
    if (head_started && !read_clock_started_) {
      read_clock_started_ = true;
      deadline = std::min(deadline, now + int64_t{shared_.options.read_timeout_s} * 1'000'000'000);
      deadline_ns_.store(deadline, std::memory_order_release);
      head_deadline_ns_ = now + int64_t{shared_.options.header_timeout_s} * 1'000'000'000;
    }
    const bool head_late = head_started && !parser_->is_header_done() && now >= head_deadline_ns_;
    if (now >= deadline || head_late) return HardClose();
    if (BodyRateBelow(now, shared_.options.min_body_bytes_per_s, kBodyRateGraceNs)) {
      WarnRateLimited(shared_.last_slow_body_warning, now,
                      "closing HTTP connections whose request body arrives slower than --http-min-body-rate");
      HardClose();
    }
  }

 private:
  enum : uint32_t { kResponded = 1, kWatchFired = 2 };

  // Loop thread.
  void ReadNext() {
    if (closing_ || closed_) return;
    if (discard_ > 0) return SkipBody();
    body_pre_ = 0;
    // A wrong guess of ReadLikeTheLast may have grown the read buffer to a
    // body's size: an idle connection keeps no more than a read's worth.
    if (buffer_.size() == 0 && buffer_.capacity() > kMaxReadChunk) buffer_.shrink_to_fit();
    parser_.reset();  // the previous request's fields go before their memory is reused
    fields_arena_.release();
    parser_.emplace(std::piecewise_construct, std::make_tuple(), std::make_tuple(FieldsAllocator(&fields_arena_)));
    head_ = false;
    parser_->header_limit(static_cast<uint32_t>(std::min<size_t>(shared_.options.max_header_bytes, UINT32_MAX)));
    parser_->body_limit(shared_.options.max_body_bytes);
    reading_ = true;
    read_clock_started_ = false;
    const int64_t now = shared_.NowNs();
    loop_.FollowRefusals(shared_.last_refusal_ns.load(std::memory_order_relaxed), now);
    loop_.LendIfLate(now);
    idle_since_ns_.store(now, std::memory_order_relaxed);
    deadline_ns_.store(now + int64_t{shared_.options.idle_timeout_s} * 1'000'000'000, std::memory_order_release);
    if (ReadLikeTheLast()) return;
    WithStream([&](auto& stream) {
      http::async_read_header(stream, buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, size_t n) {
        self->Predict(ec ? 0 : n);
        self->OnHeader(ec);
      });
    });
  }

  // After a head of `head_bytes` was read the usual way: a request with a
  // body of known length (kPredictMinBody to kPredictMaxBody) lets the next
  // read expect the same head and body lengths (clients send alike requests).
  // A prediction is armed by two requests in a row with the same lengths:
  // a client whose bodies vary (JSON of different sizes) never pays for a
  // wrong guess.
  void Predict(size_t head_bytes) {
    size_t len = 0;
    if (head_bytes == 0 || tls_ || parser_->chunked() || !KnownLength(len) || len < kPredictMinBody ||
        len > kPredictMaxBody) {
      len = head_bytes = 0;
    }
    const bool again = head_bytes > 0 && head_bytes == last_head_ && len == last_body_;
    last_head_ = head_bytes;
    last_body_ = len;
    predicted_head_ = again ? head_bytes : 0;
    predicted_body_ = again ? len : 0;
  }

  // Loop thread, from ReadNext: when the last request predicts this one,
  // reads head and body with one recvmsg, the head into the read buffer
  // and the body straight into its string (a second recv saved). At most
  // the predicted bytes are read, so nothing of a following request is.
  // Whatever the head turns out to be, the bytes go where the usual path
  // expects them; returns false (nothing read) when the usual read should
  // run instead.
  bool ReadLikeTheLast() {
    const size_t head = predicted_head_, len = predicted_body_;
    if (head == 0 || tls_ || buffer_.size() > 0) return false;
    // Room for the body, its contents written below.
    body_ = TakeBodyBuffer(len);
    const auto area = buffer_.prepare(head);
    iovec iov[2] = {{area.data(), head}, {body_.data(), len}};
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = 2;
    const ssize_t n = ::recvmsg(fd_, &msg, MSG_DONTWAIT);
    if (n <= 0) {
      GiveBodyBuffer(std::move(body_));  // nothing yet, the end or an error: the usual read finds out the same
      return false;
    }
    buffer_.commit(std::min(static_cast<size_t>(n), head));
    const size_t in_body = static_cast<size_t>(n) > head ? static_cast<size_t>(n) - head : 0;
    beast::error_code ec;
    // What the parser takes is consumed (it may take the request line of a
    // head that is not complete yet, as when Beast reads).
    const size_t used = parser_->put(buffer_.data(), ec);
    buffer_.consume(used);
    if (ec == http::error::need_more) ec = {};
    size_t got = 0;
    const bool alike =
        !ec && parser_->is_header_done() && used == head && !parser_->chunked() && KnownLength(got) && got == len;
    if (alike) {
      body_pre_ = in_body;
      return OnHeader({}), true;
    }
    // Not alike: the body's bytes join the head's in the read buffer (a
    // copy, only on a wrong guess) and the usual path parses them; ReadNext
    // gives back what the buffer grew by once it is empty again.
    predicted_head_ = predicted_body_ = 0;
    if (in_body > 0) {
      auto more = buffer_.prepare(in_body);
      std::memcpy(more.data(), body_.data(), in_body);
      buffer_.commit(in_body);
    }
    GiveBodyBuffer(std::move(body_));
    if (ec) return OnHeader(ec), true;
    if (parser_->is_header_done()) {
      Predict(used);
      return OnHeader({}), true;
    }
    // The head is not complete yet: Beast reads on from what the buffer
    // holds (the head's length is what the parser took here and there).
    WithStream([&](auto& stream) {
      http::async_read_header(stream, buffer_, *parser_,
                              [self = shared_from_this(), used](beast::error_code e, size_t m) {
                                self->Predict(e ? 0 : used + m);
                                self->OnHeader(e);
                              });
    });
    return true;
  }

  void OnHeader(beast::error_code ec) {
    if (ec) return OnReadError(ec);
    if (reject_) return Reject();
    const auto& msg = parser_->get();
    request_ = HttpRequest();
    request_.method = std::string(msg.method_string());
    request_.target = std::string(msg.target());
    if (shared_.options.access_log) {
      access_start_ns_ = shared_.NowNs();
      access_method_ = request_.method;
      access_target_ = request_.target;
      access_bytes_ = 0;
    }
    request_.headers.reserve(16);
    for (const auto& f : msg) {
      std::string name(f.name_string());
      for (auto& c : name) c = (c >= 'A' && c <= 'Z') ? static_cast<char>(c + ('a' - 'A')) : c;  // ASCII, no locale
      request_.headers.emplace_back(std::move(name), std::string(f.value()));
    }
    request_id_.clear();
    if (std::string_view id = request_.Header("x-request-id"); UsableRequestId(id)) {
      request_id_ = id;
    } else if (shared_.options.access_log) {
      char made[32];
      const uint64_t n = shared_.next_id.fetch_add(1, std::memory_order_relaxed);
      std::snprintf(made, sizeof made, "%08x%012llx", shared_.id_prefix,
                    static_cast<unsigned long long>(n & 0xffffffffffffULL));
      request_id_ = made;
    }
    request_.request_id = request_id_;
    keep_alive_ = msg.keep_alive();
    http10_ = msg.version() == 10;
    head_ = msg.method() == http::verb::head;
    // Transfer-Encoding: "chunked" alone is read (Beast frames it). Another
    // coding, a list ("chunked, gzip", "gzip, chunked") or the field twice
    // leaves the body's length to rules a proxy in front may apply
    // differently (request smuggling): refused, and the connection closed
    // (RFC 9112 6.1, 6.3).
    if (std::string_view bad = UnreadableTransferEncoding(); !bad.empty()) {
      return Fail(400, "Transfer-Encoding '" + std::string(bad.substr(0, 64)) +
                           "' is not supported: a request body is sent whole (Content-Length) or as one "
                           "'Transfer-Encoding: chunked'");
    }
    // The head alone may settle the request (a key missing, a queue full):
    // answered before a byte of the body is read.
    if (shared_.head_check) {
      if (auto early = shared_.head_check(request_)) return RespondEarly(std::move(*early));
    }
    if (parser_->is_done()) return Dispatch();
    // "Expect: 100-continue": the client waits for a word before it sends
    // the body (curl does for bodies over 1 MiB, for a second): given now.
    if (ExpectsContinue()) {
      static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      if (tls_) {
        asio::async_write(*tls_, asio::buffer(kContinue.data(), kContinue.size()),
                          [self = shared_from_this()](beast::error_code e, size_t) {
                            if (e) return self->HardClose();
                            self->ReadBody();
                          });
        return;
      }
      // 25 bytes into a send buffer that holds nothing (the previous
      // response is out); should it not take them, the client sends the
      // body after its own wait.
      (void)::send(fd_, kContinue.data(), kContinue.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    ReadBody();
  }

  // The request's Transfer-Encoding when it is anything but one field
  // saying "chunked" (any case, spaces around it); empty when absent or fine.
  std::string_view UnreadableTransferEncoding() const {
    std::string_view first;
    int fields = 0;
    for (const auto& [k, v] : request_.headers) {
      if (k != "transfer-encoding") continue;
      if (++fields == 1) first = v;
    }
    if (fields == 0) return {};
    std::string_view t = first;
    while (!t.empty() && (t.front() == ' ' || t.front() == '\t')) t.remove_prefix(1);
    while (!t.empty() && (t.back() == ' ' || t.back() == '\t')) t.remove_suffix(1);
    const bool chunked = t.size() == 7 && std::equal(t.begin(), t.end(), "chunked", [](char a, char b) {
                           return std::tolower(static_cast<unsigned char>(a)) == b;
                         });
    if (fields == 1 && chunked) return {};
    return first.empty() ? std::string_view("(empty)") : first;
  }

  bool ExpectsContinue() const {
    if (http10_) return false;
    const std::string_view v = request_.Header("expect");
    return v.size() == 12 && std::equal(v.begin(), v.end(), "100-continue", [](char a, char b) {
             return std::tolower(static_cast<unsigned char>(a)) == b;
           });
  }

  // Loop thread: reads the body of the request whose head is in request_.
  void ReadBody() {
    body_started_ns_ = shared_.NowNs();
    body_have_ = 0;
    size_t len = 0;
    if (!parser_->chunked() && KnownLength(len) && body_pre_ > 0) {
      // Read with the head (ReadLikeTheLast): body_ holds len bytes' room
      // and the first body_pre_ of them.
      return ReadBodyRest(std::exchange(body_pre_, 0), len);
    }
    if (!parser_->chunked() && KnownLength(len)) {
      // A body of known length (already checked against the limit) is read
      // straight into the request's string: one copy, from the kernel.
      const size_t have = std::min(len, buffer_.size());
      // Every byte written: these and the rest read below. (Room taken with
      // the head but not filled, as after 100-continue, goes back first.)
      GiveBodyBuffer(std::move(body_));
      body_ = TakeBodyBuffer(len);
      if (have > 0) std::memcpy(body_.data(), buffer_.data().data(), have);
      buffer_.consume(have);
      return ReadBodyRest(have, len);
    }
    // Chunked: Beast's parser assembles the body.
    if (buffer_.capacity() < kMaxReadChunk) buffer_.reserve(kMaxReadChunk);
    WithStream([&](auto& stream) {
      http::async_read(stream, buffer_, *parser_,
                       [self = shared_from_this()](beast::error_code e, size_t) { self->OnBody(e); });
    });
  }

  // Loop thread: body_ holds room for a body of `len` bytes and its first
  // `have`; reads the rest straight into it, then dispatches.
  void ReadBodyRest(size_t have, size_t len) {
    body_by_length_ = true;
    body_have_ = have;
    if (have == len) return Dispatch();
    WithStream([&](auto& stream) {
      // The condition sees each read's progress: what the body rate reads.
      asio::async_read(
          stream, asio::buffer(body_.data() + have, len - have),
          [this, have, rest = len - have](const beast::error_code& e, size_t n) -> size_t {
            body_have_ = have + n;
            return e ? 0 : rest - n;
          },
          [self = shared_from_this()](beast::error_code e, size_t) {
            if (e == asio::error::eof || e == ssl::error::stream_truncated) {
              e = http::error::partial_message;
            }
            self->OnBody(e);
          });
    });
  }

  void OnBody(beast::error_code ec) {
    if (ec) return OnReadError(ec);
    Dispatch();
  }

  void OnReadError(beast::error_code ec) {
    reading_ = false;
    if (ec == asio::error::operation_aborted || closed_) return;
    if (ec == http::error::end_of_stream || ec == asio::error::eof || ec == asio::error::connection_reset ||
        ec == http::error::partial_message || ec == ssl::error::stream_truncated) {
      return HardClose();
    }
    if (reject_) return Reject();
    if (ec == http::error::body_limit) {
      return Fail(413, "request body exceeds the limit of " + std::to_string(shared_.options.max_body_bytes) +
                           " bytes (--http-max-body-bytes)");
    }
    if (ec == http::error::header_limit) {
      return Fail(431, "request line and headers exceed the limit of " +
                           std::to_string(shared_.options.max_header_bytes) + " bytes (--http-max-header-bytes)");
    }
    return Fail(400, "malformed HTTP request: " + ec.message());
  }

  void Reject() {
    Fail(503, "too many open connections (limit " + std::to_string(shared_.options.max_connections) +
                  ", --http-max-connections); try again later");
  }

  // Answers an error and closes the connection.
  void Fail(int status, std::string message) {
    reading_ = false;
    keep_alive_ = false;
    HttpResponse r;
    r.status = status;
    r.body = JsonError(message);
    Respond(std::move(r));
  }

  // The request's Content-Length, when its head is parsed and has one: the
  // value the parser frames the body by (it checked the field, repeats and
  // lists included), not a second reading of the field (a lookup by name).
  bool KnownLength(size_t& len) const {
    if (!parser_->is_header_done()) return false;
    const auto n = parser_->content_length();
    if (!n) return false;
    len = static_cast<size_t>(*n);
    return true;
  }

  // Loop thread: answers from the request's head; the body (if any) is not
  // read. A body of known length is skipped before the next request (the
  // client may go on sending it after our answer, as HTTP/1.1 allows);
  // otherwise the connection closes after the answer.
  void RespondEarly(HttpResponse r) {
    reading_ = false;
    size_t len = 0;
    if (!parser_->is_done()) {
      // A client that expected "100 Continue" may send its body or not:
      // only closing keeps the connection's bytes in step.
      if (!ExpectsContinue() && !parser_->chunked() && KnownLength(len)) {
        const size_t pre = std::min(len, std::exchange(body_pre_, 0));  // read with the head already
        GiveBodyBuffer(std::move(body_));  // that room is not needed while the rest is skipped
        const size_t have = std::min(len - pre, buffer_.size());
        buffer_.consume(have);
        discard_ = len - pre - have;
      } else {
        keep_alive_ = false;
      }
    }
    request_ = HttpRequest();
    state_.store(0, std::memory_order_relaxed);
    deadline_ns_.store(0, std::memory_order_release);
    pipelined_ = true;  // the next read (or the skip) starts as soon as the answer is out
    Respond(std::move(r));
  }

  // Loop thread: reads and drops the rest of a body that was answered
  // early, then the next request. Bounded by the read timeout.
  void SkipBody() {
    if (closing_ || closed_) return;
    const size_t from_buffer = std::min(discard_, buffer_.size());
    buffer_.consume(from_buffer);
    discard_ -= from_buffer;
    if (discard_ == 0) return ReadNext();
    reading_ = true;
    deadline_ns_.store(shared_.NowNs() + int64_t{shared_.options.read_timeout_s} * 1'000'000'000,
                       std::memory_order_release);
    WithStream([&](auto& stream) {
      stream.async_read_some(asio::buffer(loop_.discard.data(), std::min(discard_, loop_.discard.size())),
                             [self = shared_from_this()](beast::error_code ec, size_t n) {
                               self->reading_ = false;
                               if (ec) return self->HardClose();
                               self->discard_ -= std::min(n, self->discard_);
                               self->SkipBody();
                             });
    });
  }

  void Dispatch() {
    reading_ = false;
    body_started_ns_ = 0;
    HttpRequest req = std::move(request_);
    request_ = HttpRequest();
    if (body_by_length_) {
      req.body = std::move(body_);
      body_ = std::string();
      body_by_length_ = false;
    } else {
      req.body = std::move(parser_->get().body());
    }
    // The previous request's token is reused once nothing else holds it
    // (its answer is out; the engine may still hold it a moment longer):
    // the count read as 1 means no other owner is left to cancel or read it.
    if (!cancel_ || cancel_.use_count() != 1 || cancel_->cancelled()) cancel_ = std::make_shared<CancellationToken>();
    req.cancel = cancel_;
    req.lone_client = loop_.last_client == this;
    req.loop = loop_.lender;
    loop_.last_client = this;
    deadline_ns_.store(0, std::memory_order_release);
    state_.store(0, std::memory_order_relaxed);
    // Bytes of a pipelined next request already sit in our buffer: the
    // socket may never become readable again, so no watch.
    // Over TLS, decrypted bytes may wait inside the TLS layer where the
    // socket cannot show them: read on as soon as the response is out.
    pipelined_ = buffer_.size() > 0 || tls_.has_value();
    if (!pipelined_) {
      plain_->async_wait(tcp::socket::wait_read,
                         [self = shared_from_this()](beast::error_code ec) { self->OnWatch(ec); });
    }
    access_bytes_ = req.body.size();
    if (!req.Header("content-encoding").empty()) {
      req.loop = nullptr;  // handled on the inflater's thread, which is no loop's
      asio::post(*shared_.inflater, [self = shared_from_this(), req = std::move(req)]() mutable {
        self->InflateAndHandle(std::move(req));
      });
      return;
    }
    shared_.handler(std::move(req), [self = shared_from_this()](HttpResponse r) { self->Respond(std::move(r)); });
  }

  // The inflater's thread: decodes a compressed body, then hands the
  // request on (from this thread, like an engine thread's answer).
  void InflateAndHandle(HttpRequest req) {
    if (req.cancel && req.cancel->cancelled()) {
      // The client left while the body waited: nothing is inflated for it.
      HttpResponse r;
      r.status = 499;
      r.body = JsonError("the client closed the request");
      return Respond(std::move(r));
    }
    auto decoded =
        DecodeContentEncoding(req.Header("content-encoding"), std::move(req.body), shared_.options.max_body_bytes);
    if (!decoded) {
      HttpResponse r;
      const StatusCode code = decoded.error().code();
      r.status = code == StatusCode::kResourceExhausted ? 413 : code == StatusCode::kUnimplemented ? 415 : 400;
      r.body = JsonError(decoded.error().message());
      return Respond(std::move(r));
    }
    req.body = std::move(*decoded);
    std::erase_if(req.headers, [](const auto& h) { return h.first == "content-encoding"; });
    shared_.handler(std::move(req), [self = shared_from_this()](HttpResponse r) { self->Respond(std::move(r)); });
  }

  // Loop thread. Fires once per request: the client closed the connection
  // (cancel the request), sent more bytes (pipelining; the next read picks
  // them up), or sent the next request after the response went out.
  // Only an end of stream or an error seen by the socket itself cancels:
  // readiness alone may be left over from reading the body (asio takes
  // the epoll event it gathered before the body's last read took the
  // bytes), and a client still waiting must never be told it left.
  void OnWatch(beast::error_code ec) {
    if (ec == asio::error::operation_aborted || closed_) return;
    bool gone = static_cast<bool>(ec);
    if (!gone && !(state_.load(std::memory_order_acquire) & kResponded)) {
      char byte;
      const ssize_t r = ::recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        // Nothing to read and no end: watch on (a response finished
        // meanwhile is seen by the next firing, which its Finish relies on).
        plain_->async_wait(tcp::socket::wait_read,
                           [self = shared_from_this()](beast::error_code e) { self->OnWatch(e); });
        return;
      }
      gone = r <= 0;  // 0: the client closed its side; < 0: reset or another error
    }
    const uint32_t prev = state_.fetch_or(kWatchFired, std::memory_order_acq_rel);
    if (prev & kResponded) return ReadNext();
    if (gone) cancel_->Cancel();
  }

  // Any thread, once per request: writes the response with a non-blocking
  // send; what the socket does not take is finished on the loop thread.
  void Respond(HttpResponse r) {
    if (r.status == 503 || r.status == 429) shared_.last_refusal_ns.store(shared_.NowNs(), std::memory_order_relaxed);
    if (shared_.options.access_log && !access_method_.empty()) {
      shared_.options.access_log({access_method_, access_target_, r.status, access_bytes_,
                                  head_ ? size_t{0} : r.body.size(), shared_.NowNs() - access_start_ns_, client_,
                                  request_id_});
    }
    // Moved out: a response to a request that never got this far (one that
    // does not parse) must not carry the previous request's id.
    if (!request_id_.empty()) r.headers.emplace_back("X-Request-ID", std::exchange(request_id_, {}));
    if (head_) {
      // HEAD: the headers a GET would get (Content-Length included), no body.
      r.headers.emplace_back("Content-Length", std::to_string(r.body.size()));
      r.body.clear();
      r.stream = nullptr;
    }
    // A body written as it comes: chunked, or for HTTP/1.0 ended by closing the connection.
    const bool streamed = static_cast<bool>(r.stream);
    if (streamed && http10_) keep_alive_ = false;
    // The status line and headers, built in a buffer this thread keeps
    // (nothing below calls back into Respond before the last use of it:
    // Finish only posts).
    thread_local std::string head;
    head.clear();
    head.reserve(128 + r.content_type.size());
    head += "HTTP/1.1 ";
    head += std::to_string(r.status);
    head += ' ';
    const auto reason = http::obsolete_reason(static_cast<http::status>(r.status));
    head.append(reason.data(), reason.size());
    head += "\r\nServer: quern\r\n";
    if (!r.content_type.empty()) {
      head += "Content-Type: ";
      head += r.content_type;
      head += "\r\n";
    }
    for (const auto& [k, v] : r.headers) {
      head += k;
      head += ": ";
      head += v;
      head += "\r\n";
    }
    if (streamed) {
      if (!http10_) head += "Transfer-Encoding: chunked\r\n";
      head += "Cache-Control: no-cache\r\n";
    } else if (!head_) {
      head += "Content-Length: ";
      head += std::to_string(r.body.size());
      head += "\r\n";
    }
    if (!keep_alive_) {
      head += "Connection: close\r\n";
    } else if (http10_) {
      head += "Connection: keep-alive\r\n";
    }
    head += "\r\n";
    if (streamed) return StartStream(head, std::move(r));

    if (tls_) {
      // Encryption happens on the loop thread.
      out_head_ = head;
      out_body_ = std::move(r.body);
      out_sent_ = 0;
      shared_.writing.fetch_add(1, std::memory_order_acq_rel);
      asio::post(loop_.io, [self = shared_from_this()] { self->WriteRest(); });
      return;
    }
    const size_t total = head.size() + r.body.size();
    size_t sent = 0;
    while (sent < total) {
      iovec iov[2];
      int count = 0;
      if (sent < head.size()) {
        iov[count++] = {head.data() + sent, head.size() - sent};
        if (!r.body.empty()) iov[count++] = {r.body.data(), r.body.size()};
      } else {
        iov[count++] = {r.body.data() + (sent - head.size()), total - sent};
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = static_cast<size_t>(count);
      const ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        sent += static_cast<size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        break;
      } else {
        return Finish(/*failed=*/true);
      }
    }
    if (sent == total) return Finish(/*failed=*/false);
    // The socket's send buffer is full (a large response or a slow reader).
    out_head_ = head;
    out_body_ = std::move(r.body);
    out_sent_ = sent;
    shared_.writing.fetch_add(1, std::memory_order_acq_rel);
    asio::post(loop_.io, [self = shared_from_this()] { self->WriteRest(); });
  }

  // A streamed body (HttpResponse::stream): the writer the handler gets. Pieces go into the
  // session's queue, which its loop thread writes out in order.
  class BodyStream final : public HttpBodyStream {
   public:
    BodyStream(std::shared_ptr<Session> session, bool chunked, uint64_t generation)
        : session_(std::move(session)), chunked_(chunked), generation_(generation) {}
    ~BodyStream() override { session_->CloseStream(generation_, /*complete=*/false); }
    bool Write(std::string piece) override {
      if (piece.empty()) return true;
      return session_->QueueStream(generation_, Frame(piece, chunked_));
    }
    void End() override { session_->CloseStream(generation_, /*complete=*/true); }
    static std::string Frame(std::string_view piece, bool chunked) {
      if (!chunked) return std::string(piece);
      char size[24];
      const int n = std::snprintf(size, sizeof size, "%zx\r\n", piece.size());
      std::string out;
      out.reserve(static_cast<size_t>(n) + piece.size() + 2);
      out.append(size, static_cast<size_t>(n)).append(piece).append("\r\n");
      return out;
    }

   private:
    std::shared_ptr<Session> session_;
    const bool chunked_;
    // Which of the session's responses it writes: a stream ended and let go late does nothing to
    // the next response on the connection.
    const uint64_t generation_;
  };
  // At most this many bytes of a streamed body wait for the client at once; a writer past it waits
  // for the client to read, at most kStreamWaitNs, then is refused.
  static constexpr size_t kMaxStreamQueued = size_t{4} << 20;
  static constexpr int64_t kStreamWaitNs = int64_t{30} * 1'000'000'000;

  // The responding thread: the head (and `r.body`, the first piece) queued, the writer handed over.
  void StartStream(const std::string& head, HttpResponse r) {
    std::shared_ptr<BodyStream> body;
    {
      std::lock_guard lock(stream_mu_);
      body = std::make_shared<BodyStream>(shared_from_this(), !http10_, ++stream_generation_);
      stream_queue_ = head;
      if (!r.body.empty()) stream_queue_ += BodyStream::Frame(r.body, !http10_);
      stream_queued_ = stream_queue_.size();
      stream_writing_ = true;
      stream_ended_ = stream_complete_ = stream_broken_ = false;
    }
    shared_.writing.fetch_add(1, std::memory_order_acq_rel);
    asio::post(loop_.io, [self = shared_from_this()] { self->WriteStream(); });
    r.stream(std::move(body));
  }

  // Any thread: `framed` queued (waiting for room); false when the client has gone, the body has
  // ended (or it is not response `generation`'s), or the client did not read in time.
  bool QueueStream(uint64_t generation, std::string framed) {
    std::unique_lock lock(stream_mu_);
    const auto over = [&] { return generation != stream_generation_ || stream_broken_ || stream_ended_; };
    stream_room_.wait_for(lock, std::chrono::nanoseconds(kStreamWaitNs),
                          [&] { return over() || stream_queued_ < kMaxStreamQueued; });
    if (over() || stream_queued_ >= kMaxStreamQueued) return false;
    stream_queued_ += framed.size();
    stream_queue_ += framed;
    const bool post = !stream_writing_;
    stream_writing_ = true;
    lock.unlock();
    if (post) asio::post(loop_.io, [self = shared_from_this()] { self->WriteStream(); });
    return true;
  }

  // Any thread, the first call counting: the body ends (with its last chunk when `complete`; cut
  // off, the connection closing, when not).
  void CloseStream(uint64_t generation, bool complete) {
    std::unique_lock lock(stream_mu_);
    if (generation != stream_generation_ || stream_ended_) return;
    stream_ended_ = true;
    stream_complete_ = complete;
    if (complete && !http10_) stream_queue_ += "0\r\n\r\n";
    const bool post = !stream_writing_;
    stream_writing_ = true;
    lock.unlock();
    stream_room_.notify_all();
    if (post) asio::post(loop_.io, [self = shared_from_this()] { self->WriteStream(); });
  }

  // Loop thread: writes what is queued; once the body has ended and is out, the response is done.
  void WriteStream() {
    std::string out;
    bool ended = false, complete = false, broken = false;
    {
      std::lock_guard lock(stream_mu_);
      out.swap(stream_queue_);
      ended = stream_ended_;
      complete = stream_complete_;
      if (closed_) stream_broken_ = true;
      broken = stream_broken_;
      if ((out.empty() && ended) || broken) stream_writing_ = false;
      if (out.empty() && !ended && !broken) {
        stream_writing_ = false;  // the next piece posts again
        return;
      }
    }
    if (broken || (out.empty() && ended)) {
      stream_room_.notify_all();
      if (!ended) return;  // the writer ends it; its close finishes the response
      shared_.writing.fetch_sub(1, std::memory_order_acq_rel);
      return Finish(/*failed=*/broken || !complete);  // (HTTP/1.0: the close ends the body)
    }
    deadline_ns_.store(shared_.NowNs() + int64_t{shared_.options.read_timeout_s} * 1'000'000'000,
                       std::memory_order_release);
    stream_out_ = std::move(out);
    WithStream([&](auto& stream) {
      asio::async_write(stream, asio::buffer(stream_out_),
                        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnStreamWritten(ec); });
    });
  }

  void OnStreamWritten(beast::error_code ec) {
    deadline_ns_.store(0, std::memory_order_release);  // a request in flight again, however long
    {
      std::lock_guard lock(stream_mu_);
      stream_queued_ -= std::min(stream_queued_, stream_out_.size());
      if (ec) stream_broken_ = true;
    }
    stream_out_.clear();
    stream_room_.notify_all();
    if (ec) cancel_->Cancel();  // the client has gone: the work for it stops
    WriteStream();
  }

  // Loop thread.
  void WriteRest() {
    if (closed_) {
      shared_.writing.fetch_sub(1, std::memory_order_acq_rel);
      return Finish(true);
    }
    deadline_ns_.store(shared_.NowNs() + int64_t{shared_.options.read_timeout_s} * 1'000'000'000,
                       std::memory_order_release);
    std::array<asio::const_buffer, 2> bufs;
    size_t count = 0;
    if (out_sent_ < out_head_.size()) {
      bufs[count++] = asio::buffer(out_head_.data() + out_sent_, out_head_.size() - out_sent_);
      bufs[count++] = asio::buffer(out_body_);
    } else {
      bufs[count++] = asio::buffer(out_body_.data() + (out_sent_ - out_head_.size()),
                                   out_body_.size() - (out_sent_ - out_head_.size()));
    }
    auto on_done = [self = shared_from_this()](beast::error_code ec, size_t) {
      self->out_head_.clear();
      self->out_body_.clear();
      self->shared_.writing.fetch_sub(1, std::memory_order_acq_rel);
      self->Finish(static_cast<bool>(ec));
    };
    WithStream([&](auto& stream) {
      if (count == 2) {
        asio::async_write(stream, bufs, std::move(on_done));
      } else {
        asio::async_write(stream, bufs[0], std::move(on_done));
      }
    });
  }

  // Any thread: the response is out (or the connection broke).
  void Finish(bool failed) {
    const int64_t now = shared_.NowNs();
    idle_since_ns_.store(now, std::memory_order_relaxed);
    deadline_ns_.store(now + int64_t{shared_.options.idle_timeout_s} * 1'000'000'000, std::memory_order_release);
    if (failed || !keep_alive_) {
      asio::post(loop_.io, [self = shared_from_this(), failed] { failed ? self->HardClose() : self->LingerClose(); });
      return;
    }
    if (pipelined_) {
      asio::post(loop_.io, [self = shared_from_this()] { self->ReadNext(); });
      return;
    }
    const uint32_t prev = state_.fetch_or(kResponded, std::memory_order_acq_rel);
    if (prev & kWatchFired) asio::post(loop_.io, [self = shared_from_this()] { self->ReadNext(); });
    // Otherwise the pending watch starts the next read when the next request
    // arrives (or sees the close).
  }

  // Loop thread: no more responses; let the client read what we sent before
  // the socket closes (closing with unread input would send a reset that can
  // destroy our last response on the way).
  void LingerClose() {
    if (closing_ || closed_) return;
    closing_ = true;
    deadline_ns_.store(shared_.NowNs() + kLingerNs, std::memory_order_release);
    if (tls_) {
      // close_notify, then wait (up to the linger time) for the client's.
      tls_->async_shutdown([self = shared_from_this()](beast::error_code) { self->HardClose(); });
      return;
    }
    beast::error_code ec;
    plain_->shutdown(tcp::socket::shutdown_send, ec);
    Drain();
  }

  void Drain() {
    plain_->async_read_some(asio::buffer(loop_.discard), [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec) return self->HardClose();
      self->Drain();
    });
  }

  // Loop thread. Never called while a request is in flight (the responding
  // thread may be sending on fd_).
  void HardClose() {
    if (closed_) return;
    closed_ = true;
    beast::error_code ec;
    Socket().close(ec);
  }

  tcp::socket& Socket() { return tls_ ? tls_->next_layer() : *plain_; }

  // Runs `f` with the stream requests are read from and responses written to.
  template <typename F>
  void WithStream(F&& f) {
    if (tls_) {
      f(*tls_);
    } else {
      f(*plain_);
    }
  }

  std::optional<tcp::socket> plain_;             // plaintext connections
  std::optional<ssl::stream<tcp::socket>> tls_;  // TLS connections
  const int fd_;
  Loop& loop_;
  Shared& shared_;
  const bool reject_;  // over the connection limit: answer 503 and close

  // Loop thread only.
  beast::flat_buffer buffer_;
  // The request being read. Its header fields live in a buffer of this
  // connection's (one allocation per field before), reused for each request;
  // a header larger than the buffer takes the rest from the heap.
  using FieldsAllocator = std::pmr::polymorphic_allocator<char>;
  alignas(std::max_align_t) std::byte fields_buffer_[1024];
  std::pmr::monotonic_buffer_resource fields_arena_{fields_buffer_, sizeof(fields_buffer_)};
  std::optional<http::request_parser<http::string_body, FieldsAllocator>> parser_;
  std::shared_ptr<CancellationToken> cancel_;
  HttpRequest request_;  // the request being read: line and headers, then its body
  // The access log's record of the request being answered (only with one).
  std::string client_, access_method_, access_target_;
  std::string request_id_;  // of the request being answered: HttpRequest::request_id
  int64_t access_start_ns_ = 0;
  size_t access_bytes_ = 0;
  std::string body_;     // a body of known length, read directly
  size_t body_pre_ = 0;  // of it, bytes read with the head (ReadLikeTheLast)
  // The last request's head and body lengths, when it had a body of known
  // length worth reading with its head (0: read the usual way).
  size_t predicted_head_ = 0, predicted_body_ = 0;
  size_t last_head_ = 0, last_body_ = 0;  // the lengths of the request before (Predict)
  size_t discard_ = 0;                    // bytes of a body answered early, still to skip
  bool body_by_length_ = false;
  int64_t body_started_ns_ = 0;  // when the body of the request being read began (0: none)
  size_t body_have_ = 0;         // of a body of known length, the bytes read so far
  bool reading_ = false;
  bool read_clock_started_ = false;
  bool counted_ = true;  // holds a place in Shared::open (or rejecting)
  bool handshaking_ = false;
  bool closing_ = false;
  bool closed_ = false;

  // Written on the loop thread before the handler runs, read by the
  // responding thread (ordered by the handler's hand-off).
  bool keep_alive_ = true;
  bool http10_ = false;
  bool head_ = false;  // a HEAD request: the response carries no body
  bool pipelined_ = false;

  // A streamed body (StartStream): what waits to be written, by any thread; the loop thread
  // writes it.
  std::mutex stream_mu_;
  std::condition_variable stream_room_;  // room in the queue, or the stream ended or broke
  std::string stream_queue_;             // guarded by stream_mu_
  size_t stream_queued_ = 0;             // bytes queued or being written; guarded
  bool stream_writing_ = false;          // a WriteStream is posted or its write under way; guarded
  bool stream_ended_ = false, stream_complete_ = false, stream_broken_ = false;  // guarded
  uint64_t stream_generation_ = 0;  // the streamed response under way (BodyStream); guarded
  std::string stream_out_;          // loop thread: the bytes being written

  // Response handed to the loop thread when the socket did not take it all.
  std::string out_head_;
  std::string out_body_;
  size_t out_sent_ = 0;

  std::atomic<uint32_t> state_{0};         // kResponded | kWatchFired for the request in flight
  std::atomic<int64_t> idle_since_ns_{0};  // when the connection last began to wait for a request
  std::atomic<int64_t> deadline_ns_{0};    // idle/read/write/linger deadline; 0 = request in flight
  int64_t head_deadline_ns_ = 0;           // loop thread: when the head begun must be complete
};

}  // namespace

class HttpServer::Impl {
 public:
  Impl(HttpServerOptions options, HttpHandler handler, HttpHeadCheck head_check) {
    shared_.options = std::move(options);
    if (shared_.options.clock) shared_.clock = shared_.options.clock;
    shared_.handler = std::move(handler);
    shared_.head_check = std::move(head_check);
    const int n = std::max(1, shared_.options.io_threads);
    for (int i = 0; i < n; ++i) loops_.push_back(std::make_unique<Loop>());
    acceptor_.emplace(loops_[0]->io);
    retry_timer_.emplace(loops_[0]->io);
  }

  Status Listen() {
    const auto& o = shared_.options;
    if (o.max_connections < 1) return InvalidArgument("--http-max-connections must be at least 1");
    if (o.max_header_bytes < 256) return InvalidArgument("--http-max-header-bytes must be at least 256");
    if (o.idle_timeout_s < 1 || o.read_timeout_s < 1 || o.header_timeout_s < 1) {
      return InvalidArgument("HTTP timeouts must be at least 1 s");
    }
    beast::error_code ec;
    if (o.tls_cert_file.empty() != o.tls_key_file.empty() ||
        (!o.tls_client_ca_file.empty() && o.tls_cert_file.empty())) {
      return InvalidArgument("TLS needs both a certificate and a key file (and them for client certificates)");
    }
    if (!o.tls_cert_file.empty()) {
      QUERN_ASSIGN_OR_RETURN(shared_.tls,
                             MakeServerTlsContext(o.tls_cert_file, o.tls_key_file, o.tls_client_ca_file, "TLS"));
    }
    auto address = asio::ip::make_address(o.host, ec);
    if (ec) return InvalidArgument("--host '" + o.host + "' is not an IP address");
    tcp::endpoint ep(address, static_cast<unsigned short>(o.port));
    acceptor_->open(ep.protocol(), ec);
    if (!ec) acceptor_->set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_->bind(ep, ec);
    if (!ec) acceptor_->listen(asio::socket_base::max_listen_connections, ec);
    if (ec) return Unavailable("cannot listen on " + o.host + ":" + std::to_string(o.port) + ": " + ec.message());
    Accept();
    // On one usable core the loops run their requests' batches: a hand-off
    // to an instance's thread would only take turns with them on it.
    const bool lend = UsableCores() == 1 && shared_.options.caller_loop;
    for (auto& loop : loops_) {
      ScheduleSweep(*loop);
      loop->thread = std::thread([this, l = loop.get(), lend] {
        NameThisThread("quern-http");
        DeferToRunningThreads();  // until the server refuses work (Session::ReadNext)
        if (lend) {
          RunLending(*l, shared_.options.caller_loop());
        } else {
          l->io.run();
        }
      });
    }
    return Status::Ok();
  }

  // The loop of a thread that runs its requests' batches: every ready
  // handler first (reading the requests that have arrived, writing
  // answers), then the batches due, then a wait for the next event or for
  // the time a queued batch is due.
  void RunLending(Loop& l, std::unique_ptr<CallerLoop> lender) {
    l.lender = lender.get();
    while (!l.io.stopped()) {
      l.io.poll();
      l.lent_at_ns = shared_.NowNs();
      int64_t wait_ns = -1;
      if (lender->RunDue(&wait_ns) || l.io.stopped()) continue;
      if (wait_ns < 0) {
        l.io.run_one();
      } else if (wait_ns > 0) {
        l.io.run_one_for(std::chrono::nanoseconds(wait_ns));
      }
    }
    l.lender = nullptr;
  }

  ~Impl() {
    Stop();
    // Requests queued for the inflater hold sessions: let them go while the
    // loops they belong to are still here.
    shared_.inflater.reset();
    // Sessions with pending operations are freed with their io_context.
    acceptor_.reset();
    retry_timer_.reset();
    loops_.clear();
  }

  void Stop() {
    for (auto& loop : loops_) loop->io.stop();
    for (auto& loop : loops_) {
      if (loop->thread.joinable()) loop->thread.join();
    }
    // Bodies not inflated yet are dropped with their sessions; one being
    // inflated finishes first.
    if (shared_.inflater) {
      shared_.inflater->stop();
      shared_.inflater->join();
    }
  }

  int port() const { return acceptor_->local_endpoint().port(); }
  int open_connections() const { return shared_.open.load(std::memory_order_relaxed); }
  int pending_writes() const { return shared_.writing.load(std::memory_order_acquire); }

 private:
  void Accept() {
    Loop& target = *loops_[next_loop_++ % loops_.size()];
    acceptor_->async_accept(target.io, [this, &target](beast::error_code ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted) return;
      if (ec) {
        // Out of file descriptors, most likely: wait instead of spinning.
        WarnRateLimited(accept_warning_, shared_.NowNs(), ("cannot accept a connection: " + ec.message()).c_str());
        retry_timer_->expires_after(std::chrono::milliseconds(100));
        retry_timer_->async_wait([this](beast::error_code e) {
          if (!e) Accept();
        });
        return;
      }
      Admit(target, std::move(socket));
      Accept();
    });
  }

  void Admit(Loop& target, tcp::socket socket) {
    if (shared_.open.fetch_add(1, std::memory_order_relaxed) >= shared_.options.max_connections) {
      shared_.open.fetch_sub(1, std::memory_order_relaxed);
      // At the limit: the oldest idle connection (one that has not sent a
      // byte of a request) makes room, so idle connections cannot lock
      // clients out. The search starts on the target loop and visits each
      // loop once.
      asio::post(target.io, [this, &target, s = std::make_shared<tcp::socket>(std::move(socket))] {
        EvictAndAdmit(target, target, std::move(*s), 1);
      });
      return;
    }
    StartSession(target, std::move(socket), false);
  }

  // Loop thread of `loop`. The new connection's session runs on `home`, the
  // loop its socket belongs to (the place in the count is shared by all).
  void EvictAndAdmit(Loop& loop, Loop& home, tcp::socket socket, size_t visited) {
    if (EvictOldestIdle(loop)) return StartSession(home, std::move(socket), false, /*posted=*/&loop != &home);
    if (visited < loops_.size()) {
      Loop& next = *loops_[(IndexOf(loop) + 1) % loops_.size()];
      asio::post(next.io, [this, &next, &home, visited, s = std::make_shared<tcp::socket>(std::move(socket))] {
        EvictAndAdmit(next, home, std::move(*s), visited + 1);
      });
      return;
    }
    if (&loop != &home) {
      // Answer from the socket's own loop.
      asio::post(home.io, [this, &home, s = std::make_shared<tcp::socket>(std::move(socket))] {
        EvictAndAdmit(home, home, std::move(*s), loops_.size() + 1);
      });
      return;
    }
    // Every connection is busy: answer 503 while few are being answered so.
    WarnRateLimited(shared_.last_limit_warning, shared_.NowNs(),
                    "HTTP connection limit reached and no connection is idle; answering 503");
    if (shared_.rejecting.fetch_add(1, std::memory_order_relaxed) >= kMaxRejecting) {
      shared_.rejecting.fetch_sub(1, std::memory_order_relaxed);
      shared_.last_refusal_ns.store(shared_.NowNs(), std::memory_order_relaxed);  // refused without a word
      return;                                                                     // closes the socket
    }
    StartSession(loop, std::move(socket), true, /*posted=*/false);
  }

  // Loop thread of `loop`: closes its oldest idle session, whose place in
  // the connection count passes to the caller. False when none is idle.
  bool EvictOldestIdle(Loop& loop) {
    for (int scan = 0; scan < 2; ++scan) {
      while (!loop.evictable.empty()) {
        auto [since, weak] = std::move(loop.evictable.back());
        loop.evictable.pop_back();
        auto session = weak.lock();
        if (session && session->IdleSince() == since) {
          session->Evict();
          return true;
        }
      }
      if (scan == 1) break;
      // Refill: the oldest idle sessions, enough for a burst of newcomers.
      for (const auto& weak : loop.sessions) {
        if (auto session = weak.lock()) {
          if (const int64_t since = session->IdleSince(); since > 0) loop.evictable.emplace_back(since, weak);
        }
      }
      const size_t keep = std::max<size_t>(16, static_cast<size_t>(shared_.options.max_connections) / 16);
      auto newest_first = [](const auto& a, const auto& b) { return a.first > b.first; };
      if (loop.evictable.size() > keep) {
        std::nth_element(loop.evictable.begin(), loop.evictable.end() - static_cast<std::ptrdiff_t>(keep),
                         loop.evictable.end(), newest_first);
        loop.evictable.erase(loop.evictable.begin(), loop.evictable.end() - static_cast<std::ptrdiff_t>(keep));
      }
      std::sort(loop.evictable.begin(), loop.evictable.end(), newest_first);
    }
    return false;
  }

  size_t IndexOf(const Loop& loop) const {
    for (size_t i = 0; i < loops_.size(); ++i) {
      if (loops_[i].get() == &loop) return i;
    }
    return 0;
  }

  // `posted`: called off the loop's thread, so the start is posted to it.
  void StartSession(Loop& target, tcp::socket socket, bool reject, bool posted = true) {
    beast::error_code ec;
    socket.set_option(tcp::no_delay(true), ec);
    auto session = std::make_shared<Session>(std::move(socket), target, shared_, reject);
    auto start = [&target, session = std::move(session)] {
      target.sessions.push_back(session);
      session->Start();
    };
    if (posted) {
      asio::post(target.io, std::move(start));
    } else {
      start();
    }
  }

  void ScheduleSweep(Loop& loop) {
    loop.sweep_timer.expires_after(kSweepInterval);
    loop.sweep_timer.async_wait([this, &loop](beast::error_code ec) {
      if (ec) return;
      const int64_t now = shared_.NowNs();
      loop.FollowRefusals(shared_.last_refusal_ns.load(std::memory_order_relaxed), now);
      auto& s = loop.sessions;
      size_t kept = 0;
      for (size_t i = 0; i < s.size(); ++i) {
        if (auto session = s[i].lock()) {
          session->Sweep(now);
          if (kept != i) s[kept] = std::move(s[i]);  // (a self-move would empty it)
          ++kept;
        }
      }
      s.resize(kept);
      ScheduleSweep(loop);
    });
  }

  Shared shared_;
  std::vector<std::unique_ptr<Loop>> loops_;
  std::optional<tcp::acceptor> acceptor_;
  std::optional<asio::steady_timer> retry_timer_;
  size_t next_loop_ = 0;
  std::atomic<int64_t> accept_warning_{0};
};

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HttpServer::~HttpServer() = default;
void HttpServer::Stop() {
  impl_->Stop();
}
int HttpServer::port() const {
  return impl_->port();
}
int HttpServer::open_connections() const {
  return impl_->open_connections();
}
int HttpServer::pending_writes() const {
  return impl_->pending_writes();
}

Result<std::unique_ptr<HttpServer>> HttpServer::Start(HttpServerOptions options, HttpHandler handler,
                                                      HttpHeadCheck head_check) {
  auto impl = std::make_unique<Impl>(std::move(options), std::move(handler), std::move(head_check));
  QUERN_RETURN_IF_ERROR(impl->Listen());
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

}  // namespace quern
