#include "core/cpus.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <thread>

namespace quern {
namespace {

// The CPU quota of this process's cgroup (v2) in cores, or 0 when none.
double CgroupQuotaCores() {
  std::ifstream cgroup("/proc/self/cgroup");
  std::string line, path;
  while (std::getline(cgroup, line)) {
    if (line.starts_with("0::")) path = line.substr(3);
  }
  if (path.empty() || path.find("..") != std::string::npos) return 0;
  std::ifstream max("/sys/fs/cgroup" + path + "/cpu.max");
  std::string quota;
  double period = 0;
  if (!(max >> quota >> period) || quota == "max" || period <= 0) return 0;
  try {
    const double q = std::stod(quota);
    return q > 0 ? q / period : 0;
  } catch (...) {
    return 0;
  }
}

}  // namespace

int UsableCores() {
  int n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) n = std::max(1, CPU_COUNT(&set));
  const double quota = CgroupQuotaCores();
  if (quota > 0) n = std::min(n, std::max(1, static_cast<int>(std::ceil(quota))));
  return n;
}

}  // namespace quern
