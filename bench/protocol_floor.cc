// The floor under a server's CPU per request: a server that does the least a
// KServe v2 server can do on this machine and answers every infer request
// with the same canned response, computing nothing. Over HTTP: one thread,
// epoll, non-blocking sockets; a request is read up to the end of its body
// (Content-Length) and answered with one send (a binary-tensor response of
// the model's output shape, zeros). Over gRPC: the same libgrpc++ and callback
// API as `quern serve`, ModelInfer and ModelStreamInfer answered with a
// prepared response. `quern perf` measures it exactly as it measures a
// server; what a real server costs beyond it is its own work (parsing, the
// engine, batching, the model).
//
//   protocol_floor --http-port 18600 --grpc-port 18601 --model identity
//                  --input x:FP32:-1,4 --output y:FP32:-1,4
//
// With --http-model FILE and --http-batch N, the HTTP floor also runs the
// model: each held request's input (the body's last bytes, one item) is
// copied into a batch buffer, and before the N answers go out the batch runs
// through ONNX Runtime (one thread, as one instance of `quern serve` on one
// core runs it). That is the least a batching server does with the model:
// receive, gather, run, answer; what `quern serve` costs beyond it is its own
// work, with no need to subtract a compute time measured some other way.
//
// Prints nothing while it serves; its CPU time is read from /proc by the
// script that runs it (bench/request_cost.sh).
#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <onnxruntime_cxx_api.h>
#include <onnxruntime_session_options_config_keys.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "grpc_service.grpc.pb.h"

namespace {

struct TensorSpec {
  std::string name;
  std::string datatype;
  std::vector<int64_t> shape;  // -1 = open (1 in responses)
};

TensorSpec ParseSpec(const std::string& s) {
  TensorSpec t;
  const auto a = s.find(':');
  const auto b = s.find(':', a + 1);
  if (a == std::string::npos || b == std::string::npos) {
    std::fprintf(stderr, "bad tensor spec '%s' (NAME:DTYPE:D,D,...)\n", s.c_str());
    std::exit(2);
  }
  t.name = s.substr(0, a);
  t.datatype = s.substr(a + 1, b - a - 1);
  std::stringstream dims(s.substr(b + 1));
  for (std::string d; std::getline(dims, d, ',');) t.shape.push_back(std::stoll(d));
  return t;
}

int64_t ElementBytes(const std::string& dt) {
  if (dt == "FP64" || dt == "INT64" || dt == "UINT64") return 8;
  if (dt == "FP16" || dt == "INT16" || dt == "UINT16" || dt == "BF16") return 2;
  if (dt == "INT8" || dt == "UINT8" || dt == "BOOL") return 1;
  return 4;
}

int64_t Bytes(const TensorSpec& t) {
  int64_t n = ElementBytes(t.datatype);
  for (const int64_t d : t.shape) n *= std::max<int64_t>(d, 1);
  return n;
}

std::string ShapeJson(const TensorSpec& t, bool open_as_one) {
  std::string s = "[";
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(open_as_one ? std::max<int64_t>(t.shape[i], 1) : t.shape[i]);
  }
  return s + "]";
}

std::string HttpResponse(const std::string& content_type, const std::string& body, size_t json_size) {
  std::string r = "HTTP/1.1 200 OK\r\nServer: floor\r\nContent-Type: " + content_type + "\r\n";
  if (json_size) r += "Inference-Header-Content-Length: " + std::to_string(json_size) + "\r\n";
  r += "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n";
  return r + body;
}

// ---- HTTP: one epoll thread ----

struct Conn {
  std::string in;
};

bool IEquals(const char* a, const char* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  }
  return true;
}

// The length of the first complete request in `in` (head and body), or 0.
size_t CompleteRequest(const std::string& in) {
  const size_t end = in.find("\r\n\r\n");
  if (end == std::string::npos) return 0;
  size_t length = 0;
  static constexpr char kName[] = "\r\ncontent-length:";
  const size_t name_len = sizeof kName - 1;
  for (size_t i = 0; i + name_len <= end + 2; ++i) {
    if (in[i] == '\r' && IEquals(in.data() + i, kName, name_len)) {
      length = std::strtoull(in.c_str() + i + name_len, nullptr, 10);
      break;
    }
  }
  const size_t total = end + 4 + length;
  return in.size() >= total ? total : 0;
}

[[noreturn]] void Die(const char* what) {
  std::perror(what);
  std::exit(1);
}

// Sends `out` whole on `fd`; false when the connection failed.
bool SendAll(int fd, const std::string& out) {
  size_t sent = 0;
  while (sent < out.size()) {
    const ssize_t w = ::send(fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
    if (w <= 0) return false;
    sent += static_cast<size_t>(w);
  }
  return true;
}

// --http-model: a batch of held requests runs through the model before it
// is answered. One FP32 input; its items are the last bytes of each body.
class BatchModel {
 public:
  // Session and memory as `quern serve` sets them for one instance on one
  // core: one intra-op thread, sequential, the environment's shared CPU
  // arena, inputs in 64-byte aligned memory.
  BatchModel(const std::string& file, const TensorSpec& input, int max_batch)
      // No telemetry (read when the environment is created; see ort_model.cc).
      : env_((setenv("ORT_DISABLE_TELEMETRY", "1", 0), ORT_LOGGING_LEVEL_WARNING), "protocol_floor") {
    if (input.datatype != "FP32" || input.shape.empty() || input.shape[0] != -1) {
      std::fprintf(stderr, "--http-model needs one FP32 input with an open batch dimension\n");
      std::exit(2);
    }
    env_.DisableTelemetryEvents();
    Ort::ArenaCfg arena(0, -1, -1, -1);
    env_.CreateAndRegisterAllocator(Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault), arena);
    Ort::SessionOptions so;
    so.SetIntraOpNumThreads(1);
    so.SetInterOpNumThreads(1);
    so.SetExecutionMode(ORT_SEQUENTIAL);
    so.AddConfigEntry(kOrtSessionOptionsConfigUseEnvAllocators, "1");
    so.AddConfigEntry(kOrtSessionOptionsConfigAllowIntraOpSpinning, "0");
    so.AddConfigEntry(kOrtSessionOptionsConfigAllowInterOpSpinning, "0");
    session_ = std::make_unique<Ort::Session>(env_, file.c_str(), so);
    input_name_ = input.name;
    shape_ = input.shape;
    item_bytes_ = static_cast<size_t>(Bytes(input));
    Ort::AllocatorWithDefaultOptions alloc;
    for (size_t i = 0; i < session_->GetOutputCount(); ++i) {
      output_names_.push_back(session_->GetOutputNameAllocated(i, alloc).get());
    }
    for (const auto& n : output_names_) output_ptrs_.push_back(n.c_str());
    batch_.reset(
        static_cast<char*>(std::aligned_alloc(64, (item_bytes_ * static_cast<size_t>(max_batch) + 63) / 64 * 64)));
    batch_bytes_ = item_bytes_ * static_cast<size_t>(max_batch);
  }

  // Copies the item at the end of `body` into row `row` of the batch.
  void Hold(int row, std::string_view body) {
    if (body.size() < item_bytes_ || static_cast<size_t>(row + 1) * item_bytes_ > batch_bytes_) return;
    std::memcpy(batch_.get() + static_cast<size_t>(row) * item_bytes_, body.data() + body.size() - item_bytes_,
                item_bytes_);
  }

  // Runs the first `rows` rows (outputs discarded: the answers are canned).
  void Run(int rows) {
    if (rows <= 0) return;
    shape_[0] = rows;
    auto mem = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
    Ort::Value in = Ort::Value::CreateTensor<float>(mem, reinterpret_cast<float*>(batch_.get()),
                                                    static_cast<size_t>(rows) * item_bytes_ / sizeof(float),
                                                    shape_.data(), shape_.size());
    const char* in_name = input_name_.c_str();
    auto out = session_->Run(Ort::RunOptions{nullptr}, &in_name, &in, 1, output_ptrs_.data(), output_ptrs_.size());
    (void)out;
  }

 private:
  Ort::Env env_;
  std::unique_ptr<Ort::Session> session_;
  std::string input_name_;
  std::vector<int64_t> shape_;
  size_t item_bytes_ = 0;
  std::vector<std::string> output_names_;
  std::vector<const char*> output_ptrs_;
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char[], Free> batch_;
  size_t batch_bytes_ = 0;
};

// `batch` > 1: infer requests are answered `batch` at a time (when no
// request comes for 1 ms, those held are answered anyway), the pattern in
// which a batching server answers: its clients wait, asleep, for a batch
// instead of getting each answer at once. With `model`, the held requests'
// batch runs through it first.
void ServeHttp(int port, const std::string& metadata_response, const std::string& infer_response, int batch,
               BatchModel* model) {
  const int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  const int one = 1;
  ::setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) Die("bind");
  if (::listen(lfd, 1024) != 0) Die("listen");
  const int ep = ::epoll_create1(0);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = lfd;
  ::epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
  std::unordered_map<int, Conn> conns;
  constexpr size_t kReadChunk = 1 << 16;
  epoll_event events[64];
  std::vector<int> held;  // connections with an infer request waiting for its batch (one each, in order)
  const auto answer_held = [&] {
    if (model) model->Run(static_cast<int>(held.size()));
    for (const int fd : held) {
      if (conns.count(fd) && !SendAll(fd, infer_response)) {
        ::close(fd);
        conns.erase(fd);
      }
    }
    held.clear();
  };
  while (true) {
    const int n = ::epoll_wait(ep, events, 64, held.empty() ? -1 : 1);
    if (n == 0) answer_held();
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == lfd) {
        while (true) {
          const int c = ::accept4(lfd, nullptr, nullptr, SOCK_NONBLOCK);
          if (c < 0) break;
          ::setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          epoll_event cev{};
          cev.events = EPOLLIN;
          cev.data.fd = c;
          ::epoll_ctl(ep, EPOLL_CTL_ADD, c, &cev);
          conns[c];
        }
        continue;
      }
      Conn& conn = conns[fd];
      bool closed = false;
      while (true) {
        // Received straight into the connection's buffer: the kernel's copy
        // is the only one (the model floor's gather reads from there).
        ssize_t r = 0;
        const size_t had = conn.in.size();
        conn.in.resize_and_overwrite(had + kReadChunk, [&](char* p, size_t) {
          r = ::recv(fd, p + had, kReadChunk, 0);
          return had + static_cast<size_t>(std::max<ssize_t>(r, 0));
        });
        if (r > 0) {
          if (static_cast<size_t>(r) < kReadChunk) break;
        } else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
          closed = true;
          break;
        } else if (errno == EAGAIN) {
          break;
        }
      }
      // Answer every complete request (one send each; a client that does
      // not read its answers is not this benchmark's concern).
      while (!closed) {
        const size_t len = CompleteRequest(conn.in);
        if (len == 0) break;
        const bool infer = conn.in.compare(0, 4, "GET ") != 0;
        if (infer && batch > 1 && model)
          model->Hold(static_cast<int>(held.size()), std::string_view(conn.in).substr(0, len));
        conn.in.erase(0, len);
        if (infer && batch > 1) {
          held.push_back(fd);
          if (static_cast<int>(held.size()) >= batch) answer_held();
          continue;
        }
        closed = !SendAll(fd, infer ? infer_response : metadata_response);
      }
      if (closed) {
        std::erase(held, fd);
        ::close(fd);
        conns.erase(fd);
      }
    }
  }
}

// ---- gRPC: the callback API, as quern serve uses it ----

class FloorService final : public inference::GRPCInferenceService::WithCallbackMethod_ModelMetadata<
                               inference::GRPCInferenceService::WithCallbackMethod_ModelInfer<
                                   inference::GRPCInferenceService::WithCallbackMethod_ModelStreamInfer<
                                       inference::GRPCInferenceService::Service>>> {
 public:
  FloorService(inference::ModelMetadataResponse metadata, inference::ModelInferResponse infer)
      : metadata_(std::move(metadata)), infer_(std::move(infer)) {
    stream_answer_.mutable_infer_response()->CopyFrom(infer_);
  }

  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* ctx, const inference::ModelMetadataRequest*,
                                          inference::ModelMetadataResponse* out) override {
    *out = metadata_;
    auto* r = ctx->DefaultReactor();
    r->Finish(grpc::Status::OK);
    return r;
  }

  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* ctx, const inference::ModelInferRequest* in,
                                       inference::ModelInferResponse* out) override {
    *out = infer_;
    out->set_id(in->id());
    auto* r = ctx->DefaultReactor();
    r->Finish(grpc::Status::OK);
    return r;
  }

  grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse>* ModelStreamInfer(
      grpc::CallbackServerContext*) override {
    class Stream final
        : public grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse> {
     public:
      explicit Stream(const inference::ModelStreamInferResponse& answer) : answer_(answer) { StartRead(&request_); }
      // Answers each request as it is read, carrying its id (quern perf
      // matches answers by id when several are in flight).
      void OnReadDone(bool ok) override {
        if (!ok) {
          Finish(grpc::Status::OK);
          return;
        }
        answer_.mutable_infer_response()->set_id(request_.id());
        StartWrite(&answer_);
      }
      void OnWriteDone(bool ok) override {
        if (!ok) {
          Finish(grpc::Status::OK);
          return;
        }
        StartRead(&request_);
      }
      void OnDone() override { delete this; }

     private:
      inference::ModelStreamInferResponse answer_;
      inference::ModelInferRequest request_;
    };
    return new Stream(stream_answer_);
  }

 private:
  inference::ModelMetadataResponse metadata_;
  inference::ModelInferResponse infer_;
  inference::ModelStreamInferResponse stream_answer_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The least a KServe v2 server can do per request: canned answers over HTTP and gRPC"};
  int http_port = 0;
  int grpc_port = 0;
  int http_batch = 1;
  std::string model;
  std::vector<std::string> inputs;
  std::vector<std::string> outputs;
  app.add_option("--http-port", http_port, "HTTP port on 127.0.0.1 (0 = none)");
  app.add_option("--grpc-port", grpc_port, "gRPC port on 127.0.0.1 (0 = none)");
  app.add_option("--model", model, "The model's name")->required();
  app.add_option("--input", inputs, "NAME:DTYPE:D,D,... (-1 = open), as the metadata tells")->required();
  app.add_option("--http-batch", http_batch,
                 "Answer HTTP infer requests this many at a time, as a batching server does (1 = each at once)");
  app.add_option("--output", outputs, "NAME:DTYPE:D,D,...: answered with zeros (open dimensions 1)")->required();
  std::string http_model;
  app.add_option(
      "--http-model", http_model,
      "An ONNX file: with --http-batch, each batch of held HTTP requests runs through it before the answers");
  CLI11_PARSE(app, argc, argv);
  std::signal(SIGPIPE, SIG_IGN);

  std::vector<TensorSpec> in_specs;
  std::vector<TensorSpec> out_specs;
  for (const auto& s : inputs) in_specs.push_back(ParseSpec(s));
  for (const auto& s : outputs) out_specs.push_back(ParseSpec(s));

  // HTTP answers.
  auto tensors_json = [](const std::vector<TensorSpec>& specs) {
    std::string s = "[";
    for (size_t i = 0; i < specs.size(); ++i) {
      if (i) s += ",";
      s += R"({"name":")" + specs[i].name + R"(","datatype":")" + specs[i].datatype + R"(","shape":)" +
           ShapeJson(specs[i], false) + "}";
    }
    return s + "]";
  };
  const std::string metadata_json = R"({"name":")" + model + R"(","versions":["1"],"platform":"onnxruntime_onnx",)" +
                                    R"("inputs":)" + tensors_json(in_specs) + R"(,"outputs":)" +
                                    tensors_json(out_specs) + "}";
  std::string infer_json = R"({"model_name":")" + model + R"(","model_version":"1","outputs":[)";
  std::string binary;
  for (size_t i = 0; i < out_specs.size(); ++i) {
    if (i) infer_json += ",";
    const int64_t bytes = Bytes(out_specs[i]);
    infer_json += R"({"name":")" + out_specs[i].name + R"(","datatype":")" + out_specs[i].datatype + R"(","shape":)" +
                  ShapeJson(out_specs[i], true) + R"(,"parameters":{"binary_data_size":)" + std::to_string(bytes) +
                  "}}";
    binary.append(static_cast<size_t>(bytes), '\0');
  }
  infer_json += "]}";
  const std::string metadata_response = HttpResponse("application/json", metadata_json, 0);
  const std::string infer_response = HttpResponse("application/octet-stream", infer_json + binary, infer_json.size());

  // gRPC answers.
  inference::ModelMetadataResponse md;
  md.set_name(model);
  md.add_versions("1");
  md.set_platform("onnxruntime_onnx");
  for (const auto& t : in_specs) {
    auto* m = md.add_inputs();
    m->set_name(t.name);
    m->set_datatype(t.datatype);
    for (const int64_t d : t.shape) m->add_shape(d);
  }
  for (const auto& t : out_specs) {
    auto* m = md.add_outputs();
    m->set_name(t.name);
    m->set_datatype(t.datatype);
    for (const int64_t d : t.shape) m->add_shape(d);
  }
  inference::ModelInferResponse ir;
  ir.set_model_name(model);
  ir.set_model_version("1");
  for (const auto& t : out_specs) {
    auto* o = ir.add_outputs();
    o->set_name(t.name);
    o->set_datatype(t.datatype);
    for (const int64_t d : t.shape) o->add_shape(std::max<int64_t>(d, 1));
    ir.add_raw_output_contents(std::string(static_cast<size_t>(Bytes(t)), '\0'));
  }

  std::unique_ptr<grpc::Server> server;
  FloorService service(md, ir);
  if (grpc_port > 0) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:" + std::to_string(grpc_port), grpc::InsecureServerCredentials());
    builder.RegisterService(&service);
    builder.SetMaxReceiveMessageSize(64 << 20);
    server = builder.BuildAndStart();
    if (!server) {
      std::fprintf(stderr, "gRPC port %d: cannot listen\n", grpc_port);
      return 1;
    }
  }
  if (http_port > 0) {
    std::unique_ptr<BatchModel> batch_model;
    if (!http_model.empty() && http_batch > 1)
      batch_model = std::make_unique<BatchModel>(http_model, in_specs[0], http_batch);
    ServeHttp(http_port, metadata_response, infer_response, http_batch, batch_model.get());  // does not return
  }
  if (server) server->Wait();
  return 0;
}
