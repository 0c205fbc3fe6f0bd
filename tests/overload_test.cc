// Refusing before reading: the engine says whether a model's queue is full
// now, the KServe handler turns that into a 503 from a request's line and
// headers, and the HTTP server answers from the head alone, then skips the
// body and serves the next request on the same connection.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>

#include "core/cpus.h"
#include "frontends/http/http_server.h"
#include "frontends/http/kserve_handler.h"
#include "quern/engine.h"
#include "test_util.h"

namespace quern {
namespace {

using testing::Floats;

// Runs 5 ms; from the second call on, waits for `gate` first.
class Gated : public Model {
 public:
  Gated(std::shared_future<void> gate, std::atomic<int>* calls) : gate_(std::move(gate)), calls_(calls) {}
  Status Execute(const std::vector<NamedTensor>& inputs, int64_t batch_size,
                 std::vector<NamedTensor>& outputs) override {
    if (calls_->fetch_add(1) > 0) gate_.wait();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    outputs = {{"y", inputs.at(0).tensor}};
    (void)batch_size;
    return Status::Ok();
  }

 private:
  std::shared_future<void> gate_;
  std::atomic<int>* calls_;
};

InferRequest Request() {
  InferRequest r;
  r.model = "gated";
  r.inputs = {{"x", Floats({1, 2}, {1, 2})}};
  return r;
}

// "gated": one FP32 row of 2 in, the same out, batches of one.
ModelConfig GatedConfig() {
  ModelConfig c;
  c.name = "gated";
  c.max_batch_size = 1;
  c.inputs = {{.name = "x", .dtype = DataType::kFp32, .dims = {2}}};
  c.outputs = {{.name = "y", .dtype = DataType::kFp32, .dims = {2}}};
  return c;
}

// Polls `cond` for up to 30 s (a model load under the sanitizers on a loaded
// machine may take seconds).
template <typename F>
bool WaitFor(F cond) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!cond() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return cond();
}

TEST(EarlyAdmission, EngineAndHandlerRefuseOnlyWhileTheQueueIsFull) {
  auto engine = Engine::Create({});
  ASSERT_TRUE(engine.has_value());
  Engine& e = **engine;
  ModelConfig c = GatedConfig();
  c.instance_count = 1;
  c.batching = BatchingConfig{};
  c.max_queue_wait_ms = 1;
  std::promise<void> open;
  std::shared_future<void> gate = open.get_future().share();
  std::atomic<int> calls{0};
  ASSERT_TRUE(e.RegisterModel(c, [&] { return std::unique_ptr<Model>(new Gated(gate, &calls)); }).ok());
  KServeHandler handler(&e);
  Router router;
  ASSERT_TRUE(handler.AddRoutes(router).ok());
  HttpRequest head;
  head.method = "POST";
  head.target = "/v2/models/gated/infer";

  EXPECT_TRUE(e.CheckAdmission("gated").ok()) << "nothing measured yet";
  EXPECT_TRUE(e.CheckAdmission("unknown").ok()) << "Infer reports unknown models";
  ASSERT_TRUE(e.Infer(Request()).get().status.ok());  // measures ~5 ms per item
  EXPECT_TRUE(e.CheckAdmission("gated").ok()) << "the instance is free";
  EXPECT_FALSE(router.Head(head).has_value());

  auto running = e.Infer(Request());  // holds the only instance at the gate
  ASSERT_TRUE(WaitFor([&] { return calls.load() == 2; }));
  EXPECT_TRUE(e.CheckAdmission("gated").ok()) << "nothing waits: always admitted";
  auto queued = e.Infer(Request());
  ASSERT_TRUE(WaitFor([&] { return e.GetStatistics("gated").value()[0].pending == 1; }));

  // One queued item is ~5 ms of work, over the 1 ms limit.
  Status refused = e.CheckAdmission("gated");
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable);
  EXPECT_NE(refused.message().find("model 'gated'"), std::string::npos) << refused.message();
  EXPECT_NE(refused.message().find("queue is full"), std::string::npos) << refused.message();
  auto answer = router.Head(head);
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->status, 503);
  EXPECT_NE(answer->body.find("queue is full"), std::string::npos) << answer->body;
  head.target = "/v2/models/gated/versions/" + std::to_string(e.GetModel("gated")->version) + "/infer?x=1";
  EXPECT_TRUE(router.Head(head).has_value()) << head.target;
  // Only inference requests are refused from their head.
  for (const char* target : {"/v2/models/gated", "/v2/models/gated/ready", "/v2/models/gated/infer/x",
                             "/v2/models/unknown/infer", "/v2/models/gated/versions/x/infer", "/v2/health/ready"}) {
    head.target = target;
    EXPECT_FALSE(router.Head(head).has_value()) << target;
  }
  head.target = "/v2/models/gated/infer";
  head.method = "GET";
  EXPECT_FALSE(router.Head(head).has_value());

  // A request its caller admitted already (asked CheckAdmission when it took
  // it, and bounds what it holds) is not refused by the same bound again.
  auto refused_now = e.Infer(Request()).get();
  EXPECT_EQ(refused_now.status.code(), StatusCode::kUnavailable) << refused_now.status.message();
  auto taken = e.Infer(Request(), {.admitted = true});

  open.set_value();
  EXPECT_TRUE(running.get().status.ok());
  EXPECT_TRUE(queued.get().status.ok());
  EXPECT_TRUE(taken.get().status.ok());
  EXPECT_TRUE(e.CheckAdmission("gated").ok());
  auto stats = e.GetStatistics("gated");
  ASSERT_TRUE(stats.has_value());
  EXPECT_EQ((*stats)[0].fail_rejected, 4u) << "refusals from the head count as rejected requests";
  EXPECT_EQ((*stats)[0].success.count, 4u);
}

TEST(Draining, InFlightCountsRequestsOfVersionsBeingReplaced) {
  // A draining server waits for Engine::InFlight() to reach 0: requests of a
  // version being replaced (or unloaded) must count until they finish.
  auto engine = Engine::Create({});
  ASSERT_TRUE(engine.has_value());
  Engine& e = **engine;
  const ModelConfig c = GatedConfig();
  std::promise<void> open;
  std::shared_future<void> gate = open.get_future().share();
  std::atomic<int> calls{1};  // every call waits for the gate
  std::atomic<int> created{0};
  auto factory = [&] {
    created.fetch_add(1);
    return std::unique_ptr<Model>(new Gated(gate, &calls));
  };
  ASSERT_TRUE(e.RegisterModel(c, factory).ok());
  auto running = e.Infer(Request());
  ASSERT_TRUE(WaitFor([&] { return calls.load() == 2; }));
  EXPECT_EQ(e.InFlight(), 1);
  // Replacing the model retires the old version: it waits for the request at the gate.
  auto replaced = std::async(std::launch::async, [&] { return e.RegisterModel(c, factory); });
  ASSERT_TRUE(WaitFor([&] { return created.load() == 2; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the old version leaves the model table
  EXPECT_EQ(replaced.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
  EXPECT_EQ(e.InFlight(), 1) << "the retiring version's request is still in flight";
  open.set_value();
  EXPECT_TRUE(running.get().status.ok());
  EXPECT_TRUE(replaced.get().ok());
  EXPECT_EQ(e.InFlight(), 0);
}

TEST(Draining, NoRepositoryPollAfterPollingStops) {
  testing::TempDir repo;
  testing::CopyModel("add_sub", repo.path(), "a");
  EngineOptions o;
  o.model_repository = repo.path().string();
  o.repository_poll_interval_s = 0.02;
  auto engine = Engine::Create(o);
  ASSERT_TRUE(engine.has_value());
  Engine& e = **engine;
  // Polling works: a new model appears...
  testing::CopyModel("add_sub", repo.path(), "b");
  EXPECT_TRUE(WaitFor([&] { return e.ModelReady("b"); }));
  // ...until it stops: then nothing loads or unloads.
  e.StopRepositoryPolling();  // returns once a poll in progress has ended
  testing::CopyModel("add_sub", repo.path(), "c");
  std::filesystem::remove_all(repo.path() / "a");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(e.GetModel("c").has_value());
  EXPECT_TRUE(e.ModelReady("a"));
}

TEST(UsableCores, FollowTheAffinityMask) {
  // Default thread counts divide the cores a process may use (taskset, a
  // container's cpuset), not every CPU of the host.
  cpu_set_t all;
  ASSERT_EQ(sched_getaffinity(0, sizeof(all), &all), 0);
  EXPECT_LE(UsableCores(), CPU_COUNT(&all));
  EXPECT_GE(UsableCores(), 1);
  // On this thread alone (the affinity mask is per thread), then restored.
  std::thread([&] {
    cpu_set_t one;
    CPU_ZERO(&one);
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &all)) {
        CPU_SET(c, &one);
        break;
      }
    }
    ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
    EXPECT_EQ(UsableCores(), 1);
    // A repository model without instance_group gets one instance per usable core.
    testing::TempDir repo;
    testing::CopyModel("add_sub", repo.path());
    EngineOptions o;
    o.model_repository = repo.path().string();
    auto engine = Engine::Create(o);
    ASSERT_TRUE(engine.has_value());
    auto m = (*engine)->GetModel("add_sub");
    ASSERT_TRUE(m.has_value());
    EXPECT_EQ(m->config.instance_count, 1);
  }).join();
}

// A blocking loopback client with a deadline on every read.
class Client {
 public:
  explicit Client(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  }
  ~Client() { ::close(fd_); }
  bool connected() const { return connected_; }

  bool Send(const std::string& s) {
    size_t sent = 0;
    while (sent < s.size()) {
      const ssize_t n = ::send(fd_, s.data() + sent, s.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += static_cast<size_t>(n);
    }
    return true;
  }

  // One response (headers and Content-Length bytes of body), or what came
  // before the deadline, EOF or an error.
  std::string ReadResponse(int timeout_ms = 5000) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (true) {
      const size_t end = in_.find("\r\n\r\n");
      if (end != std::string::npos) {
        size_t length = 0;
        const size_t at = in_.find("Content-Length: ");
        if (at != std::string::npos && at < end) length = std::stoul(in_.substr(at + 16));
        if (in_.size() >= end + 4 + length) {
          std::string out = in_.substr(0, end + 4 + length);
          in_.erase(0, end + 4 + length);
          return out;
        }
      }
      if (!ReadSome(deadline)) {
        std::string out;
        out.swap(in_);
        return out;
      }
    }
  }

  // True when the server closes the connection before the deadline.
  bool ClosedByServer(int timeout_ms = 5000) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (ReadSome(deadline)) {
    }
    return eof_;
  }

 private:
  bool ReadSome(std::chrono::steady_clock::time_point deadline) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) return false;
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
    if (n <= 0) {
      eof_ = true;
      return false;
    }
    in_.append(buf, static_cast<size_t>(n));
    return true;
  }

  int fd_ = -1;
  bool connected_ = false;
  bool eof_ = false;
  std::string in_;
};

TEST(EarlyAdmission, ServerAnswersFromTheHeadThenSkipsTheBody) {
  std::atomic<int> handled{0};
  HttpServerOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  auto server = HttpServer::Start(
      o,
      [&](HttpRequest&& r, HttpDone done) {
        handled.fetch_add(1);
        HttpResponse resp;
        resp.body = r.target + " read " + std::to_string(r.body.size()) + " bytes";
        done(std::move(resp));
      },
      [](const HttpRequest& head) -> std::optional<HttpResponse> {
        if (head.target != "/refuse") return std::nullopt;
        EXPECT_TRUE(head.body.empty());
        EXPECT_EQ(head.Header("x-test"), "yes") << "headers reach the check, in lower case";
        HttpResponse r;
        r.status = 503;
        r.body = "{\"error\":\"full\"}";
        return r;
      });
  ASSERT_TRUE(server.has_value()) << server.error().ToString();
  const int port = (*server)->port();

  // The answer comes while the body has not been sent at all.
  Client c(port);
  ASSERT_TRUE(c.connected());
  const std::string body(3'000'000, 'x');
  ASSERT_TRUE(c.Send("POST /refuse HTTP/1.1\r\nHost: a\r\nX-Test: yes\r\nContent-Length: " +
                     std::to_string(body.size()) + "\r\n\r\n" + body.substr(0, 1000)));
  std::string r = c.ReadResponse();
  EXPECT_TRUE(r.starts_with("HTTP/1.1 503")) << r;
  EXPECT_NE(r.find("{\"error\":\"full\"}"), std::string::npos) << r;
  EXPECT_EQ(r.find("Connection: close"), std::string::npos) << "a body of known length keeps the connection";
  EXPECT_EQ(handled.load(), 0);
  // The rest of the body is skipped; the next request on the connection is read whole.
  ASSERT_TRUE(c.Send(body.substr(1000)));
  ASSERT_TRUE(c.Send("POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"));
  r = c.ReadResponse();
  EXPECT_TRUE(r.starts_with("HTTP/1.1 200")) << r;
  EXPECT_NE(r.find("/echo read 5 bytes"), std::string::npos) << r;
  EXPECT_EQ(handled.load(), 1);

  // Body and next request arriving together with the head (pipelined).
  ASSERT_TRUE(
      c.Send("POST /refuse HTTP/1.1\r\nX-Test: yes\r\nContent-Length: 4\r\n\r\nabcdGET /next HTTP/1.1\r\n\r\n"));
  r = c.ReadResponse();
  EXPECT_TRUE(r.starts_with("HTTP/1.1 503")) << r;
  r = c.ReadResponse();
  EXPECT_NE(r.find("/next read 0 bytes"), std::string::npos) << r;

  // "Expect: 100-continue": the client is told to send its body...
  ASSERT_TRUE(c.Send("POST /echo HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"));
  r = c.ReadResponse();
  EXPECT_EQ(r, "HTTP/1.1 100 Continue\r\n\r\n");
  ASSERT_TRUE(c.Send("hello"));
  r = c.ReadResponse();
  EXPECT_NE(r.find("/echo read 5 bytes"), std::string::npos) << r;
  // ...unless it is answered from the head: then the connection closes, as
  // the client may send the body or not.
  Client expecting(port);
  ASSERT_TRUE(
      expecting.Send("POST /refuse HTTP/1.1\r\nX-Test: yes\r\nExpect: 100-Continue\r\nContent-Length: 9\r\n\r\n"));
  r = expecting.ReadResponse();
  EXPECT_TRUE(r.starts_with("HTTP/1.1 503")) << r;
  EXPECT_NE(r.find("Connection: close"), std::string::npos) << r;
  EXPECT_TRUE(expecting.ClosedByServer());

  // A body of unknown length cannot be skipped: answered, then closed.
  Client chunked(port);
  ASSERT_TRUE(chunked.Send("POST /refuse HTTP/1.1\r\nX-Test: yes\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"));
  r = chunked.ReadResponse();
  EXPECT_TRUE(r.starts_with("HTTP/1.1 503")) << r;
  EXPECT_NE(r.find("Connection: close"), std::string::npos) << r;
  EXPECT_TRUE(chunked.ClosedByServer());
  EXPECT_EQ(handled.load(), 3);
}

}  // namespace
}  // namespace quern
