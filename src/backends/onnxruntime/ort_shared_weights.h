// One copy of an ONNX model's weights for all its instances' sessions.
//
// Each Ort::Session loaded from a file holds its own copy of the weights,
// and of what ONNX Runtime derives from them: convolution weights reordered
// into blocked layouts by its graph optimizations, matrices repacked for its
// GEMM kernels. A model with N instances (and the wide one) held N + 1
// copies. Instead:
//
//  1. One session optimizes the model once and writes the optimized graph,
//     its weights in a separate file, into a private temporary directory
//     (session.optimized_model_external_initializers_*).
//  2. The weights are read once, each at a 64-byte-aligned address of one
//     buffer (ONNX Runtime's kernels run measurably slower on the unaligned
//     weights of an ORT-format file used in place).
//  3. Every instance's session loads the optimized graph without optimizing
//     it again, is given the buffer's tensors as its initializers
//     (OrtApi::AddInitializer), and shares one prepacked-weights container
//     with the model's other sessions, so a repacked matrix exists once.
//
// ONNX Runtime caches the packed form only of weights handed over this way,
// so a repacked matrix then exists twice (its original and one packed form)
// however many sessions share it; one session alone would free the
// original. Hence the backend shares only between two or more sessions.
// Kernels that cannot cache packed weights (the quantized convolutions of a
// QDQ model) refuse the container; then every session packs its own.
// Initializers the graph also lists as inputs (a caller may override them)
// stay with each session.
//
// Thread safety: NewSession may be called from several threads.
#pragma once

#include <onnxruntime_cxx_api.h>

#include <atomic>
#include <cstddef>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "backends/onnxruntime/ort_model.h"
#include "quern/status.h"

namespace quern {

class SharedOnnxWeights {
 public:
  // Optimizes `file` at `graph_optimization_level` (ModelConfig's numbering)
  // and reads its weights. An error from ONNX Runtime (loading, optimizing or
  // saving the model) is INVALID_ARGUMENT naming the model; other failures
  // (no temporary directory, an optimized file that cannot be read) are
  // INTERNAL. Either way the caller may still load the file per instance.
  static Result<std::shared_ptr<SharedOnnxWeights>> Create(const std::string& model_name,
                                                           const std::filesystem::path& file,
                                                           int graph_optimization_level);
  ~SharedOnnxWeights();
  SharedOnnxWeights(const SharedOnnxWeights&) = delete;
  SharedOnnxWeights& operator=(const SharedOnnxWeights&) = delete;

  // A session on the optimized model with `options` (threads, allocators),
  // sharing the weights. Throws Ort::Exception as Ort::Session does. Valid
  // until RemoveFiles(); the session stays valid after it, as long as this
  // object lives.
  Ort::Session NewSession(Ort::SessionOptions& options) const;

  // Removes the temporary directory. Sessions created earlier keep working.
  void RemoveFiles();

  // The model's inputs and outputs.
  const OnnxModelIO& io() const { return io_; }
  // How many weights, and how many bytes, the sessions share directly.
  size_t shared_count() const { return names_.size(); }
  size_t shared_bytes() const { return shared_bytes_; }

 private:
  struct AlignedFree {
    void operator()(std::byte* p) const;
  };
  SharedOnnxWeights() = default;
  Status Read(const std::string& model_name);

  std::filesystem::path dir_;             // the temporary directory
  std::filesystem::path optimized_file_;  // dir_ / "model.onnx"
  OnnxModelIO io_;
  std::unique_ptr<std::byte[], AlignedFree> buffer_;
  size_t shared_bytes_ = 0;
  std::vector<std::string> names_;
  std::vector<Ort::Value> values_;  // tensors over buffer_, one per name
  OrtPrepackedWeightsContainer* container_ = nullptr;
  // Set once a session could not use container_: later ones do without.
  mutable std::atomic<bool> unshareable_packing_{false};
};

}  // namespace quern
