#include "frontends/grpc/grpc_server.h"

#include <absl/synchronization/mutex.h>
#include <fcntl.h>
#include <grpc/support/log.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_posix.h>
#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/support/server_interceptor.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "auth/api_keys.h"
#include "core/cpus.h"
#include "core/log.h"
#include "core/model_config_parser.h"
#include "core/mutex.h"
#include "frontends/grpc/grpc_convert.h"
#include "grpc_service.grpc.pb.h"
#include "health.grpc.pb.h"
#include "protocol/kserve_codec.h"

namespace quern {
namespace {

using inference::GRPCInferenceService;

grpc::Status ToGrpc(const Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(static_cast<int>(s.code())), s.message());
}

// The remaining time of a client deadline on the engine's clock; 0 = none.
// gRPC turned the client's timeout into a date on the real clock, so the
// time left is read against that clock.
int64_t DeadlineNs(const grpc::CallbackServerContext* ctx, const Engine& engine) {
  const auto deadline = ctx->deadline();
  if (deadline >= std::chrono::system_clock::time_point::max() - std::chrono::hours(24 * 365)) return 0;
  const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - std::chrono::system_clock::now());
  return engine.clock().NowNs() + std::max<int64_t>(left.count(), 1);
}

// Which stream the previous streamed inference came from. A stream whose
// requests follow one another with nobody else's between them, one in
// flight at a time, is alone: its batch may run on the gRPC thread that
// received it (SubmitOptions::lend_thread; the engine decides whether it is
// short enough), with no hand-off to an engine thread and back. While
// streams take turns, their requests go to the engine's threads, where they
// batch: run on the receiving threads, each would run alone (on a busy core
// the next request is received only after the previous one's run), and
// batching would stop. Unary calls have no such identity (a client's
// threads share one connection, so the peer's address does not tell them
// apart; tried: 16 callers over 8 connections ran batches of 1.3 instead
// of 5), so theirs always go to the engine's threads.
class LastCaller {
 public:
  // Records `caller` as the latest; whether it was the latest already.
  bool Repeats(uintptr_t caller) { return last_.exchange(caller, std::memory_order_relaxed) == caller; }

 private:
  std::atomic<uintptr_t> last_{0};
};

// One unary call served as a stream of one message each way, so that the
// call is admitted (its key, the server draining) before its message is
// read: gRPC reads a unary method's whole message (up to
// --grpc-max-message-bytes) before the method sees the call, a stream's
// message only when the server asks for it. A call refused is answered
// without its message being read; what its client sent meanwhile stays
// within the stream's HTTP/2 window. Clients see a unary call as before.
// Deletes itself when gRPC is done with it.
class UnaryCall : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  void OnReadDone(bool ok) override {
    if (!ok) {
      return Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                 std::string(path_) + ": the call ended before its request message"));
    }
    Run();
  }
  void OnDone() override { delete this; }

 protected:
  // `path`: the method's, "/inference.GRPCInferenceService/ModelInfer"
  // (static storage).
  explicit UnaryCall(std::string_view path) : path_(path) {}

  // Reads the request when `admitted`, else answers with its error.
  void Begin(const Status& admitted) {
    if (!admitted.ok()) return Finish(ToGrpc(admitted));
    StartRead(&request_bytes_);
  }

  // The request has arrived: parse it (Parse) and answer (Answer or Finish).
  virtual void Run() = 0;

  // Parses the request into `m`; false, with the call answered, when it is
  // not a valid message for the method.
  template <class M>
  bool Parse(M* m) {
    if (grpc::SerializationTraits<M>::Deserialize(&request_bytes_, m).ok()) return true;
    Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the request is not a valid message for " + std::string(path_) + " (protobuf parsing failed)"));
    return false;
  }

  // Sends `m` and OK in one batch.
  template <class M>
  void Answer(const M& m) {
    bool own = false;
    if (grpc::Status st = grpc::SerializationTraits<M>::Serialize(m, &answer_bytes_, &own); !st.ok()) {
      return Finish(st);
    }
    StartWriteAndFinish(&answer_bytes_, grpc::WriteOptions(), grpc::Status::OK);
  }

 private:
  const std::string_view path_;
  grpc::ByteBuffer request_bytes_;
  grpc::ByteBuffer answer_bytes_;
};

// A unary method answered on gRPC's thread: `run` fills the answer or
// returns an error.
template <class Req, class Resp>
class SimpleCall final : public UnaryCall {
 public:
  using Body = std::function<grpc::Status(grpc::CallbackServerContext*, const Req&, Resp*)>;

  // `body` outlives the call (the service holds it).
  SimpleCall(std::string_view path, grpc::CallbackServerContext* ctx, const Body* body, const Status& admitted)
      : UnaryCall(path), ctx_(ctx), body_(body) {
    Begin(admitted);
  }

 private:
  void Run() override {
    Req in;
    if (!Parse(&in)) return;
    Resp out;
    const grpc::Status st = (*body_)(ctx_, in, &out);
    if (!st.ok()) return Finish(st);
    Answer(out);
  }

  grpc::CallbackServerContext* ctx_;
  const Body* body_;
};

// One unary ModelInfer call. Its request and answer live on one arena: a
// block or two instead of an allocation per field (raw bytes are strings
// of their own). The engine's callback always comes before OnDone (it
// finishes the call).
class InferCall final : public UnaryCall {
 public:
  InferCall(Engine* engine, grpc::CallbackServerContext* ctx, const Status& admitted)
      : UnaryCall("/inference.GRPCInferenceService/ModelInfer"),
        engine_(engine),
        ctx_(ctx),
        arena_(ArenaBlocks()),
        cancel_(std::make_shared<CancellationToken>()) {
    Begin(admitted);
  }

  void OnCancel() override { cancel_->Cancel(); }

 private:
  static google::protobuf::ArenaOptions ArenaBlocks() {
    google::protobuf::ArenaOptions o;
    o.start_block_size = 2048;
    o.max_block_size = 64 * 1024;
    return o;
  }

  void Run() override {
    request_ = google::protobuf::Arena::CreateMessage<inference::ModelInferRequest>(&arena_);
    if (!Parse(request_)) return;
    auto ir = ToInferRequest(*request_);
    if (!ir) return Finish(ToGrpc(ir.error()));
    ir->cancel = cancel_;
    ir->deadline_ns = DeadlineNs(ctx_, *engine_);
    // The request's name in the engine (and a Python model's request_id()):
    // its id, else the x-request-id metadata.
    std::string_view name = request_->id();
    if (auto it = ctx_->client_metadata().find("x-request-id"); name.empty() && it != ctx_->client_metadata().end()) {
      name = std::string_view(it->second.data(), it->second.size());
    }
    if (UsableRequestId(name)) ir->metadata.emplace_back("request_id", std::string(name));
    InferCallback done = [this](InferResponse&& r) {
      if (!r.status.ok()) return Finish(ToGrpc(r.status));
      if (Status st = ApplyClassifications(*request_, *engine_, r); !st.ok()) return Finish(ToGrpc(st));
      auto* response = google::protobuf::Arena::CreateMessage<inference::ModelInferResponse>(&arena_);
      ToInferResponse(r, request_->id(), response);
      Answer(*response);
    };
    if (Status st = engine_->InferAsync(std::move(*ir), done); !st.ok()) Finish(ToGrpc(st));
  }

  Engine* engine_;
  grpc::CallbackServerContext* ctx_;
  google::protobuf::Arena arena_;
  inference::ModelInferRequest* request_ = nullptr;
  std::shared_ptr<CancellationToken> cancel_;
};

// ModelStreamInfer: reads requests one after another, submits each at once,
// and writes responses in completion order (one write in flight at a time).
// Lives until gRPC is done with the stream and every request has answered.
// Messages travel as raw bytes and are parsed here: gRPC would end the
// stream with OK on a message that does not parse, without a word to the
// client; here it is answered with an error and the stream goes on.
// Backpressure: the stream reads its next message only while fewer than
// kMaxStreamPending of its requests are unanswered and the answers waiting
// to be written, with those its unanswered requests will make (each counted
// as large as the last answer), come to less than kMaxStreamUnsentBytes;
// otherwise it reads on once answers leave, and meanwhile HTTP/2 flow
// control holds the client (a client that never reads its answers holds a
// bounded amount).
class StreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
  static constexpr size_t kAnswerBlock = 4096;
  static constexpr int kMaxStreamPending = 256;
  static constexpr size_t kMaxStreamUnsentBytes = size_t{16} << 20;

  // Blocks for a request's arena: the first one fits its fields, not its
  // raw bytes (those are strings of their own).
  static google::protobuf::ArenaOptions RequestArena() {
    google::protobuf::ArenaOptions o;
    o.start_block_size = 1024;
    o.max_block_size = 64 * 1024;
    return o;
  }

 public:
  // `admit` (may be empty) runs for every message: a request it refuses is
  // answered with its error (rate limits, draining) and the stream goes on.
  StreamReactor(Engine* engine, grpc::CallbackServerContext* ctx, std::function<Status()> admit,
                LastCaller* last_caller)
      : engine_(engine), ctx_(ctx), admit_(std::move(admit)), last_caller_(last_caller) {
    StartNextRead();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client finished sending (or the stream broke)
      MutexLock lock(mu_);
      reads_done_ = true;
      MaybeFinishLocked();
      return;
    }
    bool read_on;
    // The message and its parts live on an arena of its own (one block
    // for a typical request instead of an allocation per field), kept
    // until the request is answered: its tensors borrow the raw bytes.
    auto arena = std::make_shared<google::protobuf::Arena>(RequestArena());
    auto* request = google::protobuf::Arena::CreateMessage<inference::ModelInferRequest>(arena.get());
    const grpc::Status parsed =
        grpc::SerializationTraits<inference::ModelInferRequest>::Deserialize(&reading_, request);
    ++messages_;
    const uint64_t n = messages_;
    bool lone;
    {
      // Counted before the next read starts: that read may end (the client
      // half-closing) on another thread while this message is handled, and
      // the stream must not finish before this message is answered.
      MutexLock lock(mu_);
      ++pending_;
      // Alone: the previous inference came over this stream too, and this is
      // its only request in flight (a stream that keeps several in flight
      // batches them).
      lone = last_caller_->Repeats(reinterpret_cast<uintptr_t>(this)) && pending_ == 1 && writes_.empty();
      read_on = RoomLocked();
      read_paused_ = !read_on;
    }
    if (read_on) StartNextRead();
    if (!parsed.ok()) {
      Answer("",
             InvalidArgument("stream message " + std::to_string(n) +
                             " is not a valid inference.ModelInferRequest (protobuf parsing failed)"),
             nullptr);
      return Release();
    }
    Submit(std::move(arena), request, lone);
  }

  void OnWriteDone(bool ok) override {
    bool read_on;
    {
      MutexLock lock(mu_);
      writing_ = false;
      unsent_bytes_ -= writes_.front()->Length();
      writes_.pop_front();
      if (!ok) broken_ = true;
      if (!broken_ && !writes_.empty()) {
        writing_ = true;
        StartWrite(writes_.front().get());
      }
      if (broken_) {
        writes_.clear();
        unsent_bytes_ = 0;
      }
      read_on = ResumeLocked();
      MaybeFinishLocked();
    }
    if (read_on) StartNextRead();
  }

  void OnCancel() override {
    MutexLock lock(mu_);
    broken_ = true;
    for (auto& c : cancels_) c->Cancel();
    (void)ResumeLocked();  // a paused stream reads no more: its reads are over
    MaybeFinishLocked();
  }

  void OnDone() override {
    bool last;
    {
      MutexLock lock(mu_);
      done_ = true;
      last = pending_ == 0;
    }
    if (last) delete this;
  }

 private:
  // Whether another message may be read now (see kMaxStreamPending).
  bool RoomLocked() const QUERN_REQUIRES(mu_) {
    return pending_ < kMaxStreamPending &&
           unsent_bytes_ + static_cast<size_t>(pending_) * last_answer_bytes_ < kMaxStreamUnsentBytes;
  }

  // A paused stream: true when it may read on now (the caller then starts
  // the read, outside the lock). A broken one reads no more: its reads are
  // over.
  bool ResumeLocked() QUERN_REQUIRES(mu_) {
    if (!read_paused_) return false;
    if (broken_) {
      read_paused_ = false;
      reads_done_ = true;
      return false;
    }
    if (!RoomLocked()) return false;
    read_paused_ = false;
    return true;
  }

  void StartNextRead() {
    reading_.Clear();
    StartRead(&reading_);
  }

  // Answers the request (counted in pending_ by OnReadDone) now or when the
  // engine does, then releases it.
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
    ir->deadline_ns = DeadlineNs(ctx_, *engine_);
    {
      MutexLock lock(mu_);
      if (broken_) cancel->Cancel();
      cancels_.push_back(cancel);
    }
    // The request message owns the raw input bytes: it lives in the callback.
    InferCallback done = [this, arena = std::move(arena), request, cancel](InferResponse&& r) {
      if (r.status.ok()) r.status = ApplyClassifications(*request, *engine_, r);
      Answer(request->id(), r.status, &r);
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

  // Queues a response (or an error for this request only) for writing.
  void Answer(const std::string& id, const Status& status, const InferResponse* r) {
    // Built on an arena that starts in a block this thread keeps, and
    // serialized before it goes.
    thread_local std::unique_ptr<char[]> block;
    thread_local bool block_in_use = false;
    google::protobuf::ArenaOptions options;
    const bool take_block = !block_in_use;
    if (take_block) {
      if (!block) block = std::make_unique<char[]>(kAnswerBlock);
      options.initial_block = block.get();
      options.initial_block_size = kAnswerBlock;
      block_in_use = true;
    }
    struct Give {
      bool taken;
      ~Give() {
        if (taken) block_in_use = false;
      }
    } give{take_block};
    google::protobuf::Arena arena(options);
    auto& out = *google::protobuf::Arena::CreateMessage<inference::ModelStreamInferResponse>(&arena);
    if (!status.ok()) {
      out.set_error_message(status.message());
      out.mutable_infer_response()->set_id(id);
    } else {
      ToInferResponse(*r, id, out.mutable_infer_response());
    }
    auto bytes = std::make_unique<grpc::ByteBuffer>();
    bool own = false;
    if (!grpc::SerializationTraits<inference::ModelStreamInferResponse>::Serialize(out, bytes.get(), &own).ok()) {
      // Only a response over 2 GiB fails to serialize.
      out.Clear();
      out.set_error_message("the response could not be serialized (over the protobuf size limit)");
      out.mutable_infer_response()->set_id(id);
      bytes = std::make_unique<grpc::ByteBuffer>();
      (void)grpc::SerializationTraits<inference::ModelStreamInferResponse>::Serialize(out, bytes.get(), &own);
    }
    MutexLock lock(mu_);
    if (broken_ || finished_) return;
    unsent_bytes_ += bytes->Length();
    last_answer_bytes_ = bytes->Length();
    writes_.push_back(std::move(bytes));
    if (!writing_) {
      writing_ = true;
      StartWrite(writes_.front().get());
    }
  }

  // One message answered (its answer queued for writing): the stream may
  // end now, and the reactor may go once gRPC is done with it.
  void Release() {
    bool last, read_on;
    {
      MutexLock lock(mu_);
      --pending_;
      read_on = ResumeLocked();
      MaybeFinishLocked();
      last = done_ && pending_ == 0;
    }
    if (read_on) StartNextRead();
    if (last) delete this;
  }

  // The stream ends when the client has finished sending, every request has
  // answered and every answer is written (or the stream broke).
  void MaybeFinishLocked() QUERN_REQUIRES(mu_) {
    // A cancelled stream also ends its reads (OnReadDone(false)), so
    // reads_done_ covers it.
    if (finished_ || writing_ || pending_ > 0 || !reads_done_) return;
    finished_ = true;
    Finish(grpc::Status::OK);
  }

  Engine* engine_;
  grpc::CallbackServerContext* ctx_;
  std::function<Status()> admit_;
  LastCaller* last_caller_;
  grpc::ByteBuffer reading_;  // gRPC's read target (one read in flight)
  uint64_t messages_ = 0;     // read so far (the reading thread only)

  Mutex mu_;
  std::deque<std::unique_ptr<grpc::ByteBuffer>> writes_ QUERN_GUARDED_BY(mu_);  // front = being written
  std::vector<std::shared_ptr<CancellationToken>> cancels_ QUERN_GUARDED_BY(mu_);
  int pending_ QUERN_GUARDED_BY(mu_) = 0;          // messages read and not answered yet
  size_t unsent_bytes_ QUERN_GUARDED_BY(mu_) = 0;  // in writes_
  size_t last_answer_bytes_ QUERN_GUARDED_BY(mu_) = 0;
  bool read_paused_ QUERN_GUARDED_BY(mu_) = false;  // no read in flight: waiting for room
  bool writing_ QUERN_GUARDED_BY(mu_) = false;
  bool reads_done_ QUERN_GUARDED_BY(mu_) = false;
  bool broken_ QUERN_GUARDED_BY(mu_) = false;    // cancelled or a write failed: no more writes
  bool finished_ QUERN_GUARDED_BY(mu_) = false;  // Finish called
  bool done_ QUERN_GUARDED_BY(mu_) = false;      // OnDone called
};

Status ModelControlOff() {
  return FailedPrecondition(
      "model load and unload over the API are off; start quern serve with --model-control explicit");
}

grpc::Status NotImplemented(std::string_view what) {
  return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, std::string(what) +
                                                           " is not implemented by Quern (no shared memory, tracing or "
                                                           "log settings over gRPC)");
}

// A stream refused before it starts (no valid key).
class RefusedStream final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit RefusedStream(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

// Who may make a call.
enum class Access {
  kUser,   // any valid key; refused while the server drains
  kAdmin,  // an admin key; refused while the server drains
  kProbe,  // any valid key; answered while the server drains too
};

// A generated gRPC service whose every method is served here on raw bytes
// and declared a stream to gRPC, so that a call's messages are read only
// when its reactor asks (see UnaryCall): each call is admitted first.
template <class Generated>
class RawService : public Generated {
 public:
  // Whether every method of the service is served here (one left to gRPC's
  // generated code would read its message before the call is admitted).
  bool ServesEveryMethod() const { return served_ == descriptor_->method_count(); }

 protected:
  using Reactor = grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>;

  RawService(std::string_view full_name, const GrpcServerOptions& options)
      : options_(options),
        descriptor_(google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(std::string(full_name))) {}

  // Serves method `name` with the reactors `make` returns.
  void Serve(std::string_view name, std::function<Reactor*(grpc::CallbackServerContext*)> make) {
    using Handler = grpc::internal::CallbackBidiHandler<grpc::ByteBuffer, grpc::ByteBuffer>;
    const int index = descriptor_->FindMethodByName(std::string(name))->index();
    this->MarkMethodStreamed(index, new Handler(nullptr));  // the stream type; the handler is replaced below
    this->MarkMethodRawCallback(index, new Handler(std::move(make)));
    ++served_;
  }

  // Serves unary method `name` with `body` (see SimpleCall), admitted by
  // `access`.
  template <class Req, class Resp, class F>
  void Unary(std::string_view name, Access access, F body) {
    using Call = SimpleCall<Req, Resp>;
    auto* fn = new typename Call::Body(std::move(body));
    bodies_.emplace_back(fn);
    const std::string_view path = Path(name);
    Serve(name, [this, path, access, fn](grpc::CallbackServerContext* ctx) -> Reactor* {
      return new Call(path, ctx, fn, Admit(ctx, access));
    });
  }

  // "/<package>.<service>/<name>", kept as long as the service.
  std::string_view Path(std::string_view name) {
    return paths_.emplace_back("/" + descriptor_->full_name() + "/" + std::string(name));
  }

  // OK when the call may proceed: it presents an acceptable key (and, but
  // for probes, the server is not draining). Takes the key's rate-limit
  // token.
  Status Admit(grpc::CallbackServerContext* ctx, Access access) const {
    if (options_.authorize) {
      std::string_view authorization, x_api_key;
      for (const auto& [k, v] : ctx->client_metadata()) {
        const std::string_view key(k.data(), k.size());
        if (key == "authorization") authorization = std::string_view(v.data(), v.size());
        if (key == "x-api-key") x_api_key = std::string_view(v.data(), v.size());
      }
      QUERN_RETURN_IF_ERROR(options_.authorize(PresentedKey(authorization, x_api_key), access == Access::kAdmin));
    }
    if (access != Access::kProbe && draining()) return Unavailable("the server is shutting down");
    return Status::Ok();
  }

  bool draining() const { return options_.draining && options_.draining->load(std::memory_order_acquire); }
  bool starting() const { return options_.started && !options_.started->load(std::memory_order_acquire); }

  const GrpcServerOptions& options_;

 private:
  const google::protobuf::ServiceDescriptor* descriptor_;
  std::vector<std::shared_ptr<void>> bodies_;  // the unary methods' bodies, by pointer in their handlers
  std::deque<std::string> paths_;
  int served_ = 0;
};

// GRPCInferenceService with every method on raw bytes, admitted before its
// first message is read: the unary methods as UnaryCall, ModelStreamInfer
// as a StreamReactor.
class Service final : public RawService<GRPCInferenceService::Service> {
 public:
  Service(Engine* engine, const GrpcServerOptions& options)
      : RawService("inference.GRPCInferenceService", options), engine_(engine) {
    namespace inf = inference;
    Unary<inf::ServerLiveRequest, inf::ServerLiveResponse>("ServerLive", Access::kProbe, [](auto*, auto&, auto* out) {
      out->set_live(true);
      return grpc::Status::OK;
    });
    Unary<inf::ServerReadyRequest, inf::ServerReadyResponse>(
        "ServerReady", Access::kProbe, [this](auto*, auto&, auto* out) {
          out->set_ready(!starting() && !draining() && engine_->AllModelsReady());
          return grpc::Status::OK;
        });
    Unary<inf::ModelReadyRequest, inf::ModelReadyResponse>("ModelReady", Access::kProbe,
                                                           [this](auto*, auto& in, auto* out) {
                                                             auto v = ParseModelVersion(in.name(), in.version());
                                                             if (!v) return ToGrpc(v.error());
                                                             out->set_ready(engine_->ModelReady(in.name(), *v));
                                                             return grpc::Status::OK;
                                                           });
    Unary<inf::ServerMetadataRequest, inf::ServerMetadataResponse>(
        "ServerMetadata", Access::kUser, [](auto*, auto&, auto* out) {
          out->set_name("quern");
          out->set_version("0.1.0");
          for (const std::string_view e : kKServeExtensions) {
            out->add_extensions(std::string(e));
          }
          return grpc::Status::OK;
        });
    Unary<inf::ModelMetadataRequest, inf::ModelMetadataResponse>("ModelMetadata", Access::kUser,
                                                                 [this](auto*, auto& in, auto* out) {
                                                                   auto m = Model(in.name(), in.version());
                                                                   if (!m) return ToGrpc(m.error());
                                                                   FillMetadata(*m, out);
                                                                   return grpc::Status::OK;
                                                                 });
    Unary<inf::ModelConfigRequest, inf::ModelConfigResponse>("ModelConfig", Access::kUser,
                                                             [this](auto*, auto& in, auto* out) {
                                                               auto m = Model(in.name(), in.version());
                                                               if (!m) return ToGrpc(m.error());
                                                               *out->mutable_config() = ToProto(m->config);
                                                               return grpc::Status::OK;
                                                             });
    Unary<inf::ModelStatisticsRequest, inf::ModelStatisticsResponse>(
        "ModelStatistics", Access::kUser, [this](auto*, auto& in, auto* out) { return Statistics(in, out); });
    Unary<inf::RepositoryIndexRequest, inf::RepositoryIndexResponse>(
        "RepositoryIndex", Access::kUser, [this](auto*, auto& in, auto* out) { return Index(in, out); });
    Unary<inf::RepositoryModelLoadRequest, inf::RepositoryModelLoadResponse>(
        "RepositoryModelLoad", Access::kAdmin, [this](auto*, auto& in, auto*) { return Load(in); });
    Unary<inf::RepositoryModelUnloadRequest, inf::RepositoryModelUnloadResponse>(
        "RepositoryModelUnload", Access::kAdmin, [this](auto*, auto& in, auto*) {
          if (!options_.model_control) return ToGrpc(ModelControlOff());
          return ToGrpc(engine_->UnloadModel(in.model_name()));
        });
    NotServed<inf::SystemSharedMemoryStatusRequest, inf::SystemSharedMemoryStatusResponse>("SystemSharedMemoryStatus");
    NotServed<inf::SystemSharedMemoryRegisterRequest, inf::SystemSharedMemoryRegisterResponse>(
        "SystemSharedMemoryRegister");
    NotServed<inf::SystemSharedMemoryUnregisterRequest, inf::SystemSharedMemoryUnregisterResponse>(
        "SystemSharedMemoryUnregister");
    NotServed<inf::CudaSharedMemoryStatusRequest, inf::CudaSharedMemoryStatusResponse>("CudaSharedMemoryStatus");
    NotServed<inf::CudaSharedMemoryRegisterRequest, inf::CudaSharedMemoryRegisterResponse>("CudaSharedMemoryRegister");
    NotServed<inf::CudaSharedMemoryUnregisterRequest, inf::CudaSharedMemoryUnregisterResponse>(
        "CudaSharedMemoryUnregister");
    NotServed<inf::TraceSettingRequest, inf::TraceSettingResponse>("TraceSetting");
    NotServed<inf::LogSettingsRequest, inf::LogSettingsResponse>("LogSettings");
    Serve("ModelInfer", [this](grpc::CallbackServerContext* ctx) -> Reactor* {
      return new InferCall(engine_, ctx, Admit(ctx, Access::kUser));
    });
    Serve("ModelStreamInfer", [this](grpc::CallbackServerContext* ctx) -> Reactor* {
      if (Status st = Admit(ctx, Access::kUser); !st.ok()) return new RefusedStream(ToGrpc(st));
      // Every message is a request: each one takes its key's rate-limit
      // token and is refused while the server drains.
      return new StreamReactor(
          engine_, ctx, [this, ctx] { return Admit(ctx, Access::kUser); }, &last_caller_);
    });
  }

 private:
  template <class Req, class Resp>
  void NotServed(std::string_view name) {
    Unary<Req, Resp>(name, Access::kUser, [name](auto*, auto&, auto*) { return NotImplemented(name); });
  }

  Result<ModelStatus> Model(const std::string& name, const std::string& version) {
    QUERN_ASSIGN_OR_RETURN(int64_t v, ParseModelVersion(name, version));
    return engine_->GetModel(name, v);
  }

  grpc::Status Statistics(const inference::ModelStatisticsRequest& in, inference::ModelStatisticsResponse* out) {
    auto v = ParseModelVersion(in.name(), in.version());
    if (!v) return ToGrpc(v.error());
    auto stats = engine_->GetStatistics(in.name(), *v);
    if (!stats) return ToGrpc(stats.error());
    for (const auto& s : *stats) FillStatistics(s, out->add_model_stats());
    return grpc::Status::OK;
  }

  grpc::Status Index(const inference::RepositoryIndexRequest& in, inference::RepositoryIndexResponse* out) {
    for (const auto& m : engine_->ListModels()) {
      if (in.ready() && m.state != ModelState::kReady) continue;
      auto* e = out->add_models();
      e->set_name(m.name);
      e->set_version(std::to_string(m.version));
      e->set_state(std::string(ModelStateName(m.state)));
      e->set_reason(m.reason);
    }
    return grpc::Status::OK;
  }

  grpc::Status Load(const inference::RepositoryModelLoadRequest& in) {
    if (!options_.model_control) return ToGrpc(ModelControlOff());
    if (!in.parameters().empty()) {
      // "config" (an override) and "file:..." (model files in the request):
      // Quern loads what the repository holds; refused rather than ignored.
      return ToGrpc(InvalidArgument("model '" + in.model_name() + "': load parameter '" +
                                    in.parameters().begin()->first.substr(0, 64) +
                                    "' is not supported; Quern loads the model's files and "
                                    "config.pbtxt from the repository as they are"));
    }
    return ToGrpc(engine_->LoadModel(in.model_name()));
  }

  Engine* engine_;
  LastCaller last_caller_;
};

// grpc.health.v1 (Check and Watch) for "" (the server) and
// "inference.GRPCInferenceService": SERVING while every model is ready and
// the server is not draining. Open to load balancers with no key: a call
// the keys would not admit is answered for the server as a whole without
// its request being read (so it can make the server hold no large
// message); an admitted one (or any, with no keys configured) is answered
// for the service it names.
class HealthService final : public RawService<grpc::health::v1::Health::Service> {
  using Response = grpc::health::v1::HealthCheckResponse;

 public:
  explicit HealthService(const GrpcServerOptions& options) : RawService("grpc.health.v1.Health", options) {
    Serve("Check", [this](grpc::CallbackServerContext* ctx) -> Reactor* { return new CheckCall(this, ctx); });
    Serve("Watch", [this](grpc::CallbackServerContext* ctx) -> Reactor* { return new WatchCall(this, ctx); });
  }

  // Sets whether the server serves; watchers are told of a change.
  void Set(bool serving) {
    const auto status = serving ? Response::SERVING : Response::NOT_SERVING;
    MutexLock lock(mu_);
    if (status == status_ || closed_) return;
    status_ = status;
    for (WatchCall* w : watchers_) w->Send(status, false);
  }

  // The server stops: NOT_SERVING from now on; each watch is sent it and
  // finished.
  void Close() {
    MutexLock lock(mu_);
    closed_ = true;
    status_ = Response::NOT_SERVING;
    for (WatchCall* w : watchers_) w->Send(status_, true);
  }

 private:
  // Whether the call's request is read: it is admitted, or no keys are set.
  bool Reads(grpc::CallbackServerContext* ctx) const { return !options_.authorize || Admit(ctx, Access::kProbe).ok(); }
  static bool Known(const std::string& service) {
    return service.empty() || service == "inference.GRPCInferenceService";
  }
  Response::ServingStatus Current() const {
    MutexLock lock(mu_);
    return status_;
  }

  class CheckCall final : public UnaryCall {
   public:
    CheckCall(HealthService* health, grpc::CallbackServerContext* ctx)
        : UnaryCall("/grpc.health.v1.Health/Check"), health_(health) {
      if (health->Reads(ctx)) {
        Begin(Status::Ok());
      } else {
        Reply(health->Current());
      }
    }

   private:
    void Run() override {
      grpc::health::v1::HealthCheckRequest in;
      if (!Parse(&in)) return;
      if (!Known(in.service())) {
        return Finish(
            grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service '" + in.service().substr(0, 128) +
                                                          "' (known: \"\" and \"inference.GRPCInferenceService\")"));
      }
      Reply(health_->Current());
    }
    void Reply(Response::ServingStatus status) {
      Response out;
      out.set_status(status);
      Answer(out);
    }
    HealthService* health_;
  };

  // One Watch: the status now, then each change, until the client leaves.
  class WatchCall final : public Reactor {
   public:
    WatchCall(HealthService* health, grpc::CallbackServerContext* ctx) : health_(health) {
      if (health->Reads(ctx)) {
        StartRead(&request_bytes_);
      } else {
        Watch(true);
      }
    }

    void OnReadDone(bool ok) override {
      grpc::health::v1::HealthCheckRequest in;
      if (!ok ||
          !grpc::SerializationTraits<grpc::health::v1::HealthCheckRequest>::Deserialize(&request_bytes_, &in).ok()) {
        // (A client that left makes both this and OnCancel run: one Finish.)
        MutexLock lock(mu_);
        return FinishLocked(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                         "the request is not a valid message for /grpc.health.v1.Health/Watch"));
      }
      Watch(Known(in.service()));
    }

    // Queues `status` to be written (a write in flight: after it); `last`:
    // the watch ends once it is written.
    void Send(Response::ServingStatus status, bool last) {
      MutexLock lock(mu_);
      wanted_ = status;
      last_ = last_ || last;
      if (!writing_) WriteOrEndLocked();
    }

    void OnWriteDone(bool ok) override {
      MutexLock lock(mu_);
      writing_ = false;
      if (!ok) return FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "the watch's answer was not sent"));
      WriteOrEndLocked();
    }

    void OnCancel() override {
      MutexLock lock(mu_);
      FinishLocked(grpc::Status::CANCELLED);
    }

    void OnDone() override {
      if (registered_) health_->Forget(this);
      delete this;
    }

   private:
    void Watch(bool known) {
      if (!known) return Send(Response::SERVICE_UNKNOWN, false);  // it never changes: no updates follow
      registered_ = true;
      health_->Add(this);
    }

    void WriteOrEndLocked() QUERN_REQUIRES(mu_) {
      if (finished_) return;
      if (wanted_ != sent_) return WriteLocked();
      if (last_) FinishLocked(grpc::Status::OK);
    }

    void WriteLocked() QUERN_REQUIRES(mu_) {
      Response out;
      out.set_status(wanted_);
      sent_ = wanted_;
      bool own = false;
      answer_bytes_.Clear();
      if (!grpc::SerializationTraits<Response>::Serialize(out, &answer_bytes_, &own).ok()) {
        return FinishLocked(grpc::Status(grpc::StatusCode::INTERNAL, "cannot serialize the health status"));
      }
      writing_ = true;
      StartWrite(&answer_bytes_);
    }

    void FinishLocked(const grpc::Status& status) QUERN_REQUIRES(mu_) {
      if (finished_) return;
      finished_ = true;
      Finish(status);
    }

    HealthService* health_;
    grpc::ByteBuffer request_bytes_;
    bool registered_ = false;  // set before Add, read in OnDone: after the read or the constructor
    Mutex mu_;
    grpc::ByteBuffer answer_bytes_ QUERN_GUARDED_BY(mu_);
    Response::ServingStatus wanted_ QUERN_GUARDED_BY(mu_) = Response::UNKNOWN;
    Response::ServingStatus sent_ QUERN_GUARDED_BY(mu_) = Response::UNKNOWN;
    bool writing_ QUERN_GUARDED_BY(mu_) = false;
    bool last_ QUERN_GUARDED_BY(mu_) = false;  // finish once wanted_ is sent
    bool finished_ QUERN_GUARDED_BY(mu_) = false;
  };

  void Add(WatchCall* w) {
    MutexLock lock(mu_);
    watchers_.insert(w);
    w->Send(status_, closed_);
  }
  void Forget(WatchCall* w) {
    MutexLock lock(mu_);
    watchers_.erase(w);
  }

  mutable Mutex mu_;
  Response::ServingStatus status_ QUERN_GUARDED_BY(mu_) = Response::NOT_SERVING;
  bool closed_ QUERN_GUARDED_BY(mu_) = false;
  std::set<WatchCall*> watchers_ QUERN_GUARDED_BY(mu_);
};

// The access log's record of one call, written when gRPC destroys the
// interceptor (the call is over).
class AccessLogInterceptor final : public grpc::experimental::Interceptor {
 public:
  AccessLogInterceptor(const char* method, const GrpcServerOptions& options)
      : method_(method ? method : ""),
        infer_(method_ == "/inference.GRPCInferenceService/ModelInfer"),
        options_(options),
        start_(std::chrono::steady_clock::now()) {}

  ~AccessLogInterceptor() override {
    const int64_t ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count();
    options_.access_log({method_, status_, ns, client_, model_, request_id_});
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      if (auto* md = methods->GetRecvInitialMetadata()) {
        auto it = md->find("x-request-id");
        if (it != md->end() && UsableRequestId({it->second.data(), it->second.size()})) {
          request_id_.assign(it->second.data(), it->second.size());
        }
      }
    }
    if (infer_ && methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      if (auto* bytes = static_cast<grpc::ByteBuffer*>(methods->GetRecvMessage())) {
        std::string id;
        grpc::ProtoBufferReader reader(bytes);
        PeekInferNames(&reader, &model_, &id);
        if (UsableRequestId(id)) request_id_ = std::move(id);  // before the metadata's, as the engine does
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      static constexpr std::string_view kNames[] = {
          "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
          "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
          "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
          "DATA_LOSS", "UNAUTHENTICATED"};
      const auto code = static_cast<size_t>(methods->GetSendStatus().error_code());
      status_ = code < std::size(kNames) ? kNames[code] : "UNKNOWN";
    }
    methods->Proceed();
  }

  void set_client(std::string client) { client_ = std::move(client); }

 private:
  const std::string_view method_;  // gRPC's registered name: outlives the call
  const bool infer_;
  const GrpcServerOptions& options_;
  const std::chrono::steady_clock::time_point start_;
  std::string client_, model_, request_id_;
  std::string_view status_ = "CANCELLED";  // no status sent: the call broke off
};

// The peer addresses of the connections Quern accepted and handed to gRPC,
// by descriptor (gRPC names such a peer "fd:<n>").
class AcceptedPeers {
 public:
  void Set(int fd, std::string address) {
    MutexLock lock(mu_);
    by_fd_[fd] = std::move(address);
  }
  std::string Get(int fd) const {
    MutexLock lock(mu_);
    auto it = by_fd_.find(fd);
    return it == by_fd_.end() ? std::string() : it->second;
  }

 private:
  mutable Mutex mu_;
  std::map<int, std::string> by_fd_ QUERN_GUARDED_BY(mu_);
};

class AccessLogInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  AccessLogInterceptorFactory(const GrpcServerOptions& options, const AcceptedPeers* peers)
      : options_(options), peers_(peers) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    auto* interceptor = new AccessLogInterceptor(info->method(), options_);
    if (auto* ctx = info->server_context()) {
      const std::string peer = ctx->peer();
      if (peer.starts_with("fd:") && peers_) {
        interceptor->set_client(peers_->Get(std::atoi(peer.c_str() + 3)));
      } else {
        interceptor->set_client(PeerAddress(peer));
      }
    }
    return interceptor;
  }

 private:
  // "ipv4:127.0.0.1:5000" -> "127.0.0.1", "ipv6:[::1]:5000" -> "::1".
  static std::string PeerAddress(std::string peer) {
    if (const size_t colon = peer.find(':'); colon != std::string::npos && colon < 5) peer.erase(0, colon + 1);
    if (peer.starts_with("%5B") || peer.starts_with("[")) {
      const size_t open = peer.starts_with("[") ? 1 : 3;
      const size_t close = peer.find(open == 1 ? "]" : "%5D");
      return close == std::string::npos ? peer : peer.substr(open, close - open);
    }
    if (const size_t colon = peer.rfind(':'); colon != std::string::npos) peer.resize(colon);
    return peer;
  }
  const GrpcServerOptions& options_;
  const AcceptedPeers* peers_;
};

}  // namespace

// gRPC core's own log lines (a failed TLS handshake writes one per
// connection, as any client can cause) go through Quern's logger, in its
// format, at most kGrpcLogBurst lines per kGrpcLogWindowS seconds; the
// lines dropped are counted in the next one written.
constexpr int kGrpcLogBurst = 20;
constexpr int64_t kGrpcLogWindowS = 10;

void GrpcLogLine(gpr_log_func_args* args) {
  static std::atomic<int64_t> window_start_s{0};
  static std::atomic<int> written{0};
  static std::atomic<int64_t> dropped{0};
  if (args->severity == GPR_LOG_SEVERITY_DEBUG) return;
  const int64_t now_s =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  int64_t start = window_start_s.load(std::memory_order_relaxed);
  if (now_s - start >= kGrpcLogWindowS && window_start_s.compare_exchange_strong(start, now_s)) {
    written.store(0, std::memory_order_relaxed);
  }
  if (written.fetch_add(1, std::memory_order_relaxed) >= kGrpcLogBurst) {
    dropped.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const int64_t before = dropped.exchange(0, std::memory_order_relaxed);
  const LogLevel level = args->severity == GPR_LOG_SEVERITY_ERROR ? LogLevel::kWarning : LogLevel::kInfo;
  const std::string_view message = args->message ? args->message : "";
  if (before > 0) {
    Log(level, message, {{"source", "grpc"}, {"dropped_before", std::to_string(before)}});
  } else {
    Log(level, message, {{"source", "grpc"}});
  }
}

class GrpcServer::Impl {
 public:
  Impl(GrpcServerOptions options, Engine* engine)
      : options_(std::move(options)), engine_(engine), service_(engine, options_), health_(options_) {}

  Status Start() {
    if (!service_.ServesEveryMethod() || !health_.ServesEveryMethod()) {
      return Internal("a gRPC method is not served by Quern's own handlers");
    }
    // Debian's Abseil is built with mutex deadlock detection on: every lock
    // of gRPC's mutexes then updates a global lock graph (a tenth of gRPC's
    // CPU time per call). Quern's own locks are std::mutex.
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
    gpr_set_log_function(GrpcLogLine);
    grpc::EnableDefaultHealthCheckService(false);  // HealthService instead
    grpc::ServerBuilder builder;
    const std::string address =
        (options_.host.find(':') != std::string::npos ? "[" + options_.host + "]" : options_.host) + ":" +
        std::to_string(options_.port);
    if (options_.tls_cert_file.empty() != options_.tls_key_file.empty() ||
        (!options_.tls_client_ca_file.empty() && options_.tls_cert_file.empty())) {
      return InvalidArgument("gRPC TLS needs both a certificate and a key file (and them for client certificates)");
    }
    std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
    if (!options_.tls_cert_file.empty() || !options_.tls_key_file.empty()) {
      auto read = [](const std::string& path, const char* what) -> Result<std::string> {
        std::ifstream in(path, std::ios::binary);
        if (!in) return Err(InvalidArgument(std::string("cannot read the gRPC TLS ") + what + " file '" + path + "'"));
        std::ostringstream text;
        text << in.rdbuf();
        return text.str();
      };
      grpc::SslServerCredentialsOptions ssl;
      grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
      QUERN_ASSIGN_OR_RETURN(pair.cert_chain, read(options_.tls_cert_file, "certificate"));
      QUERN_ASSIGN_OR_RETURN(pair.private_key, read(options_.tls_key_file, "key"));
      ssl.pem_key_cert_pairs.push_back(std::move(pair));
      if (!options_.tls_client_ca_file.empty()) {
        QUERN_ASSIGN_OR_RETURN(ssl.pem_root_certs, read(options_.tls_client_ca_file, "client CA"));
        ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
      }
      credentials = grpc::SslServerCredentials(ssl);
    }
    // Plaintext connections are accepted here and counted (gRPC 1.51 cannot
    // bound them: idle HTTP/2 connections used every descriptor); TLS ones
    // by gRPC itself.
    const bool own_listener = options_.tls_cert_file.empty();
    if (own_listener) {
      QUERN_RETURN_IF_ERROR(Listen());
    } else {
      builder.AddListeningPort(address, credentials, &port_);
    }
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, std::max(1, options_.idle_timeout_s) * 1000);
    builder.RegisterService(&service_);
    builder.RegisterService(&health_);
    if (options_.access_log) {
      std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
      interceptors.push_back(std::make_unique<AccessLogInterceptorFactory>(options_, &peers_));
      builder.experimental().SetInterceptorCreators(std::move(interceptors));
    }
    builder.SetMaxReceiveMessageSize(options_.max_receive_bytes);
    if (options_.max_concurrent_streams > 0) {
      builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options_.max_concurrent_streams);
    }
    builder.SetMaxSendMessageSize(options_.max_send_bytes);
    {
      // gRPC's threads (its callback threads, "nexting_thread", are made
      // here) run under SCHED_BATCH: an answer an engine thread writes
      // queues a completion that wakes one of them, and on the same core a
      // waking thread preempted the engine thread at every answer of a
      // batch (a 48 KiB model over 16 streams on one core: 4.2 context
      // switches per request instead of 0.7, a third more CPU per request).
      // They now run when the engine thread sleeps or its slice ends.
      // (A model loaded over gRPC, on one of these threads, gets the engine's
      // own attributes back: Engine::LoadModel.)
      const SchedulingAttributes home = CurrentScheduling();
      ScopedScheduling batch_policy(home.policy == SCHED_OTHER ? SchedulingAttributes{SCHED_BATCH, home.slice_ns}
                                                               : home);
      server_ = builder.BuildAndStart();
    }
    if (!server_ || port_ == 0) return Unavailable("cannot listen for gRPC on " + address);
    if (own_listener) acceptor_ = std::thread([this] { AcceptLoop(); });
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

  ~Impl() {
    Stop();
    for (int& fd : stop_pipe_) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
  }

  void Stop() {
    {
      MutexLock lock(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.SignalAll();
    if (health_thread_.joinable()) health_thread_.join();
    if (stop_pipe_[1] >= 0) {
      const char c = 's';
      ssize_t ignored = ::write(stop_pipe_[1], &c, 1);
      (void)ignored;
    }
    if (acceptor_.joinable()) acceptor_.join();
    if (listen_fd_ >= 0) ::close(listen_fd_);
    listen_fd_ = -1;
    health_.Close();
    if (server_) {
      // Calls still running after a second are cancelled (their requests
      // are withdrawn from the batcher); Shutdown returns when all are done.
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    }
  }

  int port() const { return port_; }
  void RefreshHealth() { UpdateHealth(); }

 private:
  // Binds and listens on options_.host:port (port 0: a free one).
  Status Listen() {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICHOST | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const std::string port = std::to_string(options_.port);
    // Any address (0.0.0.0 or ::) listens on both families, as gRPC's own
    // listener did: IPv6 with IPv4-mapped addresses, or IPv4 alone where
    // the host has no IPv6.
    const bool any = options_.host == "0.0.0.0" || options_.host == "::";
    const char* host = any ? "::" : options_.host.c_str();
    if (::getaddrinfo(host, port.c_str(), &hints, &found) != 0 || !found) {
      return InvalidArgument("gRPC: --host '" + options_.host + "' is not an IP address");
    }
    std::unique_ptr<addrinfo, void (*)(addrinfo*)> guard(found, ::freeaddrinfo);
    int fd = ::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 && any) {
      if (::getaddrinfo("0.0.0.0", port.c_str(), &hints, &found) != 0 || !found) {
        return Unavailable("gRPC: cannot resolve 0.0.0.0");
      }
      guard.reset(found);
      fd = ::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    }
    const int one = 1, zero = 0;
    if (fd >= 0 && found->ai_family == AF_INET6 && any) {
      ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    }
    if (fd < 0 || ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
        ::bind(fd, found->ai_addr, found->ai_addrlen) != 0 || ::listen(fd, SOMAXCONN) != 0) {
      const std::string why = std::strerror(errno);
      if (fd >= 0) ::close(fd);
      return Unavailable("cannot listen for gRPC on " + options_.host + ":" + port + ": " + why);
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
    port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    listen_fd_ = fd;
    if (::pipe2(stop_pipe_, O_CLOEXEC) != 0) return Unavailable("gRPC: cannot create a pipe");
    return Status::Ok();
  }

  // The acceptor thread: each connection is counted and handed to gRPC; at
  // the limit (after forgetting those gRPC has closed) it is closed at once.
  void AcceptLoop() {
    NameThisThread("quern-grpc-accept");
    struct Handed {
      int fd;
      dev_t dev;
      ino_t ino;  // the socket's: a descriptor naming another file is another connection
    };
    std::vector<Handed> open;  // handed to gRPC
    const size_t limit = static_cast<size_t>(std::max(1, options_.max_connections));
    int64_t last_warning_ns = 0;
    for (;;) {
      pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_pipe_[0], POLLIN, 0}};
      if (::poll(fds, 2, -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[1].revents) return;
      sockaddr_storage from{};
      socklen_t from_len = sizeof from;
      const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&from), &from_len, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) ::usleep(100000);  // the next look may find room
        continue;
      }
      struct stat st {};
      ::fstat(fd, &st);
      if (open.size() >= limit) {
        // gRPC closes connections itself: a descriptor no longer naming the
        // socket handed over is gone (socket inodes are not reused soon).
        std::erase_if(open, [](const Handed& e) {
          struct stat now {};
          return ::fstat(e.fd, &now) != 0 || now.st_ino != e.ino || now.st_dev != e.dev;
        });
      }
      if (open.size() >= limit) {
        ::close(fd);
        const int64_t now = engine_->clock().NowNs();
        if (now - last_warning_ns > 10'000'000'000LL) {
          last_warning_ns = now;
          Log(LogLevel::kWarning, "gRPC connection limit reached (" + std::to_string(limit) +
                                      ", --grpc-max-connections); closing new connections");
        }
        continue;
      }
      const int nodelay = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &nodelay, sizeof nodelay);
      // Sockets another part of the process closed and opened again under
      // the same number are told apart by their inode.
      std::erase_if(open, [&](const Handed& e) { return e.fd == fd; });
      open.push_back({fd, st.st_dev, st.st_ino});
      if (options_.access_log) {
        char host[NI_MAXHOST] = "";
        ::getnameinfo(reinterpret_cast<sockaddr*>(&from), from_len, host, sizeof host, nullptr, 0, NI_NUMERICHOST);
        std::string_view name = host;
        if (name.starts_with("::ffff:") && name.find('.') != std::string_view::npos) name.remove_prefix(7);
        peers_.Set(fd, std::string(name));
      }
      grpc::AddInsecureChannelFromFd(server_.get(), fd);
    }
  }

  // grpc.health.v1: SERVING while every model is ready and the server has
  // started and is not draining.
  void UpdateHealth() {
    health_.Set(!(options_.started && !options_.started->load(std::memory_order_acquire)) &&
                !(options_.draining && options_.draining->load(std::memory_order_acquire)) &&
                engine_->AllModelsReady());
  }

  GrpcServerOptions options_;
  Engine* engine_;
  Service service_;
  HealthService health_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  Mutex mu_;
  CondVar cv_;
  bool stopping_ QUERN_GUARDED_BY(mu_) = false;
  std::thread health_thread_;
  AcceptedPeers peers_;          // the access log's client addresses
  int listen_fd_ = -1;           // plaintext: the listening socket
  int stop_pipe_[2] = {-1, -1};  // ends the acceptor
  std::thread acceptor_;
};

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
