#include "frontends/grpc/grpc_server.h"

#include <google/protobuf/arena.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <set>
#include <thread>

#include "auth/api_keys.h"
#include "core/log.h"
#include "core/model_config_parser.h"
#include "core/mutex.h"
#include "core/serial_worker.h"
#include "frontends/grpc/grpc_convert.h"
#include "frontends/grpc/grpc_transport.h"
#include "health.pb.h"
#include "protocol/kserve_codec.h"

namespace quern {
namespace {

constexpr std::string_view kService = "/inference.GRPCInferenceService/";
constexpr std::string_view kHealth = "/grpc.health.v1.Health/";

// Which stream the previous streamed inference came from. A stream whose
// requests follow one another with nobody else's between them, one in
// flight at a time, is alone: its batch may run on the gRPC thread that
// received it (SubmitOptions::lend_thread; the engine decides whether it is
// short enough), with no hand-off to an engine thread and back. While
// streams take turns, their requests go to the engine's threads, where they
// batch. Unary calls have no such identity (a client's threads share one
// connection), so theirs always go to the engine's threads.
class LastCaller {
 public:
  // Records `caller` as the latest; whether it was the latest already.
  bool Repeats(uintptr_t caller) { return last_.exchange(caller, std::memory_order_relaxed) == caller; }

 private:
  std::atomic<uintptr_t> last_{0};
};

// Who may make a call.
enum class Access {
  kUser,   // any valid key; refused while the server drains
  kAdmin,  // an admin key; refused while the server drains
  kProbe,  // any valid key; answered while the server drains too
};

template <class M>
std::string Serialize(const M& m) {
  std::string out;
  m.SerializeToString(&out);
  return out;
}

// A handler that does nothing: its call was refused when it started.
class Refused final : public GrpcHandler {
 public:
  void OnMessage(std::string) override {}
};

// One unary call: `body` answers the parsed request or returns an error,
// on the call's loop thread, or on `slow` when given. Reads the request only
// when admitted.
template <class Req, class Resp>
class UnaryHandler final : public GrpcHandler {
 public:
  using Body = std::function<Status(const Req&, Resp*)>;
  UnaryHandler(const std::shared_ptr<GrpcCall>& call, const Body* body, SerialWorker* slow)
      : call_(call.get()), weak_(call), body_(body), slow_(slow) {}

  void OnMessage(std::string message) override {
    Req in;
    if (!in.ParseFromString(message)) {
      return call_->Finish(InvalidArgument("the request is not a valid message for " + std::string(call_->path()) +
                                           " (protobuf parsing failed)"));
    }
    message = {};
    if (!slow_) return Answer(*call_, *body_, in);
    const bool queued = slow_->Post([call = weak_.lock(), body = body_, in = std::move(in)] {
      if (call) Answer(*call, *body, in);
    });
    if (!queued) call_->Finish(Unavailable("too many model loads and unloads are waiting; try again later"));
  }
  void OnHalfClose() override {
    call_->Finish(InvalidArgument(std::string(call_->path()) + ": the call ended before its request message"));
  }

 private:
  static void Answer(GrpcCall& call, const Body& body, const Req& in) {
    Resp out;
    if (Status st = body(in, &out); !st.ok()) return call.Finish(st);
    if (!call.Write(Serialize(out))) return call.Finish(ResourceExhausted("the answer could not be queued"));
    call.Finish(Status::Ok());
  }

  GrpcCall* call_;
  std::weak_ptr<GrpcCall> weak_;
  const Body* body_;
  SerialWorker* slow_;
};

// One ModelInfer call. Its request and answer live on one arena: a block or
// two instead of an allocation per field (raw bytes are strings of their
// own). The engine's answer holds the call (and so this handler) until it
// has written it.
class InferHandler final : public GrpcHandler {
 public:
  InferHandler(Engine* engine, const std::shared_ptr<GrpcCall>& call, size_t max_send_bytes)
      : engine_(engine),
        call_(call),
        max_send_bytes_(max_send_bytes),
        arena_(ArenaBlocks()),
        cancel_(std::make_shared<CancellationToken>()) {}

  void OnCancel() override { cancel_->Cancel(); }
  void OnHalfClose() override {
    if (auto c = call_.lock())
      c->Finish(InvalidArgument(std::string(c->path()) + ": the call ended before its request message"));
  }

  void OnMessage(std::string message) override {
    auto call = call_.lock();
    if (!call) return;
    request_ = google::protobuf::Arena::CreateMessage<inference::ModelInferRequest>(&arena_);
    const bool parsed = request_->ParseFromString(message);
    message = {};
    if (!parsed) {
      return call->Finish(
          InvalidArgument("the request is not a valid message for /inference.GRPCInferenceService/ModelInfer (protobuf "
                          "parsing failed)"));
    }
    // The request's name in the engine (and a Python model's request_id()):
    // its id, else the x-request-id metadata.
    std::string_view name = request_->id();
    if (name.empty()) name = call->Metadata("x-request-id");
    const bool usable = UsableRequestId(name);
    call->set_log_fields(request_->model_name().substr(0, 256), usable ? std::string(name) : std::string());
    auto ir = ToInferRequest(*request_);
    if (!ir) return call->Finish(ir.error());
    ir->cancel = cancel_;
    ir->deadline_ns = call->deadline_ns();  // the engine's clock (the transport's)
    if (usable) ir->metadata.emplace_back("request_id", std::string(name));
    InferCallback done = [this, call](InferResponse&& r) {
      if (!r.status.ok()) return call->Finish(r.status);
      if (Status st = ApplyClassifications(*request_, *engine_, r); !st.ok()) return call->Finish(st);
      auto* response = google::protobuf::Arena::CreateMessage<inference::ModelInferResponse>(&arena_);
      ToInferResponse(r, request_->id(), response);
      const size_t size = response->ByteSizeLong();
      if (size > max_send_bytes_) {
        return call->Finish(ResourceExhausted("the response is " + std::to_string(size) + " bytes, over the limit of " +
                                              std::to_string(max_send_bytes_) + " (--grpc-max-message-bytes)"));
      }
      if (!call->Write(Serialize(*response))) {
        return call->Finish(ResourceExhausted(
            "the answer was not sent: this connection holds as many unread answers as it may (its client does not "
            "read them)"));
      }
      call->Finish(Status::Ok());
    };
    if (Status st = engine_->InferAsync(std::move(*ir), done); !st.ok()) call->Finish(st);
  }

 private:
  static google::protobuf::ArenaOptions ArenaBlocks() {
    google::protobuf::ArenaOptions o;
    o.start_block_size = 2048;
    o.max_block_size = 64 * 1024;
    return o;
  }

  Engine* engine_;
  std::weak_ptr<GrpcCall> call_;
  size_t max_send_bytes_;
  google::protobuf::Arena arena_;
  inference::ModelInferRequest* request_ = nullptr;
  std::shared_ptr<CancellationToken> cancel_;
};

// ModelStreamInfer: reads requests one after another, submits each at once,
// and writes responses in completion order. A message that does not parse
// is answered with an error and the stream goes on.
// Backpressure: the stream reads its next message only while fewer than
// kMaxStreamPending of its requests are unanswered and the answers waiting
// to be sent, with those its unanswered requests will make (each counted as
// large as the last answer), come to less than kMaxStreamUnsentBytes;
// otherwise it reads on once answers leave, and meanwhile HTTP/2 flow
// control holds the client (a client that never reads its answers holds a
// bounded amount, and its connection closes when they do not move).
class StreamHandler final : public GrpcHandler {
  static constexpr int kMaxStreamPending = 256;
  static constexpr size_t kMaxStreamUnsentBytes = size_t{16} << 20;
  // How long a decoupled model's response waits for a slow reader before it is refused.
  static constexpr int64_t kMaxRoomWaitNs = int64_t{30} * 1'000'000'000;

  static google::protobuf::ArenaOptions RequestArena() {
    google::protobuf::ArenaOptions o;
    o.start_block_size = 1024;
    o.max_block_size = 64 * 1024;
    return o;
  }

 public:
  // `admit` (may be empty) runs for every message: a request it refuses is
  // answered with its error (rate limits, draining) and the stream goes on.
  StreamHandler(Engine* engine, const std::shared_ptr<GrpcCall>& call, std::function<Status()> admit,
                LastCaller* last_caller, size_t max_send_bytes)
      : engine_(engine),
        call_(call),
        raw_(call.get()),
        admit_(std::move(admit)),
        last_caller_(last_caller),
        max_send_bytes_(max_send_bytes) {}

  void Begin() { raw_->Read(); }

  void OnMessage(std::string message) override {
    auto arena = std::make_shared<google::protobuf::Arena>(RequestArena());
    auto* request = google::protobuf::Arena::CreateMessage<inference::ModelInferRequest>(arena.get());
    const bool parsed = request->ParseFromString(message);
    message = {};
    const uint64_t n = ++messages_;
    bool lone, read_on;
    {
      // Counted before the next read starts: the stream must not finish
      // before this message is answered.
      MutexLock lock(mu_);
      ++pending_;
      lone = last_caller_->Repeats(reinterpret_cast<uintptr_t>(this)) && pending_ == 1 && raw_->unsent_bytes() == 0;
      read_on = RoomLocked();
      read_paused_ = !read_on;
    }
    if (read_on) raw_->Read();
    if (!parsed) {
      Answer("",
             InvalidArgument("stream message " + std::to_string(n) +
                             " is not a valid inference.ModelInferRequest (protobuf parsing failed)"),
             nullptr);
      return Release();
    }
    Submit(std::move(arena), request, lone);
  }

  void OnHalfClose() override {
    MutexLock lock(mu_);
    reads_done_ = true;
    MaybeFinishLocked();
  }

  void OnWritten() override {
    bool read_on;
    {
      MutexLock lock(mu_);
      read_on = ResumeLocked();
      room_.SignalAll();
    }
    if (read_on) raw_->Read();
  }

  void OnCancel() override {
    MutexLock lock(mu_);
    broken_ = true;
    room_.SignalAll();
    for (auto& c : cancels_) c->Cancel();
  }

 private:
  bool RoomLocked() const QUERN_REQUIRES(mu_) {
    return pending_ < kMaxStreamPending &&
           raw_->unsent_bytes() + static_cast<size_t>(pending_) * last_answer_bytes_ < kMaxStreamUnsentBytes;
  }

  // A paused stream: true when it may read on now.
  bool ResumeLocked() QUERN_REQUIRES(mu_) {
    if (!read_paused_ || broken_ || !RoomLocked()) return false;
    read_paused_ = false;
    return true;
  }

  void Submit(std::shared_ptr<google::protobuf::Arena> arena, const inference::ModelInferRequest* request, bool lone) {
    if (admit_) {
      if (Status st = admit_(); !st.ok()) {
        Answer(request->id(), st, nullptr);
        return Release();
      }
    }
    auto ir = ToInferRequest(*request);
    if (!ir) {
      Answer(request->id(), ir.error(), nullptr);
      return Release();
    }
    auto cancel = std::make_shared<CancellationToken>();
    ir->cancel = cancel;
    ir->deadline_ns = raw_->deadline_ns();
    {
      MutexLock lock(mu_);
      if (broken_) cancel->Cancel();
      cancels_.push_back(cancel);
    }
    // A decoupled model's responses before the last (the last comes to `done`): each sent as it
    // comes, with triton_final_response false.
    ir->on_response = [this, call = call_.lock(), request, cancel](InferResponse&& r) {
      if (cancel->cancelled()) return;  // the client has gone, or did not read in time: dropped
      if (r.status.ok()) r.status = ApplyClassifications(*request, *engine_, r);
      if (!AwaitRoom()) cancel->Cancel();  // not read in time: the model may stop
      Answer(request->id(), r.status, &r, false);
    };
    // The request message owns the raw input bytes: it lives in the callback,
    // and so does the call (and this handler).
    InferCallback done = [this, call = call_.lock(), arena = std::move(arena), request, cancel](InferResponse&& r) {
      if (r.status.ok()) r.status = ApplyClassifications(*request, *engine_, r);
      // A decoupled model that closed the request without a response: nothing is sent, unless the
      // client asked for an empty last response (Triton's triton_enable_empty_final_response).
      const auto empty = request->parameters().find("triton_enable_empty_final_response");
      if (!r.final_only || (empty != request->parameters().end() && empty->second.bool_param())) {
        Answer(request->id(), r.status, &r, r.decoupled ? std::optional<bool>(true) : std::nullopt);
      }
      {
        MutexLock lock(mu_);
        std::erase(cancels_, cancel);
      }
      Release();
    };
    if (Status st = engine_->InferAsync(std::move(*ir), done, {.lend_thread = lone}); !st.ok()) {
      InferResponse refused;  // answered and counted as the callback does
      refused.status = std::move(st);
      done(std::move(refused));
    }
  }

  // A decoupled model's instance sending to a client that reads slowly: waits (a bounded while,
  // which holds the model's next send) until the call's unread answers are below the bound again.
  // False when there is no room still (the answer may then be refused: Answer says so).
  bool AwaitRoom() {
    const Clock& clock = RealClockInstance();
    const int64_t until = clock.NowNs() + kMaxRoomWaitNs;
    MutexLock lock(mu_);
    while (!broken_ && raw_->unsent_bytes() > kMaxStreamUnsentBytes) {
      if (room_.WaitUntil(lock, clock, until)) return raw_->unsent_bytes() <= kMaxStreamUnsentBytes;
    }
    return !broken_;
  }

  // Queues a response (or an error for this request only) for sending; `final`: a decoupled
  // model's response, with Triton's parameter triton_final_response.
  void Answer(const std::string& id, const Status& status, const InferResponse* r,
              std::optional<bool> final = std::nullopt) {
    google::protobuf::Arena arena;
    auto& out = *google::protobuf::Arena::CreateMessage<inference::ModelStreamInferResponse>(&arena);
    if (!status.ok()) {
      out.set_error_message(status.message());
      out.mutable_infer_response()->set_id(id);
    } else {
      ToInferResponse(*r, id, out.mutable_infer_response());
    }
    if (final) {
      (*out.mutable_infer_response()->mutable_parameters())["triton_final_response"].set_bool_param(*final);
    }
    if (out.ByteSizeLong() > max_send_bytes_) {
      const size_t size = out.ByteSizeLong();
      out.Clear();
      out.set_error_message("the response is " + std::to_string(size) + " bytes, over the limit of " +
                            std::to_string(max_send_bytes_) + " (--grpc-max-message-bytes)");
      out.mutable_infer_response()->set_id(id);
    }
    std::string bytes = Serialize(out);
    const size_t size = bytes.size();
    if (!raw_->Write(std::move(bytes))) {
      // The connection holds all the unread answers it may: say so in a
      // short answer, or end the stream when even that cannot go.
      out.Clear();
      out.set_error_message("the answer was not sent: this connection holds as many unread answers as it may");
      out.mutable_infer_response()->set_id(id);
      if (!raw_->Write(Serialize(out))) {
        raw_->Finish(ResourceExhausted("the stream's answers are not being read"));
      }
    }
    MutexLock lock(mu_);
    last_answer_bytes_ = size;
  }

  // One message answered: the stream may end now.
  void Release() {
    bool read_on;
    {
      MutexLock lock(mu_);
      --pending_;
      read_on = ResumeLocked();
      MaybeFinishLocked();
    }
    if (read_on) raw_->Read();
  }

  // The stream ends when the client has finished sending and every request
  // has answered (the transport sends the trailers after the answers).
  void MaybeFinishLocked() QUERN_REQUIRES(mu_) {
    if (finished_ || pending_ > 0 || !reads_done_) return;
    finished_ = true;
    raw_->Finish(Status::Ok());
  }

  Engine* engine_;
  std::weak_ptr<GrpcCall> call_;
  GrpcCall* raw_;  // alive as long as this handler (the call owns it)
  std::function<Status()> admit_;
  LastCaller* last_caller_;
  size_t max_send_bytes_;
  uint64_t messages_ = 0;  // the loop thread only

  Mutex mu_;
  CondVar room_;  // signalled when answers were written, or the call ended
  std::vector<std::shared_ptr<CancellationToken>> cancels_ QUERN_GUARDED_BY(mu_);
  int pending_ QUERN_GUARDED_BY(mu_) = 0;
  size_t last_answer_bytes_ QUERN_GUARDED_BY(mu_) = 0;
  bool read_paused_ QUERN_GUARDED_BY(mu_) = false;
  bool reads_done_ QUERN_GUARDED_BY(mu_) = false;
  bool broken_ QUERN_GUARDED_BY(mu_) = false;
  bool finished_ QUERN_GUARDED_BY(mu_) = false;
};

Status ModelControlOff() {
  return FailedPrecondition(
      "model load and unload over the API are off; start quern serve with --model-control explicit");
}

Status NotImplemented(std::string_view what) {
  return Unimplemented(std::string(what) +
                       " is not implemented by Quern (no shared memory, tracing or log settings over gRPC)");
}

// grpc.health.v1 (Check and Watch) for "" (the server) and
// "inference.GRPCInferenceService": SERVING while every model is ready and
// the server is not draining. Open to load balancers with no key: a call
// the keys would not admit is answered for the server as a whole without
// its request being read; an admitted one (or any, with no keys
// configured) is answered for the service it names.
class HealthService {
  using Response = grpc::health::v1::HealthCheckResponse;

 public:
  // Sets whether the server serves; watchers are told of a change.
  void Set(bool serving) {
    const auto status = serving ? Response::SERVING : Response::NOT_SERVING;
    MutexLock lock(mu_);
    if (status == status_ || closed_) return;
    status_ = status;
    for (WatchHandler* w : watchers_) w->Send(status, false);
  }

  // The server stops: NOT_SERVING from now on; each watch is sent it and
  // finished.
  void Close() {
    MutexLock lock(mu_);
    closed_ = true;
    status_ = Response::NOT_SERVING;
    for (WatchHandler* w : watchers_) w->Send(status_, true);
  }

  Response::ServingStatus Current() const {
    MutexLock lock(mu_);
    return status_;
  }

  static bool Known(const std::string& service) {
    return service.empty() || service == "inference.GRPCInferenceService";
  }

  class CheckHandler final : public GrpcHandler {
   public:
    CheckHandler(HealthService* health, GrpcCall* call, bool reads) : health_(health), call_(call) {
      if (reads) {
        call_->Read();
      } else {
        Reply(health_->Current());
      }
    }
    void OnMessage(std::string message) override {
      grpc::health::v1::HealthCheckRequest in;
      if (!in.ParseFromString(message)) {
        return call_->Finish(InvalidArgument(
            "the request is not a valid message for /grpc.health.v1.Health/Check (protobuf parsing failed)"));
      }
      if (!Known(in.service())) {
        return call_->Finish(NotFound("unknown service '" + in.service().substr(0, 128) +
                                      "' (known: \"\" and \"inference.GRPCInferenceService\")"));
      }
      Reply(health_->Current());
    }
    void OnHalfClose() override {
      call_->Finish(InvalidArgument("/grpc.health.v1.Health/Check: the call ended before its request message"));
    }

   private:
    void Reply(Response::ServingStatus status) {
      Response out;
      out.set_status(status);
      call_->Write(Serialize(out));
      call_->Finish(Status::Ok());
    }
    HealthService* health_;
    GrpcCall* call_;
  };

  // One Watch: the status now, then each change, until the client leaves.
  class WatchHandler final : public GrpcHandler {
   public:
    WatchHandler(HealthService* health, GrpcCall* call) : health_(health), call_(call) {}
    ~WatchHandler() override { health_->Forget(this); }

    void Begin(bool reads) {
      if (reads) {
        call_->Read();
      } else {
        Watch(true);
      }
    }

    void OnMessage(std::string message) override {
      grpc::health::v1::HealthCheckRequest in;
      if (!in.ParseFromString(message)) {
        MutexLock lock(mu_);
        return FinishLocked(InvalidArgument("the request is not a valid message for /grpc.health.v1.Health/Watch"));
      }
      Watch(Known(in.service()));
    }
    void OnHalfClose() override {
      MutexLock lock(mu_);
      FinishLocked(InvalidArgument("/grpc.health.v1.Health/Watch: the call ended before its request message"));
    }
    void OnCancel() override {
      health_->Forget(this);
      MutexLock lock(mu_);
      finished_ = true;
    }

    // Sends `status` if it is new; `last`: the watch ends with it.
    void Send(Response::ServingStatus status, bool last) {
      MutexLock lock(mu_);
      if (finished_) return;
      if (status != sent_) {
        sent_ = status;
        Response out;
        out.set_status(status);
        if (!call_->Write(Serialize(out))) return FinishLocked(ResourceExhausted("the watch's answers are not read"));
      }
      if (last) FinishLocked(Status::Ok());
    }

   private:
    void Watch(bool known) {
      if (!known) return Send(Response::SERVICE_UNKNOWN, false);  // it never changes: no updates follow
      health_->Add(this);
    }
    void FinishLocked(const Status& status) QUERN_REQUIRES(mu_) {
      if (finished_) return;
      finished_ = true;
      call_->Finish(status);
    }

    HealthService* health_;
    GrpcCall* call_;
    Mutex mu_;
    Response::ServingStatus sent_ QUERN_GUARDED_BY(mu_) = Response::UNKNOWN;
    bool finished_ QUERN_GUARDED_BY(mu_) = false;
  };

 private:
  void Add(WatchHandler* w) {
    MutexLock lock(mu_);
    watchers_.insert(w);
    w->Send(status_, closed_);
  }
  void Forget(WatchHandler* w) {
    MutexLock lock(mu_);
    watchers_.erase(w);
  }

  mutable Mutex mu_;
  Response::ServingStatus status_ QUERN_GUARDED_BY(mu_) = Response::NOT_SERVING;
  bool closed_ QUERN_GUARDED_BY(mu_) = false;
  std::set<WatchHandler*> watchers_ QUERN_GUARDED_BY(mu_);
};

std::string_view CodeName(StatusCode code) {
  static constexpr std::string_view kNames[] = {
      "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
      "DATA_LOSS", "UNAUTHENTICATED"};
  const auto i = static_cast<size_t>(code);
  return i < std::size(kNames) ? kNames[i] : "UNKNOWN";
}

}  // namespace

class GrpcServer::Impl {
 public:
  Impl(GrpcServerOptions options, Engine* engine) : options_(std::move(options)), engine_(engine) {}

  Status Start() {
    GrpcTransportOptions t;
    t.host = options_.host;
    t.port = options_.port;
    t.io_threads = options_.io_threads;
    t.max_message_bytes = static_cast<size_t>(std::max(1, options_.max_receive_bytes));
    t.max_concurrent_streams = options_.max_concurrent_streams;
    t.max_connections = options_.max_connections;
    t.max_connections_per_client = options_.max_connections_per_client;
    t.idle_timeout_s = std::max(1, options_.idle_timeout_s);
    t.message_timeout_s = std::max(1, options_.message_timeout_s);
    t.write_timeout_s = std::max(1, options_.write_timeout_s);
    t.max_unsent_bytes = options_.max_unsent_bytes;
    t.tls_cert_file = options_.tls_cert_file;
    t.tls_key_file = options_.tls_key_file;
    t.tls_client_ca_file = options_.tls_client_ca_file;
    t.clock = &engine_->clock();
    if (options_.access_log) {
      t.on_call_end = [this](const GrpcCallRecord& r) {
        options_.access_log(
            {r.method, r.finished ? CodeName(r.code) : "CANCELLED", r.duration_ns, r.client, r.model, r.request_id});
      };
    }
    auto transport = GrpcTransport::Start(std::move(t), Methods());
    if (!transport) return transport.error();
    transport_ = std::move(*transport);
    UpdateHealth();
    health_thread_ = std::thread([this] {
      MutexLock lock(mu_);
      while (!stopping_) {
        cv_.WaitFor(lock, engine_->clock(), std::chrono::milliseconds(options_.health_poll_ms));
        if (stopping_) break;
        lock.Unlock();
        UpdateHealth();
        lock.Lock();
      }
    });
    return Status::Ok();
  }

  ~Impl() { Stop(); }

  void Stop() {
    {
      MutexLock lock(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.SignalAll();
    if (health_thread_.joinable()) health_thread_.join();
    health_.Close();
    // Calls still running after a second are cancelled (their requests are
    // withdrawn from the batcher).
    if (transport_) transport_->Stop(1000);
    slow_calls_.Stop();
  }

  int port() const { return transport_ ? transport_->port() : 0; }
  void RefreshHealth() { UpdateHealth(); }

 private:
  bool draining() const { return options_.draining && options_.draining->load(std::memory_order_acquire); }
  bool starting() const { return options_.started && !options_.started->load(std::memory_order_acquire); }

  // OK when the call may proceed: it presents an acceptable key (and, but
  // for probes, the server is not draining). Takes the key's rate-limit
  // token.
  Status Admit(const GrpcCall& call, Access access) const {
    if (options_.authorize) {
      QUERN_RETURN_IF_ERROR(options_.authorize(PresentedKey(call.Metadata("authorization"), call.Metadata("x-api-key")),
                                               access == Access::kAdmin));
    }
    if (access != Access::kProbe && draining()) return Unavailable("the server is shutting down");
    return Status::Ok();
  }

  // A unary method of the inference service, answered by `body`.
  template <class Req, class Resp>
  void Unary(std::vector<GrpcMethodSpec>& out, std::string_view name, Access access,
             std::function<Status(const Req&, Resp*)> body, SerialWorker* slow = nullptr) {
    auto* fn = new typename UnaryHandler<Req, Resp>::Body(std::move(body));
    bodies_.emplace_back(fn);
    out.push_back({std::string(kService) + std::string(name), false, false,
                   [this, access, fn, slow](const std::shared_ptr<GrpcCall>& call) -> std::unique_ptr<GrpcHandler> {
                     LogRequestId(*call);
                     if (Status st = Admit(*call, access); !st.ok()) {
                       call->Finish(st);
                       return std::make_unique<Refused>();
                     }
                     auto h = std::make_unique<UnaryHandler<Req, Resp>>(call, fn, slow);
                     call->Read();
                     return h;
                   }});
  }

  static void LogRequestId(GrpcCall& call) {
    const std::string_view id = call.Metadata("x-request-id");
    if (UsableRequestId(id)) call.set_log_fields("", std::string(id));
  }

  template <class Req, class Resp>
  void NotServed(std::vector<GrpcMethodSpec>& out, std::string_view name) {
    Unary<Req, Resp>(out, name, Access::kUser, [name](const Req&, Resp*) { return NotImplemented(name); });
  }

  std::vector<GrpcMethodSpec> Methods();

  Result<ModelStatus> Model(const std::string& name, const std::string& version) {
    QUERN_ASSIGN_OR_RETURN(int64_t v, ParseModelVersion(name, version));
    return engine_->GetModel(name, v);
  }

  Status Statistics(const inference::ModelStatisticsRequest& in, inference::ModelStatisticsResponse* out) {
    QUERN_ASSIGN_OR_RETURN(int64_t v, ParseModelVersion(in.name(), in.version()));
    QUERN_ASSIGN_OR_RETURN(auto stats, engine_->GetStatistics(in.name(), v));
    for (const auto& s : stats) FillStatistics(s, out->add_model_stats());
    return Status::Ok();
  }

  Status Index(const inference::RepositoryIndexRequest& in, inference::RepositoryIndexResponse* out) {
    for (const auto& m : engine_->ListModels()) {
      if (in.ready() && m.state != ModelState::kReady) continue;
      auto* e = out->add_models();
      e->set_name(m.name);
      e->set_version(std::to_string(m.version));
      e->set_state(std::string(ModelStateName(m.state)));
      e->set_reason(m.reason);
    }
    return Status::Ok();
  }

  Status Load(const inference::RepositoryModelLoadRequest& in) {
    if (!options_.model_control) return ModelControlOff();
    if (!in.parameters().empty()) {
      // "config" (an override) and "file:..." (model files in the request):
      // Quern loads what the repository holds; refused rather than ignored.
      return InvalidArgument("model '" + in.model_name() + "': load parameter '" +
                             in.parameters().begin()->first.substr(0, 64) +
                             "' is not supported; Quern loads the model's files and "
                             "config.pbtxt from the repository as they are");
    }
    return engine_->LoadModel(in.model_name());
  }

  // grpc.health.v1: SERVING while every model is ready and the server has
  // started and is not draining.
  void UpdateHealth() { health_.Set(!starting() && !draining() && engine_->AllModelsReady()); }

  GrpcServerOptions options_;
  Engine* engine_;
  HealthService health_;
  LastCaller last_caller_;
  std::vector<std::shared_ptr<void>> bodies_;  // the unary methods' bodies
  std::unique_ptr<GrpcTransport> transport_;
  SerialWorker slow_calls_{"quern-grpc-admin", 64};  // model loads and unloads: never on an I/O thread
  Mutex mu_;
  CondVar cv_;
  bool stopping_ QUERN_GUARDED_BY(mu_) = false;
  std::thread health_thread_;
};

std::vector<GrpcMethodSpec> GrpcServer::Impl::Methods() {
  namespace inf = inference;
  std::vector<GrpcMethodSpec> m;
  Unary<inf::ServerLiveRequest, inf::ServerLiveResponse>(m, "ServerLive", Access::kProbe, [](auto&, auto* out) {
    out->set_live(true);
    return Status::Ok();
  });
  Unary<inf::ServerReadyRequest, inf::ServerReadyResponse>(m, "ServerReady", Access::kProbe, [this](auto&, auto* out) {
    out->set_ready(!starting() && !draining() && engine_->AllModelsReady());
    return Status::Ok();
  });
  Unary<inf::ModelReadyRequest, inf::ModelReadyResponse>(
      m, "ModelReady", Access::kProbe, [this](auto& in, auto* out) -> Status {
        QUERN_ASSIGN_OR_RETURN(int64_t v, ParseModelVersion(in.name(), in.version()));
        out->set_ready(engine_->ModelReady(in.name(), v));
        return Status::Ok();
      });
  Unary<inf::ServerMetadataRequest, inf::ServerMetadataResponse>(m, "ServerMetadata", Access::kUser,
                                                                 [](auto&, auto* out) {
                                                                   out->set_name("quern");
                                                                   out->set_version(Version());
                                                                   for (const std::string_view e : kKServeExtensions) {
                                                                     out->add_extensions(std::string(e));
                                                                   }
                                                                   return Status::Ok();
                                                                 });
  Unary<inf::ModelMetadataRequest, inf::ModelMetadataResponse>(
      m, "ModelMetadata", Access::kUser, [this](auto& in, auto* out) -> Status {
        QUERN_ASSIGN_OR_RETURN(auto s, Model(in.name(), in.version()));
        FillMetadata(s, out);
        return Status::Ok();
      });
  Unary<inf::ModelConfigRequest, inf::ModelConfigResponse>(
      m, "ModelConfig", Access::kUser, [this](auto& in, auto* out) -> Status {
        QUERN_ASSIGN_OR_RETURN(auto s, Model(in.name(), in.version()));
        *out->mutable_config() = ToProto(s.config);
        return Status::Ok();
      });
  Unary<inf::ModelStatisticsRequest, inf::ModelStatisticsResponse>(
      m, "ModelStatistics", Access::kUser, [this](auto& in, auto* out) { return Statistics(in, out); });
  Unary<inf::RepositoryIndexRequest, inf::RepositoryIndexResponse>(
      m, "RepositoryIndex", Access::kUser, [this](auto& in, auto* out) { return Index(in, out); });
  Unary<inf::RepositoryModelLoadRequest, inf::RepositoryModelLoadResponse>(
      m, "RepositoryModelLoad", Access::kAdmin, [this](auto& in, auto*) { return Load(in); }, &slow_calls_);
  Unary<inf::RepositoryModelUnloadRequest, inf::RepositoryModelUnloadResponse>(
      m, "RepositoryModelUnload", Access::kAdmin,
      [this](auto& in, auto*) {
        if (!options_.model_control) return ModelControlOff();
        return engine_->UnloadModel(in.model_name());
      },
      &slow_calls_);
  NotServed<inf::SystemSharedMemoryStatusRequest, inf::SystemSharedMemoryStatusResponse>(m, "SystemSharedMemoryStatus");
  NotServed<inf::SystemSharedMemoryRegisterRequest, inf::SystemSharedMemoryRegisterResponse>(
      m, "SystemSharedMemoryRegister");
  NotServed<inf::SystemSharedMemoryUnregisterRequest, inf::SystemSharedMemoryUnregisterResponse>(
      m, "SystemSharedMemoryUnregister");
  NotServed<inf::CudaSharedMemoryStatusRequest, inf::CudaSharedMemoryStatusResponse>(m, "CudaSharedMemoryStatus");
  NotServed<inf::CudaSharedMemoryRegisterRequest, inf::CudaSharedMemoryRegisterResponse>(m, "CudaSharedMemoryRegister");
  NotServed<inf::CudaSharedMemoryUnregisterRequest, inf::CudaSharedMemoryUnregisterResponse>(
      m, "CudaSharedMemoryUnregister");
  NotServed<inf::TraceSettingRequest, inf::TraceSettingResponse>(m, "TraceSetting");
  NotServed<inf::LogSettingsRequest, inf::LogSettingsResponse>(m, "LogSettings");
  const size_t max_send = static_cast<size_t>(std::max(1, options_.max_send_bytes));
  m.push_back({std::string(kService) + "ModelInfer", false, false,
               [this, max_send](const std::shared_ptr<GrpcCall>& call) -> std::unique_ptr<GrpcHandler> {
                 LogRequestId(*call);
                 if (Status st = Admit(*call, Access::kUser); !st.ok()) {
                   call->Finish(st);
                   return std::make_unique<Refused>();
                 }
                 auto h = std::make_unique<InferHandler>(engine_, call, max_send);
                 call->Read();
                 return h;
               }});
  m.push_back({std::string(kService) + "ModelStreamInfer", true, false,
               [this, max_send](const std::shared_ptr<GrpcCall>& call) -> std::unique_ptr<GrpcHandler> {
                 LogRequestId(*call);
                 if (Status st = Admit(*call, Access::kUser); !st.ok()) {
                   call->Finish(st);
                   return std::make_unique<Refused>();
                 }
                 // Every message is a request: each one takes its key's
                 // rate-limit token and is refused while the server drains.
                 GrpcCall* raw = call.get();
                 auto h = std::make_unique<StreamHandler>(
                     engine_, call, [this, raw] { return Admit(*raw, Access::kUser); }, &last_caller_, max_send);
                 h->Begin();
                 return h;
               }});
  // grpc.health.v1: a call the keys would not admit is answered for the
  // server without its request being read.
  m.push_back({std::string(kHealth) + "Check", false, false,
               [this](const std::shared_ptr<GrpcCall>& call) -> std::unique_ptr<GrpcHandler> {
                 const bool reads = !options_.authorize || Admit(*call, Access::kProbe).ok();
                 return std::make_unique<HealthService::CheckHandler>(&health_, call.get(), reads);
               }});
  m.push_back({std::string(kHealth) + "Watch", true, /*long_lived=*/true,
               [this](const std::shared_ptr<GrpcCall>& call) -> std::unique_ptr<GrpcHandler> {
                 const bool reads = !options_.authorize || Admit(*call, Access::kProbe).ok();
                 auto h = std::make_unique<HealthService::WatchHandler>(&health_, call.get());
                 h->Begin(reads);
                 return h;
               }});
  return m;
}

GrpcServer::GrpcServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GrpcServer::~GrpcServer() = default;
void GrpcServer::Stop() {
  impl_->Stop();
}
int GrpcServer::port() const {
  return impl_->port();
}
void GrpcServer::RefreshHealth() {
  impl_->RefreshHealth();
}

Result<std::unique_ptr<GrpcServer>> GrpcServer::Start(GrpcServerOptions options, Engine* engine) {
  auto impl = std::make_unique<Impl>(std::move(options), engine);
  QUERN_RETURN_IF_ERROR(impl->Start());
  return std::unique_ptr<GrpcServer>(new GrpcServer(std::move(impl)));
}

}  // namespace quern
