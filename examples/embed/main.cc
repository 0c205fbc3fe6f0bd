// Embeds Quern's engine: a C++ model registered in code, requests scheduled
// from several threads without waiting, their answers polled from a
// completion queue, and the telemetry of each printed. With a model
// repository as its argument it also runs the repository's add_sub (ONNX
// Runtime, loaded from Quern's installation).
#include <quern/engine.h>

#include <cstdio>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace {

// y = 2x, for any batch: the model's Execute never runs twice at once on one
// instance; the engine batches the requests of every caller into it.
class Doubler final : public quern::Model {
 public:
  quern::Status Execute(const std::vector<quern::NamedTensor>& inputs, int64_t batch,
                        std::vector<quern::NamedTensor>& outputs) override {
    auto x = inputs[0].tensor.values<float>();
    std::vector<float> y(x.begin(), x.end());
    for (float& v : y) v *= 2;
    outputs.push_back({"y", quern::Tensor::From<float>(quern::DataType::kFp32, {batch, 4}, y)});
    return quern::Status::Ok();
  }
};

}  // namespace

int main(int argc, char** argv) {
  quern::EngineOptions options;
  if (argc > 1) options.model_repository = argv[1];
  auto engine = quern::Engine::Create(options);
  if (!engine) {
    std::fprintf(stderr, "engine: %s\n", engine.error().ToString().c_str());
    return 1;
  }
  quern::ModelConfig config;
  config.name = "doubler";
  config.max_batch_size = 8;
  config.inputs = {{"x", quern::DataType::kFp32, {4}}};
  config.outputs = {{"y", quern::DataType::kFp32, {4}}};
  config.instance_count = 1;
  quern::BatchingConfig batching;
  batching.max_queue_delay_us = 2000;  // a little time for company
  config.batching = batching;
  if (auto st = (*engine)->RegisterModel(config, [] { return std::make_unique<Doubler>(); }); !st.ok()) {
    std::fprintf(stderr, "register: %s\n", st.ToString().c_str());
    return 1;
  }

  // 4 threads schedule 8 requests each; nobody waits on a single answer.
  quern::CompletionQueue answers;
  std::map<uint64_t, float> sent;  // request id -> its first value
  std::mutex mu;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 8; ++i) {
        const float v = static_cast<float>(t * 100 + i);
        quern::InferRequest r;
        r.model = "doubler";
        r.inputs = {{"x", quern::Tensor::From<float>(quern::DataType::kFp32, {1, 4}, std::vector<float>{v, v, v, v})}};
        auto id = (*engine)->InferAsync(std::move(r), &answers);
        std::lock_guard<std::mutex> lock(mu);
        if (id) sent[*id] = v;
      }
    });
  }
  for (auto& th : threads) th.join();
  int wrong = 0;
  for (size_t got = 0; got < sent.size(); ++got) {
    quern::InferResponse r = answers.Wait();
    const float want = 2 * sent.at(r.request_id);
    const bool right = r.status.ok() && r.outputs.size() == 1 && r.outputs[0].tensor.values<float>()[0] == want;
    wrong += right ? 0 : 1;
    std::printf("request %llu: y[0] = %g (%s), batch of %lld, queued %.3f ms, computed %.3f ms\n",
                static_cast<unsigned long long>(r.request_id), right ? want : -1.0, right ? "right" : "WRONG",
                static_cast<long long>(r.telemetry.batch_size), r.telemetry.queue_ns() / 1e6,
                r.telemetry.compute_ns() / 1e6);
  }

  if (argc > 1) {
    quern::InferRequest r;
    r.model = "add_sub";
    r.inputs = {
        {"INPUT0", quern::Tensor::From<float>(quern::DataType::kFp32, {1, 4}, std::vector<float>{1, 2, 3, 4})},
        {"INPUT1", quern::Tensor::From<float>(quern::DataType::kFp32, {1, 4}, std::vector<float>{10, 20, 30, 40})}};
    quern::InferResponse resp = (*engine)->Infer(std::move(r)).get();
    const auto* sum = resp.FindOutput("OUTPUT0");
    const bool right = resp.status.ok() && sum && sum->values<float>()[3] == 44.f;
    wrong += right ? 0 : 1;
    std::printf("add_sub (ONNX Runtime): %s\n", right ? "11 22 33 44, right" : resp.status.ToString().c_str());
  }
  std::printf("quern %s: %zu requests, %d wrong\n", quern::Version(), sent.size(), wrong);
  return wrong == 0 && sent.size() == 32 ? 0 : 1;
}
