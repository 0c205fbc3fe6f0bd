#include "frontends/grpc/grpc_server.h"

#include <absl/synchronization/mutex.h>
#include <fcntl.h>
#include <grpc/support/log.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_posix.h>
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

#include "core/cpus.h"
#include "core/log.h"
#include "core/model_config_parser.h"
#include "core/mutex.h"
#include "frontends/grpc/grpc_convert.h"
#include "grpc_service.grpc.pb.h"
#include "protocol/kserve_codec.h"
#include "server/api_keys.h"

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
// received it (InferRequest::lend_thread; the engine decides whether it is
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

// One unary ModelInfer call. Deletes itself when gRPC is done with it; the
// engine's callback always comes before that (Finish is called from it).
class InferReactor final : public grpc::ServerUnaryReactor {
 public:
  InferReactor(Engine* engine, grpc::CallbackServerContext* ctx, const inference::ModelInferRequest* request,
               inference::ModelInferResponse* response)
      : response_(response), cancel_(std::make_shared<CancellationToken>()) {
    auto ir = ToInferRequest(*request);
    if (!ir) {
      Finish(ToGrpc(ir.error()));
      return;
    }
    ir->cancel = cancel_;
    ir->deadline_ns = DeadlineNs(ctx, *engine);
    // The request's name in the engine (and a Python model's request_id()):
    // its id, else the x-request-id metadata.
    std::string_view name = request->id();
    if (auto it = ctx->client_metadata().find("x-request-id"); name.empty() && it != ctx->client_metadata().end()) {
      name = std::string_view(it->second.data(), it->second.size());
    }
    if (UsableRequestId(name)) ir->metadata.emplace_back("request_id", std::string(name));
    InferCallback done = [this, request, engine](InferResponse&& r) {
      if (!r.status.ok()) return Finish(ToGrpc(r.status));
      if (Status st = ApplyClassifications(*request, *engine, r); !st.ok()) return Finish(ToGrpc(st));
      ToInferResponse(r, request->id(), response_);
      Finish(grpc::Status::OK);
    };
    if (Status st = engine->InferAsync(std::move(*ir), done); !st.ok()) Finish(ToGrpc(st));
  }

  void OnCancel() override { cancel_->Cancel(); }
  void OnDone() override { delete this; }

 private:
  inference::ModelInferResponse* response_;
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
    ir->lend_thread = lone;
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
    if (Status st = engine_->InferAsync(std::move(*ir), done); !st.ok()) {
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

grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, const grpc::Status& status) {
  auto* r = ctx->DefaultReactor();
  r->Finish(status);
  return r;
}

Status ModelControlOff() {
  return FailedPrecondition(
      "model load and unload over the API are off; start quern serve with --model-control explicit");
}

grpc::ServerUnaryReactor* NotImplemented(grpc::CallbackServerContext* ctx, const char* what) {
  return Reply(ctx, grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                                 std::string(what) + " is not implemented by Quern (no shared memory, tracing or "
                                                     "log settings over gRPC)"));
}

// A stream refused before it starts (no valid key).
class RefusedStream final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit RefusedStream(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

// GRPCInferenceService::CallbackService with ModelStreamInfer on raw bytes
// (see StreamReactor); every other method as generated.
using G = GRPCInferenceService;
using ServiceBase = G::WithCallbackMethod_ServerLive<G::WithCallbackMethod_ServerReady<
    G::WithCallbackMethod_ModelReady<G::WithCallbackMethod_ServerMetadata<G::WithCallbackMethod_ModelMetadata<
        G::WithCallbackMethod_ModelInfer<G::WithRawCallbackMethod_ModelStreamInfer<G::WithCallbackMethod_ModelConfig<
            G::WithCallbackMethod_ModelStatistics<G::WithCallbackMethod_RepositoryIndex<
                G::WithCallbackMethod_RepositoryModelLoad<G::WithCallbackMethod_RepositoryModelUnload<
                    G::WithCallbackMethod_SystemSharedMemoryStatus<G::WithCallbackMethod_SystemSharedMemoryRegister<
                        G::WithCallbackMethod_SystemSharedMemoryUnregister<
                            G::WithCallbackMethod_CudaSharedMemoryStatus<G::WithCallbackMethod_CudaSharedMemoryRegister<
                                G::WithCallbackMethod_CudaSharedMemoryUnregister<G::WithCallbackMethod_TraceSetting<
                                    G::WithCallbackMethod_LogSettings<G::Service>>>>>>>>>>>>>>>>>>>>;

// A unary ModelInfer's request and response on one arena per call: a block
// or two instead of an allocation per field (raw bytes are strings of their
// own). gRPC releases the holder once the call is done.
class InferMessages final : public grpc::MessageHolder<inference::ModelInferRequest, inference::ModelInferResponse> {
 public:
  InferMessages() : arena_(Options()) {
    set_request(google::protobuf::Arena::CreateMessage<inference::ModelInferRequest>(&arena_));
    set_response(google::protobuf::Arena::CreateMessage<inference::ModelInferResponse>(&arena_));
  }
  void Release() override { delete this; }

 private:
  static google::protobuf::ArenaOptions Options() {
    google::protobuf::ArenaOptions o;
    o.start_block_size = 2048;
    o.max_block_size = 64 * 1024;
    return o;
  }
  google::protobuf::Arena arena_;
};

class InferMessageAllocator final
    : public grpc::MessageAllocator<inference::ModelInferRequest, inference::ModelInferResponse> {
 public:
  grpc::MessageHolder<inference::ModelInferRequest, inference::ModelInferResponse>* AllocateMessages() override {
    return new InferMessages();
  }
};

class Service final : public ServiceBase {
 public:
  Service(Engine* engine, const GrpcServerOptions& options) : engine_(engine), options_(options) {
    SetMessageAllocatorFor_ModelInfer(&infer_messages_);
  }

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* ctx, const inference::ServerLiveRequest*,
                                       inference::ServerLiveResponse* out) override {
    if (auto* denied = Deny(ctx, false, true)) return denied;
    out->set_live(true);
    return Reply(ctx, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* ctx, const inference::ServerReadyRequest*,
                                        inference::ServerReadyResponse* out) override {
    if (auto* denied = Deny(ctx, false, true)) return denied;
    out->set_ready(!draining() && engine_->AllModelsReady());
    return Reply(ctx, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* ctx, const inference::ModelReadyRequest* in,
                                       inference::ModelReadyResponse* out) override {
    if (auto* denied = Deny(ctx, false, true)) return denied;
    auto v = ParseModelVersion(in->name(), in->version());
    if (!v) return Reply(ctx, ToGrpc(v.error()));
    out->set_ready(engine_->ModelReady(in->name(), *v));
    return Reply(ctx, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* ctx, const inference::ServerMetadataRequest*,
                                           inference::ServerMetadataResponse* out) override {
    if (auto* denied = Deny(ctx)) return denied;
    out->set_name("quern");
    out->set_version("0.1.0");
    for (const std::string_view e : kKServeExtensions) out->add_extensions(std::string(e));
    return Reply(ctx, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* ctx, const inference::ModelMetadataRequest* in,
                                          inference::ModelMetadataResponse* out) override {
    if (auto* denied = Deny(ctx)) return denied;
    auto m = Model(in->name(), in->version());
    if (!m) return Reply(ctx, ToGrpc(m.error()));
    FillMetadata(*m, out);
    return Reply(ctx, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ModelConfig(grpc::CallbackServerContext* ctx, const inference::ModelConfigRequest* in,
                                        inference::ModelConfigResponse* out) override {
    if (auto* denied = Deny(ctx)) return denied;
    auto m = Model(in->name(), in->version());
    if (!m) return Reply(ctx, ToGrpc(m.error()));
    *out->mutable_config() = ToProto(m->config);
    return Reply(ctx, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ModelStatistics(grpc::CallbackServerContext* ctx,
                                            const inference::ModelStatisticsRequest* in,
                                            inference::ModelStatisticsResponse* out) override {
    if (auto* denied = Deny(ctx)) return denied;
    auto v = ParseModelVersion(in->name(), in->version());
    if (!v) return Reply(ctx, ToGrpc(v.error()));
    auto stats = engine_->GetStatistics(in->name(), *v);
    if (!stats) return Reply(ctx, ToGrpc(stats.error()));
    for (const auto& s : *stats) FillStatistics(s, out->add_model_stats());
    return Reply(ctx, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* RepositoryIndex(grpc::CallbackServerContext* ctx,
                                            const inference::RepositoryIndexRequest* in,
                                            inference::RepositoryIndexResponse* out) override {
    if (auto* denied = Deny(ctx)) return denied;
    for (const auto& m : engine_->ListModels()) {
      if (in->ready() && m.state != ModelState::kReady) continue;
      auto* e = out->add_models();
      e->set_name(m.name);
      e->set_version(std::to_string(m.version));
      e->set_state(std::string(ModelStateName(m.state)));
      e->set_reason(m.reason);
    }
    return Reply(ctx, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* RepositoryModelLoad(grpc::CallbackServerContext* ctx,
                                                const inference::RepositoryModelLoadRequest* in,
                                                inference::RepositoryModelLoadResponse*) override {
    if (auto* denied = Deny(ctx, true)) return denied;
    if (!options_.model_control) return Reply(ctx, ToGrpc(ModelControlOff()));
    if (!in->parameters().empty()) {
      // "config" (an override) and "file:..." (model files in the request):
      // Quern loads what the repository holds; refused rather than ignored.
      return Reply(ctx, ToGrpc(InvalidArgument("model '" + in->model_name() + "': load parameter '" +
                                               in->parameters().begin()->first.substr(0, 64) +
                                               "' is not supported; Quern loads the model's files and "
                                               "config.pbtxt from the repository as they are")));
    }
    return Reply(ctx, ToGrpc(engine_->LoadModel(in->model_name())));
  }

  grpc::ServerUnaryReactor* RepositoryModelUnload(grpc::CallbackServerContext* ctx,
                                                  const inference::RepositoryModelUnloadRequest* in,
                                                  inference::RepositoryModelUnloadResponse*) override {
    if (auto* denied = Deny(ctx, true)) return denied;
    if (!options_.model_control) return Reply(ctx, ToGrpc(ModelControlOff()));
    return Reply(ctx, ToGrpc(engine_->UnloadModel(in->model_name())));
  }

  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* ctx, const inference::ModelInferRequest* in,
                                       inference::ModelInferResponse* out) override {
    if (auto* denied = Deny(ctx)) return denied;
    return new InferReactor(engine_, ctx, in, out);
  }

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ModelStreamInfer(
      grpc::CallbackServerContext* ctx) override {
    if (Status st = Authorize(ctx, false); !st.ok()) return new RefusedStream(ToGrpc(st));
    if (draining()) return new RefusedStream(ToGrpc(Unavailable("the server is shutting down")));
    // Every message is a request: each one takes its key's rate-limit token
    // and is refused while the server drains.
    return new StreamReactor(
        engine_, ctx,
        [this, ctx] {
          if (draining()) return Unavailable("the server is shutting down");
          return Authorize(ctx, false);
        },
        &last_caller_);
  }

  grpc::ServerUnaryReactor* SystemSharedMemoryStatus(grpc::CallbackServerContext* ctx,
                                                     const inference::SystemSharedMemoryStatusRequest*,
                                                     inference::SystemSharedMemoryStatusResponse*) override {
    if (auto* denied = Deny(ctx)) return denied;
    return NotImplemented(ctx, "SystemSharedMemoryStatus");
  }
  grpc::ServerUnaryReactor* SystemSharedMemoryRegister(grpc::CallbackServerContext* ctx,
                                                       const inference::SystemSharedMemoryRegisterRequest*,
                                                       inference::SystemSharedMemoryRegisterResponse*) override {
    if (auto* denied = Deny(ctx)) return denied;
    return NotImplemented(ctx, "SystemSharedMemoryRegister");
  }
  grpc::ServerUnaryReactor* SystemSharedMemoryUnregister(grpc::CallbackServerContext* ctx,
                                                         const inference::SystemSharedMemoryUnregisterRequest*,
                                                         inference::SystemSharedMemoryUnregisterResponse*) override {
    if (auto* denied = Deny(ctx)) return denied;
    return NotImplemented(ctx, "SystemSharedMemoryUnregister");
  }
  grpc::ServerUnaryReactor* CudaSharedMemoryStatus(grpc::CallbackServerContext* ctx,
                                                   const inference::CudaSharedMemoryStatusRequest*,
                                                   inference::CudaSharedMemoryStatusResponse*) override {
    if (auto* denied = Deny(ctx)) return denied;
    return NotImplemented(ctx, "CudaSharedMemoryStatus");
  }
  grpc::ServerUnaryReactor* CudaSharedMemoryRegister(grpc::CallbackServerContext* ctx,
                                                     const inference::CudaSharedMemoryRegisterRequest*,
                                                     inference::CudaSharedMemoryRegisterResponse*) override {
    if (auto* denied = Deny(ctx)) return denied;
    return NotImplemented(ctx, "CudaSharedMemoryRegister");
  }
  grpc::ServerUnaryReactor* CudaSharedMemoryUnregister(grpc::CallbackServerContext* ctx,
                                                       const inference::CudaSharedMemoryUnregisterRequest*,
                                                       inference::CudaSharedMemoryUnregisterResponse*) override {
    if (auto* denied = Deny(ctx)) return denied;
    return NotImplemented(ctx, "CudaSharedMemoryUnregister");
  }
  grpc::ServerUnaryReactor* TraceSetting(grpc::CallbackServerContext* ctx, const inference::TraceSettingRequest*,
                                         inference::TraceSettingResponse*) override {
    if (auto* denied = Deny(ctx)) return denied;
    return NotImplemented(ctx, "TraceSetting");
  }
  grpc::ServerUnaryReactor* LogSettings(grpc::CallbackServerContext* ctx, const inference::LogSettingsRequest*,
                                        inference::LogSettingsResponse*) override {
    if (auto* denied = Deny(ctx)) return denied;
    return NotImplemented(ctx, "LogSettings");
  }

 private:
  Result<ModelStatus> Model(const std::string& name, const std::string& version) {
    QUERN_ASSIGN_OR_RETURN(int64_t v, ParseModelVersion(name, version));
    return engine_->GetModel(name, v);
  }

  // Not OK when the call presents no acceptable key.
  Status Authorize(grpc::CallbackServerContext* ctx, bool admin) const {
    if (!options_.authorize) return Status::Ok();
    std::string_view authorization, x_api_key;
    for (const auto& [k, v] : ctx->client_metadata()) {
      const std::string_view key(k.data(), k.size());
      if (key == "authorization") authorization = std::string_view(v.data(), v.size());
      if (key == "x-api-key") x_api_key = std::string_view(v.data(), v.size());
    }
    return options_.authorize(PresentedKey(authorization, x_api_key), admin);
  }

  bool draining() const { return options_.draining && options_.draining->load(std::memory_order_acquire); }

  // A finished reactor when the call may not proceed, else null. `probe`:
  // liveness and readiness, answered while draining too.
  grpc::ServerUnaryReactor* Deny(grpc::CallbackServerContext* ctx, bool admin = false, bool probe = false) const {
    Status st = Authorize(ctx, admin);
    if (st.ok() && !probe && draining()) st = Unavailable("the server is shutting down");
    return st.ok() ? nullptr : Reply(ctx, ToGrpc(st));
  }

  Engine* engine_;
  const GrpcServerOptions& options_;
  LastCaller last_caller_;
  InferMessageAllocator infer_messages_;  // outlives the server's calls: the service does
};

// gRPC 1.51 answers a request message that does not parse as its method's
// protobuf with UNIMPLEMENTED and no message. This turns that answer into
// INVALID_ARGUMENT naming the method. Every status Quern sends itself
// carries a message, so an empty UNIMPLEMENTED for one of the service's own
// methods can only come from there.
class UnparseableMessageInterceptor final : public grpc::experimental::Interceptor {
 public:
  // `method` outlives the call (gRPC's registered method name).
  explicit UnparseableMessageInterceptor(const char* method) : method_(method) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status s = methods->GetSendStatus();
      if (s.error_code() == grpc::StatusCode::UNIMPLEMENTED && s.error_message().empty()) {
        methods->ModifySendStatus(grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            std::string("the request is not a valid message for ") + method_ + " (protobuf parsing failed)"));
      }
    }
    methods->Proceed();
  }

 private:
  const char* method_;
};

class UnparseableMessageInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  UnparseableMessageInterceptorFactory() {
    const auto* service =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName("inference.GRPCInferenceService");
    for (int i = 0; service && i < service->method_count(); ++i) {
      methods_.insert("/" + service->full_name() + "/" + service->method(i)->name());
    }
  }

  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    // Only the service's own methods: an unknown method stays UNIMPLEMENTED.
    const char* method = info->method();
    if (!method || !methods_.contains(std::string_view(method))) return nullptr;
    return new UnparseableMessageInterceptor(method);
  }

 private:
  std::set<std::string, std::less<>> methods_;
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
      if (const auto* m = static_cast<const inference::ModelInferRequest*>(methods->GetRecvMessage())) {
        model_ = m->model_name().substr(0, 256);
        if (UsableRequestId(m->id())) request_id_ = m->id();  // before the metadata's, as the engine does
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
      : options_(std::move(options)), engine_(engine), service_(engine, options_) {}

  Status Start() {
    // Debian's Abseil is built with mutex deadlock detection on: every lock
    // of gRPC's mutexes then updates a global lock graph (a tenth of gRPC's
    // CPU time per call). Quern's own locks are std::mutex.
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
    gpr_set_log_function(GrpcLogLine);
    grpc::EnableDefaultHealthCheckService(true);
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
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(std::make_unique<UnparseableMessageInterceptorFactory>());
    if (options_.access_log) {
      interceptors.push_back(std::make_unique<AccessLogInterceptorFactory>(options_, &peers_));
    }
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
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
        cv_.WaitFor(lock, std::chrono::milliseconds(options_.health_poll_ms));
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
    if (server_) {
      // Calls still running after a second are cancelled (their requests
      // are withdrawn from the batcher); Shutdown returns when all are done.
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    }
  }

  int port() const { return port_; }

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

  // grpc.health.v1: SERVING when every model is ready (service "" and
  // "inference.GRPCInferenceService").
  void UpdateHealth() {
    auto* health = server_->GetHealthCheckService();
    if (!health) return;
    const bool ready =
        !(options_.draining && options_.draining->load(std::memory_order_acquire)) && engine_->AllModelsReady();
    if (ready == last_ready_) return;
    last_ready_ = ready;
    health->SetServingStatus("inference.GRPCInferenceService", ready);
    health->SetServingStatus(ready);  // every service known, "" included
  }

  GrpcServerOptions options_;
  Engine* engine_;
  Service service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  Mutex mu_;
  CondVar cv_;
  bool stopping_ QUERN_GUARDED_BY(mu_) = false;
  std::optional<bool> last_ready_;  // the health thread's (and Start's, before it runs)
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

Result<std::unique_ptr<GrpcServer>> GrpcServer::Start(GrpcServerOptions options, Engine* engine) {
  auto impl = std::make_unique<Impl>(std::move(options), engine);
  QUERN_RETURN_IF_ERROR(impl->Start());
  return std::unique_ptr<GrpcServer>(new GrpcServer(std::move(impl)));
}

}  // namespace quern
