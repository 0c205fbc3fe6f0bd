#include "backends/python/python_backend.h"

#include <google/protobuf/util/json_util.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>

#include "backends/python/python_process.h"
#include "core/idle_release.h"
#include "core/log.h"
#include "core/model_config_parser.h"
#include "core/mutex.h"
#include "metrics/custom_metrics.h"

namespace quern {
namespace {

constexpr size_t kAlign = 64;
constexpr int64_t kDefaultExecuteTimeoutMs = 60000;
// A decoupled model whose every open request was cancelled (and it told) has this long, once its
// execute() has returned, to close them before the batch is ended for it.
constexpr int64_t kCancelGraceMs = 2000;
// The most bytes one scrape of /metrics reads from an idle process (what is left: the next one).
constexpr size_t kGatheredBytesMax = 4u << 20;
constexpr int64_t kDefaultInitializeTimeoutMs = 120000;

// quern.python.max_memory_mb when a model does not say: half of the memory
// the process may have (the machine's, or its cgroup's limit when lower), at
// least 4 GiB (the interpreter, numpy and a CPU framework map well under
// that before a model allocates anything). GPU instances get none by
// default: CUDA reserves far more address space than it uses.
int64_t DefaultPythonMemoryMb() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  int64_t total_mb = pages > 0 && page > 0 ? (static_cast<int64_t>(pages) * page) >> 20 : 0;
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    if (FILE* f = std::fopen(path, "r")) {
      unsigned long long limit = 0;
      if (std::fscanf(f, "%llu", &limit) == 1 && limit > 0 && static_cast<int64_t>(limit >> 20) < total_mb) {
        total_mb = static_cast<int64_t>(limit >> 20);
      }
      std::fclose(f);
    }
  }
  return std::max<int64_t>(4096, total_mb / 2);
}
// A process that failed to start is not started again sooner than this.
constexpr auto kRestartBackoff = std::chrono::seconds(1);
// A process that died (or was killed for a timeout) while running this many
// batches in a row is started again only after a pause, 1 s doubling with
// each further death up to kMaxCrashBackoff; the batches of the pause fail
// at once. A batch answered ends the streak.
constexpr int kCrashesBeforeBackoff = 3;
constexpr auto kMaxCrashBackoff = std::chrono::seconds(30);

// Where a process runs (quern.same_core): while its batches are short, the
// process is moved to the CPU of the thread that runs the batch, and that
// thread, instead of sleeping until the answer, gives its CPU to the process
// (sched_yield) and reads the answer once the process has given it back. The
// round trip then never crosses cores and neither side is woken: on this kind
// of virtual machine a wake-up on another, idle core costs 12-17 us of CPU on
// each side, more than the Python stub's own work. (Holding the thread on its
// CPU with sched_setaffinity kept a sleeping thread from being woken on the
// idle core, but cost two system calls per batch, ~4 us.) The thread yields
// for at most twice the round trip plus kYieldSlackNs, never longer than
// "short", then sleeps as for any batch: a process that sleeps or computes
// long costs it no more. Short: the round trips' moving average (1/8 each)
// below quern.same_core_below_us (default kSameCoreBelowUs), after
// kSameCoreAfterBatches of them; it leaves the core again above twice that
// (also when two processes on one core slow each other down). Long batches
// keep the freedom to migrate, and two instances their two cores.
constexpr int64_t kSameCoreBelowUs = 250;
constexpr int kSameCoreAfterBatches = 8;
constexpr int64_t kYieldSlackNs = 20'000;
// The most models a chain of calls (BLS: A calls B calls C ...) may hold.
constexpr size_t kMaxCallDepth = 16;
// The most a model's call to another model (BLS) may bring back in one frame.
constexpr size_t kMaxBlsAnswerBytes = size_t{1} << 30;
// exec(decoupled=True): at most this many responses are gathered for the caller.
constexpr size_t kMaxBlsResponses = 65536;

size_t AlignShmOffset(size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

template <typename T>
void Put(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // little-endian hosts only (x86-64, arm64)
  out.append(b, sizeof(T));
}

// Reads a reply frame with every length checked.
class FrameReader {
 public:
  explicit FrameReader(std::string_view data) : data_(data) {}
  template <typename T>
  bool Get(T& v) {
    if (data_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(&v, data_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool Bytes(size_t n, std::string_view& v) {
    if (data_.size() - pos_ < n) return false;
    v = data_.substr(pos_, n);
    pos_ += n;
    return true;
  }

 private:
  std::string_view data_;
  size_t pos_ = 0;
};

// Triton's TRITONSERVER_Error codes, as pb_utils.TritonError numbers them.
Status FromTritonCode(uint8_t code, std::string message) {
  switch (code) {
    case 2: return NotFound(std::move(message));
    case 3: return InvalidArgument(std::move(message));
    case 4: return Unavailable(std::move(message));
    case 5: return Unimplemented(std::move(message));
    case 6: return Status(StatusCode::kAlreadyExists, std::move(message));
    case 7: return Cancelled(std::move(message));
    default: return Internal(std::move(message));
  }
}

// The pb_utils.TritonError code of a status (its message goes with it).
uint8_t ToTritonCode(StatusCode code) {
  switch (code) {
    case StatusCode::kNotFound: return 2;
    case StatusCode::kInvalidArgument: return 3;
    case StatusCode::kUnavailable:
    case StatusCode::kResourceExhausted:
    case StatusCode::kDeadlineExceeded: return 4;
    case StatusCode::kUnimplemented: return 5;
    case StatusCode::kAlreadyExists: return 6;
    case StatusCode::kCancelled: return 7;
    default: return 1;  // INTERNAL
  }
}

// Where a BLS call's input tensors lie: the first `size` bytes of the BLS slot at `shm`, each after
// the one before (`next`: where the next may start), so that together they take at most `size`.
struct SlotInputs {
  const std::byte* shm = nullptr;
  size_t size = 0;
  size_t next = 0;
};

// A tensor of a frame: u16 name length, u8 type, u8 rank, the name, rank int64 dims, u64 byte count,
// then its bytes: in the frame (`slot` null), or (a BLS call's) u64 offset, its place in the BLS slot
// (`slot`). BYTES elements as 4-byte lengths and their bytes. Copied out either way: the process
// writes its next call into the slot.
Result<NamedTensor> ReadFrameTensor(FrameReader& r, SlotInputs* slot = nullptr) {
  uint16_t len = 0;
  uint8_t type = 0, rank = 0;
  std::string_view name;
  if (!r.Get(len) || !r.Get(type) || !r.Get(rank) || !r.Bytes(len, name) || rank > kMaxTensorRank) {
    return Err(InvalidArgument("a malformed tensor"));
  }
  Shape shape(rank);
  for (auto& d : shape) {
    if (!r.Get(d) || d < 0) return Err(InvalidArgument("tensor '" + std::string(name) + "': a malformed shape"));
  }
  uint64_t size = 0, offset = 0;
  const std::byte* data = nullptr;
  if (!slot) {
    std::string_view bytes;
    if (!r.Get(size) || !r.Bytes(size, bytes)) {
      return Err(InvalidArgument("tensor '" + std::string(name) + "': its bytes are cut short"));
    }
    data = reinterpret_cast<const std::byte*>(bytes.data());
  } else if (!r.Get(size) || !r.Get(offset) || offset < slot->next || offset > slot->size ||
             size > slot->size - offset || !slot->shm) {
    return Err(InvalidArgument("tensor '" + std::string(name) +
                               "': its bytes lie outside the call's shared memory, or over another input's"));
  } else {
    data = slot->shm + offset;
    slot->next = offset + size;
  }
  const auto dtype = static_cast<DataType>(type);
  const size_t element = DataTypeByteSize(dtype);
  if (type == 0 || type > static_cast<uint8_t>(DataType::kBf16) ||
      (dtype != DataType::kBytes && ByteCount(shape, element) != static_cast<int64_t>(size)) ||
      (dtype == DataType::kBytes && ElementCount(shape) < 0)) {
    return Err(InvalidArgument("tensor '" + std::string(name) + "': its type, shape and byte count disagree"));
  }
  Tensor t = Tensor::AllocateUninitialized(dtype, std::move(shape), size);
  if (size) std::memcpy(t.mutable_data(), data, size);
  return NamedTensor{std::string(name), std::move(t)};
}

// The bytes `tensors` take in the BLS slot, each at an aligned offset.
size_t SlotBytes(const std::vector<NamedTensor>& tensors) {
  size_t n = 0;
  for (const NamedTensor& t : tensors) n += AlignShmOffset(t.tensor.byte_size());
  return n;
}

// A tensor of a BLS answer, as ReadFrameTensor reads one from the slot: its bytes copied into the BLS slot `shm` at
// `offset`, which moves past them.
void PutSlotTensor(std::string& out, const NamedTensor& n, std::byte* shm, size_t& offset) {
  const Tensor& t = n.tensor;
  Put<uint16_t>(out, static_cast<uint16_t>(std::min<size_t>(n.name.size(), 65535)));
  Put<uint8_t>(out, static_cast<uint8_t>(t.dtype()));
  Put<uint8_t>(out, static_cast<uint8_t>(t.shape().size()));
  out.append(n.name, 0, 65535);
  for (int64_t d : t.shape()) Put<int64_t>(out, d);
  Put<uint64_t>(out, t.byte_size());
  Put<uint64_t>(out, offset);
  if (t.byte_size()) std::memcpy(shm + offset, t.data(), t.byte_size());
  offset += AlignShmOffset(t.byte_size());
}

Result<int64_t> MillisecondsParameter(const ModelConfig& config, const char* key, int64_t fallback) {
  auto it = config.parameters.find(key);
  if (it == config.parameters.end()) return fallback;
  int64_t v = 0;
  const std::string& s = it->second;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || v < 0 || v > 86400000LL * 365) {
    return Err(InvalidArgument("model '" + config.name + "': parameter " + key + " must be a number of milliseconds " +
                               "(0 = no limit), got '" + s + "'"));
  }
  return v;
}

// The shape the process sees for a configured tensor (its reshape when set).
const Shape& ModelDims(const TensorConfig& t) {
  return t.reshape ? *t.reshape : t.dims;
}

void WriteTensorList(rapidjson::Writer<rapidjson::StringBuffer>& w, const std::vector<TensorConfig>& list) {
  w.StartArray();
  for (const auto& t : list) {
    w.StartObject();
    w.Key("name");
    w.String(t.name.c_str());
    w.Key("dtype");
    w.Int(static_cast<int>(t.dtype));
    w.Key("dims");
    w.StartArray();
    for (int64_t d : ModelDims(t)) w.Int64(d);
    w.EndArray();
    w.EndObject();
  }
  w.EndArray();
}

struct PythonModelSpec {
  // The engine's submit, for the model's calls to other models (BLS); empty outside an engine.
  std::function<Status(InferRequest&&, InferCallback&, const SubmitOptions&)> submit;
  std::string python;
  std::filesystem::path model_file;
  std::filesystem::path version_dir;
  std::filesystem::path model_dir;
  std::string version;
  std::string config_json;  // Triton's JSON form, for initialize(args)
  int64_t execute_timeout_ms = kDefaultExecuteTimeoutMs;
  int64_t initialize_timeout_ms = kDefaultInitializeTimeoutMs;
  int64_t max_memory_mb = 0;                             // quern.python.max_memory_mb; 0 = none
  bool max_memory_given = false;                         // set by the model (else not for GPU instances)
  bool same_core = true;                                 // quern.same_core
  int64_t same_core_below_ns = kSameCoreBelowUs * 1000;  // quern.same_core_below_us
  // Gives back the pages of the instances' shared memory slots that their last batches did not
  // need (the backend's, shared by its models; null: kept until the process ends).
  std::shared_ptr<IdleRelease> shm_release;
};

// One instance: one Python process, started again after it dies.
class PythonModel final : public Model {
 public:
  PythonModel(ModelConfig config, std::shared_ptr<const PythonModelSpec> spec, int instance, InstanceDevice device)
      : config_(std::move(config)),
        spec_(std::move(spec)),
        instance_(instance),
        device_(device),
        tag_("model '" + config_.name + "' instance " + std::to_string(instance)),
        abandon_fd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)),
        wake_fd_(config_.decoupled ? ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK) : -1) {
    CustomMetrics::Global().AddRefresher(this, [this] { GatherMetrics(); });
    if (spec_->shm_release) spec_->shm_release->Add(this, [this] { return ReleaseIdleShm(); });
  }

  ~PythonModel() override {
    if (spec_->shm_release) spec_->shm_release->Remove(this);
    CustomMetrics::Global().RemoveRefresher(this);
    if (abandon_fd_ >= 0) ::close(abandon_fd_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }

  // The server stopped waiting (its drain deadline passed): a running
  // execute() is ended by killing the process, and nothing runs after it.
  void Abandon() override {
    abandoned_.store(true, std::memory_order_release);
    const uint64_t one = 1;
    if (abandon_fd_ >= 0) (void)!::write(abandon_fd_, &one, sizeof one);
  }

  Status Load() override {
    MutexLock lock(run_mu_);
    auto p = PythonProcess::Start(Launch());
    if (!p) return p.error();
    process_ = std::move(*p);
    batch_ = 0;
    return Status::Ok();
  }

  Status Execute(const std::vector<NamedTensor>& inputs, int64_t batch_size,
                 std::vector<NamedTensor>& outputs) override {
    const int64_t rows[1] = {batch_size};
    Status status[1];
    QUERN_RETURN_IF_ERROR(ExecuteRequests(inputs, batch_size, {rows, status}, outputs));
    return status[0];
  }

  Status ExecuteRequests(const std::vector<NamedTensor>& inputs, int64_t batch_size, BatchRequests requests,
                         std::vector<NamedTensor>& outputs) override {
    MutexLock lock(run_mu_);
    return RunBatch(inputs, batch_size, requests, outputs);
  }

 private:
  Status RunBatch(const std::vector<NamedTensor>& inputs, int64_t batch_size, BatchRequests requests,
                  std::vector<NamedTensor>& outputs) QUERN_REQUIRES(run_mu_) {
    if (abandoned_.load(std::memory_order_acquire)) {
      return Unavailable(tag_ + ": the server is stopping; the batch was not run");
    }
    QUERN_RETURN_IF_ERROR(EnsureProcess());
    // A look at the slots that found batches running back to back is done here, between them.
    if (shm_look_due_.exchange(false, std::memory_order_acq_rel)) GiveBackUnusedShm();
    // Inputs go into shared memory one after another, each aligned.
    size_t end = 0;
    std::vector<size_t> offsets(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      offsets[i] = end;
      end = AlignShmOffset(end + inputs[i].tensor.byte_size());
    }
    // One slot always stays free (ReadOutputs copies rather than borrow the last one).
    const int slot = process_->FreeSlot();
    if (slot < 0) return Internal(tag_ + ": no free shared memory slot");
    QUERN_RETURN_IF_ERROR(process_->Reserve(slot, std::max<size_t>(end, 1)));
    NoteSlotUse(slot, end);
    if (spec_->shm_release) spec_->shm_release->Touch(this);  // arms the next look
    std::byte* shm = process_->shm(slot);
    std::string frame = "E";
    Put<uint8_t>(frame, static_cast<uint8_t>(slot));
    Put<uint32_t>(frame, static_cast<uint32_t>(requests.rows.size()));
    Put<uint32_t>(frame, static_cast<uint32_t>(inputs.size()));
    Put<int64_t>(frame, batch_size);
    Put<uint64_t>(frame, process_->shm_size(slot));
    for (int64_t r : requests.rows) Put<int64_t>(frame, r);
    // Each request's id (pb_utils InferenceRequest.request_id()), at most 1 KiB, and its parameters
    // (request.parameters(), JSON; the front ends hold them to kMaxRequestParametersBytes).
    for (size_t i = 0; i < requests.rows.size(); ++i) {
      const std::string_view id = i < requests.ids.size() ? requests.ids[i].substr(0, 1024) : std::string_view();
      Put<uint16_t>(frame, static_cast<uint16_t>(id.size()));
      frame += id;
      const std::string_view parameters = i < requests.parameters.size() ? requests.parameters[i] : std::string_view();
      Put<uint32_t>(frame, static_cast<uint32_t>(parameters.size()));
      frame += parameters;
    }
    for (size_t i = 0; i < inputs.size(); ++i) {
      const Tensor& t = inputs[i].tensor;
      if (t.byte_size()) std::memcpy(shm + offsets[i], t.data(), t.byte_size());
      Put<uint16_t>(frame, static_cast<uint16_t>(inputs[i].name.size()));
      Put<uint8_t>(frame, static_cast<uint8_t>(t.dtype()));
      Put<uint8_t>(frame, static_cast<uint8_t>(t.shape().size()));
      frame += inputs[i].name;
      for (int64_t d : t.shape()) Put<int64_t>(frame, d);
      Put<uint64_t>(frame, offsets[i]);
      Put<uint64_t>(frame, t.byte_size());
    }
    // Yielding only helps a process that runs on this CPU: elsewhere it
    // would spin beside it.
    bool same_core = false;
    if (SameCore()) {
      same_core = process_->RunOn(sched_getcpu());
    } else {
      process_->RunAnywhere();
    }
    const auto sent_at = std::chrono::steady_clock::now();
    QUERN_RETURN_IF_ERROR(process_->Send(frame));
    ++batch_;  // as the process counts its batches (a decoupled model's frames name theirs)
    if (same_core) {
      process_->YieldForFrame(
          std::min(static_cast<int64_t>(2 * round_trip_ns_) + kYieldSlackNs, spec_->same_core_below_ns));
    }
    const auto deadline = sent_at + std::chrono::milliseconds(spec_->execute_timeout_ms);
    // A decoupled model's responses, sent while execute() runs or after it returned (frames "P";
    // "d" says it returned): the run lasts until every request of the batch is closed.
    Discard discard;  // a warm-up run's
    Decoupled streams(config_.decoupled ? (requests.responses ? requests.responses : &discard) : nullptr,
                      requests.rows.size());
    if (streams.sink)
      streams.sink->OnCancel([fd = wake_fd_] {
        const uint64_t one = 1;
        (void)!::write(fd, &one, sizeof one);
      });
    auto reply = AwaitAnswer(streams, deadline, requests.callers);
    if (reply) Measure(std::chrono::steady_clock::now() - sent_at);
    if (!reply && reply.error().code() != StatusCode::kCancelled) {
      ++crashes_in_a_row_;
      last_crash_ = std::chrono::steady_clock::now();
    } else if (reply) {
      crashes_in_a_row_ = 0;
    }
    if (!reply) {
      if (reply.error().code() == StatusCode::kCancelled) {
        return Unavailable(tag_ +
                           ": the server stopped waiting for execute() (its drain timeout passed); the Python "
                           "process was killed");
      }
      if (reply.error().code() == StatusCode::kDeadlineExceeded) {
        return DeadlineExceeded(tag_ + ": execute() ran longer than " + std::to_string(spec_->execute_timeout_ms) +
                                " ms (quern.execute_timeout_ms); its Python process was killed and starts again");
      }
      return Unavailable(reply.error().message() + " while running a batch; it starts again");
    }
    if (streams.sink && streams.returned) return Status::Ok();  // every request closed
    return ReadReply(*reply, slot, batch_size, requests, outputs);
  }

  // At a scrape of /metrics, while no batch runs: the metrics the process sent since its last batch
  // (frames "M": what the model changed while it ran no batch, which the process sends on its own
  // within a fraction of a second). A running batch reads them itself. Besides them only a forgotten
  // batch's responses ("P", "d") may come between batches; they are dropped as the next batch would.
  void GatherMetrics() {
    if (!run_mu_.TryLock()) return;  // a batch runs (or the process starts): it reads them
    for (size_t bytes = 0; process_ && !broken_ && bytes < kGatheredBytesMax;) {
      auto frame = process_->ReceiveReady();
      if (!frame) {  // it died: the next batch starts it again
        Log(LogLevel::kWarning, frame.error().message() + " while it ran no batch", {{"model", config_.name}});
        broken_ = true;
        break;
      }
      if (!*frame) break;  // none more
      const std::string& f = **frame;
      bytes += 4 + f.size();
      if (!f.empty() && f[0] == 'M') {
        ApplyMetrics(std::string_view(f).substr(1));
      } else if (f.empty() || (f[0] != 'P' && f[0] != 'd')) {
        // Out of step: replaced before the next batch (not here, where a scrape would wait for it).
        Log(LogLevel::kWarning, tag_ + ": its Python process sent a frame while it ran no batch; it starts again",
            {{"model", config_.name}});
        broken_ = true;
      }
    }
    run_mu_.Unlock();
  }

  // A batch used slot `slot` up to `end` bytes: kept at the next look (GiveBackUnusedShm).
  void NoteSlotUse(int slot, size_t end) QUERN_REQUIRES(run_mu_) {
    auto& need = slot_need_[static_cast<size_t>(slot)];
    need = std::max(need, end);
  }

  // IdleRelease's thread, an idle time after a batch armed it: the look below, or, while a batch
  // runs (it holds run_mu_), a note that the next batch does it before it starts.
  IdleRelease::Outcome ReleaseIdleShm() {
    if (!run_mu_.TryLock()) {
      shm_look_due_.store(true, std::memory_order_release);
      return IdleRelease::Outcome::kHeld;
    }
    const bool kept = GiveBackUnusedShm();
    run_mu_.Unlock();
    return kept ? IdleRelease::Outcome::kHeld : IdleRelease::Outcome::kReleased;
  }

  // Each free slot keeps what batches used since the last look and gives the rest of its pages
  // back (all of them when no batch used it: the load is over). A slot whose outputs are still
  // being answered is left to the next look. The BLS slot is left as it is: the process may write
  // a call's inputs there whenever its code calls another model. Whether anything is still kept.
  bool GiveBackUnusedShm() QUERN_REQUIRES(run_mu_) {
    bool kept = false;
    for (int i = 0; i < PythonProcess::kSlots; ++i) {
      auto& need = slot_need_[static_cast<size_t>(i)];
      if (!process_) {
        need = 0;
        continue;
      }
      if (!process_->SlotFree(i)) {
        kept = true;
        continue;
      }
      process_->Punch(i, need);
      kept = kept || need > 0;
      need = 0;
    }
    return kept;
  }

  void ApplyMetrics(std::string_view json) {
    Status st = CustomMetrics::Global().Apply(config_.name, json);
    if (!st.ok() && metric_errors_logged_.size() < 64 && metric_errors_logged_.insert(st.message()).second) {
      Log(LogLevel::kWarning, st.message(), {{"model", config_.name}});  // once per distinct refusal
    }
  }

  // A warm-up run of a decoupled model: its responses go nowhere.
  struct Discard final : ResponseSink {
    void Send(size_t, bool, Status, std::vector<NamedTensor>, bool) override {}
    bool cancelled(size_t) const override { return false; }
    void OnCancel(std::function<void()>) override {}
  };
  // A decoupled model's batch: which requests are still open, which were told they are cancelled.
  struct Decoupled {
    Decoupled(ResponseSink* s, size_t requests)
        : sink(s), closed(s ? requests : 0), told(s ? requests : 0), open(s ? requests : 0) {}
    ResponseSink* sink;
    std::vector<bool> closed, told;
    size_t open;
    bool returned = false;  // execute() returned (frame "d")
  };

  // The batch's answer, after the calls to other models (BLS, frames "B") and the model's metrics
  // ("M") that come before it. A decoupled model's run ends when it has returned ("d") and every
  // request of the batch is closed ("P" with the final flag): the answer is then its last frame.
  // Past the batch's execute_timeout_ms, or kCancelGraceMs after every request still open was
  // cancelled (and the model told), once execute() has returned: the open requests fail, the
  // process forgets the batch, and runs on.
  Result<std::string> AwaitAnswer(Decoupled& streams, std::chrono::steady_clock::time_point deadline,
                                  std::span<const std::string_view> callers) {
    auto reply = process_->Receive(spec_->execute_timeout_ms, abandon_fd_, wake_fd_);
    std::optional<std::chrono::steady_clock::time_point> all_cancelled;
    for (;;) {
      if (streams.sink) {
        uint64_t n = 0;  // cancellations, looked at between frames too (a busy stream never waits)
        if (::read(wake_fd_, &n, sizeof n) == sizeof n || (!reply && reply.error().code() == StatusCode::kUnknown)) {
          QUERN_RETURN_IF_ERROR(SendCancellations(streams));
          if (!all_cancelled && streams.open > 0 && AllOpenCancelled(streams)) {
            all_cancelled = std::chrono::steady_clock::now();
          }
        }
        if (!reply && reply.error().code() == StatusCode::kUnknown) reply = std::string();  // "woken": on
      }
      if (!reply) {
        if (streams.returned && reply.error().code() == StatusCode::kDeadlineExceeded) {
          return Forget(streams, all_cancelled.has_value());
        }
        return reply;
      }
      if (reply->empty()) {
        // (woken)
      } else if ((*reply)[0] == 'M') {
        ApplyMetrics(std::string_view(*reply).substr(1));
      } else if ((*reply)[0] == 'B') {
        QUERN_RETURN_IF_ERROR(process_->Send(CallModel(*reply, deadline, callers)));
      } else if (streams.sink && (*reply)[0] == 'P') {
        if (Status st = Deliver(*reply, streams); !st.ok()) {
          process_.reset();  // out of step with it: a new one starts
          return Err(st);
        }
      } else if (streams.sink && (*reply)[0] == 'd') {
        uint32_t batch = 0;
        FrameReader r(std::string_view(*reply).substr(1));
        if (r.Get(batch) && batch == batch_) streams.returned = true;  // (an earlier batch's: forgotten)
      } else {
        return reply;  // the batch's answer
      }
      if (streams.returned && streams.open == 0) return reply;
      if (!streams.returned) {
        reply = process_->Receive(MsLeft(deadline), abandon_fd_, wake_fd_);
        continue;
      }
      // execute() has returned: the wait for the open requests is bounded without killing.
      int64_t wait = spec_->execute_timeout_ms > 0 ? MsLeft(deadline) : 0;
      if (all_cancelled) {
        const auto grace =
            *all_cancelled + std::chrono::milliseconds(kCancelGraceMs) - std::chrono::steady_clock::now();
        const int64_t grace_ms =
            std::max<int64_t>(1, std::chrono::duration_cast<std::chrono::milliseconds>(grace).count());
        wait = wait > 0 ? std::min(wait, grace_ms) : grace_ms;
      }
      reply = process_->Receive(wait, abandon_fd_, wake_fd_, /*kill_on_timeout=*/false);
    }
  }

  bool AllOpenCancelled(const Decoupled& streams) const {
    for (size_t i = 0; i < streams.closed.size(); ++i) {
      if (!streams.closed[i] && !streams.told[i]) return false;
    }
    return true;
  }

  // Fails a decoupled batch's open requests (their callers gone, or past execute_timeout_ms) and
  // has the process forget the batch (frame "Z": u32 the batch): its senders are closed, what they
  // sent meanwhile is dropped here (an earlier batch's frames). The process is not killed.
  Result<std::string> Forget(Decoupled& streams, bool cancelled) {
    const Status st =
        cancelled ? Cancelled(tag_ + ": the request's caller had gone, and the model did not close it within " +
                              std::to_string(kCancelGraceMs) + " ms")
                  : DeadlineExceeded(tag_ + ": the model did not close the request within " +
                                     std::to_string(spec_->execute_timeout_ms) + " ms (quern.execute_timeout_ms)");
    for (size_t i = 0; i < streams.closed.size(); ++i) {
      if (streams.closed[i]) continue;
      streams.closed[i] = true;
      streams.sink->Send(i, true, st, {}, true);
    }
    streams.open = 0;
    std::string frame = "Z";
    Put<uint32_t>(frame, batch_);
    QUERN_RETURN_IF_ERROR(process_->Send(frame));
    return std::string("d");
  }

  // Tells the process which open requests were cancelled since last time (frames "K": u32 the
  // request's index): pb_utils' request.is_cancelled() and its sender's turn true.
  Status SendCancellations(Decoupled& streams) {
    for (size_t i = 0; i < streams.closed.size(); ++i) {
      if (streams.closed[i] || streams.told[i] || !streams.sink->cancelled(i)) continue;
      streams.told[i] = true;
      std::string frame = "K";
      Put<uint32_t>(frame, static_cast<uint32_t>(i));
      QUERN_RETURN_IF_ERROR(process_->Send(frame));
    }
    return Status::Ok();
  }

  // One response of a decoupled model (frame "P"): u32 the batch (the process's count of them),
  // u32 the request's index, u8 flags (1: final),
  // u8 what it holds (0 nothing, 1 tensors, 2 an error), then u8 TritonError code, u32 message
  // length and the message, or u16 tensors and each tensor as a BLS call's are.
  Status Deliver(std::string_view frame, Decoupled& streams) {
    auto broken = [&](const std::string& what) {
      return Internal(tag_ + ": its Python process sent " + what + " (a decoupled response)");
    };
    FrameReader r(frame.substr(1));
    uint32_t batch = 0, index = 0;
    uint8_t flags = 0, kind = 0;
    if (!r.Get(batch) || !r.Get(index) || !r.Get(flags) || !r.Get(kind) || kind > 2) {
      return broken("a malformed frame");
    }
    if (batch != batch_) return Status::Ok();  // a batch it was told to forget: dropped
    if (index >= streams.closed.size()) return broken("a response to no request of the batch");
    if (streams.closed[index]) return broken("a response to a request it had closed");
    const bool final = (flags & 1) != 0;
    Status status;
    std::vector<NamedTensor> outputs;
    if (kind == 2) {
      uint8_t code = 0;
      uint32_t len = 0;
      std::string_view message;
      if (!r.Get(code) || !r.Get(len) || !r.Bytes(len, message)) return broken("a malformed error");
      status = FromTritonCode(code, tag_ + ": " + std::string(message));
    } else if (kind == 1) {
      uint16_t count = 0;
      if (!r.Get(count)) return broken("a malformed frame");
      for (uint16_t i = 0; i < count; ++i) {
        auto tensor = ReadFrameTensor(r);
        if (!tensor) return broken("a malformed tensor: " + tensor.error().message());
        outputs.push_back(std::move(*tensor));
      }
      status = CheckResponse(outputs);
      if (!status.ok()) outputs.clear();
    }
    if (final) {
      streams.closed[index] = true;
      --streams.open;
    }
    streams.sink->Send(index, kind != 0, std::move(status), std::move(outputs), final);
    return Status::Ok();
  }

  // A decoupled response's tensors against the configuration: outputs it names, in their types and
  // dims (the request's rows first, for a model that batches), BYTES well formed.
  Status CheckResponse(const std::vector<NamedTensor>& outputs) const {
    for (const NamedTensor& n : outputs) {
      const TensorConfig* oc = config_.FindOutput(n.name);
      const std::string where = tag_ + ": a response holds ";
      if (!oc) return Internal(where + "'" + n.name + "', which is not an output of the model");
      if (oc->dtype != n.tensor.dtype()) {
        return Internal(where + "output '" + n.name + "' as " + std::string(DataTypeName(n.tensor.dtype())) +
                        "; the configuration says " + std::string(DataTypeName(oc->dtype)));
      }
      Shape want = ModelDims(*oc);
      if (config_.max_batch_size > 0) want.insert(want.begin(), -1);
      const Shape& got = n.tensor.shape();
      bool fits = got.size() == want.size();
      for (size_t d = 0; fits && d < got.size(); ++d) fits = want[d] < 0 || want[d] == got[d];
      if (!fits) {
        return Internal(where + "output '" + n.name + "' of shape " + ShapeToString(got) + "; the configuration says " +
                        ShapeToString(want) + (config_.max_batch_size > 0 ? " (the request's rows first)" : ""));
      }
      if (Status st = n.tensor.Validate(); !st.ok())
        return Internal(where + "output '" + n.name + "': " + st.message());
    }
    return Status::Ok();
  }

  // What is left of the batch's execute_timeout_ms for Receive (0: no limit).
  int64_t MsLeft(std::chrono::steady_clock::time_point deadline) const {
    if (spec_->execute_timeout_ms <= 0) return 0;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    return std::max<int64_t>(1, left.count());
  }

  // One call to another model from the process (BLS, its frame "B"): run by the engine like any
  // request (batched with other callers, queued, counted in that model's statistics); the frame "b"
  // that answers it: u32 call, u64 the BLS slot's size, u8 failed, u8 TritonError code, u32 message
  // length, the message, then u16 outputs and each output as the request's tensors are. The
  // tensors both ways lie in the BLS slot (PythonProcess::kBlsSlot): the call's inputs as the
  // process wrote them, the answer's outputs written there once they are read.
  std::string CallModel(std::string_view frame, std::chrono::steady_clock::time_point deadline,
                        std::span<const std::string_view> callers) {
    FrameReader r(frame.substr(1));
    uint32_t call = 0;
    int64_t version = -1;
    uint64_t timeout_us = 0, slot_size = 0;
    uint8_t decoupled = 0;  // exec(decoupled=True): every response, as a list
    const bool head = r.Get(call) && r.Get(version) && r.Get(timeout_us) && r.Get(decoupled) && r.Get(slot_size);
    constexpr int kSlot = PythonProcess::kBlsSlot;
    auto answer = [&](Status st, const std::vector<NamedTensor>* outputs, size_t written = 0) {
      return CallAnswer(call, std::move(st), outputs, written);
    };
    InferRequest request;
    uint16_t len = 0, count = 0;
    uint32_t parameters_len = 0;
    std::string_view model, id, parameters;
    if (!head || !r.Get(len) || !r.Bytes(len, model) || !r.Get(len) || !r.Bytes(len, id) || !r.Get(parameters_len) ||
        !r.Bytes(parameters_len, parameters) || !r.Get(count)) {
      return answer(Internal(tag_ + ": a malformed call to another model (BLS)"), nullptr);
    }
    if (parameters.size() > kMaxRequestParametersBytes) {
      return answer(InvalidArgument(tag_ + ": BLS call to '" + std::string(model) + "': its parameters take " +
                                    std::to_string(parameters.size()) + " bytes; at most " +
                                    std::to_string(kMaxRequestParametersBytes)),
                    nullptr);
    }
    request.parameters = parameters;
    for (uint16_t i = 0; i < count; ++i) {
      std::string_view name;
      if (!r.Get(len) || !r.Bytes(len, name)) return answer(Internal(tag_ + ": a malformed BLS call"), nullptr);
      request.requested_outputs.emplace_back(name);
    }
    if (Status st = ReadCallInputs(r, model, slot_size, request); !st.ok()) return answer(st, nullptr);
    if (model == config_.name) {
      return answer(InvalidArgument("model '" + config_.name +
                                    "' called itself (BLS): its execute() would wait for its own instances"),
                    nullptr);
    }
    // The models whose runs wait for this one's (they called it, and so on up), and this one: a
    // call to any of them would wait for a run that waits for it (A calls B calls A).
    std::set<std::string, std::less<>> chain = {config_.name};
    for (std::string_view c : callers) {
      for (size_t at = 0; at < c.size();) {
        const size_t end = std::min(c.find('\n', at), c.size());
        if (end > at) chain.emplace(c.substr(at, end - at));
        at = end + 1;
      }
    }
    if (chain.contains(model)) {
      return answer(InvalidArgument("model '" + config_.name + "' called '" + std::string(model) +
                                    "', which is waiting for it already (a loop of calls): it would wait for itself"),
                    nullptr);
    }
    if (chain.size() > kMaxCallDepth) {
      return answer(InvalidArgument("model '" + config_.name + "': calls nested " + std::to_string(chain.size()) +
                                    " models deep; at most " + std::to_string(kMaxCallDepth)),
                    nullptr);
    }
    std::string chain_text;
    for (const std::string& c : chain) chain_text += (chain_text.empty() ? "" : "\n") + c;
    request.metadata.emplace_back("quern.callers", std::move(chain_text));
    if (!spec_->submit) return answer(Unavailable(tag_ + ": no engine serves its calls to other models"), nullptr);
    request.model = std::string(model);
    request.version = version;
    request.timeout_us = timeout_us;
    request.cancel = std::make_shared<CancellationToken>();
    if (!id.empty()) request.metadata.emplace_back("request_id", std::string(id));
    struct Pending {
      Mutex mu;
      CondVar cv;
      std::optional<InferResponse> response;
      std::vector<InferResponse> before;  // exec(decoupled=True): the responses before the last
      size_t bytes = 0;
    };
    auto pending = std::make_shared<Pending>();
    auto cancel = request.cancel;
    InferCallback done = [pending](InferResponse&& response) {
      MutexLock lock(pending->mu);
      pending->response = std::move(response);
      pending->cv.SignalAll();
    };
    if (decoupled) {
      // Kept until the last (the caller gets them together), at most kMaxBlsAnswerBytes in all: past
      // that the call is cancelled and fails.
      request.on_response = [pending, cancel](InferResponse&& response) {
        MutexLock lock(pending->mu);
        pending->bytes += 64 + response.status.message().size();  // a response's own bytes, roughly
        for (const NamedTensor& n : response.outputs) pending->bytes += 64 + n.name.size() + n.tensor.byte_size();
        if (pending->bytes > kMaxBlsAnswerBytes || pending->before.size() >= kMaxBlsResponses) {
          pending->bytes = std::max(pending->bytes, kMaxBlsAnswerBytes + 1);  // the call fails, said below
          cancel->Cancel();
          return;
        }
        pending->before.push_back(std::move(response));
      };
    }
    // This thread waits for the answer anyway: it is lent to a short batch (SubmitOptions::lend_thread:
    // a model whose runs are bounded by their inputs, ONNX Runtime's say, measured under a millisecond,
    // small inputs, an instance free), which then runs here without a hand-off to an engine thread and
    // back; anything longer keeps the wait below, with its timeout. (Not for exec(decoupled=True).)
    if (Status st = spec_->submit(std::move(request), done, SubmitOptions{.lend_thread = !decoupled}); !st.ok()) {
      return answer(st, nullptr);
    }
    const Clock& clock = RealClockInstance();
    MutexLock lock(pending->mu);
    while (!pending->response) {
      if (abandoned_.load(std::memory_order_acquire)) {
        cancel->Cancel();
        return answer(Unavailable("the server is stopping"), nullptr);
      }
      if (spec_->execute_timeout_ms > 0 && std::chrono::steady_clock::now() >= deadline) {
        cancel->Cancel();
        return answer(DeadlineExceeded("model '" + std::string(model) + "' did not answer within the caller's " +
                                       "quern.execute_timeout_ms"),
                      nullptr);
      }
      pending->cv.WaitUntil(lock, clock, clock.NowNs() + 50'000'000);  // a look at the stop and the timeout
    }
    size_t bytes = pending->bytes;
    for (const NamedTensor& n : pending->response->outputs) bytes += n.tensor.byte_size();
    if ((pending->response->status.ok() || decoupled) && bytes > kMaxBlsAnswerBytes) {
      return answer(ResourceExhausted("model '" + std::string(model) + "' answered more than a call takes (" +
                                      std::to_string(kMaxBlsAnswerBytes) + " bytes, " +
                                      std::to_string(kMaxBlsResponses) + " responses)"),
                    nullptr);
    }
    if (!decoupled) return answer(pending->response->status, &pending->response->outputs);
    pending->before.push_back(std::move(*pending->response));
    size_t bytes_in_slot = 1;
    for (const InferResponse& response : pending->before) {
      if (response.status.ok() && !response.final_only) bytes_in_slot += SlotBytes(response.outputs);
    }
    if (Status st = process_->Reserve(kSlot, bytes_in_slot); !st.ok()) return answer(st, nullptr);
    return PutResponses(answer(Status::Ok(), nullptr, bytes_in_slot), pending->before, process_->shm(kSlot));
  }

  // The frame "b" answering call `call` (CallModel's), its outputs written into the BLS slot;
  // `written`: the bytes of the slot the answer's outputs take (computed here when `outputs` are
  // given), for the process to map.
  std::string CallAnswer(uint32_t call, Status st, const std::vector<NamedTensor>* outputs, size_t written) {
    constexpr int kSlot = PythonProcess::kBlsSlot;
    size_t offset = 0;
    if (st.ok() && outputs) {
      written = SlotBytes(*outputs);
      st = process_->Reserve(kSlot, std::max<size_t>(written, 1));
    }
    std::string out = "b";
    Put<uint32_t>(out, call);
    Put<uint64_t>(out, st.ok() ? written : 0);
    Put<uint8_t>(out, st.ok() ? 0 : 1);
    Put<uint8_t>(out, ToTritonCode(st.code()));
    const std::string message = st.ok() ? std::string() : st.message().substr(0, 65536);
    Put<uint32_t>(out, static_cast<uint32_t>(message.size()));
    out += message;
    if (st.ok() && outputs) {
      Put<uint16_t>(out, static_cast<uint16_t>(outputs->size()));
      for (const NamedTensor& n : *outputs) PutSlotTensor(out, n, process_->shm(kSlot), offset);
    }
    return out;
  }

  // A call's inputs (u16 count, then each tensor) into `request`, their bytes from the BLS slot,
  // where they take the first `slot_size` bytes, one after another.
  Status ReadCallInputs(FrameReader& r, std::string_view model, uint64_t slot_size, InferRequest& request) {
    constexpr int kSlot = PythonProcess::kBlsSlot;
    uint16_t count = 0;
    if (!r.Get(count)) return Internal(tag_ + ": a malformed BLS call");
    if (slot_size > kMaxBlsAnswerBytes) {
      return InvalidArgument(tag_ + ": BLS call to '" + std::string(model) + "': its inputs take " +
                             std::to_string(slot_size) + " bytes of shared memory; at most " +
                             std::to_string(kMaxBlsAnswerBytes));
    }
    QUERN_RETURN_IF_ERROR(process_->Remap(kSlot, std::max<uint64_t>(slot_size, 1)));
    SlotInputs slot{process_->shm(kSlot), static_cast<size_t>(slot_size), 0};
    for (uint16_t i = 0; i < count; ++i) {
      auto tensor = ReadFrameTensor(r, &slot);
      if (!tensor) {
        return InvalidArgument(tag_ + ": BLS call to '" + std::string(model) + "': " + tensor.error().message());
      }
      request.inputs.push_back(std::move(*tensor));
    }
    return Status::Ok();
  }

  // After the head of a call's answer, exec(decoupled=True)'s responses as the stub reads them: u32
  // responses, each u8 final, u8 what it holds (0 nothing, 1 tensors, 2 an error: u8 code, u32
  // length, the message).
  static std::string PutResponses(std::string out, const std::vector<InferResponse>& responses, std::byte* shm) {
    size_t offset = 0;
    Put<uint32_t>(out, static_cast<uint32_t>(responses.size()));
    for (size_t i = 0; i < responses.size(); ++i) {
      const InferResponse& response = responses[i];
      Put<uint8_t>(out, i + 1 == responses.size() ? 1 : 0);
      if (!response.status.ok()) {
        const std::string message = response.status.message().substr(0, 65536);
        Put<uint8_t>(out, 2);
        Put<uint8_t>(out, ToTritonCode(response.status.code()));
        Put<uint32_t>(out, static_cast<uint32_t>(message.size()));
        out += message;
      } else if (response.final_only) {
        Put<uint8_t>(out, 0);
      } else {
        Put<uint8_t>(out, 1);
        Put<uint16_t>(out, static_cast<uint16_t>(response.outputs.size()));
        for (const NamedTensor& n : response.outputs) PutSlotTensor(out, n, shm, offset);
      }
    }
    return out;
  }

  PythonLaunch Launch() const {
    rapidjson::StringBuffer sb;
    rapidjson::Writer<rapidjson::StringBuffer> w(sb);
    w.StartObject();
    w.Key("model_name");
    w.String(config_.name.c_str());
    w.Key("model_file");
    w.String(spec_->model_file.c_str());
    w.Key("version_dir");
    w.String(spec_->version_dir.c_str());
    w.Key("max_batch_size");
    w.Int(config_.max_batch_size);
    w.Key("decoupled");
    w.Bool(config_.decoupled);
    w.Key("server_pid");
    w.Int64(::getpid());
    w.Key("max_memory_mb");
    w.Int64(device_.gpu && !spec_->max_memory_given ? 0 : spec_->max_memory_mb);
    w.Key("inputs");
    WriteTensorList(w, config_.inputs);
    w.Key("outputs");
    WriteTensorList(w, config_.outputs);
    // initialize(args) as Triton passes it.
    w.Key("args");
    w.StartObject();
    const std::pair<const char*, std::string> args[] = {
        {"model_config", spec_->config_json},
        {"model_instance_kind", device_.gpu ? "GPU" : "CPU"},
        {"model_instance_name", config_.name + "_" + std::to_string(instance_)},
        {"model_instance_device_id", std::to_string(device_.gpu ? device_.device : 0)},
        {"model_repository", spec_->model_dir.string()},
        {"model_version", spec_->version},
        {"model_name", config_.name},
    };
    for (const auto& [k, v] : args) {
      w.Key(k);
      w.String(v.c_str(), static_cast<rapidjson::SizeType>(v.size()));
    }
    w.EndObject();
    w.EndObject();
    PythonLaunch launch;
    launch.model_name = config_.name;
    launch.instance = instance_;
    launch.python = spec_->python;
    launch.launch_json = sb.GetString();
    launch.start_timeout_ms = spec_->initialize_timeout_ms > 0 ? spec_->initialize_timeout_ms : 86400000LL * 365;
    return launch;
  }

  // Whether this batch's round trip stays on one core (see kSameCoreBelowNs).
  bool SameCore() {
    if (!spec_->same_core || round_trips_ < kSameCoreAfterBatches) return false;
    const auto below = static_cast<double>(spec_->same_core_below_ns);
    same_core_ = round_trip_ns_ < (same_core_ ? 2 * below : below);
    return same_core_;
  }

  void Measure(std::chrono::steady_clock::duration took) {
    const double ns = static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(took).count());
    round_trip_ns_ = round_trips_ == 0 ? ns : round_trip_ns_ + (ns - round_trip_ns_) / 8;
    ++round_trips_;
  }

  // A process that died is started again before the next batch; one that
  // fails to start is not tried again for a second (batches fail at once
  // meanwhile, with the reason).
  Status EnsureProcess() {
    if (process_ && !broken_ && !process_->finished()) return Status::Ok();
    process_.reset();
    broken_ = false;
    const auto now = std::chrono::steady_clock::now();
    if (crashes_in_a_row_ >= kCrashesBeforeBackoff) {
      const auto pause = std::min<std::chrono::steady_clock::duration>(
          kMaxCrashBackoff,
          std::chrono::seconds(1) * (int64_t{1} << std::min(crashes_in_a_row_ - kCrashesBeforeBackoff, 5)));
      if (now - last_crash_ < pause) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(pause - (now - last_crash_)).count();
        return Unavailable(tag_ + ": its Python process died running " + std::to_string(crashes_in_a_row_) +
                           " batches in a row; it starts again in " + std::to_string(left) + " ms");
      }
    }
    if (!last_start_error_.empty() && now - last_start_failure_ < kRestartBackoff) {
      return Unavailable(tag_ + ": its Python process is restarting; the last start failed: " + last_start_error_);
    }
    auto p = PythonProcess::Start(Launch());
    if (!p) {
      last_start_failure_ = now;
      last_start_error_ = p.error().message();
      Log(LogLevel::kError, tag_ + ": the Python process could not be started again: " + last_start_error_,
          {{"model", config_.name}});
      return Unavailable(last_start_error_);
    }
    last_start_error_.clear();
    Log(LogLevel::kWarning, tag_ + ": Python process started again (pid " + std::to_string((*p)->pid()) + ")",
        {{"model", config_.name}});
    process_ = std::move(*p);
    batch_ = 0;
    return Status::Ok();
  }

  // A reply the process sent; anything malformed fails the batch and ends
  // the process (it is started again).
  Status ReadReply(std::string_view reply, int slot, int64_t batch_size, BatchRequests requests,
                   std::vector<NamedTensor>& outputs) QUERN_REQUIRES(run_mu_) {
    if (reply.size() >= 2 && reply[0] == 'X') {
      return FromTritonCode(static_cast<uint8_t>(reply[1]), tag_ + ": " + std::string(reply.substr(2)));
    }
    Status st = ReadOutputs(reply, slot, batch_size, requests, outputs);
    if (!st.ok()) {
      outputs.clear();
      process_.reset();
    }
    return st;
  }

  // Outputs borrow the slot's bytes while another slot stays free for the
  // next batch; otherwise they are copied out.
  Status ReadOutputs(std::string_view reply, int slot, int64_t batch_size, BatchRequests requests,
                     std::vector<NamedTensor>& outputs) QUERN_REQUIRES(run_mu_) {
    auto broken = [&](const std::string& what) { return Internal(tag_ + ": its Python process sent " + what); };
    if (reply.empty() || reply[0] != 'D') return broken("an unknown reply");
    FrameReader r(reply.substr(1));
    uint64_t shm_size = 0;
    uint32_t failed = 0;
    if (!r.Get(shm_size) || !r.Get(failed) || failed > requests.rows.size()) return broken("a malformed reply");
    for (uint32_t k = 0; k < failed; ++k) {
      uint32_t index = 0, len = 0;
      uint8_t code = 0;
      std::string_view message;
      if (!r.Get(index) || !r.Get(code) || !r.Get(len) || !r.Bytes(len, message) || index >= requests.rows.size()) {
        return broken("a malformed reply");
      }
      requests.status[index] = FromTritonCode(code, tag_ + ": " + std::string(message));
    }
    QUERN_RETURN_IF_ERROR(process_->Remap(slot, shm_size));
    const size_t mapped = process_->shm_size(slot);
    std::byte* shm = process_->shm(slot);
    std::shared_ptr<const void> owner;
    if (process_->FreeSlotsBesides(slot) > 0) owner = process_->Borrow(slot);
    uint32_t count = 0;
    if (!r.Get(count) || count != config_.outputs.size()) return broken("a reply without every output");
    const bool batched = config_.max_batch_size > 0;
    outputs.reserve(count);
    for (const TensorConfig& oc : config_.outputs) {
      uint16_t name_len = 0;
      uint8_t dtype = 0, rank = 0;
      std::string_view name;
      uint64_t offset = 0, nbytes = 0;
      if (!r.Get(name_len) || !r.Get(dtype) || !r.Get(rank) || !r.Bytes(name_len, name)) {
        return broken("a malformed reply");
      }
      Shape shape(rank);
      for (auto& d : shape) {
        if (!r.Get(d)) return broken("a malformed reply");
      }
      if (!r.Get(offset) || !r.Get(nbytes)) return broken("a malformed reply");
      const Shape& dims = ModelDims(oc);
      const size_t element = DataTypeByteSize(oc.dtype);
      bool fits = name == oc.name && dtype == static_cast<uint8_t>(oc.dtype) &&
                  shape.size() == dims.size() + (batched ? 1 : 0) && (!batched || shape[0] == batch_size);
      for (size_t i = 0; fits && i < dims.size(); ++i) {
        const int64_t got = shape[i + (batched ? 1 : 0)];
        fits = got >= 0 && (dims[i] < 0 || got == dims[i]);
      }
      if (!fits) {
        return broken("output '" + std::string(name.substr(0, 256)) + "' as " + ShapeToString(shape) +
                      " where the configuration expects '" + oc.name + "'");
      }
      if (offset > mapped || nbytes > mapped - offset || (element && offset % element)) {
        return broken("output '" + oc.name + "' outside the shared memory");
      }
      NoteSlotUse(slot, offset + nbytes);
      if (element && ByteCount(shape, element) != static_cast<int64_t>(nbytes)) {
        return broken("output '" + oc.name + "' of " + std::to_string(nbytes) + " bytes for shape " +
                      ShapeToString(shape));
      }
      Tensor t;
      if (owner) {
        t = Tensor::Borrow(oc.dtype, shape, shm + offset, nbytes, owner);
      } else {
        t = Tensor::AllocateUninitialized(oc.dtype, shape, nbytes);
        if (nbytes) std::memcpy(t.mutable_data(), shm + offset, nbytes);
      }
      if (!element) QUERN_RETURN_IF_ERROR(t.Validate());
      outputs.push_back({oc.name, std::move(t)});
    }
    return Status::Ok();
  }

  const ModelConfig config_;
  const std::shared_ptr<const PythonModelSpec> spec_;
  const int instance_;
  const InstanceDevice device_;  // told to the model, which places its own work
  const std::string tag_;
  // Held by a batch (and Load) while it uses the process; a scrape takes it only when free.
  Mutex run_mu_;
  std::unique_ptr<PythonProcess> process_;
  bool broken_ = false;  // out of step with this side (seen between batches): replaced before the next
  // Abandon(): read by Execute, and the eventfd its wait polls.
  std::atomic<bool> abandoned_{false};
  const int abandon_fd_;
  const int wake_fd_;   // decoupled models: written when a request of the running batch is cancelled
  uint32_t batch_ = 0;  // batches sent to the process now running (it counts them too)
  std::chrono::steady_clock::time_point last_start_failure_;
  std::string last_start_error_;
  int crashes_in_a_row_ = 0;  // batches whose process died, since the last one answered
  std::chrono::steady_clock::time_point last_crash_;
  // The round trips' moving average, how many were measured, and whether
  // they stay on one core now (SameCore).
  std::set<std::string> metric_errors_logged_;  // refusals of the model's metrics, each logged once
  double round_trip_ns_ = 0;
  int64_t round_trips_ = 0;
  bool same_core_ = false;
  // Bytes of each slot the batches since the last look (GiveBackUnusedShm) used, and whether a
  // look that found a batch running is due before the next one.
  std::array<size_t, PythonProcess::kSlots> slot_need_ QUERN_GUARDED_BY(run_mu_){};
  std::atomic<bool> shm_look_due_{false};
};

class PythonOpenedModel final : public OpenedModel {
 public:
  explicit PythonOpenedModel(std::shared_ptr<const PythonModelSpec> spec) : spec_(std::move(spec)) {}

  Result<std::unique_ptr<Model>> NewInstance(const ModelConfig& config, const InstanceDevice& device) override {
    auto model = std::make_unique<PythonModel>(config, spec_, next_instance_++, device);
    QUERN_RETURN_IF_ERROR(model->Load());
    return std::unique_ptr<Model>(std::move(model));
  }

 private:
  std::shared_ptr<const PythonModelSpec> spec_;
  int next_instance_ = 0;
};

// Whether model.py defines auto_complete_config: a line "def auto_complete_config" (indented, as a
// method), not a mention in a comment or a string. (The process asked to run it answers the
// configuration unchanged when it is no TritonPythonModel method after all.)
bool DefinesAutoComplete(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::string text(size_t{4} << 20, '\0');  // a model.py is far smaller; beyond 4 MiB is not looked at
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  const std::string_view def = "def auto_complete_config";
  for (size_t at = text.find(def); at != std::string::npos; at = text.find(def, at + 1)) {
    size_t line = at;
    while (line > 0 && (text[line - 1] == ' ' || text[line - 1] == '\t')) --line;
    if (line == 0 || text[line - 1] == '\n') return true;
  }
  return false;
}

// Triton's auto-complete: the model's TritonPythonModel.auto_complete_config(config) runs in a process
// of its own (nothing else of the model runs there) and completes `config` with the inputs,
// outputs, max_batch_size and dynamic batching it sets.
Status AutoComplete(ModelConfig& config, const PythonModelSpec& spec) {
  const std::string who = "model '" + config.name + "'";
  QUERN_ASSIGN_OR_RETURN(const std::string given, ToTritonJson(config));
  rapidjson::StringBuffer sb;
  rapidjson::Writer<rapidjson::StringBuffer> w(sb);
  w.StartObject();
  const std::pair<const char*, std::string> fields[] = {
      {"mode", "auto_complete"},
      {"model_name", config.name},
      {"model_file", spec.model_file.string()},
      {"version_dir", spec.version_dir.string()},
      {"model_config", given},
  };
  for (const auto& [k, v] : fields) {
    w.Key(k);
    w.String(v.c_str(), static_cast<rapidjson::SizeType>(v.size()));
  }
  w.Key("server_pid");
  w.Int64(::getpid());
  w.Key("max_memory_mb");
  w.Int64(spec.max_memory_mb);
  w.EndObject();
  PythonLaunch launch;
  launch.model_name = config.name;
  launch.python = spec.python;
  launch.launch_json = sb.GetString();
  launch.start_timeout_ms = spec.initialize_timeout_ms > 0 ? spec.initialize_timeout_ms : 86400000LL * 365;
  auto process = PythonProcess::Start(launch);
  if (!process) {
    return Status(process.error().code(), who + ": auto_complete_config: " + process.error().message());
  }
  auto answer = (*process)->Receive(launch.start_timeout_ms);
  if (!answer) return Status(answer.error().code(), who + ": auto_complete_config: " + answer.error().message());
  if (answer->empty() || (*answer)[0] != 'A') {
    return Internal(who + ": its Python process answered auto_complete_config with an unknown frame");
  }
  QUERN_ASSIGN_OR_RETURN(const inference::ModelConfig proto,
                         ParseModelConfigJson(std::string_view(*answer).substr(1),
                                              who + ": the configuration auto_complete_config returned"));
  QUERN_ASSIGN_OR_RETURN(ModelConfig completed,
                         ConvertModelConfig(proto, who + ": the configuration auto_complete_config returned"));
  config.inputs = std::move(completed.inputs);
  config.outputs = std::move(completed.outputs);
  config.max_batch_size = completed.max_batch_size;
  if (completed.batching) config.batching = std::move(completed.batching);
  config.decoupled = completed.decoupled;  // set_model_transaction_policy
  return Status::Ok();
}

class PythonBackend final : public Backend {
 public:
  void SetServices(const ModelServices& services) override { services_ = services; }

  Result<std::unique_ptr<OpenedModel>> Open(ModelConfig& config, const std::filesystem::path& file,
                                            bool has_config_file, int /*cores*/, int /*instances*/) override {
    const std::string who = "model '" + config.name + "'";
    std::error_code ec;
    if (!std::filesystem::is_regular_file(file, ec)) {
      return Err(NotFound(who + ": " + file.string() + " does not exist (a Python model's code is <version>/" +
                          file.filename().string() + ")"));
    }
    if (config.parameters.count("EXECUTION_ENV_PATH")) {
      return Err(InvalidArgument(who + ": parameter EXECUTION_ENV_PATH (a packed environment) is not supported; " +
                                 "name a virtual environment or an interpreter with parameter quern.python"));
    }
    auto spec = std::make_shared<PythonModelSpec>();
    spec->submit = services_.submit;
    std::call_once(shm_release_once_,
                   [this] { shm_release_ = std::make_shared<IdleRelease>(RealClockInstance(), kShmIdleNs); });
    spec->shm_release = shm_release_;
    spec->model_file = file;
    spec->version_dir = file.parent_path();
    spec->model_dir = spec->version_dir.parent_path();
    spec->version = spec->version_dir.filename().string();
    auto python = config.parameters.find("quern.python");
    QUERN_ASSIGN_OR_RETURN(
        spec->python, ResolvePythonInterpreter(python == config.parameters.end() ? "" : python->second, spec->model_dir,
                                               config.name));
    QUERN_ASSIGN_OR_RETURN(spec->execute_timeout_ms,
                           MillisecondsParameter(config, "quern.execute_timeout_ms", kDefaultExecuteTimeoutMs));
    QUERN_ASSIGN_OR_RETURN(spec->initialize_timeout_ms,
                           MillisecondsParameter(config, "quern.initialize_timeout_ms", kDefaultInitializeTimeoutMs));
    // By default half of the machine's memory (at least 4 GiB): a model
    // that asks for more fails its batch instead of taking the host.
    spec->max_memory_mb = DefaultPythonMemoryMb();
    if (auto it = config.parameters.find("quern.python.max_memory_mb"); it != config.parameters.end()) {
      int64_t mb = 0;
      const std::string& v = it->second;
      const auto parsed = std::from_chars(v.data(), v.data() + v.size(), mb);
      if (parsed.ec != std::errc() || parsed.ptr != v.data() + v.size() || (mb != 0 && mb < 64) ||
          mb > (int64_t{1} << 24)) {
        return Err(InvalidArgument(who +
                                   ": parameter quern.python.max_memory_mb must be mebibytes of address space in "
                                   "[64, 16777216], or 0 for no bound, got \"" +
                                   v + "\""));
      }
      spec->max_memory_mb = mb;
      spec->max_memory_given = true;
    }
    if (auto it = config.parameters.find("quern.same_core"); it != config.parameters.end()) {
      if (it->second == "on" || it->second == "true") {
        spec->same_core = true;
      } else if (it->second == "off" || it->second == "false") {
        spec->same_core = false;
      } else {
        return Err(
            InvalidArgument(who + ": parameter quern.same_core must be \"on\" or \"off\", got \"" + it->second + "\""));
      }
    }
    if (auto it = config.parameters.find("quern.same_core_below_us"); it != config.parameters.end()) {
      int64_t us = 0;
      const std::string& v = it->second;
      const auto parsed = std::from_chars(v.data(), v.data() + v.size(), us);
      if (parsed.ec != std::errc() || parsed.ptr != v.data() + v.size() || us < 1 || us > 10'000'000) {
        return Err(InvalidArgument(who +
                                   ": parameter quern.same_core_below_us must be microseconds in [1, 10000000], "
                                   "got \"" +
                                   v + "\""));
      }
      spec->same_core_below_ns = us * 1000;
    }
    // As Triton does: a model's auto_complete_config completes its configuration, with or without
    // config.pbtxt (without one, it is asked however model.py defines it, a base class included).
    if (!has_config_file || DefinesAutoComplete(file)) QUERN_RETURN_IF_ERROR(AutoComplete(config, *spec));
    if (config.inputs.empty() || config.outputs.empty()) {
      return Err(
          InvalidArgument(who + (has_config_file ? ": a Python model's configuration must list its inputs and "
                                                   "outputs, or its TritonPythonModel.auto_complete_config add them"
                                                 : ": a Python model without config.pbtxt needs "
                                                   "TritonPythonModel.auto_complete_config to name its inputs and "
                                                   "outputs")));
    }
    for (const auto* list : {&config.inputs, &config.outputs}) {
      for (const auto& t : *list) {
        if (t.dtype == DataType::kBf16 || t.dtype == DataType::kInvalid) {
          return Err(InvalidArgument(who + ": tensor '" + t.name + "' has type " + std::string(DataTypeName(t.dtype)) +
                                     ", which numpy (and so a Python model) " + "does not have"));
        }
      }
    }
    QUERN_ASSIGN_OR_RETURN(spec->config_json, ToTritonJson(config));
    return std::unique_ptr<OpenedModel>(std::make_unique<PythonOpenedModel>(std::move(spec)));
  }

  // The model is told its device (args model_instance_kind and
  // model_instance_device_id, as Triton does) and places its work itself.
  std::string WhyNoGpu() const override { return ""; }

 private:
  ModelServices services_;
  // Shared by the models it opens (each holds it through its spec): what their slots' last
  // batches did not use goes back after kShmIdleNs, as the engine's kept run memory does. Made
  // (its thread started) by the first Open.
  static constexpr int64_t kShmIdleNs = 5'000'000'000;
  std::once_flag shm_release_once_;
  std::shared_ptr<IdleRelease> shm_release_;
};

}  // namespace

std::shared_ptr<Backend> NewPythonBackend() {
  return std::make_shared<PythonBackend>();
}

}  // namespace quern
