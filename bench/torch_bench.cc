// torch_bench: a TorchScript model through raw LibTorch (the ceiling) and
// through Quern's engine, in one process per layout (LibTorch's intra-op
// pool is sized once per process).
//
//   torch_bench --repo DIR --model resnet50 --mode raw --threads 2 --callers 1 --batches 1 2 4
//   torch_bench --repo DIR --model resnet50_2i --mode engine --submitters 1 2 4
//
// Raw: Quern's LibTorch plugin called directly (no queue, no batching): the
// pool set to --threads, --callers threads each running batches of each
// size back to back on one module. Engine: the model served from DIR as its
// config.pbtxt says (instances, batching; bench/torch_bench.sh writes
// one per layout), --submitters
// threads each sending single-item requests back to back (Engine::Infer).
// Inputs: the model's first input, FP32 of the configured item shape,
// random, rotating through four buffers.
#include <dlfcn.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "backends/pytorch/torch_plugin_api.h"
#include "quern/engine.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

std::vector<float> RandomData(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

int64_t Elements(const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

// Items/s of `callers` threads running batches of `batch` back to back.
double Raw(const QuernTorchApi* api, void* module, const std::vector<int64_t>& item, int batch, int callers,
           double seconds) {
  std::vector<int64_t> dims = item;
  dims.insert(dims.begin(), batch);
  std::atomic<int64_t> items{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < callers; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::vector<float>> data;
      for (int i = 0; i < 4; ++i) data.push_back(RandomData(static_cast<size_t>(Elements(dims)), 1 + i + 10 * t));
      auto run = [&](int i) {
        QuernTorchTensor in{};
        in.dtype = static_cast<uint8_t>(quern::DataType::kFp32);
        in.rank = static_cast<int32_t>(dims.size());
        std::copy(dims.begin(), dims.end(), in.dims);
        in.data = data[static_cast<size_t>(i % 4)].data();
        in.bytes = data[0].size() * sizeof(float);
        const QuernTorchTensor* out = nullptr;
        int n = 0;
        char* error = nullptr;
        void* result = api->run(module, &in, 1, &out, &n, &error);
        if (!result) {
          std::fprintf(stderr, "LibTorch: %s\n", error ? error : "?");
          std::exit(1);
        }
        api->release(result);
      };
      run(0);  // warm up
      while (!go.load()) std::this_thread::yield();
      const auto end = Clock::now() + std::chrono::duration<double>(seconds);
      for (int i = 1; Clock::now() < end; ++i) {
        run(i);
        items += batch;
      }
    });
  }
  const auto start = Clock::now();
  go = true;
  for (auto& th : threads) th.join();
  return static_cast<double>(items.load()) / std::chrono::duration<double>(Clock::now() - start).count();
}

// The first input's name and item shape from config.pbtxt (name and dims
// of the first `input [ { ... } ]` entry).
bool FirstInput(const fs::path& config, std::string& name, std::vector<int64_t>& dims) {
  std::ifstream f(config);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string s = ss.str();
  const size_t in = s.find("input");
  const size_t n = s.find("name:", in);
  const size_t q1 = s.find('"', n), q2 = s.find('"', q1 + 1);
  const size_t d = s.find("dims:", q2), open = s.find('[', d), close = s.find(']', open);
  if (in == std::string::npos || n == std::string::npos || q2 == std::string::npos || close == std::string::npos) {
    return false;
  }
  name = s.substr(q1 + 1, q2 - q1 - 1);
  std::stringstream list(s.substr(open + 1, close - open - 1));
  for (std::string tok; std::getline(list, tok, ',');) dims.push_back(std::stoll(tok));
  return !dims.empty();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"TorchScript through raw LibTorch and through Quern's engine"};
  std::string repo, model = "resnet50", mode = "raw";
  double seconds = 5;
  int threads = 0, callers = 1;
  std::vector<int> batches = {1, 2, 4}, submitters = {1, 2, 4};
  app.add_option("--repo", repo, "model repository holding the model")->required();
  app.add_option("--model", model, "the model's name");
  app.add_option("--mode", mode, "raw or engine")->check(CLI::IsMember({"raw", "engine"}));
  app.add_option("--seconds", seconds, "measured time per setting");
  app.add_option("--threads", threads, "raw: LibTorch's intra-op threads (0 = every core)");
  app.add_option("--callers", callers, "raw: threads running batches at once");
  app.add_option("--batches", batches, "raw: batch sizes");
  app.add_option("--submitters", submitters, "engine: concurrent submitting threads");
  CLI11_PARSE(app, argc, argv);

  std::string input;
  std::vector<int64_t> item;
  if (!FirstInput(fs::path(repo) / model / "config.pbtxt", input, item)) {
    std::fprintf(stderr, "cannot read the first input of %s/%s/config.pbtxt\n", repo.c_str(), model.c_str());
    return 1;
  }
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (mode == "raw") {
    void* plugin = dlopen(QUERN_PYTORCH_PLUGIN_PATH, RTLD_NOW | RTLD_LOCAL);
    auto fn = plugin ? reinterpret_cast<QuernTorchApiFn>(dlsym(plugin, "quern_torch_api")) : nullptr;
    if (!fn) {
      std::fprintf(stderr, "cannot load %s: %s\n", QUERN_PYTORCH_PLUGIN_PATH, dlerror());
      return 1;
    }
    const QuernTorchApi* api = fn();
    const int in_force = api->set_threads(threads > 0 ? threads : cores);
    char* error = nullptr;
    void* module = api->load((fs::path(repo) / model / "1" / "model.pt").c_str(), &error);
    if (!module) {
      std::fprintf(stderr, "LibTorch: %s\n", error ? error : "?");
      return 1;
    }
    for (int b : batches) {
      const double r = Raw(api, module, item, b, callers, seconds);
      std::printf("raw LibTorch %s, %d intra-op threads, %d caller(s), batch %d: %.2f items/s\n", api->version,
                  in_force, callers, b, r);
    }
    return 0;
  }
  auto engine = quern::Engine::Create({.model_repository = repo});
  if (!engine) {
    std::fprintf(stderr, "%s\n", engine.error().ToString().c_str());
    return 1;
  }
  for (int n : submitters) {
    std::atomic<bool> stop{false}, measuring{false};
    std::atomic<int64_t> items{0}, batch_sum{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < n; ++t) {
      ts.emplace_back([&, t] {
        std::vector<int64_t> dims = item;
        dims.insert(dims.begin(), 1);
        std::vector<std::vector<float>> data;
        for (int i = 0; i < 4; ++i) data.push_back(RandomData(static_cast<size_t>(Elements(dims)), 1 + i + 10 * t));
        for (int i = 0; !stop.load(); ++i) {
          quern::InferRequest r;
          r.model = model;
          const auto& d = data[static_cast<size_t>(i % 4)];
          r.inputs = {{input, quern::Tensor::Borrow(quern::DataType::kFp32, dims, d.data(), d.size() * sizeof(float))}};
          quern::InferResponse resp = (*engine)->Infer(std::move(r)).get();
          if (!resp.status.ok()) {
            std::fprintf(stderr, "%s\n", resp.status.ToString().c_str());
            std::exit(1);
          }
          if (measuring.load()) {
            ++items;
            batch_sum += resp.telemetry.batch_size;
          }
        }
      });
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(std::min(2.0, seconds / 2)));  // warm-up
    const auto w0 = Clock::now();
    measuring = true;
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    measuring = false;
    const double wall = std::chrono::duration<double>(Clock::now() - w0).count();
    stop = true;
    for (auto& th : ts) th.join();
    std::printf("engine, model %s, %d submitter(s): %.2f items/s, mean batch %.2f\n", model.c_str(), n,
                static_cast<double>(items.load()) / wall,
                items.load() ? static_cast<double>(batch_sum.load()) / static_cast<double>(items.load()) : 0.0);
  }
  return 0;
}
