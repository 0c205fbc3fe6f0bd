#include "frontends/http/http_server.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <optional>
#include <thread>
#include <vector>

namespace quern {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {

constexpr size_t kReadBufferBytes = 64 * 1024;

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, const HttpServerOptions& options, const HttpHandler& handler)
      : stream_(std::move(socket)), options_(options), handler_(handler) {
    // Beast reads at most the buffer's free capacity per system call: a
    // small buffer turns a 50 KiB tensor body into a hundred reads.
    buffer_.reserve(kReadBufferBytes);
  }

  void Run() {
    asio::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->Read(); });
  }

 private:
  void Read() {
    parser_.emplace();
    parser_->body_limit(options_.max_body_bytes);
    stream_.expires_after(std::chrono::seconds(options_.read_timeout_s));
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }

  void OnRead(beast::error_code ec) {
    if (ec == http::error::end_of_stream || ec == beast::error::timeout || ec == asio::error::connection_reset) {
      return Close();
    }
    if (ec == http::error::body_limit) {
      HttpResponse r;
      r.status = 413;
      r.body =
          "{\"error\":\"request body exceeds the limit of " + std::to_string(options_.max_body_bytes) + " bytes\"}";
      keep_alive_ = false;
      return Write(std::move(r));
    }
    if (ec) return Close();
    auto msg = parser_->release();
    keep_alive_ = msg.keep_alive();
    HttpRequest req;
    req.method = std::string(msg.method_string());
    req.target = std::string(msg.target());
    for (const auto& f : msg) {
      std::string name(f.name_string());
      for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      req.headers.emplace_back(std::move(name), std::string(f.value()));
    }
    req.body = std::move(msg.body());
    req.cancel = std::make_shared<CancellationToken>();
    stream_.expires_never();
    WatchForDisconnect(req.cancel);
    handler_(std::move(req), [self = shared_from_this()](HttpResponse r) {
      asio::post(self->stream_.get_executor(), [self, r = std::move(r)]() mutable { self->Write(std::move(r)); });
    });
  }

  // While a request is in flight, a readable socket with nothing to read
  // means the client closed it: its queued work is cancelled. Pipelined
  // bytes (the next request) stop the watch; Read() picks them up.
  void WatchForDisconnect(std::shared_ptr<CancellationToken> cancel) {
    stream_.socket().async_wait(tcp::socket::wait_read,
                                [self = shared_from_this(), cancel = std::move(cancel)](beast::error_code ec) {
                                  if (ec == asio::error::operation_aborted) return;
                                  beast::error_code avail_ec;
                                  const size_t n = self->stream_.socket().available(avail_ec);
                                  if (ec || avail_ec || n == 0) cancel->Cancel();
                                });
  }

  void Write(HttpResponse r) {
    auto res = std::make_shared<http::response<http::string_body>>(static_cast<http::status>(r.status), 11);
    res->set(http::field::server, "quern");
    if (!r.content_type.empty()) res->set(http::field::content_type, r.content_type);
    for (const auto& [k, v] : r.headers) res->set(k, v);
    res->body() = std::move(r.body);
    res->keep_alive(keep_alive_);
    res->prepare_payload();  // Content-Length, never chunked
    beast::error_code ignored;
    stream_.socket().cancel(ignored);  // ends the disconnect watch
    http::async_write(stream_, *res, [self = shared_from_this(), res](beast::error_code ec, size_t) {
      if (ec || !self->keep_alive_) return self->Close();
      self->Read();
    });
  }

  void Close() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  const HttpServerOptions& options_;
  const HttpHandler& handler_;
  bool keep_alive_ = true;
};

}  // namespace

class HttpServer::Impl {
 public:
  Impl(HttpServerOptions options, HttpHandler handler)
      : options_(std::move(options)), handler_(std::move(handler)), acceptor_(io_) {}

  Status Listen() {
    beast::error_code ec;
    auto address = asio::ip::make_address(options_.host, ec);
    if (ec) return InvalidArgument("--host '" + options_.host + "' is not an IP address");
    tcp::endpoint ep(address, static_cast<unsigned short>(options_.port));
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      return Unavailable("cannot listen on " + options_.host + ":" + std::to_string(options_.port) + ": " +
                         ec.message());
    }
    Accept();
    for (int i = 0; i < std::max(1, options_.io_threads); ++i) threads_.emplace_back([this] { io_.run(); });
    return Status::Ok();
  }

  ~Impl() { Stop(); }

  void Stop() {
    io_.stop();
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

  int port() const { return acceptor_.local_endpoint().port(); }

 private:
  void Accept() {
    acceptor_.async_accept(asio::make_strand(io_), [this](beast::error_code ec, tcp::socket socket) {
      if (!ec) std::make_shared<Session>(std::move(socket), options_, handler_)->Run();
      if (acceptor_.is_open()) Accept();
    });
  }

  HttpServerOptions options_;
  HttpHandler handler_;
  asio::io_context io_;
  tcp::acceptor acceptor_;
  std::vector<std::thread> threads_;
};

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HttpServer::~HttpServer() = default;
void HttpServer::Stop() {
  impl_->Stop();
}
int HttpServer::port() const {
  return impl_->port();
}

Result<std::unique_ptr<HttpServer>> HttpServer::Start(HttpServerOptions options, HttpHandler handler) {
  auto impl = std::make_unique<Impl>(std::move(options), std::move(handler));
  QUERN_RETURN_IF_ERROR(impl->Listen());
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

}  // namespace quern
