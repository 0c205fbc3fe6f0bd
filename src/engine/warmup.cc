#include "engine/warmup.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <random>
#include <string>

#include "core/repository.h"
#include "engine/batch_assembly.h"

namespace quern {
namespace {

// A warm-up sample larger than this, all its inputs together, is refused (a
// typo in dims must not exhaust memory while loading).
constexpr int64_t kMaxWarmupBytes = int64_t{1} << 30;

// Reads `bytes` bytes of the regular file `path` into `out` (a FIFO, a device
// or a folder is refused, not waited on; a longer file's rest is not read).
Status ReadSampleFile(const std::filesystem::path& path, std::byte* out, size_t bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return NotFound("warm-up data file " + path.string() + " cannot be opened");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return InvalidArgument("warm-up data file " + path.string() + " is not a regular file");
  }
  size_t got = 0;
  while (got < bytes) {
    const ssize_t n = ::read(fd, out + got, bytes - got);
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  if (got != bytes) {
    return InvalidArgument("warm-up data file " + path.string() + " holds " + std::to_string(got) +
                           " bytes, the input needs " + std::to_string(bytes));
  }
  return Status::Ok();
}

Tensor MakeWarmupTensor(const WarmupInput& in, Shape shape, const std::filesystem::path& dir, int64_t& budget,
                        Status& error) {
  const int64_t n = ElementCount(shape);
  // A string element costs its std::string whatever its length.
  const int64_t total = ByteCount(
      shape, in.dtype == DataType::kBytes ? static_cast<int64_t>(sizeof(std::string)) : DataTypeByteSize(in.dtype));
  if (n < 0 || total < 0 || total > budget) {
    error = InvalidArgument("warm-up input of shape " + ShapeToString(shape) + " would take the sample past " +
                            std::to_string(kMaxWarmupBytes) + " bytes");
    return Tensor();
  }
  budget -= total;
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
    error = ReadSampleFile(*resolved, t.mutable_data(), bytes);
  }
  return t;
}

}  // namespace

Result<std::vector<NamedTensor>> WarmupInputs(const ModelConfig& config, const WarmupSample& sample,
                                              const std::filesystem::path& model_dir, int64_t& rows) {
  std::vector<NamedTensor> inputs;
  int64_t budget = kMaxWarmupBytes;
  rows = config.max_batch_size > 0 ? PaddedBatchSize(config.fixed_batch_sizes, sample.batch_size) : 0;
  for (const auto& [name, in] : sample.inputs) {
    Shape shape = in.dims;
    if (rows > 0) shape.insert(shape.begin(), rows);
    Status error;
    Tensor t = MakeWarmupTensor(in, std::move(shape), model_dir, budget, error);
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
