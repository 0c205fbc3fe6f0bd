#include "core/gpus.h"

#include <dlfcn.h>

namespace quern {
namespace {

// CUDA driver API entry points, by their documented signatures (cuda.h).
using CuInit = int (*)(unsigned int);
using CuDeviceGetCount = int (*)(int*);
using CuGetErrorString = int (*)(int, const char**);

GpuCount Count() {
  GpuCount g;
  // The handle stays open: CUDA's libraries, loaded later by a backend,
  // use the same driver.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) {
    g.why_none = "no NVIDIA driver here (libcuda.so.1 could not be loaded)";
    return g;
  }
  auto init = reinterpret_cast<CuInit>(dlsym(lib, "cuInit"));
  auto count = reinterpret_cast<CuDeviceGetCount>(dlsym(lib, "cuDeviceGetCount"));
  auto error_string = reinterpret_cast<CuGetErrorString>(dlsym(lib, "cuGetErrorString"));
  if (!init || !count) {
    g.why_none = "libcuda.so.1 lacks cuInit or cuDeviceGetCount";
    return g;
  }
  auto why = [&](const char* call, int rc) {
    const char* text = nullptr;
    if (error_string) error_string(rc, &text);
    return std::string("CUDA's driver: ") + call + " failed with error " + std::to_string(rc) +
           (text ? std::string(" (") + text + ")" : std::string());
  };
  if (int rc = init(0); rc != 0) {  // 100 = CUDA_ERROR_NO_DEVICE
    g.why_none = why("cuInit", rc);
    return g;
  }
  int n = 0;
  if (int rc = count(&n); rc != 0) {
    g.why_none = why("cuDeviceGetCount", rc);
    return g;
  }
  g.count = n;
  if (n == 0) g.why_none = "CUDA's driver sees no device (CUDA_VISIBLE_DEVICES may hide them)";
  return g;
}

}  // namespace

const GpuCount& VisibleGpus() {
  static const GpuCount gpus = Count();
  return gpus;
}

}  // namespace quern
