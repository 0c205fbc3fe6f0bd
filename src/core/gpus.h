// GPUs this process can use, as CUDA's driver counts them.
//
// The driver (libcuda.so.1, installed with NVIDIA's kernel driver) is opened
// with dlopen on the first call, so Quern neither links nor needs it: a
// machine without one has no GPUs, and the reason says why. CUDA's own
// rules apply (CUDA_VISIBLE_DEVICES hides and renumbers devices).
//
// Thread safety: VisibleGpus may be called from any thread; it asks the
// driver once per process.
#pragma once

#include <string>

namespace quern {

struct GpuCount {
  int count = 0;
  std::string why_none;  // set when count is 0: no driver, no device, an error
};

const GpuCount& VisibleGpus();

}  // namespace quern
