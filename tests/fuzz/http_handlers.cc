// Fuzz target: the HTTP handlers (KServe v2, vision, jobs) at handler level,
// as the server calls them after reading a request, over a real
// quern::Engine serving small generated models (scripts/gen_models.py
// --tests; the build writes them to QUERN_FUZZ_MODELS_DIR, or set
// QUERN_FUZZ_MODELS). The models are copied once into a temporary
// repository, removed at exit.
//
// Input, as an HTTP/1.1 request without the version:
//   METHOD TARGET\n
//   name: value\n          (headers, any number; names are lower-cased as the server does)
//   \n
//   body
// "$JOB" in the target stands for the id of the last job submitted. A first
// line without a space is a target (POST when a body follows, else GET).
//
// Each request must be answered exactly once, with a status from 100 to 599
// and, for JSON answers, a body that parses. Handlers are called on a small
// stack (fuzz_util.h), so that deep nesting overflows early.
//
// POST /v2/repository/models/{m}/load and /unload are fuzzed too: after
// each request, any served model that is no longer ready is loaded again,
// so that every input runs against the same models.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <system_error>

#include "frontends/http/kserve_handler.h"
#include "frontends/jobs/job_handler.h"
#include "frontends/vision/vision_handler.h"
#include "fuzz_util.h"
#include "store/result_store.h"

#ifndef QUERN_FUZZ_MODELS_DIR
#define QUERN_FUZZ_MODELS_DIR ""
#endif

namespace fs = std::filesystem;

namespace {

struct World {
  fs::path repo;
  quern::Engine* engine = nullptr;
  quern::KServeHandler* kserve = nullptr;
  quern::VisionService* vision_service = nullptr;
  quern::VisionHandler* vision = nullptr;
  quern::MemoryResultStore* store = nullptr;
  quern::JobHandler* jobs = nullptr;
  quern::Router* router = nullptr;  // the three front ends' routes, as the server's HTTP port has them
  std::string last_job_id = "0";
};
World* world = nullptr;

[[noreturn]] void Die(const std::string& why) {
  std::fprintf(stderr, "http_handlers: %s\n", why.c_str());
  std::exit(2);
}

void WriteText(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

// The repository: small models of every kind the handlers treat differently
// (derived config, BYTES and other types, runtime failure, fixed batch sizes,
// no batching, several versions, detection, classification).
void MakeRepository(const fs::path& models, const fs::path& repo) {
  for (const char* m :
       {"add_sub", "dtypes", "fail_on_3", "fixed4", "nobatch", "tile4", "versions", "detect_yolov8", "detect_detr"}) {
    std::error_code ec;
    fs::copy(models / m, repo / m, fs::copy_options::recursive, ec);
    if (ec) Die("cannot copy test model " + (models / m).string() + ": " + ec.message());
  }
  // fixed4 without its 20 ms queue delay: inputs stay fast.
  WriteText(repo / "fixed4/config.pbtxt", R"(name: "fixed4"
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]
dynamic_batching { }
parameters { key: "quern.fixed_batch_sizes" value { string_value: "4" } }
)");
  // A classifier for /predict: the detector's graph, read as 224 class scores.
  std::error_code ec;
  fs::create_directories(repo / "classify/1");
  fs::copy_file(models / "detect_yolov8/1/model.onnx", repo / "classify/1/model.onnx", ec);
  if (ec) Die("cannot copy the detector model: " + ec.message());
  WriteText(repo / "classify/config.pbtxt", R"(max_batch_size: 8
input [ { name: "images" data_type: TYPE_FP32 dims: [ 3, 64, 64 ] } ]
output [ { name: "output0" data_type: TYPE_FP32 dims: [ 7, 32 ] label_filename: "labels.txt" } ]
dynamic_batching { }
parameters { key: "quern.task" value { string_value: "classification" } }
parameters { key: "quern.image.resize" value { string_value: "center_crop" } }
)");
  WriteText(repo / "classify/labels.txt", "red\ngreen\nblue\n");
}

void Shutdown() {
  if (world == nullptr) return;
  delete world->router;
  delete world->vision_service;  // waits for its images, which need the engine and the handler
  delete world->vision;
  delete world->kserve;
  delete world->engine;  // drains: job callbacks still reach the job handler
  delete world->jobs;
  delete world->store;
  std::error_code ec;
  fs::remove_all(world->repo, ec);
  delete world;
  world = nullptr;
}

// The models of the repository (MakeRepository), loaded again after a
// request unloaded one.
constexpr const char* kServed[] = {"add_sub", "dtypes",   "fail_on_3",     "fixed4",      "nobatch",
                                   "tile4",   "versions", "detect_yolov8", "detect_detr", "classify"};

void RestoreModels() {
  for (const char* m : kServed) {
    if (world->engine->ModelReady(m)) continue;
    if (auto s = world->engine->LoadModel(m); !s.ok()) Die(std::string("cannot load ") + m + " again: " + s.message());
  }
}

quern::HttpRequest ParseInput(std::string_view in) {
  quern::HttpRequest r;
  auto take_line = [&in]() {
    const size_t nl = in.find('\n');
    std::string_view line = in.substr(0, nl);
    in.remove_prefix(nl == std::string_view::npos ? in.size() : nl + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    return line;
  };
  const std::string_view first = take_line();
  if (const size_t sp = first.find(' '); sp != std::string_view::npos) {
    r.method.assign(first.substr(0, sp));
    r.target.assign(first.substr(sp + 1));
  } else {
    r.target.assign(first);
  }
  while (!in.empty()) {
    const std::string_view line = take_line();
    if (line.empty()) break;
    const size_t colon = line.find(':');
    std::string name(line.substr(0, colon));
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    std::string_view value = colon == std::string_view::npos ? std::string_view() : line.substr(colon + 1);
    while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
    r.headers.emplace_back(std::move(name), std::string(value));
  }
  r.body.assign(in);
  if (r.method.empty()) r.method = r.body.empty() ? "GET" : "POST";
  if (const size_t j = r.target.find("$JOB"); j != std::string::npos) r.target.replace(j, 4, world->last_job_id);
  return r;
}

struct Call {
  std::promise<quern::HttpResponse> response;
  std::atomic<int> answers{0};
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  const char* env = std::getenv("QUERN_FUZZ_MODELS");
  const fs::path models = env != nullptr ? env : QUERN_FUZZ_MODELS_DIR;
  if (models.empty() || !fs::exists(models / "add_sub")) {
    Die("no test models in '" + models.string() +
        "': build the fuzz preset (it runs scripts/gen_models.py --tests) or set QUERN_FUZZ_MODELS");
  }
  world = new World;
  std::string tmpl = (fs::temp_directory_path() / "quern-fuzz-XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) Die("mkdtemp failed");
  world->repo = tmpl;
  MakeRepository(models, world->repo);

  quern::EngineOptions eo;
  eo.model_repository = world->repo.string();
  eo.cores = 1;
  auto engine = quern::Engine::Create(eo);
  if (!engine) Die("engine: " + engine.error().ToString());
  world->engine = engine->release();
  for (const auto& m : world->engine->ListModels()) {
    if (m.state != quern::ModelState::kReady) Die("model " + m.name + " did not load: " + m.reason);
  }
  world->kserve = new quern::KServeHandler(world->engine);
  quern::VisionServiceOptions vo;
  vo.model_repository = world->repo;
  vo.stage_threads = 1;
  vo.max_image_pixels = int64_t{1} << 22;
  world->vision_service = new quern::VisionService(world->engine, vo);
  world->vision = new quern::VisionHandler(world->vision_service, {});
  quern::MemoryResultStoreOptions so;
  so.max_bytes = size_t{16} << 20;
  so.max_tombstones = 1024;
  world->store = new quern::MemoryResultStore(so);
  world->jobs = new quern::JobHandler(world->engine, world->store);
  world->router = new quern::Router();
  for (const quern::Status& st : {world->kserve->AddRoutes(*world->router), world->jobs->AddRoutes(*world->router),
                                  world->vision->AddRoutes(*world->router)}) {
    if (!st.ok()) Die("routes: " + st.ToString());
  }
  std::atexit(Shutdown);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  quern::HttpRequest request = ParseInput(quern::fuzz::AsView(data, size));
  request.cancel = std::make_shared<quern::CancellationToken>();
  const std::string target = request.target;

  auto call = std::make_shared<Call>();
  auto future = call->response.get_future();
  quern::HttpDone done = [call](quern::HttpResponse r) {
    if (call->answers.fetch_add(1) != 0) quern::fuzz::Fail("a request was answered twice");
    call->response.set_value(std::move(r));
  };
  quern::fuzz::SmallStack::Run([&] {
    // The checks the server makes from a request's head first (their
    // answer, when there is one, is not the request's: it goes on anyway).
    (void)world->router->Head(request);
    world->router->Dispatch(std::move(request), std::move(done));
  });
  if (future.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    quern::fuzz::Fail("no answer within 30 s", target);
  }
  const quern::HttpResponse r = future.get();
  RestoreModels();
  if (r.status < 100 || r.status > 599) quern::fuzz::Fail("HTTP status out of range", std::to_string(r.status));
  bool binary = false;
  for (const auto& [k, v] : r.headers) binary = binary || k == "Inference-Header-Content-Length";
  if (r.content_type == "application/json" && !binary && !r.body.empty()) {
    quern::fuzz::CheckJson(r.body, "a JSON answer does not parse");
  }
  if (r.status == 202) {
    const std::string key = "\"job_id\":\"";
    if (const size_t at = r.body.find(key); at != std::string::npos) {
      const size_t end = r.body.find('"', at + key.size());
      if (end != std::string::npos) world->last_job_id = r.body.substr(at + key.size(), end - at - key.size());
    }
  }
  return 0;
}
