#include "core/cpus.h"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

namespace quern {
namespace {

// The CPU quota of this process's cgroup in cores, or 0 when none: cgroup
// v2's cpu.max, or v1's cpu.cfs_quota_us / cpu.cfs_period_us.
double CgroupQuotaCores() {
  std::ifstream cgroup("/proc/self/cgroup");
  std::string line;
  double cores = 0;
  auto lower = [&cores](double q) {
    if (q > 0 && (cores == 0 || q < cores)) cores = q;
  };
  while (std::getline(cgroup, line)) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (path.find("..") != std::string::npos) continue;
    if (line.starts_with("0::")) {
      std::ifstream max("/sys/fs/cgroup" + path + "/cpu.max");
      std::string quota;
      double period = 0;
      if (max >> quota >> period && quota != "max" && period > 0) lower(std::strtod(quota.c_str(), nullptr) / period);
    } else if (controllers == "cpu" || controllers == "cpu,cpuacct" || controllers == "cpuacct,cpu") {
      const std::string dir = "/sys/fs/cgroup/" + controllers + path;
      double quota = -1, period = 0;
      std::ifstream(dir + "/cpu.cfs_quota_us") >> quota;
      std::ifstream(dir + "/cpu.cfs_period_us") >> period;
      if (quota > 0 && period > 0) lower(quota / period);
    }
  }
  return cores;
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

void NameThisThread(const char* name) {
  char shortened[16] = {};
  for (int i = 0; i < 15 && name[i] != '\0'; ++i) shortened[i] = name[i];
  pthread_setname_np(pthread_self(), shortened);
}

namespace {

// sched_setattr(2)'s argument; glibc 2.36 has no wrapper for it.
struct SchedAttr {
  uint32_t size, sched_policy;
  uint64_t sched_flags;
  int32_t sched_nice;
  uint32_t sched_priority;
  uint64_t sched_runtime, sched_deadline, sched_period;
  uint32_t sched_util_min, sched_util_max;
};

bool GetAttr(SchedAttr& attr) {
  attr = {};
#ifdef SYS_sched_getattr
  return syscall(SYS_sched_getattr, 0, &attr, sizeof(attr), 0) == 0;
#else
  return false;
#endif
}

bool SetAttr(SchedAttr attr) {
  attr.size = sizeof(attr);
  attr.sched_flags = 0;
#ifdef SYS_sched_setattr
  return syscall(SYS_sched_setattr, 0, &attr, 0) == 0;
#else
  return false;
#endif
}

bool Switchable(uint32_t policy) {
  return policy == SCHED_OTHER || policy == SCHED_BATCH;
}

}  // namespace

namespace {
// The calling thread to `policy` with `slice_ns` requested (0: the kernel's
// default), its nice value kept; only between SCHED_OTHER and SCHED_BATCH.
void SetFairScheduling(uint32_t policy, uint64_t slice_ns) {
  SchedAttr attr;
  if (!GetAttr(attr) || !Switchable(attr.sched_policy)) return;
  attr.sched_policy = policy;
  attr.sched_runtime = slice_ns;
  (void)SetAttr(attr);
}
}  // namespace

void PreferShortSlices() {
  SetFairScheduling(SCHED_OTHER, 100'000);  // 0.1 ms (EEVDF custom slices)
}

void DeferToRunningThreads() {
  SetFairScheduling(SCHED_BATCH, 0);
}

SchedulingAttributes CurrentScheduling() {
  SchedAttr attr;
  if (!GetAttr(attr)) return {sched_getscheduler(0), 0};
  return {static_cast<int>(attr.sched_policy), attr.sched_runtime};
}

ScopedScheduling::ScopedScheduling(SchedulingAttributes want) {
  SchedAttr now;
  if (!GetAttr(now) || !Switchable(now.sched_policy) || want.policy < 0 ||
      !Switchable(static_cast<uint32_t>(want.policy))) {
    return;
  }
  if (static_cast<int>(now.sched_policy) == want.policy && now.sched_runtime == want.slice_ns) return;
  SchedAttr next = now;
  next.sched_policy = static_cast<uint32_t>(want.policy);
  next.sched_runtime = want.slice_ns;
  if (!SetAttr(next)) return;
  changed_ = true;
  before_ = {static_cast<int>(now.sched_policy), now.sched_runtime};
  nice_ = now.sched_nice;
}

ScopedScheduling::~ScopedScheduling() {
  if (!changed_) return;
  SchedAttr attr{};
  attr.sched_policy = static_cast<uint32_t>(before_.policy);
  attr.sched_runtime = before_.slice_ns;
  attr.sched_nice = nice_;
  (void)SetAttr(attr);
}

double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

}  // namespace quern
