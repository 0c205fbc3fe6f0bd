// python_bench: what serving a Python model costs beyond the Python function.
//
//   python_bench --seconds 5 --submitters 1 8 --bytes 16 1048576
//
// Writes a repository with two Python models whose functions cost next to
// nothing -- echo (infer() returns its input, a view of the shared memory:
// nothing is copied on the way out) and constant (returns an array made
// once, which is copied into the shared memory on the way out) -- into a
// temporary folder, loads it in an Engine, and has N threads send requests
// back to back through Engine::Infer (or Engine::Run with --run) for each model and payload size. Reports requests/s,
// latency, and CPU per request of this process (the engine: batching,
// copies into and out of shared memory, the socket round trip) and of the
// model's Python processes (the stub: reading the batch, calling infer(),
// writing the outputs), read from /proc. The payload goes both ways: N bytes
// in, N bytes out.
//
//   python_bench --bls 20 --submitters 1 --bytes 16
//
// adds two Triton-API models that call a model computing nothing (an ONNX
// model of one Identity node, run by ONNX Runtime) from execute(): calls_0
// makes no call, calls_N makes N (BLS: pb_utils.InferenceRequest.exec());
// the CPU of a call (this process and the Python process together) is their
// difference over N, printed beside the CPU of a process round trip measured
// in the same run by bench/ipc_floor (its "any cores" line).
#include <dirent.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "core/cpus.h"
#include "quern/engine.h"
#include "quern/model.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// CPU seconds of this process's live children (utime + stime from /proc).
double ChildrenCpuSeconds() {
  const pid_t self = getpid();
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  double total = 0;
  DIR* d = opendir("/proc");
  if (!d) return 0;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    std::ifstream f(std::string("/proc/") + e->d_name + "/stat");
    std::string line;
    if (!std::getline(f, line)) continue;
    const size_t close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    std::string state;
    long ppid = 0;
    rest >> state >> ppid;
    if (ppid != self) continue;
    std::string skip;
    for (int i = 0; i < 9; ++i) rest >> skip;  // pgrp .. cmajflt
    unsigned long long utime = 0, stime = 0;
    rest >> utime >> stime;
    total += (utime + stime) / tick;
  }
  closedir(d);
  return total;
}

void WriteModel(const fs::path& repo, const std::string& name, const std::string& code, int instances, int max_batch) {
  fs::create_directories(repo / name / "1");
  std::ofstream(repo / name / "config.pbtxt") << "backend: \"python\"\n"
                                              << "max_batch_size: " << max_batch << "\n"
                                              << "input [ { name: \"x\" data_type: TYPE_UINT8 dims: [ -1 ] } ]\n"
                                              << "output [ { name: \"y\" data_type: TYPE_UINT8 dims: [ -1 ] } ]\n"
                                              << "dynamic_batching { }\n"
                                              << "instance_group [ { count: " << instances << " } ]\n";
  std::ofstream(repo / name / "1" / "model.py") << code;
}

// The answer `model` gives for `payload`: spot checks (a full compare would
// cost as much as the copies measured), and every byte on a thread's first
// answer.
bool Right(const std::string& model, const std::vector<uint8_t>& payload, const quern::InferResponse& resp, bool full) {
  if (!resp.status.ok() || resp.outputs.size() != 1 || resp.outputs[0].tensor.byte_size() != payload.size()) {
    return false;
  }
  const auto* got = reinterpret_cast<const uint8_t*>(resp.outputs[0].tensor.data());
  const size_t step = full ? 1 : std::max<size_t>(1, payload.size() / 61);
  for (size_t i = 0; i < payload.size(); i += step) {
    if (got[i] != (model != "constant" ? payload[i] : 7)) return false;  // the others answer their input
  }
  return got[payload.size() - 1] == (model != "constant" ? payload.back() : 7);
}

// A model that computes nothing, the callee of calls_N: one ONNX Identity node, x -> y, UINT8 [N, L]
// (ONNX IR 8, opset 13; written by onnx.helper and checked by onnx.checker).
constexpr unsigned char kIdentityOnnx[] = {
    0x08, 0x08, 0x12, 0x00, 0x3a, 0x49, 0x0a, 0x10, 0x0a, 0x01, 0x78, 0x12, 0x01, 0x79, 0x22, 0x08, 0x49,
    0x64, 0x65, 0x6e, 0x74, 0x69, 0x74, 0x79, 0x12, 0x07, 0x6e, 0x6f, 0x74, 0x68, 0x69, 0x6e, 0x67, 0x5a,
    0x15, 0x0a, 0x01, 0x78, 0x12, 0x10, 0x0a, 0x0e, 0x08, 0x02, 0x12, 0x0a, 0x0a, 0x03, 0x12, 0x01, 0x4e,
    0x0a, 0x03, 0x12, 0x01, 0x4c, 0x62, 0x15, 0x0a, 0x01, 0x79, 0x12, 0x10, 0x0a, 0x0e, 0x08, 0x02, 0x12,
    0x0a, 0x0a, 0x03, 0x12, 0x01, 0x4e, 0x0a, 0x03, 0x12, 0x01, 0x4c, 0x42, 0x04, 0x0a, 0x00, 0x10, 0x0d};

void WriteNothing(const fs::path& repo, int max_batch) {
  fs::create_directories(repo / "nothing" / "1");
  std::ofstream(repo / "nothing" / "config.pbtxt") << "backend: \"onnxruntime\"\n"
                                                   << "max_batch_size: " << max_batch << "\n"
                                                   << "dynamic_batching { }\n";
  std::ofstream(repo / "nothing" / "1" / "model.onnx", std::ios::binary)
      .write(reinterpret_cast<const char*>(kIdentityOnnx), sizeof kIdentityOnnx);
}

// calls_N: execute() calls "nothing" N times per request (BLS), then answers its input.
std::string CallerCode(int calls) {
  return "import triton_python_backend_utils as pb_utils\n\n\n"
         "class TritonPythonModel:\n"
         "    def execute(self, requests):\n"
         "        out = []\n"
         "        for r in requests:\n"
         "            x = pb_utils.get_input_tensor_by_name(r, \"x\")\n"
         "            for _ in range(" +
         std::to_string(calls) +
         "):\n"
         "                a = pb_utils.InferenceRequest(model_name=\"nothing\", inputs=[x],\n"
         "                                              requested_output_names=[\"y\"]).exec()\n"
         "                if a.has_error():\n"
         "                    raise pb_utils.TritonModelException(a.error().message())\n"
         "            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(\"y\", x.as_numpy())]))\n"
         "        return out\n";
}

// bench/ipc_floor's "any cores" CPU per round trip (both processes), µs; 0 when it cannot run.
double IpcFloorCpuUs(const fs::path& self) {
  const fs::path floor = self.parent_path() / "ipc_floor";
  FILE* p = popen((floor.string() + " 100000 2>/dev/null").c_str(), "r");
  if (!p) return 0;
  char line[256];
  double wall = 0, one = 0, other = 0, both = 0;
  while (std::fgets(line, sizeof line, p)) {
    if (std::sscanf(line, "any cores %lf %lf %lf %lf", &wall, &one, &other, &both) == 4) break;
  }
  pclose(p);
  return both;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Python model serving cost"};
  double seconds = 5;
  std::vector<int> submitters = {1, 8};
  std::vector<int64_t> sizes = {16, 1 << 20};
  int instances = 1;
  int max_batch = 32;
  app.add_option("--seconds", seconds, "measured time per setting");
  app.add_option("--submitters", submitters, "concurrent submitting threads");
  app.add_option("--bytes", sizes, "payload per request, each way");
  app.add_option("--instances", instances, "Python processes");
  app.add_option("--max-batch", max_batch, "max_batch_size");
  int bls = 0;
  app.add_option("--bls", bls, "also measure BLS calls: models making 0 and this many calls per request");
  bool run = false;
  app.add_flag("--run", run,
               "submit through Engine::Run (the caller runs the batch when an instance is free) "
               "instead of Engine::Infer");
  CLI11_PARSE(app, argc, argv);

  char tmpl[] = "/tmp/quern-python-bench-XXXXXX";
  if (!mkdtemp(tmpl)) return 1;
  const fs::path repo(tmpl);
  WriteModel(repo, "echo", "def infer(inputs):\n    return {\"y\": inputs[\"x\"]}\n", instances, max_batch);
  WriteModel(repo, "constant",
             "import numpy as np\nmade = {}\n\ndef infer(inputs):\n    x = inputs[\"x\"]\n"
             "    if x.shape not in made:\n        made[x.shape] = np.full(x.shape, 7, np.uint8)\n"
             "    return {\"y\": made[x.shape]}\n",
             instances, max_batch);
  std::vector<std::string> models = {"echo", "constant"};
  const std::string calls_n = "calls_" + std::to_string(bls);
  if (bls > 0) {
    WriteModel(repo, "calls_0", CallerCode(0), instances, max_batch);
    WriteModel(repo, calls_n, CallerCode(bls), instances, max_batch);
    WriteNothing(repo, max_batch);
    models = {"calls_0", calls_n};
  }
  quern::EngineOptions options;
  options.model_repository = repo.string();
  options.load_all_models = false;
  auto engine = quern::Engine::Create(options);
  if (!engine) {
    std::fprintf(stderr, "%s\n", engine.error().ToString().c_str());
    return 1;
  }
  if (bls > 0) {
    if (auto st = (*engine)->LoadModel("nothing"); !st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
  }
  for (const std::string& model : models) {
    if (auto st = (*engine)->LoadModel(model); !st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
  }
  std::vector<double> cpu_per_request;  // engine + python, µs, per model, the last setting's
  std::printf("%-9s %-11s %-9s %10s %9s %9s %12s %12s %9s\n", "model", "submitters", "bytes", "req/s", "p50 ms",
              "p99 ms", "engine us/r", "python us/r", "batch");
  for (const std::string& model : models) {
    for (int64_t size : sizes) {
      std::vector<uint8_t> payload(static_cast<size_t>(size));
      for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 7);
      for (int n : submitters) {
        std::atomic<bool> measuring{false}, stop{false};
        std::vector<std::vector<double>> lat(n);
        std::vector<int64_t> batch_sum(n, 0);
        std::vector<std::thread> threads;
        for (int t = 0; t < n; ++t) {
          threads.emplace_back([&, t] {
            for (bool first = true; !stop.load(); first = false) {
              quern::InferRequest r;
              r.model = model;
              r.inputs = {
                  {"x", quern::Tensor::Borrow(quern::DataType::kUint8, {1, size}, payload.data(), payload.size())}};
              const auto t0 = Clock::now();
              quern::InferResponse resp = run ? (*engine)->Run(std::move(r)) : (*engine)->Infer(std::move(r)).get();
              if (!Right(model, payload, resp, first)) {
                std::fprintf(stderr, "wrong answer: %s\n", resp.status.ToString().c_str());
                std::exit(1);
              }
              if (measuring.load(std::memory_order_relaxed)) {
                lat[t].push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
                batch_sum[t] += resp.telemetry.batch_size;
              }
            }
          });
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(500));  // warm-up
        const double self0 = quern::ProcessCpuSeconds(), child0 = ChildrenCpuSeconds();
        const auto w0 = Clock::now();
        measuring = true;
        std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
        measuring = false;
        const double wall = std::chrono::duration<double>(Clock::now() - w0).count();
        const double self1 = quern::ProcessCpuSeconds(), child1 = ChildrenCpuSeconds();
        stop = true;
        for (auto& th : threads) th.join();
        std::vector<double> all;
        int64_t batches = 0;
        for (int t = 0; t < n; ++t) {
          all.insert(all.end(), lat[t].begin(), lat[t].end());
          batches += batch_sum[t];
        }
        std::sort(all.begin(), all.end());
        const double count = static_cast<double>(all.size());
        if (all.empty()) continue;
        std::printf("%-9s %-11d %-9lld %10.0f %9.3f %9.3f %12.1f %12.1f %9.2f\n", model.c_str(), n,
                    static_cast<long long>(size), count / wall, all[all.size() / 2],
                    all[std::min(all.size() - 1, all.size() * 99 / 100)], (self1 - self0) / count * 1e6,
                    (child1 - child0) / count * 1e6, batches / count);
        cpu_per_request.push_back((self1 - self0 + child1 - child0) / count * 1e6);
      }
    }
  }
  if (bls > 0 && cpu_per_request.size() >= 2) {
    // The last setting of each model: calls_0's, then calls_N's.
    const size_t per_model = cpu_per_request.size() / 2;
    const double call = (cpu_per_request[2 * per_model - 1] - cpu_per_request[per_model - 1]) / bls;
    const double floor = IpcFloorCpuUs(fs::absolute(argv[0]));
    std::printf("BLS call to a model computing nothing: %.1f us CPU (server + Python process)\n", call);
    if (floor > 0) {
      std::printf("process round trip (bench/ipc_floor, any cores): %.1f us CPU; the call is %.2fx it\n", floor,
                  call / floor);
    }
  }
  engine->reset();
  fs::remove_all(repo);
  return 0;
}
