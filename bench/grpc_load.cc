// gRPC load generator for ModelInfer (unary) and ModelStreamInfer (one
// bidirectional stream per connection, several requests in flight on each),
// built on the project's own proto with the gRPC callback client API.
//
//   grpc_load --target 127.0.0.1:8001 --model identity --input x --shape 1,4
//             --mode stream --connections 4 --inflight 16 --seconds 5
//
// --mode live calls ServerLive (no engine work): the cost of a gRPC call itself.
// Prints one line: mode, connections, in-flight, requests/s, p50, p99, errors.
// Stream latencies pair the i-th response with the i-th request sent on that
// stream (identical requests complete in order).
#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "grpc_service.grpc.pb.h"

namespace {

using Clock = std::chrono::steady_clock;
using inference::GRPCInferenceService;

struct Recorder {
  std::mutex mu;
  std::vector<int64_t> latencies_ns;
  std::atomic<int64_t> ok{0};
  std::atomic<int64_t> errors{0};
  std::string first_error;
  std::atomic<bool> stop{false};
  Clock::time_point measure_from;

  void Record(Clock::time_point start, bool success, const std::string& error) {
    const auto now = Clock::now();
    if (start < measure_from) return;  // warm-up
    if (!success) {
      errors.fetch_add(1, std::memory_order_relaxed);
      std::lock_guard<std::mutex> lock(mu);
      if (first_error.empty()) first_error = error;
      return;
    }
    ok.fetch_add(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mu);
    latencies_ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(now - start).count());
  }
};

// One unary call slot: starts the next call when the previous one ends.
class UnarySlot {
 public:
  UnarySlot(GRPCInferenceService::Stub* stub, const inference::ModelInferRequest* request, Recorder* rec,
            std::atomic<int>* live, bool live_only)
      : stub_(stub), request_(request), rec_(rec), live_(live), live_only_(live_only) {}

  void Start() {
    if (rec_->stop.load()) {
      live_->fetch_sub(1);
      return;
    }
    ctx_ = std::make_unique<grpc::ClientContext>();
    response_.Clear();
    start_ = Clock::now();
    auto done = [this](grpc::Status s) {
      rec_->Record(start_, s.ok(), s.error_message());
      Start();
    };
    if (live_only_) {
      stub_->async()->ServerLive(ctx_.get(), &live_request_, &live_response_, done);
    } else {
      stub_->async()->ModelInfer(ctx_.get(), request_, &response_, done);
    }
  }

 private:
  GRPCInferenceService::Stub* stub_;
  const inference::ModelInferRequest* request_;
  Recorder* rec_;
  std::atomic<int>* live_;
  bool live_only_;  // ServerLive instead of ModelInfer: gRPC's own cost per call
  inference::ServerLiveRequest live_request_;
  inference::ServerLiveResponse live_response_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  inference::ModelInferResponse response_;
  Clock::time_point start_;
};

// One bidirectional stream with `inflight` requests outstanding.
class StreamClient final
    : public grpc::ClientBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse> {
 public:
  StreamClient(GRPCInferenceService::Stub* stub, const inference::ModelInferRequest* request, int inflight,
               Recorder* rec)
      : request_(request), rec_(rec) {
    stub->async()->ModelStreamInfer(&ctx_, this);
    StartRead(&response_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      to_send_ = inflight;
      outstanding_ = inflight;
      SendLocked();
    }
    StartCall();
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) return;
    SendLocked();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended; OnDone follows
    Clock::time_point start;
    {
      std::lock_guard<std::mutex> lock(mu_);
      start = starts_.front();
      starts_.pop_front();
    }
    rec_->Record(start, response_.error_message().empty(), response_.error_message());
    response_.Clear();
    StartRead(&response_);
    std::lock_guard<std::mutex> lock(mu_);
    if (rec_->stop.load()) {
      if (--outstanding_ == 0 && !writes_done_) {
        writes_done_ = true;
        if (!writing_) StartWritesDone();
      }
      return;
    }
    ++to_send_;
    SendLocked();
  }

  void OnDone(const grpc::Status& s) override {
    if (!s.ok()) rec_->Record(Clock::now(), false, s.error_message());
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    cv_.notify_all();
  }

  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
  }

 private:
  void SendLocked() {
    if (writing_ || to_send_ == 0) return;
    --to_send_;
    writing_ = true;
    starts_.push_back(Clock::now());
    StartWrite(request_);
  }

  grpc::ClientContext ctx_;
  const inference::ModelInferRequest* request_;
  Recorder* rec_;
  inference::ModelStreamInferResponse response_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Clock::time_point> starts_;
  int to_send_ = 0;
  int outstanding_ = 0;
  bool writing_ = false;
  bool writes_done_ = false;
  bool done_ = false;
};

std::vector<int64_t> ParseShape(const std::string& s) {
  std::vector<int64_t> out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string::npos) comma = s.size();
    out.push_back(std::stoll(s.substr(pos, comma - pos)));
    pos = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gRPC load generator for Quern (KServe v2 ModelInfer / ModelStreamInfer)"};
  std::string target = "127.0.0.1:8001", model = "identity", input = "x", shape_text = "1,4", mode = "unary";
  int connections = 1, inflight = 1;
  double seconds = 5, warmup = 1;
  app.add_option("--target", target);
  app.add_option("--model", model);
  app.add_option("--input", input, "input name (FP32, random values)");
  app.add_option("--shape", shape_text, "input shape, comma-separated");
  app.add_option("--mode", mode)->check(CLI::IsMember({"unary", "stream", "live"}));
  app.add_option("--connections", connections, "channels (one stream each in stream mode)");
  app.add_option("--inflight", inflight, "outstanding requests per connection");
  app.add_option("--seconds", seconds);
  app.add_option("--warmup", warmup, "seconds not measured at the start");
  CLI11_PARSE(app, argc, argv);

  inference::ModelInferRequest request;
  request.set_model_name(model);
  auto* in = request.add_inputs();
  in->set_name(input);
  in->set_datatype("FP32");
  int64_t n = 1;
  for (int64_t d : ParseShape(shape_text)) {
    in->add_shape(d);
    n *= d;
  }
  std::vector<float> values(static_cast<size_t>(n));
  std::mt19937 rng(1);
  std::normal_distribution<float> dist;
  for (auto& v : values) v = dist(rng);
  request.add_raw_input_contents(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));

  std::vector<std::unique_ptr<GRPCInferenceService::Stub>> stubs;
  for (int c = 0; c < connections; ++c) {
    grpc::ChannelArguments args;
    args.SetInt("grpc.channel_id", c);  // distinct channels, distinct connections
    args.SetMaxReceiveMessageSize(-1);
    stubs.push_back(
        GRPCInferenceService::NewStub(grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args)));
  }

  Recorder rec;
  rec.measure_from = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(warmup));
  const auto t_end =
      rec.measure_from + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));

  std::atomic<int> live{0};
  std::vector<std::unique_ptr<UnarySlot>> slots;
  std::vector<std::unique_ptr<StreamClient>> streams;
  if (mode != "stream") {
    for (int c = 0; c < connections; ++c) {
      for (int k = 0; k < inflight; ++k) {
        slots.push_back(
            std::make_unique<UnarySlot>(stubs[static_cast<size_t>(c)].get(), &request, &rec, &live, mode == "live"));
      }
    }
    live = static_cast<int>(slots.size());
    for (auto& s : slots) s->Start();
  } else {
    for (int c = 0; c < connections; ++c) {
      streams.push_back(std::make_unique<StreamClient>(stubs[static_cast<size_t>(c)].get(), &request, inflight, &rec));
    }
  }
  std::this_thread::sleep_until(t_end);
  rec.stop = true;
  const double elapsed = std::chrono::duration<double>(Clock::now() - rec.measure_from).count();
  const int64_t ok = rec.ok.load();
  const int64_t errors = rec.errors.load();
  for (auto& s : streams) s->Wait();
  while (live.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));

  std::vector<int64_t> lat;
  {
    std::lock_guard<std::mutex> lock(rec.mu);
    lat = rec.latencies_ns;
  }
  std::sort(lat.begin(), lat.end());
  auto pct = [&](double p) {
    if (lat.empty()) return 0.0;
    return static_cast<double>(
               lat[std::min(lat.size() - 1, static_cast<size_t>(p * static_cast<double>(lat.size())))]) /
           1e3;
  };
  std::printf("mode=%s connections=%d inflight=%d ok=%lld rps=%.0f p50_us=%.0f p99_us=%.0f errors=%lld%s%s\n",
              mode.c_str(), connections, inflight, static_cast<long long>(ok), static_cast<double>(ok) / elapsed,
              pct(0.5), pct(0.99), static_cast<long long>(errors),
              rec.first_error.empty() ? "" : " first_error=", rec.first_error.c_str());
  std::fflush(stdout);
  std::_Exit(errors > 0 && ok == 0 ? 1 : 0);  // no teardown race with gRPC's threads
}
