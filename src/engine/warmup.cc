#include "engine/warmup.h"

#include <fstream>
#include <random>
#include <string>

#include "core/repository.h"
#include "engine/batch_assembly.h"

namespace quern {
namespace {

// Warm-up tensors larger than this are refused (a typo in dims must not
// exhaust memory while loading).
constexpr int64_t kMaxWarmupBytes = int64_t{1} << 30;

Tensor MakeWarmupTensor(const WarmupInput& in, Shape shape, const std::filesystem::path& dir, Status& error) {
  const int64_t n = ElementCount(shape);
  const int64_t total = ByteCount(shape, in.dtype == DataType::kBytes ? 4 : DataTypeByteSize(in.dtype));
  if (n < 0 || total < 0 || total > kMaxWarmupBytes) {
    error = InvalidArgument("warm-up input of shape " + ShapeToString(shape) + " would take more than " +
                            std::to_string(kMaxWarmupBytes) + " bytes");
    return Tensor();
  }
  if (in.dtype == DataType::kBytes) {
    return Tensor::FromStrings(std::move(shape), std::vector<std::string>(static_cast<size_t>(n)));
  }
  const size_t bytes = static_cast<size_t>(total);
  Tensor t = Tensor::Allocate(in.dtype, std::move(shape), bytes);
  if (in.fill == WarmupInput::Fill::kRandom) {
    std::mt19937 rng(42);
    if (in.dtype == DataType::kFp32) {
      std::uniform_real_distribution<float> dist(0.f, 1.f);
      auto* f = reinterpret_cast<float*>(t.mutable_data());
      for (int64_t i = 0; i < n; ++i) f[i] = dist(rng);
    } else if (in.dtype != DataType::kBool) {
      for (size_t i = 0; i < bytes; ++i) t.mutable_data()[i] = static_cast<std::byte>(rng() & 0x3f);
    }
  } else if (in.fill == WarmupInput::Fill::kFile) {
    auto resolved = ResolveInRepository(dir, dir / "warmup", in.file, "warm-up data file");
    if (!resolved) {
      error = resolved.error();
      return t;
    }
    const auto& path = *resolved;
    std::ifstream f(path, std::ios::binary);
    if (!f) {
      error = NotFound("warm-up data file " + path.string() + " cannot be opened");
      return t;
    }
    f.read(reinterpret_cast<char*>(t.mutable_data()), static_cast<std::streamsize>(bytes));
    if (static_cast<size_t>(f.gcount()) != bytes) {
      error = InvalidArgument("warm-up data file " + path.string() + " holds " + std::to_string(f.gcount()) +
                              " bytes, the input needs " + std::to_string(bytes));
    }
  }
  return t;
}

}  // namespace

Result<std::vector<NamedTensor>> WarmupInputs(const ModelConfig& config, const WarmupSample& sample,
                                              const std::filesystem::path& model_dir, int64_t& rows) {
  std::vector<NamedTensor> inputs;
  rows = config.max_batch_size > 0 ? PaddedBatchSize(config.fixed_batch_sizes, sample.batch_size) : 0;
  for (const auto& [name, in] : sample.inputs) {
    Shape shape = in.dims;
    if (rows > 0) shape.insert(shape.begin(), rows);
    Status error;
    Tensor t = MakeWarmupTensor(in, std::move(shape), model_dir, error);
    if (!error.ok()) {
      return Err(Status(error.code(), "model '" + config.name + "' warm-up '" + sample.name + "': " + error.message()));
    }
    if (const TensorConfig* tc = config.FindInput(name); tc && tc->reshape) {
      Shape r = *tc->reshape;
      if (rows > 0) r.insert(r.begin(), rows);
      t = t.Reshaped(std::move(r));
    }
    inputs.push_back({name, std::move(t)});
  }
  return inputs;
}

}  // namespace quern
