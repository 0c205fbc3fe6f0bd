#include "frontends/grpc/grpc_transport.h"

#include <nghttp2/nghttp2.h>
#include <openssl/ssl.h>

#include <algorithm>
#include <array>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "core/cpus.h"
#include "core/log.h"
#include "core/serial_worker.h"
#include "frontends/http/content_encoding.h"
#include "frontends/http/tls_context.h"

namespace quern {

namespace asio = boost::asio;
namespace ssl = asio::ssl;
using tcp = asio::ip::tcp;

int64_t ParseGrpcTimeout(std::string_view v) {
  if (v.size() < 2 || v.size() > 9) return -1;
  int64_t n = 0;
  for (char c : v.substr(0, v.size() - 1)) {
    if (c < '0' || c > '9') return -1;
    n = n * 10 + (c - '0');
  }
  constexpr int64_t kMax = int64_t{100} * 365 * 24 * 3600 * 1'000'000'000;  // a century: "no deadline" in effect
  auto scaled = [&](int64_t unit_ns) { return n > kMax / unit_ns ? kMax : n * unit_ns; };
  switch (v.back()) {
    case 'H': return scaled(int64_t{3600} * 1'000'000'000);
    case 'M': return scaled(int64_t{60} * 1'000'000'000);
    case 'S': return scaled(1'000'000'000);
    case 'm': return scaled(1'000'000);
    case 'u': return scaled(1'000);
    case 'n': return n;
    default: return -1;
  }
}

std::string PercentEncodeGrpcMessage(std::string_view message) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(message.size());
  for (unsigned char c : message) {
    if (c >= 0x20 && c <= 0x7e && c != '%') {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

namespace {

constexpr size_t kReadChunk = 64 * 1024;
constexpr size_t kMaxPendingOut = 512 * 1024;    // socket bytes queued before reading pauses
constexpr int32_t kStreamWindow = 256 * 1024;    // per call: what a client may send ahead of Read
constexpr int32_t kConnectionWindow = 16 << 20;  // consumed at once: stream windows bound memory
constexpr auto kSweepInterval = std::chrono::milliseconds(250);
constexpr std::string_view kAcceptEncoding = "identity,deflate,gzip";

int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The transport's log lines (any client can cause them: a failed TLS
// handshake, a protocol error, a reset storm) go through Quern's logger
// with source "grpc", at most kLogBurst lines per kLogWindowS seconds; the
// lines dropped are counted in the next one written.
constexpr int kLogBurst = 20;
constexpr int64_t kLogWindowS = 10;

void TransportLog(LogLevel level, const std::string& message, const std::string& client) {
  static std::atomic<int64_t> window_start_s{0};
  static std::atomic<int> written{0};
  static std::atomic<int64_t> dropped{0};
  const int64_t now_s = SteadyNs() / 1'000'000'000;
  int64_t start = window_start_s.load(std::memory_order_relaxed);
  if (now_s - start >= kLogWindowS && window_start_s.compare_exchange_strong(start, now_s)) {
    written.store(0, std::memory_order_relaxed);
  }
  if (written.fetch_add(1, std::memory_order_relaxed) >= kLogBurst) {
    dropped.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const int64_t before = dropped.exchange(0, std::memory_order_relaxed);
  if (before > 0) {
    Log(level, message, {{"source", "grpc"}, {"client", client}, {"dropped_before", std::to_string(before)}});
  } else {
    Log(level, message, {{"source", "grpc"}, {"client", client}});
  }
}

// What a call holds of its loop: work for the loop from other threads is
// posted through it, or dropped once the loop has stopped.
class LoopRef {
 public:
  explicit LoopRef(asio::io_context* io) : io_(io) {}
  bool InThisThread() const { return std::this_thread::get_id() == thread_.load(std::memory_order_acquire); }
  void SetThread() { thread_.store(std::this_thread::get_id(), std::memory_order_release); }
  template <class F>
  void Post(F&& f) {
    std::unique_lock lock(mu_);
    if (io_) asio::post(*io_, std::forward<F>(f));
  }
  void Close() {
    std::unique_lock lock(mu_);
    io_ = nullptr;
  }

 private:
  std::mutex mu_;
  asio::io_context* io_;
  std::atomic<std::thread::id> thread_{};
};

class Connection;

// Answer bytes a connection's calls have queued and nghttp2 has not taken
// yet: shared by the connection and its calls, so that a Write on another
// thread counts without touching the connection.
struct SendBudget {
  std::atomic<size_t> unsent{0};
  size_t limit = 0;
};

// A connection's place in the server's count: what the acceptor reads to
// bound connections and to pick one to close.
struct Slot {
  std::weak_ptr<Connection> conn;
  std::shared_ptr<LoopRef> loop;
  std::string peer;
  std::string client;                     // what the per-client bound counts: the address; for IPv6 its /64
  std::atomic<int64_t> idle_since_ns{0};  // 0: a call is open
  bool evicting = false;                  // under the registry's mutex
};

struct Shared;

class Call final : public GrpcCall, public std::enable_shared_from_this<Call> {
 public:
  Call(int32_t id, std::weak_ptr<Connection> conn, std::shared_ptr<LoopRef> loop, std::shared_ptr<SendBudget> budget,
       const std::string& peer, int64_t start_ns)
      : id_(id),
        conn_(std::move(conn)),
        loop_(std::move(loop)),
        budget_(std::move(budget)),
        peer_(peer),
        start_ns_(start_ns) {}
  // The handler goes first, while everything it may still touch (a Write
  // from another thread) is here.
  ~Call() override { handler_.reset(); }

  std::string_view path() const override { return path_; }
  std::string_view Metadata(std::string_view key) const override {
    for (const auto& [k, v] : metadata_) {
      if (k == key) return v;
    }
    return {};
  }
  const std::string& peer() const override { return peer_; }
  int64_t deadline_ns() const override { return deadline_ns_; }
  void Read() override;
  bool Write(std::string message) override;
  void Finish(const Status& status) override;
  size_t unsent_bytes() const override { return unsent_.load(std::memory_order_relaxed); }
  void set_log_fields(std::string model, std::string request_id) override {
    log_model_ = std::move(model);
    log_request_id_ = std::move(request_id);
  }

  // Loop thread only, below.
  const int32_t id_;
  std::weak_ptr<Connection> conn_;
  std::shared_ptr<LoopRef> loop_;
  std::shared_ptr<SendBudget> budget_;
  const std::string peer_;
  const int64_t start_ns_;
  std::string path_, method_, content_type_, encoding_;
  std::vector<std::pair<std::string, std::string>> metadata_;
  int64_t deadline_ns_ = 0;
  size_t header_bytes_ = 0;
  bool client_streaming_ = true;
  std::unique_ptr<GrpcHandler> handler_;
  bool started_ = false;

  bool long_lived_ = false;  // a watch: its connection counts as idle for eviction
  bool counted_busy_ = false;

  // Receiving.
  std::string in_;  // received; delivered up to in_off_
  size_t in_off_ = 0;
  size_t unconsumed_ = 0;   // received bytes not yet given back to the stream's window
  bool want_read_ = false;  // a Read waits for a message
  bool remote_closed_ = false;
  bool half_close_delivered_ = false;
  bool inflating_ = false;          // a message of this call is on the inflater
  int64_t message_started_ns_ = 0;  // first byte of a message not yet whole (0: none)

  // Sending.
  struct Out {
    std::array<uint8_t, 5> prefix;
    std::string body;
    size_t offset = 0;  // into prefix then body
    size_t size() const { return 5 + body.size(); }
  };
  std::deque<Out> out_;
  bool headers_sent_ = false;
  bool finish_requested_ = false;
  bool trailers_sent_ = false;  // trailers (or a trailers-only answer) submitted
  Status final_ = Status::Ok();
  std::string final_message_;
  bool written_notice_ = false;  // a message was taken: tell the handler
  std::atomic<bool> ended_{false};
  std::atomic<size_t> unsent_{0};
  std::atomic<int> posted_writes_{0};  // Writes posted to the loop, not yet carried out
  std::string log_model_, log_request_id_;

  void DoRead();
  void DoWrite(std::string message, size_t reserved);
  void DoFinish(Status status);
};

struct Loop {
  asio::io_context io;
  std::shared_ptr<LoopRef> ref = std::make_shared<LoopRef>(&io);
  std::thread thread;
  std::list<std::shared_ptr<Connection>> conns;  // loop thread only
  std::unique_ptr<asio::steady_timer> sweep;
  std::atomic<int> open_calls{0};
};

struct Shared {
  GrpcTransportOptions options;
  std::map<std::string, GrpcMethodSpec, std::less<>> methods;  // by path
  std::unique_ptr<ssl::context> tls;
  const Clock* clock = nullptr;
  std::mutex reg_mu;
  std::list<std::shared_ptr<Slot>> slots;  // under reg_mu
  std::atomic<int> open{0};
  std::atomic<int64_t> last_warning_ns{0};
  // Compressed messages are inflated here, one at a time, never on a loop
  // thread (a message inflating to the limit takes a while: the loop's
  // other connections would wait for it).
  std::unique_ptr<SerialWorker> inflater;
  int64_t NowNs() const { return clock ? clock->NowNs() : SteadyNs(); }
};

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(Shared& shared, Loop& loop, tcp::socket socket, std::shared_ptr<Slot> slot)
      : shared_(shared), loop_(loop), slot_(std::move(slot)), peer_(slot_->peer) {
    budget_->limit = shared_.options.max_unsent_bytes;
    if (shared_.tls) {
      tls_.emplace(std::move(socket), *shared_.tls);
    } else {
      plain_.emplace(std::move(socket));
    }
  }
  ~Connection() {
    if (session_) nghttp2_session_del(session_);
  }

  void Start() {
    const int64_t now = shared_.NowNs();
    started_ns_ = last_progress_ns_ = idle_since_ns_ = now;
    loop_.conns.push_back(shared_from_this());
    if (!NewSession()) return Close();
    if (tls_) {
      tls_->async_handshake(ssl::stream_base::server, [self = shared_from_this()](boost::system::error_code ec) {
        if (ec) {
          // (Closed here meanwhile: evicted, or timed out, which is no failure of the handshake.)
          if (!self->closed_) TransportLog(LogLevel::kInfo, "gRPC: TLS handshake failed: " + ec.message(), self->peer_);
          return self->Close();
        }
        self->handshaken_ = true;
        self->Run([&] { self->MaybeRead(); });
      });
      return;
    }
    handshaken_ = true;
    Run([&] { MaybeRead(); });
  }

  // Runs `f` then sends what it queued (one flush for nested entries).
  template <class F>
  void Run(F&& f) {
    ++depth_;
    f();
    --depth_;
    if (depth_ == 0) Flush();
  }

  // Sweeps timeouts; the loop's timer, every kSweepInterval.
  void Sweep(int64_t now) {
    if (closed_) return;
    Run([&] {
      const auto& o = shared_.options;
      if (!preface_seen_ && now - started_ns_ > int64_t{o.handshake_timeout_s} * 1'000'000'000) return Close();
      if (calls_.empty() && now - idle_since_ns_ > int64_t{o.idle_timeout_s} * 1'000'000'000) {
        return GoAway(NGHTTP2_NO_ERROR);
      }
      const bool stalled_output = writing_ || budget_->unsent.load(std::memory_order_relaxed) > 0;
      if (stalled_output && now - last_progress_ns_ > int64_t{o.write_timeout_s} * 1'000'000'000) {
        TransportLog(
            LogLevel::kInfo,
            "gRPC: closing a connection whose answers have not moved for " + std::to_string(o.write_timeout_s) + " s",
            peer_);
        return Close();
      }
      const int64_t message_ns = int64_t{o.message_timeout_s} * 1'000'000'000;
      std::vector<std::shared_ptr<Call>> late;
      for (auto& [id, c] : calls_) {
        // A header block left unfinished (HEADERS without END_HEADERS)
        // blocks the whole connection: it ends.
        if (!c->started_ && now - c->start_ns_ > int64_t{o.handshake_timeout_s} * 1'000'000'000) return Close();
        if (c->finish_requested_) continue;
        // Only while the handler waits for it: a message held back by the
        // server's own backpressure is not the client's delay.
        const bool partial = c->want_read_ && c->message_started_ns_ > 0 && now - c->message_started_ns_ > message_ns;
        const bool unary_waiting = !c->client_streaming_ && c->want_read_ && c->in_.size() == c->in_off_ &&
                                   !c->remote_closed_ && now - c->start_ns_ > message_ns;
        if (partial || unary_waiting) late.push_back(c);
      }
      // (Their trailers end the stream; OnFrameSend then resets what the
      // client would still send.)
      for (auto& c : late) {
        c->DoFinish(DeadlineExceeded("the call's request message did not arrive within " +
                                     std::to_string(o.message_timeout_s) + " s"));
      }
    });
  }

  // GOAWAY (the calls already started go on), then closes once they end.
  void GoAway(uint32_t code) {
    if (closed_ || going_away_) return;
    going_away_ = true;
    nghttp2_submit_goaway(session_, NGHTTP2_FLAG_NONE, nghttp2_session_get_last_proc_stream_id(session_), code, nullptr,
                          0);
    if (calls_.empty() || code != NGHTTP2_NO_ERROR) closing_ = true;
  }

  // Makes room for a new connection: GOAWAY when no call is open, else
  // (watches, or a call that began since it was picked, or a TLS handshake
  // not yet done) closed now, so the count never passes the bound.
  void Evict() {
    if (calls_.empty() && handshaken_) {
      GoAway(NGHTTP2_NO_ERROR);
    } else {
      Close();
    }
  }

  // Ends the connection now: every open call is cancelled.
  void Close() {
    if (closed_) return;
    closed_ = true;
    auto calls = std::move(calls_);
    calls_.clear();
    for (auto& [id, c] : calls) EndCall(*c, false);
    boost::system::error_code ignored;
    Socket().shutdown(tcp::socket::shutdown_both, ignored);
    Socket().close(ignored);
    loop_.conns.remove_if([this](const std::shared_ptr<Connection>& c) { return c.get() == this; });
    {
      std::lock_guard lock(shared_.reg_mu);
      shared_.slots.remove(slot_);
    }
    shared_.open.fetch_sub(1, std::memory_order_relaxed);
  }

  std::shared_ptr<SendBudget> budget_ = std::make_shared<SendBudget>();
  bool closed_ = false;
  nghttp2_session* session_ = nullptr;

  // A call's bytes left the queue.
  void Taken(Call& c, size_t n) {
    c.unsent_.fetch_sub(n, std::memory_order_relaxed);
    budget_->unsent.fetch_sub(n, std::memory_order_relaxed);
    last_progress_ns_ = shared_.NowNs();
  }

  // Queues `c`'s response headers (with its data) or resumes its data.
  void Submit(Call& c) {
    if (closed_) return;
    if (!c.headers_sent_) {
      c.headers_sent_ = true;
      static const std::string_view kStatus = ":status", k200 = "200", kType = "content-type",
                                    kGrpc = "application/grpc", kAccept = "grpc-accept-encoding";
      const nghttp2_nv nva[] = {Nv(kStatus, k200), Nv(kType, kGrpc), Nv(kAccept, kAcceptEncoding)};
      nghttp2_data_provider provider{};
      provider.source.ptr = &c;
      provider.read_callback = &Connection::ReadAnswer;
      nghttp2_submit_response(session_, c.id_, nva, std::size(nva), &provider);
    } else {
      nghttp2_session_resume_data(session_, c.id_);
    }
  }

  // A trailers-only answer (no message was written).
  void SubmitTrailersOnly(Call& c) {
    c.headers_sent_ = true;
    c.trailers_sent_ = true;
    const std::string code = std::to_string(static_cast<int>(c.final_.code()));
    static const std::string_view kStatus = ":status", k200 = "200", kType = "content-type", kGrpc = "application/grpc",
                                  kAccept = "grpc-accept-encoding", kGrpcStatus = "grpc-status",
                                  kGrpcMessage = "grpc-message";
    std::vector<nghttp2_nv> nva = {Nv(kStatus, k200), Nv(kType, kGrpc), Nv(kAccept, kAcceptEncoding),
                                   NvCopy(kGrpcStatus, code)};
    if (!c.final_message_.empty()) nva.push_back(NvCopy(kGrpcMessage, c.final_message_));
    nghttp2_submit_response(session_, c.id_, nva.data(), nva.size(), nullptr);
  }

  // Counts `c` among the calls that keep the connection from being idle
  // (`busy`), or no longer: the acceptor closes idle connections first.
  void Busy(Call& c, bool busy) {
    if (c.counted_busy_ == busy) return;
    c.counted_busy_ = busy;
    if (busy && busy_++ == 0) slot_->idle_since_ns.store(0, std::memory_order_relaxed);
    if (!busy && --busy_ == 0) {
      idle_since_ns_ = shared_.NowNs();
      slot_->idle_since_ns.store(idle_since_ns_, std::memory_order_relaxed);
    }
  }

  void RequestRead(Call& c);  // the stream window opens for `c`
  // A compressed message of `c` goes to the inflater; Inflated delivers it
  // (on the loop thread) once it is plain.
  void Inflate(Call& c, std::string message);
  void Inflated(Call& c, Result<std::string> plain);
  // `n` of `c`'s buffered bytes were delivered (or dropped).
  void TakeInbound(Call& c, size_t n);
  void ForgetInbound(Call& c);  // drops what `c` has buffered
  int64_t NowNs() const { return shared_.NowNs(); }
  // Request bytes a connection buffers for its calls before only the oldest
  // message may grow: one message at the limit, and as much again.
  size_t InboundBudget() const { return 2 * shared_.options.max_message_bytes; }
  void PumpSoon(const std::shared_ptr<Call>& c) {
    if (std::find(ready_.begin(), ready_.end(), c) == ready_.end()) ready_.push_back(c);
  }

 private:
  static nghttp2_nv Nv(std::string_view name, std::string_view value) {
    return {reinterpret_cast<uint8_t*>(const_cast<char*>(name.data())),
            reinterpret_cast<uint8_t*>(const_cast<char*>(value.data())), name.size(), value.size(),
            NGHTTP2_NV_FLAG_NO_COPY_NAME | NGHTTP2_NV_FLAG_NO_COPY_VALUE};
  }
  // A value that does not outlive the call: nghttp2 copies it.
  static nghttp2_nv NvCopy(std::string_view name, const std::string& value) {
    nghttp2_nv nv = Nv(name, value);
    nv.flags = NGHTTP2_NV_FLAG_NO_COPY_NAME;
    return nv;
  }

  tcp::socket& Socket() { return tls_ ? tls_->next_layer() : *plain_; }

  bool NewSession() {
    nghttp2_session_callbacks* cb = nullptr;
    if (nghttp2_session_callbacks_new(&cb) != 0) return false;
    nghttp2_session_callbacks_set_on_begin_headers_callback(cb, &Connection::OnBeginHeaders);
    nghttp2_session_callbacks_set_on_header_callback(cb, &Connection::OnHeader);
    nghttp2_session_callbacks_set_on_frame_recv_callback(cb, &Connection::OnFrameRecv);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cb, &Connection::OnDataChunk);
    nghttp2_session_callbacks_set_on_stream_close_callback(cb, &Connection::OnStreamClose);
    nghttp2_session_callbacks_set_on_frame_send_callback(cb, &Connection::OnFrameSend);
    nghttp2_session_callbacks_set_on_begin_frame_callback(cb, &Connection::OnBeginFrame);
    nghttp2_option* opt = nullptr;
    nghttp2_option_new(&opt);
    nghttp2_option_set_no_auto_window_update(opt, 1);
    nghttp2_option_set_max_outbound_ack(opt, 1000);
    nghttp2_option_set_max_settings(opt, 32);
    nghttp2_option_set_max_continuations(opt, 8);
    nghttp2_option_set_max_send_header_block_length(opt, 64 * 1024);
    const int rc = nghttp2_session_server_new2(&session_, cb, this, opt);
    nghttp2_option_del(opt);
    nghttp2_session_callbacks_del(cb);
    if (rc != 0) return false;
    const auto& o = shared_.options;
    std::vector<nghttp2_settings_entry> settings = {
        {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, static_cast<uint32_t>(kStreamWindow)},
        {NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE, static_cast<uint32_t>(o.max_header_bytes)},
        {NGHTTP2_SETTINGS_MAX_FRAME_SIZE, 64 * 1024},
        {NGHTTP2_SETTINGS_ENABLE_PUSH, 0}};
    if (o.max_concurrent_streams > 0) {
      settings.push_back({NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, static_cast<uint32_t>(o.max_concurrent_streams)});
    }
    if (nghttp2_submit_settings(session_, NGHTTP2_FLAG_NONE, settings.data(), settings.size()) != 0) return false;
    return nghttp2_session_set_local_window_size(session_, NGHTTP2_FLAG_NONE, 0, kConnectionWindow) == 0;
  }

  void MaybeRead() {
    if (closed_ || reading_ || !handshaken_ || pending_out() >= kMaxPendingOut) return;
    if (!nghttp2_session_want_read(session_)) return;
    reading_ = true;
    auto done = [self = shared_from_this()](boost::system::error_code ec, size_t n) { self->OnRead(ec, n); };
    if (tls_) {
      tls_->async_read_some(asio::buffer(rbuf_), done);
    } else {
      plain_->async_read_some(asio::buffer(rbuf_), done);
    }
  }

  void OnRead(boost::system::error_code ec, size_t n) {
    reading_ = false;
    if (closed_) return;
    if (ec) return Close();
    Run([&] {
      const ssize_t r = nghttp2_session_mem_recv(session_, rbuf_.data(), n);
      if (r < 0) {
        // A protocol error: nghttp2 has queued GOAWAY where one is due.
        closing_ = true;
        if (r != NGHTTP2_ERR_BAD_CLIENT_MAGIC) {
          TransportLog(LogLevel::kInfo,
                       std::string("gRPC: closing a connection: ") + nghttp2_strerror(static_cast<int>(r)), peer_);
        }
        return;
      }
      PumpReady();
    });
    MaybeRead();
  }

  void PumpReady() {
    while (!ready_.empty() && !closed_) {
      auto c = std::move(ready_.front());
      ready_.pop_front();
      Pump(*c);
    }
  }

  // Delivers what `c` has whole to its handler while it reads.
  void Pump(Call& c);

  size_t pending_out() const { return out_.size() + next_.size(); }

  void Flush() {
    if (closed_) return;
    for (int round = 0; round < 64; ++round) {
      while (next_.size() < kMaxPendingOut) {
        const uint8_t* data = nullptr;
        const ssize_t n = nghttp2_session_mem_send(session_, &data);
        if (n < 0) return Close();
        if (n == 0) break;
        next_.append(reinterpret_cast<const char*>(data), static_cast<size_t>(n));
      }
      // Handlers told their messages were taken may write more.
      bool told = false;
      for (auto& [id, c] : calls_) {
        if (!c->written_notice_) continue;
        c->written_notice_ = false;
        if (c->handler_ && !c->ended_) {
          ++depth_;
          c->handler_->OnWritten();
          --depth_;
          told = true;
        }
      }
      PumpReady();
      if (!told || closed_) break;
    }
    if (closed_) return;
    // Nothing is written while a TLS handshake runs (a sweep or an eviction
    // may flush then): a write beside the handshake on the same stream
    // breaks it. Its end flushes what waits.
    if (!handshaken_) return;
    if (!writing_ && !next_.empty()) StartWrite();
    if (!writing_ && next_.empty() &&
        (closing_ || (!nghttp2_session_want_read(session_) && !nghttp2_session_want_write(session_)))) {
      return Close();
    }
    MaybeRead();
  }

  void StartWrite() {
    writing_ = true;
    out_.swap(next_);
    next_.clear();
    auto done = [self = shared_from_this()](boost::system::error_code ec, size_t) {
      self->writing_ = false;
      if (self->closed_) return;
      if (ec) return self->Close();
      self->last_progress_ns_ = self->shared_.NowNs();
      self->out_.clear();
      self->Run([] {});
    };
    if (tls_) {
      asio::async_write(*tls_, asio::buffer(out_), done);
    } else {
      asio::async_write(*plain_, asio::buffer(out_), done);
    }
  }

  // The call is over (the stream closed): its handler learns it if it did
  // not finish it, and the access log records it.
  void EndCall(Call& c, bool trailers_out) {
    if (c.ended_.exchange(true)) return;
    const size_t left = c.unsent_.exchange(0);
    budget_->unsent.fetch_sub(left, std::memory_order_relaxed);
    c.out_.clear();
    ForgetInbound(c);
    if (c.started_) loop_.open_calls.fetch_sub(1, std::memory_order_relaxed);
    Busy(c, false);
    const bool finished = c.finish_requested_ && trailers_out;
    if (c.handler_ && !finished) {
      ++depth_;
      c.handler_->OnCancel();
      --depth_;
    }
    if (shared_.options.on_call_end && c.started_) {
      GrpcCallRecord r;
      r.method = c.path_;
      r.code = finished ? c.final_.code() : StatusCode::kCancelled;
      r.finished = finished;
      r.duration_ns = shared_.NowNs() - c.start_ns_;
      r.client = peer_;
      r.model = c.log_model_;
      r.request_id = c.log_request_id_;
      shared_.options.on_call_end(r);
    }
  }

  // The call's headers are all here: its method takes it, or it is refused.
  void StartCall(const std::shared_ptr<Call>& c);

  // --- nghttp2 callbacks ---
  static Connection* Self(void* user) { return static_cast<Connection*>(user); }

  static int OnBeginFrame(nghttp2_session*, const nghttp2_frame_hd* hd, void* user) {
    Connection* self = Self(user);
    self->preface_seen_ = true;
    if (hd->type == NGHTTP2_HEADERS || hd->type == NGHTTP2_CONTINUATION) {
      // A header block's frames, before HPACK decodes them: a client that
      // sends more than the bound in one block (CONTINUATION floods) ends.
      self->header_block_bytes_ = hd->type == NGHTTP2_HEADERS ? hd->length : self->header_block_bytes_ + hd->length;
      if (self->header_block_bytes_ > 4 * self->shared_.options.max_header_bytes + 16384) {
        TransportLog(LogLevel::kInfo, "gRPC: closing a connection that sent a header block over the limit",
                     self->peer_);
        return NGHTTP2_ERR_CALLBACK_FAILURE;
      }
    }
    return 0;
  }

  static int OnBeginHeaders(nghttp2_session* session, const nghttp2_frame* frame, void* user) {
    Connection* self = Self(user);
    if (frame->hd.type != NGHTTP2_HEADERS || frame->headers.cat != NGHTTP2_HCAT_REQUEST) return 0;
    if (self->going_away_) {
      nghttp2_submit_rst_stream(session, NGHTTP2_FLAG_NONE, frame->hd.stream_id, NGHTTP2_REFUSED_STREAM);
      return 0;
    }
    auto c = std::make_shared<Call>(frame->hd.stream_id, self->weak_from_this(), self->loop_.ref, self->budget_,
                                    self->peer_, self->shared_.NowNs());
    self->calls_[frame->hd.stream_id] = c;
    nghttp2_session_set_stream_user_data(session, frame->hd.stream_id, c.get());
    return 0;
  }

  static int OnHeader(nghttp2_session*, const nghttp2_frame* frame, const uint8_t* name, size_t namelen,
                      const uint8_t* value, size_t valuelen, uint8_t, void* user) {
    Connection* self = Self(user);
    auto it = self->calls_.find(frame->hd.stream_id);
    if (it == self->calls_.end()) return 0;
    Call& c = *it->second;
    c.header_bytes_ += namelen + valuelen + 32;
    if (c.header_bytes_ > self->shared_.options.max_header_bytes) return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
    if (c.started_) return 0;  // the client's trailers: nothing in them is read
    const std::string_view n(reinterpret_cast<const char*>(name), namelen);
    const std::string_view v(reinterpret_cast<const char*>(value), valuelen);
    if (n == ":path") {
      c.path_ = v;
    } else if (n == ":method") {
      c.method_ = v;
    } else if (n == "content-type") {
      c.content_type_ = v;
    } else if (n == "grpc-encoding") {
      c.encoding_ = v;
    } else if (n == "grpc-timeout") {
      const int64_t t = ParseGrpcTimeout(v);
      if (t >= 0) c.deadline_ns_ = c.start_ns_ + std::max<int64_t>(t, 1);
    } else if (!n.starts_with(':')) {
      c.metadata_.emplace_back(n, v);
    }
    return 0;
  }

  static int OnFrameRecv(nghttp2_session*, const nghttp2_frame* frame, void* user) {
    Connection* self = Self(user);
    if (frame->hd.type != NGHTTP2_HEADERS && frame->hd.type != NGHTTP2_DATA) return 0;
    auto it = self->calls_.find(frame->hd.stream_id);
    if (it == self->calls_.end()) return 0;
    auto c = it->second;
    if (frame->hd.type == NGHTTP2_HEADERS && frame->headers.cat == NGHTTP2_HCAT_REQUEST) self->StartCall(c);
    if (frame->hd.flags & NGHTTP2_FLAG_END_STREAM) {
      c->remote_closed_ = true;
      self->PumpSoon(c);
    }
    return 0;
  }

  // A call reset before its answer: a token from the connection's bucket;
  // none left, the connection ends (GOAWAY ENHANCE_YOUR_CALM).
  int OnCallReset() {
    const auto& o = shared_.options;
    const int64_t now = shared_.NowNs();
    if (reset_tokens_ < 0) reset_tokens_ = o.reset_burst;
    reset_tokens_ =
        std::min<double>(o.reset_burst, reset_tokens_ + (now - reset_refill_ns_) * 1e-9 * o.resets_per_second);
    reset_refill_ns_ = now;
    if (reset_tokens_ < 1) {
      TransportLog(LogLevel::kWarning,
                   "gRPC: closing a connection that reset streams faster than " + std::to_string(o.resets_per_second) +
                       " a second",
                   peer_);
      GoAway(NGHTTP2_ENHANCE_YOUR_CALM);
      return 0;
    }
    reset_tokens_ -= 1;
    return 0;
  }

  static int OnDataChunk(nghttp2_session* session, uint8_t, int32_t stream_id, const uint8_t* data, size_t len,
                         void* user) {
    Connection* self = Self(user);
    nghttp2_session_consume_connection(session, len);
    auto it = self->calls_.find(stream_id);
    if (it == self->calls_.end() || it->second->finish_requested_) return 0;  // refused or answered: dropped
    auto c = it->second;
    if (c->in_.size() == c->in_off_ && c->want_read_) c->message_started_ns_ = self->shared_.NowNs();
    c->in_.append(reinterpret_cast<const char*>(data), len);
    self->inbound_ += len;
    c->unconsumed_ += len;
    if (c->want_read_) self->RequestRead(*c);
    self->PumpSoon(c);
    return 0;
  }

  static int OnStreamClose(nghttp2_session*, int32_t stream_id, uint32_t error_code, void* user) {
    Connection* self = Self(user);
    auto it = self->calls_.find(stream_id);
    if (it == self->calls_.end()) return 0;
    auto c = std::move(it->second);
    self->calls_.erase(it);
    // A call reset before it was answered (by the client's RST_STREAM, or
    // by a stream error the client caused): a token from the reset bucket.
    if (error_code != NGHTTP2_NO_ERROR && !c->trailers_sent_) self->OnCallReset();
    self->EndCall(*c, c->trailers_sent_);
    if (self->calls_.empty()) {
      if (self->busy_ == 0) self->idle_since_ns_ = self->shared_.NowNs();
      if (self->going_away_) self->closing_ = true;
    }
    return 0;
  }

  static int OnFrameSend(nghttp2_session* session, const nghttp2_frame* frame, void* user) {
    Connection* self = Self(user);
    if ((frame->hd.type == NGHTTP2_HEADERS || frame->hd.type == NGHTTP2_DATA) &&
        (frame->hd.flags & NGHTTP2_FLAG_END_STREAM)) {
      // Answered while the client still sends: the rest of its request is
      // not wanted (RFC 9113 8.1).
      auto it = self->calls_.find(frame->hd.stream_id);
      if (it != self->calls_.end() && !it->second->remote_closed_) {
        nghttp2_submit_rst_stream(session, NGHTTP2_FLAG_NONE, frame->hd.stream_id, NGHTTP2_NO_ERROR);
      }
    }
    return 0;
  }

  static ssize_t ReadAnswer(nghttp2_session* session, int32_t stream_id, uint8_t* buf, size_t length, uint32_t* flags,
                            nghttp2_data_source* source, void* user) {
    Connection* self = Self(user);
    Call& c = *static_cast<Call*>(source->ptr);
    size_t copied = 0;
    while (copied < length && !c.out_.empty()) {
      auto& m = c.out_.front();
      while (copied < length && m.offset < 5) buf[copied++] = m.prefix[m.offset++];
      const size_t take = std::min(length - copied, m.size() - m.offset);
      if (take > 0) std::memcpy(buf + copied, m.body.data() + (m.offset - 5), take);
      copied += take;
      m.offset += take;
      if (m.offset == m.size()) {
        self->Taken(c, m.size());
        c.out_.pop_front();
        c.written_notice_ = true;
      }
    }
    if (c.out_.empty() && c.finish_requested_) {
      *flags |= NGHTTP2_DATA_FLAG_EOF | NGHTTP2_DATA_FLAG_NO_END_STREAM;
      const std::string code = std::to_string(static_cast<int>(c.final_.code()));
      static const std::string_view kGrpcStatus = "grpc-status", kGrpcMessage = "grpc-message";
      std::vector<nghttp2_nv> nva = {NvCopy(kGrpcStatus, code)};
      if (!c.final_message_.empty()) nva.push_back(NvCopy(kGrpcMessage, c.final_message_));
      nghttp2_submit_trailer(session, stream_id, nva.data(), nva.size());
      c.trailers_sent_ = true;
      return static_cast<ssize_t>(copied);
    }
    if (copied == 0) return NGHTTP2_ERR_DEFERRED;
    return static_cast<ssize_t>(copied);
  }

  Shared& shared_;
  Loop& loop_;
  std::shared_ptr<Slot> slot_;
  const std::string& peer_;
  std::optional<tcp::socket> plain_;
  std::optional<ssl::stream<tcp::socket>> tls_;
  std::array<uint8_t, kReadChunk> rbuf_;
  std::string out_, next_;
  std::map<int32_t, std::shared_ptr<Call>> calls_;
  std::deque<std::shared_ptr<Call>> ready_;
  int depth_ = 0;
  bool handshaken_ = false, reading_ = false, writing_ = false;
  bool going_away_ = false, closing_ = false, preface_seen_ = false;
  int64_t started_ns_ = 0, idle_since_ns_ = 0, last_progress_ns_ = 0;
  int busy_ = 0;  // calls that make the connection busy (Busy)
  size_t header_block_bytes_ = 0;
  size_t inbound_ = 0;  // request bytes buffered in calls, not yet delivered
  double reset_tokens_ = -1;
  int64_t reset_refill_ns_ = 0;

  friend class Call;
};

void Connection::RequestRead(Call& c) {
  if (c.unconsumed_ == 0 || closed_) return;
  // Over the connection's budget of buffered request bytes, only the call
  // whose message began first reads on (so that one always completes);
  // the others wait, held by their stream windows.
  if (inbound_ > InboundBudget()) {
    for (auto& [id, other] : calls_) {
      if (other.get() != &c && other->want_read_ && other->message_started_ns_ > 0 &&
          other->message_started_ns_ < c.message_started_ns_) {
        return;
      }
    }
  }
  nghttp2_session_consume_stream(session_, c.id_, c.unconsumed_);
  c.unconsumed_ = 0;
}

void Connection::TakeInbound(Call& c, size_t n) {
  const bool was_over = inbound_ > InboundBudget();
  inbound_ -= std::min(n, inbound_);
  if (c.in_off_ >= c.in_.size()) {
    c.in_ = std::string();
    c.in_off_ = 0;
  } else if (c.in_off_ > (size_t{1} << 20) && c.in_off_ > c.in_.size() / 2) {
    c.in_.erase(0, c.in_off_);  // now and then, not per message
    c.in_off_ = 0;
  }
  c.message_started_ns_ = c.in_.size() > c.in_off_ && c.want_read_ ? NowNs() : 0;
  if (was_over && inbound_ <= InboundBudget()) {
    for (auto& [id, other] : calls_) {
      if (other->want_read_ && other->unconsumed_ > 0) RequestRead(*other);
    }
  }
}

void Connection::ForgetInbound(Call& c) {
  TakeInbound(c, c.in_.size() - c.in_off_);
  c.in_ = std::string();
  c.in_off_ = 0;
  c.message_started_ns_ = 0;
}

void Connection::StartCall(const std::shared_ptr<Call>& c) {
  if (c->started_) return;
  c->started_ = true;
  loop_.open_calls.fetch_add(1, std::memory_order_relaxed);
  auto refuse = [&](Status st) { c->DoFinish(std::move(st)); };
  if (c->method_ != "POST") return refuse(Unimplemented("gRPC calls are POST requests"));
  if (!c->content_type_.starts_with("application/grpc")) {
    return refuse(InvalidArgument("content-type '" + c->content_type_.substr(0, 64) + "' is not application/grpc"));
  }
  if (!c->encoding_.empty() && c->encoding_ != "identity" && c->encoding_ != "gzip" && c->encoding_ != "deflate") {
    return refuse(
        Unimplemented("grpc-encoding '" + c->encoding_.substr(0, 32) + "' is not supported (identity, deflate, gzip)"));
  }
  auto m = shared_.methods.find(c->path_);
  if (m == shared_.methods.end()) {
    return refuse(Unimplemented("method '" + c->path_.substr(0, 256) + "' is not served here"));
  }
  if (budget_->unsent.load(std::memory_order_relaxed) >= budget_->limit) {
    return refuse(ResourceExhausted("this connection holds " +
                                    std::to_string(budget_->unsent.load(std::memory_order_relaxed) >> 20) +
                                    " MB of answers its client has not read; no new call is taken until they leave"));
  }
  c->client_streaming_ = m->second.client_streaming;
  c->long_lived_ = m->second.long_lived;
  if (!c->long_lived_) Busy(*c, true);
  ++depth_;
  c->handler_ = m->second.make(c);
  --depth_;
}

void Connection::Inflate(Call& c, std::string message) {
  if (c.encoding_.empty() || c.encoding_ == "identity") {
    return c.DoFinish(Internal("a message is marked compressed but the call names no grpc-encoding"));
  }
  c.inflating_ = true;
  const size_t max = shared_.options.max_message_bytes;
  auto job = [call = c.shared_from_this(), message = std::move(message), max]() mutable {
    Result<std::string> plain = DecodeContentEncoding(call->encoding_, std::move(message), max);
    call->loop_->Post([call, plain = std::move(plain)]() mutable {
      if (auto conn = call->conn_.lock()) conn->Run([&] { conn->Inflated(*call, std::move(plain)); });
    });
  };
  if (!shared_.inflater->Post(std::move(job))) {
    c.inflating_ = false;
    c.DoFinish(Unavailable("too many compressed messages wait to be inflated; try again"));
  }
}

void Connection::Inflated(Call& c, Result<std::string> plain) {
  c.inflating_ = false;
  if (c.ended_ || c.finish_requested_ || !c.handler_) return;
  if (!plain) {
    return c.DoFinish(Status(plain.error().code(),
                             "the request message's " + c.encoding_ + " compression: " + plain.error().message()));
  }
  ++depth_;
  c.handler_->OnMessage(std::move(*plain));
  --depth_;
  PumpSoon(c.shared_from_this());  // the handler may have asked for the next one
}

void Connection::Pump(Call& c) {
  if (c.ended_ || !c.handler_ || c.inflating_) return;
  const size_t max = shared_.options.max_message_bytes;
  while (c.want_read_ && !c.ended_ && !c.finish_requested_) {
    const size_t have = c.in_.size() - c.in_off_;
    if (have >= 5) {
      const auto* p = reinterpret_cast<const uint8_t*>(c.in_.data() + c.in_off_);
      const uint8_t flag = p[0];
      const size_t len = (size_t{p[1]} << 24) | (size_t{p[2]} << 16) | (size_t{p[3]} << 8) | p[4];
      if (len > max) {
        c.DoFinish(ResourceExhausted("the request message is " + std::to_string(len) + " bytes, over the limit of " +
                                     std::to_string(max) + " (--grpc-max-message-bytes)"));
        return;
      }
      if (have < 5 + len) return;
      std::string message;
      if (c.in_off_ == 0 && have == 5 + len) {
        c.in_.erase(0, 5);  // the buffer becomes the message
        message = std::move(c.in_);
        c.in_ = std::string();
      } else {
        message.assign(c.in_, c.in_off_ + 5, len);
        c.in_off_ += 5 + len;
      }
      TakeInbound(c, 5 + len);
      c.want_read_ = false;
      if (flag & 1) return Inflate(c, std::move(message));
      ++depth_;
      c.handler_->OnMessage(std::move(message));
      --depth_;
      continue;
    }
    if (c.remote_closed_) {
      if (have > 0) {
        c.DoFinish(Internal("the request ended inside a message (" + std::to_string(have) + " bytes left)"));
        return;
      }
      c.want_read_ = false;
      c.half_close_delivered_ = true;
      ++depth_;
      c.handler_->OnHalfClose();
      --depth_;
    }
    return;
  }
}

void Call::Read() {
  if (ended_) return;
  if (loop_->InThisThread()) return DoRead();
  auto self = weak_from_this().lock();
  if (!self) return;
  loop_->Post([self = std::move(self)] {
    if (auto conn = self->conn_.lock()) conn->Run([&] { self->DoRead(); });
  });
}

void Call::DoRead() {
  auto conn = conn_.lock();
  if (!conn || ended_ || half_close_delivered_) return;
  want_read_ = true;
  if (in_.size() > in_off_) message_started_ns_ = conn->NowNs();  // its clock starts now
  conn->RequestRead(*this);
  conn->PumpSoon(shared_from_this());
}

bool Call::Write(std::string message) {
  if (ended_.load(std::memory_order_acquire)) return false;
  const size_t n = message.size() + 5;
  const size_t before = budget_->unsent.fetch_add(n, std::memory_order_relaxed);
  if (before > 0 && before + n > budget_->limit) {
    budget_->unsent.fetch_sub(n, std::memory_order_relaxed);
    return false;
  }
  unsent_.fetch_add(n, std::memory_order_relaxed);
  if (loop_->InThisThread()) {
    DoWrite(std::move(message), n);
    return true;
  }
  auto self = weak_from_this().lock();
  if (!self) {
    unsent_.fetch_sub(n, std::memory_order_relaxed);
    budget_->unsent.fetch_sub(n, std::memory_order_relaxed);
    return false;
  }
  posted_writes_.fetch_add(1, std::memory_order_acq_rel);
  loop_->Post([self = std::move(self), m = std::move(message), n]() mutable {
    if (auto c = self->conn_.lock()) {
      c->Run([&] { self->DoWrite(std::move(m), n); });
    }
    self->posted_writes_.fetch_sub(1, std::memory_order_acq_rel);
  });
  return true;
}

void Call::DoWrite(std::string message, size_t reserved) {
  auto conn = conn_.lock();
  if (!conn || ended_ || finish_requested_) {
    // Never queued: give the reservation back (EndCall may have taken
    // this call's count before the reservation landed: whatever is left).
    const size_t left = std::min(reserved, unsent_.load(std::memory_order_relaxed));
    unsent_.fetch_sub(left, std::memory_order_relaxed);
    budget_->unsent.fetch_sub(left, std::memory_order_relaxed);
    return;
  }
  Out o;
  const uint32_t len = static_cast<uint32_t>(message.size());
  o.prefix = {0, static_cast<uint8_t>(len >> 24), static_cast<uint8_t>(len >> 16), static_cast<uint8_t>(len >> 8),
              static_cast<uint8_t>(len)};
  o.body = std::move(message);
  out_.push_back(std::move(o));
  conn->Submit(*this);
}

void Call::Finish(const Status& status) {
  if (ended_) return;
  if (loop_->InThisThread()) return DoFinish(status);
  auto self = weak_from_this().lock();
  if (!self) return;
  loop_->Post([self = std::move(self), status] {
    if (auto conn = self->conn_.lock()) conn->Run([&] { self->DoFinish(status); });
  });
}

void Call::DoFinish(Status status) {
  auto conn = conn_.lock();
  if (!conn || ended_ || finish_requested_) return;
  // A message written from another thread before this Finish may still be
  // on its way to the loop: the end waits behind it (a Finish made on the
  // loop thread would otherwise overtake it, and the message be dropped).
  if (posted_writes_.load(std::memory_order_acquire) > 0) {
    loop_->Post([self = shared_from_this(), status = std::move(status)]() mutable {
      if (auto c = self->conn_.lock()) c->Run([&] { self->DoFinish(std::move(status)); });
    });
    return;
  }
  finish_requested_ = true;
  want_read_ = false;
  // C-core clients refuse response headers over 8 KiB: a long message is cut.
  final_message_ = PercentEncodeGrpcMessage(std::string_view(status.message()).substr(0, 2048));
  final_ = std::move(status);
  conn->ForgetInbound(*this);
  if (!headers_sent_) {
    conn->SubmitTrailersOnly(*this);
  } else {
    conn->Submit(*this);  // the data source ends with the trailers
  }
}

}  // namespace

namespace {

// A client for the per-client bound: an IPv4 address, or an IPv6 address's
// /64 (one host is usually given a whole /64).
std::string ClientKey(const asio::ip::address& a) {
  if (!a.is_v6()) return a.to_string();
  auto bytes = a.to_v6().to_bytes();
  std::fill(bytes.begin() + 8, bytes.end(), 0);
  return asio::ip::address_v6(bytes).to_string() + "/64";
}

}  // namespace

class GrpcTransport::Impl {
 public:
  Impl(GrpcTransportOptions options, std::vector<GrpcMethodSpec> methods) {
    shared_.options = std::move(options);
    shared_.clock = shared_.options.clock;
    shared_.inflater = std::make_unique<SerialWorker>("quern-grpc-zip", 64);
    for (auto& m : methods) shared_.methods.emplace(m.path, std::move(m));
  }

  ~Impl() {
    Stop(0);
    acceptor_.reset();
    for (auto& l : loops_) {
      l->sweep.reset();
    }
    loops_.clear();
  }

  Status Start() {
    auto& o = shared_.options;
    if (o.tls_cert_file.empty() != o.tls_key_file.empty() ||
        (!o.tls_client_ca_file.empty() && o.tls_cert_file.empty())) {
      return InvalidArgument("gRPC TLS needs both a certificate and a key file (and them for client certificates)");
    }
    if (!o.tls_cert_file.empty()) QUERN_RETURN_IF_ERROR(MakeTls());
    const int n = std::max(1, o.io_threads);
    for (int i = 0; i < n; ++i) loops_.push_back(std::make_unique<Loop>());
    boost::system::error_code ec;
    const auto address = asio::ip::make_address(o.host == "0.0.0.0" ? "::" : o.host, ec);
    if (ec) return InvalidArgument("gRPC: --host '" + o.host + "' is not an IP address");
    acceptor_ = std::make_unique<tcp::acceptor>(loops_[0]->io);
    tcp::endpoint ep(address, static_cast<uint16_t>(o.port));
    acceptor_->open(ep.protocol(), ec);
    if (ec && o.host == "0.0.0.0") {  // no IPv6 here
      ep = tcp::endpoint(asio::ip::make_address("0.0.0.0"), static_cast<uint16_t>(o.port));
      ec.clear();
      acceptor_->open(ep.protocol(), ec);
    }
    if (!ec && ep.protocol() == tcp::v6() && (o.host == "0.0.0.0" || o.host == "::")) {
      acceptor_->set_option(asio::ip::v6_only(false), ec);
    }
    if (!ec) acceptor_->set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_->bind(ep, ec);
    if (!ec) acceptor_->listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      return Unavailable("cannot listen for gRPC on " + o.host + ":" + std::to_string(o.port) + ": " + ec.message());
    }
    port_ = acceptor_->local_endpoint().port();
    Accept();
    for (auto& loop : loops_) {
      ScheduleSweep(*loop);
      loop->thread = std::thread([l = loop.get()] {
        NameThisThread("quern-grpc");
        // As HTTP's I/O threads: an answer an engine thread hands over does
        // not preempt it (the engine's batch finishes first).
        DeferToRunningThreads();
        l->ref->SetThread();
        l->io.run();
      });
    }
    return Status::Ok();
  }

  void Stop(int grace_ms) {
    if (stopped_) return;
    stopped_ = true;
    shared_.inflater->Stop();  // what it still holds is dropped with its calls
    if (loops_.empty()) return;
    asio::post(loops_[0]->io, [this] {
      boost::system::error_code ignored;
      if (acceptor_) acceptor_->close(ignored);
    });
    for (auto& l : loops_) {
      asio::post(l->io, [l = l.get()] {
        for (auto& c : std::vector<std::shared_ptr<Connection>>(l->conns.begin(), l->conns.end())) {
          c->Run([&] { c->GoAway(NGHTTP2_NO_ERROR); });
        }
      });
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(grace_ms);
    while (std::chrono::steady_clock::now() < until && OpenCalls() > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    for (auto& l : loops_) {
      asio::post(l->io, [l = l.get()] {
        for (auto& c : std::vector<std::shared_ptr<Connection>>(l->conns.begin(), l->conns.end())) c->Close();
        if (l->sweep) l->sweep->cancel();
      });
    }
    for (auto& l : loops_) {
      l->ref->Close();
      // The posts above run before the loop ends: stop only once they have.
      asio::post(l->io, [l = l.get()] { l->io.stop(); });
    }
    for (auto& l : loops_) {
      if (l->thread.joinable()) l->thread.join();
    }
  }

  int port() const { return port_; }
  int open_connections() const { return shared_.open.load(std::memory_order_relaxed); }

 private:
  int OpenCalls() const {
    int n = 0;
    for (auto& l : loops_) n += l->open_calls.load(std::memory_order_relaxed);
    return n;
  }

  Status MakeTls() {
    auto& o = shared_.options;
    QUERN_ASSIGN_OR_RETURN(auto ctx,
                           MakeServerTlsContext(o.tls_cert_file, o.tls_key_file, o.tls_client_ca_file, "gRPC TLS"));
    // ALPN: HTTP/2 ("h2") is all gRPC speaks.
    SSL_CTX_set_alpn_select_cb(
        ctx->native_handle(),
        [](SSL*, const unsigned char** out, unsigned char* outlen, const unsigned char* in, unsigned int inlen,
           void*) -> int {
          for (unsigned int i = 0; i < inlen;) {
            const unsigned int len = in[i];
            if (i + 1 + len > inlen) break;
            if (len == 2 && std::memcmp(in + i + 1, "h2", 2) == 0) {
              *out = in + i + 1;
              *outlen = 2;
              return SSL_TLSEXT_ERR_OK;
            }
            i += 1 + len;
          }
          return SSL_TLSEXT_ERR_ALERT_FATAL;
        },
        nullptr);
    shared_.tls = std::move(ctx);
    return Status::Ok();
  }

  // The next connection's socket is made on the loop it will live on: its
  // reads and writes complete on that loop's thread, as everything else of
  // the connection runs.
  void Accept() {
    Loop* target = loops_[next_loop_++ % loops_.size()].get();
    acceptor_->async_accept(target->io, [this, target](boost::system::error_code ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted || stopped_) return;
      if (ec) {
        // Out of descriptors: try again shortly (the sweep may free some).
        auto timer = std::make_shared<asio::steady_timer>(loops_[0]->io, std::chrono::milliseconds(100));
        timer->async_wait([this, timer](boost::system::error_code) {
          if (!stopped_) Accept();
        });
        return;
      }
      Admit(std::move(socket), target);
      Accept();
    });
  }

  void Admit(tcp::socket socket, Loop* target) {
    boost::system::error_code ec;
    const auto remote = socket.remote_endpoint(ec);
    if (ec) return;
    auto address = remote.address();
    if (address.is_v6() && address.to_v6().is_v4_mapped()) {
      address = asio::ip::make_address_v4(asio::ip::v4_mapped, address.to_v6());
    }
    socket.set_option(tcp::no_delay(true), ec);
    auto slot = std::make_shared<Slot>();
    slot->peer = address.to_string();
    slot->client = ClientKey(address);
    slot->idle_since_ns.store(shared_.NowNs(), std::memory_order_relaxed);  // no call yet
    const auto& o = shared_.options;
    const size_t limit = static_cast<size_t>(std::max(1, o.max_connections));
    const size_t per_client = static_cast<size_t>(
        o.max_connections_per_client > 0 ? o.max_connections_per_client : std::max(1, o.max_connections / 2));
    slot->loop = target->ref;
    {
      std::lock_guard lock(shared_.reg_mu);
      size_t all = 0, same = 0;
      for (auto& s : shared_.slots) {
        if (s->evicting) continue;
        ++all;
        if (s->client == slot->client) ++same;
      }
      // At a bound, the connection longest without a call goes (of this
      // client's, at its own bound); none such: this one is refused.
      if (same >= per_client) {
        if (!EvictLocked(&slot->client)) return Refuse("per client", per_client, slot->peer);
        --all;  // the one closed counted among all too
      }
      if (all >= limit && !EvictLocked(nullptr)) return Refuse("", limit, slot->peer);
      shared_.slots.push_back(slot);
    }
    shared_.open.fetch_add(1, std::memory_order_relaxed);
    auto conn = std::make_shared<Connection>(shared_, *target, std::move(socket), slot);
    slot->conn = conn;
    asio::post(target->io, [conn] { conn->Start(); });
  }

  // Closes the connection longest without a busy call (of `client`'s, when
  // given); false when there is none.
  bool EvictLocked(const std::string* client) {
    std::shared_ptr<Slot> oldest;
    int64_t oldest_ns = 0;
    for (auto& s : shared_.slots) {
      if (s->evicting || (client && s->client != *client)) continue;
      const int64_t idle = s->idle_since_ns.load(std::memory_order_relaxed);
      if (idle == 0) continue;
      if (!oldest || idle < oldest_ns) {
        oldest = s;
        oldest_ns = idle;
      }
    }
    if (!oldest) return false;
    oldest->evicting = true;
    oldest->loop->Post([weak = oldest->conn] {
      if (auto c = weak.lock()) c->Run([&] { c->Evict(); });
    });
    return true;
  }

  void Refuse(const char* which, size_t limit, const std::string& peer) {
    const int64_t now = shared_.NowNs();
    int64_t last = shared_.last_warning_ns.load(std::memory_order_relaxed);
    if (now - last > 10'000'000'000LL && shared_.last_warning_ns.compare_exchange_strong(last, now)) {
      Log(LogLevel::kWarning,
          std::string("gRPC connection limit reached") + (*which ? " (" + std::string(which) + ")" : "") + " (" +
              std::to_string(limit) + ", every connection has a call open); closing new connections",
          {{"client", peer}});
    }
  }

  void ScheduleSweep(Loop& loop) {
    loop.sweep = std::make_unique<asio::steady_timer>(loop.io, kSweepInterval);
    loop.sweep->async_wait([this, l = &loop](boost::system::error_code ec) {
      if (ec || stopped_) return;
      const int64_t now = shared_.NowNs();
      for (auto& c : std::vector<std::shared_ptr<Connection>>(l->conns.begin(), l->conns.end())) c->Sweep(now);
      ScheduleSweep(*l);
    });
  }

  Shared shared_;
  std::vector<std::unique_ptr<Loop>> loops_;
  std::unique_ptr<tcp::acceptor> acceptor_;
  size_t next_loop_ = 0;
  int port_ = 0;
  std::atomic<bool> stopped_{false};
};

GrpcTransport::GrpcTransport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GrpcTransport::~GrpcTransport() = default;
void GrpcTransport::Stop(int grace_ms) {
  impl_->Stop(grace_ms);
}
int GrpcTransport::port() const {
  return impl_->port();
}
int GrpcTransport::open_connections() const {
  return impl_->open_connections();
}

Result<std::unique_ptr<GrpcTransport>> GrpcTransport::Start(GrpcTransportOptions options,
                                                            std::vector<GrpcMethodSpec> methods) {
  auto impl = std::make_unique<Impl>(std::move(options), std::move(methods));
  QUERN_RETURN_IF_ERROR(impl->Start());
  return std::unique_ptr<GrpcTransport>(new GrpcTransport(std::move(impl)));
}

}  // namespace quern
