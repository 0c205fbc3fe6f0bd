// layout_bench: raw ONNX Runtime, one model, C caller threads each running
// batches back to back in one of four layouts, the measurements behind the
// engine's wide instance (docs/benchmarks.md, "The camera's case"):
//
//   wide    one session with every core's intra-op thread; callers take turns
//   narrow  one single-threaded session per caller
//   shared  one session with every core's thread, run by all callers at once
//   mixed   caller 0 on a session with every core's thread, the others on
//           single-threaded sessions, all at once
//
//   layout_bench --model bench/models/detect_v5n/1/model.onnx --layout narrow --callers 2
#include <onnxruntime_cxx_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {
using SteadyClock = std::chrono::steady_clock;
}  // namespace

int main(int argc, char** argv) {
  // No telemetry from ONNX Runtime (see OrtEnv in src/backends/onnxruntime/ort_model.cc).
  setenv("ORT_DISABLE_TELEMETRY", "1", /*overwrite=*/0);
  CLI::App app{"Raw ONNX Runtime throughput of one model in four thread layouts"};
  std::string model, layout = "wide";
  int callers = 1, batch = 1;
  double seconds = 4;
  app.add_option("--model", model, "ONNX model with a dynamic batch dimension")->required();
  app.add_option("--layout", layout, "wide, narrow, shared or mixed")
      ->check(CLI::IsMember({"wide", "narrow", "shared", "mixed"}));
  app.add_option("--callers", callers, "Threads running batches")->check(CLI::Range(1, 64));
  app.add_option("--batch", batch, "Items per batch")->check(CLI::Range(1, 256));
  app.add_option("--seconds", seconds, "Measurement time");
  CLI11_PARSE(app, argc, argv);

  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  Ort::Env env(ORT_LOGGING_LEVEL_WARNING, "layout_bench");
  const bool own = layout == "narrow" || layout == "mixed";
  std::vector<std::unique_ptr<Ort::Session>> sessions;
  for (int i = 0; i < (own ? callers : 1); ++i) {
    Ort::SessionOptions so;
    so.SetIntraOpNumThreads(layout == "narrow" || (layout == "mixed" && i > 0) ? 1 : cores);
    so.SetInterOpNumThreads(1);
    so.SetExecutionMode(ORT_SEQUENTIAL);
    sessions.push_back(std::make_unique<Ort::Session>(env, model.c_str(), so));
  }
  Ort::AllocatorWithDefaultOptions alloc;
  const std::string input = sessions[0]->GetInputNameAllocated(0, alloc).get();
  const std::string output = sessions[0]->GetOutputNameAllocated(0, alloc).get();
  std::vector<int64_t> shape = sessions[0]->GetInputTypeInfo(0).GetTensorTypeAndShapeInfo().GetShape();
  shape[0] = batch;
  size_t elements = 1;
  for (int64_t d : shape) elements *= static_cast<size_t>(std::max<int64_t>(d, 1));

  std::mutex turn;  // wide: one run at a time
  std::atomic<bool> go{false};
  std::atomic<int64_t> items{0};
  std::vector<std::vector<double>> latency(static_cast<size_t>(callers));
  std::vector<std::thread> threads;
  for (int t = 0; t < callers; ++t) {
    threads.emplace_back([&, t] {
      std::vector<float> data(elements);
      std::mt19937 rng(static_cast<unsigned>(t));
      std::uniform_real_distribution<float> dist(-1.f, 1.f);
      for (float& x : data) x = dist(rng);
      auto mem = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
      Ort::Value in = Ort::Value::CreateTensor<float>(mem, data.data(), data.size(), shape.data(), shape.size());
      const char* in_names[] = {input.c_str()};
      const char* out_names[] = {output.c_str()};
      Ort::Session& s = *sessions[own ? static_cast<size_t>(t) : 0];
      s.Run(Ort::RunOptions{nullptr}, in_names, &in, 1, out_names, 1);  // warm up
      while (!go.load()) std::this_thread::yield();
      const auto end = SteadyClock::now() + std::chrono::duration<double>(seconds);
      while (SteadyClock::now() < end) {
        const auto t0 = SteadyClock::now();
        if (layout == "wide") {
          std::lock_guard<std::mutex> lock(turn);
          s.Run(Ort::RunOptions{nullptr}, in_names, &in, 1, out_names, 1);
        } else {
          s.Run(Ort::RunOptions{nullptr}, in_names, &in, 1, out_names, 1);
        }
        latency[static_cast<size_t>(t)].push_back(
            std::chrono::duration<double, std::milli>(SteadyClock::now() - t0).count());
        items += batch;
      }
    });
  }
  const auto start = SteadyClock::now();
  go = true;
  for (auto& th : threads) th.join();
  const double elapsed = std::chrono::duration<double>(SteadyClock::now() - start).count();
  std::vector<double> all;
  for (const auto& l : latency) all.insert(all.end(), l.begin(), l.end());
  std::sort(all.begin(), all.end());
  if (all.empty()) return 1;
  std::printf("%-6s callers %2d batch %3d: %9.1f items/s  p50 %8.2f ms  p99 %8.2f ms\n", layout.c_str(), callers, batch,
              static_cast<double>(items.load()) / elapsed, all[all.size() / 2], all[all.size() * 99 / 100]);
  return 0;
}
