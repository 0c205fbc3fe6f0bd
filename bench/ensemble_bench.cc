// ensemble_bench: what an ensemble costs beyond its step models.
//
//   ensemble_bench --seconds 3 --submitters 1 8 --steps 1 4
//
// Registers a C++ model `echo` (its output is its input, no copy; batched,
// two instances) and loads ensembles chain<K> of K echo steps in sequence
// from a temporary repository. N threads send 64-byte requests back to back
// through Engine::Infer, to echo directly and to each chain. Reports
// requests/s, p50 latency and this process's CPU per request, and for each
// chain its CPU per step beyond a direct request: (CPU per chain request -
// CPU per direct echo request) / K. That is what each step adds: the
// ensemble's bookkeeping and a request to echo's batcher and instances (the
// direct request already pays one caller's submission and wait; echo
// itself costs nothing).

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>
#include <vector>

#include "core/cpus.h"
#include "quern/engine.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

class Echo final : public quern::Model {
 public:
  quern::Status Execute(const std::vector<quern::NamedTensor>& inputs, int64_t,
                        std::vector<quern::NamedTensor>& outputs) override {
    outputs.push_back({"y", inputs[0].tensor});
    return quern::Status::Ok();
  }
};

void WriteChain(const fs::path& repo, int steps) {
  const std::string name = "chain" + std::to_string(steps);
  fs::create_directories(repo / name / "1");
  std::ofstream f(repo / name / "config.pbtxt");
  f << "platform: \"ensemble\"\nmax_batch_size: 64\n"
    << "input [ { name: \"x\" data_type: TYPE_FP32 dims: [ 16 ] } ]\n"
    << "output [ { name: \"y\" data_type: TYPE_FP32 dims: [ 16 ] } ]\n"
    << "ensemble_scheduling { step [\n";
  for (int i = 0; i < steps; ++i) {
    const std::string in = i == 0 ? "x" : "t" + std::to_string(i);
    const std::string out = i == steps - 1 ? "y" : "t" + std::to_string(i + 1);
    f << (i ? "," : "") << "{ model_name: \"echo\" input_map { key: \"x\" value: \"" << in
      << "\" } output_map { key: \"y\" value: \"" << out << "\" } }\n";
  }
  f << "] }\n";
}

struct Figures {
  double rps = 0, p50_ms = 0, cpu_us = 0;
};

Figures Measure(quern::Engine& engine, const std::string& model, int n, double seconds) {
  std::atomic<bool> measuring{false}, stop{false};
  std::vector<std::vector<double>> lat(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      std::vector<float> x(16);
      for (int i = 0; i < 16; ++i) x[static_cast<size_t>(i)] = static_cast<float>(t * 100 + i);
      while (!stop.load()) {
        quern::InferRequest r;
        r.model = model;
        r.inputs = {{"x", quern::Tensor::Borrow(quern::DataType::kFp32, {1, 16}, x.data(), x.size() * sizeof(float))}};
        const auto t0 = Clock::now();
        quern::InferResponse resp = engine.Infer(std::move(r)).get();
        if (!resp.status.ok() || resp.outputs.size() != 1 ||
            std::memcmp(resp.outputs[0].tensor.data(), x.data(), x.size() * sizeof(float)) != 0) {
          std::fprintf(stderr, "%s: wrong answer: %s\n", model.c_str(), resp.status.ToString().c_str());
          std::exit(1);
        }
        if (measuring.load(std::memory_order_relaxed)) {
          lat[static_cast<size_t>(t)].push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const double cpu0 = quern::ProcessCpuSeconds();
  const auto w0 = Clock::now();
  measuring = true;
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  measuring = false;
  const double wall = std::chrono::duration<double>(Clock::now() - w0).count();
  const double cpu1 = quern::ProcessCpuSeconds();
  stop = true;
  for (auto& th : threads) th.join();
  std::vector<double> all;
  for (auto& l : lat) all.insert(all.end(), l.begin(), l.end());
  std::sort(all.begin(), all.end());
  if (all.empty()) return {};
  const double count = static_cast<double>(all.size());
  return {count / wall, all[all.size() / 2], (cpu1 - cpu0) / count * 1e6};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Ensemble overhead"};
  double seconds = 3;
  std::vector<int> submitters = {1, 8};
  std::vector<int> chains = {1, 4};
  app.add_option("--seconds", seconds, "measured time per setting");
  app.add_option("--submitters", submitters, "concurrent submitting threads");
  app.add_option("--steps", chains, "ensembles of this many echo steps");
  CLI11_PARSE(app, argc, argv);

  char tmpl[] = "/tmp/quern-ensemble-bench-XXXXXX";
  if (!mkdtemp(tmpl)) return 1;
  const fs::path repo(tmpl);
  for (int k : chains) WriteChain(repo, k);
  quern::EngineOptions options;
  options.model_repository = repo.string();
  auto engine = quern::Engine::Create(options);  // the chains fail to load: echo is not registered yet
  if (!engine) {
    std::fprintf(stderr, "%s\n", engine.error().ToString().c_str());
    return 1;
  }
  quern::ModelConfig config;
  config.name = "echo";
  config.max_batch_size = 64;
  config.inputs = {{"x", quern::DataType::kFp32, {-1}}};
  config.outputs = {{"y", quern::DataType::kFp32, {-1}}};
  config.instance_count = 2;
  config.batching = quern::BatchingConfig{};
  if (auto st = (*engine)->RegisterModel(config, [] { return std::make_unique<Echo>(); }); !st.ok()) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    return 1;
  }
  for (int k : chains) {
    if (auto st = (*engine)->LoadModel("chain" + std::to_string(k)); !st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
  }
  std::printf("%-8s %-11s %10s %9s %11s %16s\n", "model", "submitters", "req/s", "p50 ms", "CPU us/req",
              "us/step added");
  for (int n : submitters) {
    const Figures direct = Measure(**engine, "echo", n, seconds);
    std::printf("%-8s %-11d %10.0f %9.3f %11.1f %16s\n", "echo", n, direct.rps, direct.p50_ms, direct.cpu_us, "-");
    for (int k : chains) {
      const std::string name = "chain" + std::to_string(k);
      const Figures f = Measure(**engine, name, n, seconds);
      std::printf("%-8s %-11d %10.0f %9.3f %11.1f %16.1f\n", name.c_str(), n, f.rps, f.p50_ms, f.cpu_us,
                  (f.cpu_us - direct.cpu_us) / k);
    }
  }
  engine->reset();
  fs::remove_all(repo);
  return 0;
}
