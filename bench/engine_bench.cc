// engine_bench: raw ONNX Runtime throughput (the ceiling X*) beside Engine
// throughput with concurrent submitters, measured in one run on one machine.
//
//   engine_bench --model bench/models/small_cnn/1/model.onnx --seconds 5
//
// Raw: one session with the same thread settings the engine uses, timed at
// several batch sizes; X* is the best items/s. Engine: N submitter threads
// each send single-item requests back to back through Engine::Infer; the
// engine batches them (dynamic batching, max_batch_size as given). The
// batching gain compares against the same engine with max_batch_size 1.
#include <onnxruntime_cxx_api.h>
#include <onnxruntime_session_options_config_keys.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "quern/engine.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

struct ModelShape {
  std::string input, output;
  std::vector<int64_t> item_shape;  // without batch
};

ModelShape Inspect(Ort::Session& s) {
  Ort::AllocatorWithDefaultOptions a;
  ModelShape m;
  m.input = s.GetInputNameAllocated(0, a).get();
  m.output = s.GetOutputNameAllocated(0, a).get();
  auto shape = s.GetInputTypeInfo(0).GetTensorTypeAndShapeInfo().GetShape();
  m.item_shape.assign(shape.begin() + 1, shape.end());
  return m;
}

int64_t Elements(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

std::vector<float> RandomData(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

struct RawConfig {
  int sessions = 1;  // parallel sessions, each on its own thread with cores/sessions intra-op threads
  bool stop_spinning = false;
  int batch = 0;  // per-concurrency comparison: the batch each session runs
  // Each run's batch is first assembled from single-item buffers (one copy
  // per item, from a pool larger than the cache holds for big items): the
  // least a server whose requests carry one item each must do.
  bool gather = false;
  std::string Name(int cores) const {
    return std::to_string(sessions) + "x" + std::to_string(cores / sessions) + "t" + (stop_spinning ? " stop" : "") +
           (gather ? " g" : "");
  }
};

int g_gpu = -1;  // >= 0: raw sessions and engine instances on this CUDA device

// Items/s of `cfg.sessions` sessions running back to back in parallel.
double RawThroughput(const std::string& path, int cores, int batch, double seconds, const ModelShape& shape,
                     const RawConfig& cfg) {
  static Ort::Env& env = *new Ort::Env(ORT_LOGGING_LEVEL_WARNING, "bench");
  std::vector<int64_t> dims = shape.item_shape;
  dims.insert(dims.begin(), batch);
  std::vector<std::unique_ptr<Ort::Session>> sessions;
  for (int i = 0; i < cfg.sessions; ++i) {
    Ort::SessionOptions so;
    so.SetIntraOpNumThreads(std::max(1, cores / cfg.sessions));
    so.SetInterOpNumThreads(1);
    so.SetExecutionMode(ORT_SEQUENTIAL);
    if (cfg.stop_spinning) so.AddConfigEntry(kOrtSessionOptionsConfigForceSpinningStop, "1");
    if (g_gpu >= 0) {
      OrtCUDAProviderOptionsV2* cuda = nullptr;
      Ort::ThrowOnError(Ort::GetApi().CreateCUDAProviderOptions(&cuda));
      const std::string id = std::to_string(g_gpu);
      const char* keys[] = {"device_id"};
      const char* values[] = {id.c_str()};
      Ort::ThrowOnError(Ort::GetApi().UpdateCUDAProviderOptions(cuda, keys, values, 1));
      so.AppendExecutionProvider_CUDA_V2(*cuda);
      Ort::GetApi().ReleaseCUDAProviderOptions(cuda);
    }
    sessions.push_back(std::make_unique<Ort::Session>(env, path.c_str(), so));
  }
  std::atomic<int64_t> items{0};
  std::atomic<bool> go{false};
  const auto duration = std::chrono::duration<double>(seconds);
  std::vector<std::thread> threads;
  for (int t = 0; t < cfg.sessions; ++t) {
    threads.emplace_back([&, t] {
      // Inputs rotate through several buffers, as a server's inputs would (a
      // single buffer would stay hot in cache and flatter the ceiling).
      constexpr int kBuffers = 4;
      std::vector<std::vector<float>> data;
      std::vector<Ort::Value> in;
      auto mem = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
      for (int i = 0; i < kBuffers; ++i) {
        data.push_back(RandomData(static_cast<size_t>(Elements(dims)), 1 + i + 10 * t));
        in.push_back(Ort::Value::CreateTensor<float>(mem, data[i].data(), data[i].size(), dims.data(), dims.size()));
      }
      // Gathering: single items rotate through a pool of at least 64 and
      // at least twice a batch (a server's requests arrive in fresh buffers).
      const size_t item = static_cast<size_t>(Elements(shape.item_shape));
      std::vector<std::vector<float>> items_pool;
      if (cfg.gather) {
        const int pool = std::max(64, 2 * batch);
        for (int i = 0; i < pool; ++i) items_pool.push_back(RandomData(item, 1000 + i + 10000 * t));
      }
      size_t next_item = 0;
      const char* in_names[] = {shape.input.c_str()};
      const char* out_names[] = {shape.output.c_str()};
      Ort::Session& s = *sessions[t];
      for (int i = 0; i < 2; ++i) s.Run(Ort::RunOptions{nullptr}, in_names, &in[0], 1, out_names, 1);  // warm up
      while (!go.load()) std::this_thread::yield();
      const auto end = Clock::now() + duration;
      for (int i = 0; Clock::now() < end; ++i) {
        const int k = i % kBuffers;
        if (cfg.gather) {
          for (int b = 0; b < batch; ++b) {
            std::memcpy(data[k].data() + b * item, items_pool[next_item].data(), item * sizeof(float));
            next_item = (next_item + 1) % items_pool.size();
          }
        }
        s.Run(Ort::RunOptions{nullptr}, in_names, &in[k], 1, out_names, 1);
        items += batch;
      }
    });
  }
  auto start = Clock::now();
  go = true;
  for (auto& th : threads) th.join();
  return items.load() / std::chrono::duration<double>(Clock::now() - start).count();
}

struct EngineResult {
  double throughput = 0;
  double mean_batch = 0;
  double p50_ms = 0, p99_ms = 0;
  int64_t batch_limit = 0;
};

// Set while the window is timed: only answers that arrive inside it count,
// so the first (cold) batches of the warm-up never reach the percentiles.
std::atomic<bool> g_measuring{false};

// Keeps `inflight` requests in the engine at all times: each completion
// callback submits the next request (how asynchronous front ends drive it).
void CallbackLoad(quern::Engine& engine, int inflight, const std::string& input, const std::vector<int64_t>& dims,
                  std::atomic<bool>& stop, std::vector<int64_t>& counts, std::vector<int64_t>& batch_sum,
                  std::vector<std::vector<double>>& lat, std::atomic<int>& active) {
  struct Slot {
    std::vector<float> data;
    Clock::time_point t0;
  };
  auto slots = std::make_shared<std::vector<Slot>>(inflight);
  for (int i = 0; i < inflight; ++i) (*slots)[i].data = RandomData(static_cast<size_t>(Elements(dims)), 100 + i);
  std::function<void(int)> submit = [&, slots](int i) {
    Slot& s = (*slots)[i];
    quern::InferRequest r;
    r.model = "m";
    r.inputs = {{input, quern::Tensor::Borrow(quern::DataType::kFp32, dims, s.data.data(), s.data.size() * 4)}};
    s.t0 = Clock::now();
    quern::InferCallback done = [&, i](quern::InferResponse&& resp) {
      if (!resp.status.ok()) {
        std::fprintf(stderr, "request failed: %s\n", resp.status.ToString().c_str());
        std::exit(1);
      }
      if (g_measuring.load(std::memory_order_relaxed)) {
        lat[i].push_back(std::chrono::duration<double, std::milli>(Clock::now() - (*slots)[i].t0).count());
        ++counts[i];
        batch_sum[i] += resp.telemetry.batch_size;
      }
      if (stop.load(std::memory_order_relaxed)) {
        --active;
        return;
      }
      submit(i);
    };
    if (quern::Status st = engine.InferAsync(std::move(r), done); !st.ok()) {
      std::fprintf(stderr, "request refused: %s\n", st.ToString().c_str());
      std::exit(1);
    }
  };
  active = inflight;
  for (int i = 0; i < inflight; ++i) submit(i);
  while (active.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// Raw ONNX Runtime's best layout for `n` single-item requests in flight:
// one session with every core's thread running batches of up to n, or one
// single-threaded session per core each running batches of up to n / cores
// (batch sizes powers of two up to max_batch); each measured for `seconds`.
RawConfig RawBestAt(const std::string& path, int cores, int n, int max_batch, double seconds, const ModelShape& shape,
                    double& best) {
  RawConfig pick;
  best = 0;
  for (int sessions : {1, cores}) {
    if (sessions > 1 && (cores < 2 || n < sessions)) continue;
    for (int b = 1; b * sessions <= n && b <= max_batch; b *= 2) {
      RawConfig c{sessions, false, b};
      const double t = RawThroughput(path, cores, b, seconds, shape, c);
      if (t > best) best = t, pick = c;
    }
    if (sessions == cores) break;
  }
  return pick;
}

int g_instances = 0;    // 0 = the engine default (one per core)
bool g_wide = true;     // the automatic layout's wide instance
double g_warmup_s = 2;  // load before timing (the batch size tuner settles here)

EngineResult EngineThroughput(const fs::path& model_file, int max_batch, int submitters, double seconds,
                              const ModelShape& shape, bool callbacks, bool tuning = true) {
  const fs::path repo = fs::temp_directory_path() / ("quern-bench-" + std::to_string(::getpid()));
  fs::remove_all(repo);
  fs::create_directories(repo / "m" / "1");
  // A copy: the engine refuses model files that lie outside its repository.
  fs::copy_file(model_file, repo / "m" / "1" / "model.onnx");
  std::ofstream config(repo / "m" / "config.pbtxt");
  config << "max_batch_size: " << max_batch << "\n" << (max_batch > 1 ? "dynamic_batching { }\n" : "");
  if (g_gpu >= 0) {
    config << "instance_group [ { kind: KIND_GPU count: " << std::max(1, g_instances) << " gpus: [ " << g_gpu
           << " ] } ]\n";
  } else if (g_instances > 0) {
    config << "instance_group [ { kind: KIND_CPU count: " << g_instances << " } ]\n";
  }
  if (!tuning) config << "parameters { key: \"quern.batch_size_tuning\" value { string_value: \"off\" } }\n";
  if (!g_wide) config << "parameters { key: \"quern.wide_instance\" value { string_value: \"off\" } }\n";
  config.close();
  auto engine = quern::Engine::Create({.model_repository = repo.string()});
  if (!engine || !(*engine)->ModelReady("m")) {
    std::fprintf(stderr, "engine failed: %s\n",
                 engine ? (*engine)->GetModel("m")->reason.c_str() : engine.error().ToString().c_str());
    std::exit(1);
  }
  std::vector<int64_t> dims = shape.item_shape;
  dims.insert(dims.begin(), 1);
  std::atomic<bool> go{false}, stop{false};
  std::vector<int64_t> counts(submitters), batch_sum(submitters);
  std::vector<std::vector<double>> lat(submitters);
  std::vector<std::thread> threads;
  std::atomic<int> active{0};
  if (callbacks) {
    threads.emplace_back([&] {
      while (!go.load()) std::this_thread::yield();
      CallbackLoad(**engine, submitters, shape.input, dims, stop, counts, batch_sum, lat, active);
    });
  }
  for (int t = 0; !callbacks && t < submitters; ++t) {
    threads.emplace_back([&, t] {
      auto data = RandomData(static_cast<size_t>(Elements(dims)), 100 + t);
      while (!go.load()) std::this_thread::yield();
      while (!stop.load(std::memory_order_relaxed)) {
        quern::InferRequest r;
        r.model = "m";
        r.inputs = {{shape.input, quern::Tensor::Borrow(quern::DataType::kFp32, dims, data.data(), data.size() * 4)}};
        auto t0 = Clock::now();
        quern::InferResponse resp = (*engine)->Infer(std::move(r)).get();
        if (!resp.status.ok()) {
          std::fprintf(stderr, "request failed: %s\n", resp.status.ToString().c_str());
          std::exit(1);
        }
        if (g_measuring.load(std::memory_order_relaxed)) {
          lat[t].push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
          ++counts[t];
          batch_sum[t] += resp.telemetry.batch_size;
        }
      }
    });
  }
  // Warm-up: let the engine run for a short while before timing.
  go = true;
  std::this_thread::sleep_for(std::chrono::duration<double>(g_warmup_s));
  g_measuring = true;
  auto start = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  g_measuring = false;
  auto elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  EngineResult r;
  if (auto stats = (*engine)->GetStatistics("m"); stats && !stats->empty()) r.batch_limit = stats->front().batch_limit;
  stop = true;
  for (auto& th : threads) th.join();
  int64_t c1 = 0, b1 = 0;  // counted inside the window only
  for (int t = 0; t < submitters; ++t) {
    c1 += counts[t];
    b1 += batch_sum[t];
  }
  r.throughput = static_cast<double>(c1) / elapsed;
  std::vector<double> all;
  for (int t = 0; t < submitters; ++t) all.insert(all.end(), lat[t].begin(), lat[t].end());
  std::sort(all.begin(), all.end());
  r.mean_batch = c1 > 0 ? static_cast<double>(b1) / static_cast<double>(c1) : 0;
  if (!all.empty()) {
    r.p50_ms = all[all.size() / 2];
    r.p99_ms = all[std::min(all.size() - 1, all.size() * 99 / 100)];
  }
  engine->reset();
  fs::remove_all(repo);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  // No telemetry from ONNX Runtime (see OrtEnv in src/backends/onnxruntime/ort_model.cc).
  setenv("ORT_DISABLE_TELEMETRY", "1", /*overwrite=*/0);
  CLI::App app{"Raw ONNX Runtime ceiling vs quern::Engine throughput"};
  std::string model;
  double seconds = 5;
  int max_batch = 16;
  std::vector<int> raw_batches{1, 2, 4, 8, 16, 32};
  std::vector<int> submitters{1, 4, 16, 64};
  int gain_submitters = 16;
  std::string mode = "callbacks";
  std::vector<int64_t> item_shape;
  app.add_option("--model", model, "ONNX model with a dynamic batch dimension")->required();
  app.add_option("--seconds", seconds, "Measurement time per configuration");
  app.add_option("--max-batch", max_batch, "Engine max_batch_size");
  app.add_option("--raw-batches", raw_batches, "Batch sizes for the raw ONNX Runtime runs");
  app.add_option("--submitters", submitters, "Concurrent submitter counts for the engine runs");
  app.add_option("--gain-submitters", gain_submitters, "Submitters for the batching-gain comparison (0 = skip it)");
  app.add_option("--item-shape", item_shape,
                 "Input shape without the batch dimension, for models with other "
                 "dynamic dimensions (e.g. 3 48 192)");
  app.add_option("--instances", g_instances, "Engine model instances (cores are divided among them)");
  app.add_option("--gpu", g_gpu,
                 "Run raw sessions (ONNX Runtime's CUDA provider) and engine instances (KIND_GPU, --instances "
                 "per device, at least 1) on this CUDA device");
  app.add_option("--warmup", g_warmup_s, "Seconds of load before each engine measurement");
  std::string wide = "on";
  app.add_option("--wide", wide, "The automatic layout's wide instance (quern.wide_instance): on or off")
      ->check(CLI::IsMember({"on", "off"}));
  bool per_concurrency = false;
  app.add_flag("--raw-per-concurrency", per_concurrency,
               "Compare each engine row with raw ONNX Runtime's best layout for that many requests in flight "
               "(one wide session or one narrow session per core, batches up to the requests in flight), measured "
               "right before it, instead of with the batch-size table's ceiling");
  bool raw_gather = false;
  app.add_flag("--raw-gather", raw_gather,
               "Also run each raw layout with its batch assembled from single-item buffers first (one copy per "
               "item: the least a server of single-item requests does); X*g is their best, and each engine row is "
               "also divided by X*g measured right before it");
  std::string tuning = "on";
  app.add_option("--tuning", tuning,
                 "Batch size tuning in the engine runs: on, off, or both (each engine row twice, side by side)")
      ->check(CLI::IsMember({"on", "off", "both"}));
  app.add_option("--mode", mode,
                 "callbacks: N requests kept in flight by completion callbacks; "
                 "threads: N threads each blocking on Infer().get()")
      ->check(CLI::IsMember({"callbacks", "threads"}));
  CLI11_PARSE(app, argc, argv);

  g_wide = wide == "on";
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  Ort::Env env(ORT_LOGGING_LEVEL_WARNING, "inspect");
  Ort::Session probe(env, model.c_str(), Ort::SessionOptions{});
  ModelShape shape = Inspect(probe);
  if (!item_shape.empty()) shape.item_shape = item_shape;
  for (int64_t d : shape.item_shape) {
    if (d < 0) {
      std::fprintf(stderr, "the model's input has dynamic dimensions besides the batch: give --item-shape\n");
      return 2;
    }
  }

  std::printf("model %s, %d cores, %.1f s per configuration%s\n\n", model.c_str(), cores, seconds,
              g_gpu >= 0 ? (", on GPU " + std::to_string(g_gpu) + " (raw and engine)").c_str() : "");
  if (per_concurrency) {
    std::printf(
        "quern::Engine (%d instance(s), 0 = automatic layout) vs raw ONNX Runtime's best layout for the same "
        "number of single-item requests in flight, measured right before it\n",
        g_instances);
    std::printf("  raw layout: SxT/bB = S sessions of T intra-op threads, each running batches of B\n");
    std::printf("  in flight  raw layout  raw items/s  engine items/s  x raw  mean batch   p50 ms   p99 ms\n");
    for (int n : submitters) {
      double raw = 0;
      const RawConfig c = RawBestAt(model, cores, n, max_batch, seconds, shape, raw);
      EngineResult r = EngineThroughput(model, max_batch, n, seconds, shape, mode == "callbacks", tuning != "off");
      const std::string layout = c.Name(cores) + "/b" + std::to_string(c.batch);
      std::printf("  %9d  %10s  %11.1f  %14.1f  %5.3f  %10.2f  %7.2f  %7.2f\n", n, layout.c_str(), raw, r.throughput,
                  r.throughput / raw, r.mean_batch, r.p50_ms, r.p99_ms);
      std::fflush(stdout);
    }
    return 0;
  }
  std::vector<RawConfig> configs{{1, false}, {1, true}};
  if (g_gpu >= 0) {
    configs = {{1, false}, {2, false}};  // sessions on the one device
  } else if (cores > 1) {
    configs.push_back({cores, false});
  }
  if (raw_gather) {
    const size_t plain = configs.size();
    for (size_t i = 0; i < plain; ++i) {
      RawConfig g = configs[i];
      g.gather = true;
      configs.push_back(g);
    }
  }
  std::printf("raw ONNX Runtime items/s (SxTt = S parallel sessions with T intra-op threads each)\n  batch");
  for (const auto& c : configs) std::printf("  %10s", c.Name(cores).c_str());
  std::printf("\n");
  double ceiling = 0, ceiling_g = 0;
  int best_batch = 0, best_batch_g = 0;
  RawConfig best, best_g;
  for (int b : raw_batches) {
    std::printf("  %5d", b);
    for (const auto& c : configs) {
      double t = RawThroughput(model, cores, b, seconds, shape, c);
      std::printf("  %10.1f", t);
      std::fflush(stdout);
      double& top = c.gather ? ceiling_g : ceiling;
      if (t > top) {
        top = t;
        (c.gather ? best_batch_g : best_batch) = b;
        (c.gather ? best_g : best) = c;
      }
    }
    std::printf("\n");
  }
  std::printf("  ceiling X* = %.1f items/s at batch %d, %s\n", ceiling, best_batch, best.Name(cores).c_str());
  if (raw_gather) {
    std::printf("  ceiling with gathering X*g = %.1f items/s at batch %d, %s (%.3f of X*)\n", ceiling_g, best_batch_g,
                best_g.Name(cores).c_str(), ceiling_g / ceiling);
  }
  std::printf("\n");

  std::printf("quern::Engine, max_batch_size %d, %d instance(s) (0 = one per core), single-item requests, %s\n",
              max_batch, g_instances,
              mode == "callbacks" ? "N in flight via completion callbacks" : "N threads blocking on futures");
  std::printf("  X*now = the ceiling configuration measured again right before each engine run\n");
  std::printf("  limit = the batch size limit at the end of the run (tuning on: what the tuner settled on)\n");
  if (raw_gather)
    std::printf("  X*g now = the gathering ceiling's configuration measured right before each engine run\n");
  std::printf("  in flight  tuning   items/s   x X*   X*now  x X*now  mean batch  limit   p50 ms   p99 ms%s\n",
              raw_gather ? "  X*g now  x X*g now" : "");
  std::vector<bool> tunings;
  if (tuning != "off") tunings.push_back(true);
  if (tuning != "on") tunings.push_back(false);
  for (int n : submitters) {
    for (bool tuned : tunings) {
      const double now = RawThroughput(model, cores, best_batch, seconds, shape, best);
      const double now_g = raw_gather ? RawThroughput(model, cores, best_batch_g, seconds, shape, best_g) : 0;
      EngineResult r = EngineThroughput(model, max_batch, n, seconds, shape, mode == "callbacks", tuned);
      std::printf("  %9d  %6s  %8.1f  %5.3f  %7.1f  %6.3f  %10.2f  %5lld  %7.2f  %7.2f", n, tuned ? "on" : "off",
                  r.throughput, r.throughput / ceiling, now, r.throughput / now, r.mean_batch,
                  static_cast<long long>(r.batch_limit), r.p50_ms, r.p99_ms);
      if (raw_gather) std::printf("  %7.1f  %9.3f", now_g, r.throughput / now_g);
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  if (gain_submitters <= 0) return 0;
  EngineResult batched = EngineThroughput(model, max_batch, gain_submitters, seconds, shape, mode == "callbacks");
  EngineResult single = EngineThroughput(model, 1, gain_submitters, seconds, shape, mode == "callbacks");
  std::printf(
      "\nbatching gain with %d submitters: %.1f items/s (max_batch_size %d) vs %.1f (max_batch_size 1) = %.2fx\n",
      gain_submitters, batched.throughput, max_batch, single.throughput, batched.throughput / single.throughput);
  return 0;
}
