// Helpers shared by the libFuzzer targets: what every target does with a
// parsed tensor, and the KServe writer round trip.
//
// A target must be deterministic, keep no state between inputs that changes
// what the next input does, touch no network and write files only under its
// own temporary directory.
#pragma once

#include <pthread.h>
#include <rapidjson/document.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "protocol/kserve_codec.h"
#include "quern/tensor.h"
#include "store/result_store.h"

namespace quern::fuzz {

inline std::string_view AsView(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// Stops the run with a message: libFuzzer saves the input as a crash.
[[noreturn]] inline void Fail(const char* what, const std::string& detail = "") {
  std::fprintf(stderr, "fuzz invariant broken: %s %s\n", what, detail.c_str());
  std::abort();
}

// Fails unless `json` is a JSON document (NaN and Infinity allowed, as
// Python's json module, and so tritonclient, reads them).
inline void CheckJson(std::string_view json, const char* what) {
  rapidjson::Document doc;
  doc.Parse<rapidjson::kParseIterativeFlag | rapidjson::kParseNanAndInfFlag>(json.data(), json.size());
  if (!doc.HasParseError()) return;
  Fail(what, std::string(json.substr(0, 400)));
}

// What the engine and the writers do with a tensor a client sent: check it
// against its shape, then read it. Every byte is touched, so ASan sees a
// tensor that claims more bytes than it has.
inline void TouchTensor(const Tensor& t) {
  (void)t.element_count();
  (void)ShapeToString(t.shape());
  if (!t.Validate().ok()) return;
  uint8_t sum = 0;
  for (size_t i = 0; i < t.byte_size(); ++i) sum ^= static_cast<uint8_t>(t.data()[i]);
  if (t.dtype() == DataType::kBytes) {
    auto strings = t.Strings();
    if (strings && static_cast<int64_t>(strings->size()) != t.element_count()) {
      Fail("a valid BYTES tensor splits into a different number of strings than its shape",
           ShapeToString(t.shape()) + " " + std::to_string(strings->size()));
    }
  }
  volatile uint8_t sink = sum;
  (void)sink;
}

// Writes tensors back as a KServe v2 response (JSON and binary parts), as an
// echo model would return what it was given. Outputs live in buffers of
// their own (a binary input may sit at any offset of its body, and outputs
// never do), so each tensor is copied first, as the result stores do.
inline void WriteBack(const std::vector<NamedTensor>& tensors, const KServeOutputFormat& format) {
  std::vector<NamedTensor> valid;
  for (const auto& t : tensors) {
    if (t.tensor.Validate().ok()) valid.push_back({t.name, OwnedCopy(t.tensor)});
  }
  rapidjson::StringBuffer sb;
  rapidjson::Writer<rapidjson::StringBuffer> w(sb);
  w.StartObject();
  w.Key("outputs");
  std::vector<const Tensor*> binary_parts;
  if (!WriteKServeOutputs(w, valid, format, binary_parts).ok()) return;
  w.EndObject();
  KServeMessage m = JoinKServeMessage(sb, binary_parts);
  size_t binary_bytes = 0;
  for (const Tensor* t : binary_parts) binary_bytes += t->byte_size();
  if (m.bytes.size() != m.json_size + binary_bytes) Fail("a KServe message is not its JSON and its binary parts");
  CheckJson(std::string_view(m.bytes).substr(0, m.json_size), "a KServe response is not JSON");
}

// Runs each input on a thread with a small stack (1 MiB; a server thread
// has 8). Recursion that grows with the input then overflows at depths that
// inputs of a fuzzer's sizes reach (tens of KiB), where on 8 MiB it would
// take hundreds of KiB: a JSON body nested 60,000 deep overflows here, and
// only past 80,000 on the main thread. One thread for the whole run.
class SmallStack {
 public:
  static constexpr size_t kStackBytes = size_t{1} << 20;

  // Runs `fn` on the small stack and returns when it has returned.
  static void Run(const std::function<void()>& fn) {
    static SmallStack* instance = new SmallStack;  // never destroyed: the thread runs to the end
    instance->RunOne(fn);
  }

 private:
  SmallStack() {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, kStackBytes);
    pthread_t thread;
    if (pthread_create(&thread, &attr, &SmallStack::Loop, this) != 0) Fail("cannot start the small-stack thread");
    pthread_attr_destroy(&attr);
    pthread_detach(thread);
  }

  void RunOne(const std::function<void()>& fn) {
    std::unique_lock<std::mutex> lock(mu_);
    job_ = &fn;
    cv_.notify_all();
    cv_.wait(lock, [this] { return job_ == nullptr; });
  }

  static void* Loop(void* self) {
    auto* s = static_cast<SmallStack*>(self);
    std::unique_lock<std::mutex> lock(s->mu_);
    while (true) {
      s->cv_.wait(lock, [s] { return s->job_ != nullptr; });
      (*s->job_)();
      s->job_ = nullptr;
      s->cv_.notify_all();
    }
    return nullptr;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void()>* job_ = nullptr;
};

}  // namespace quern::fuzz
