// Cores and threads.
//
// The number of cores this process may use: the CPUs of its affinity mask
// (taskset, a container's cpuset), lowered by a cgroup v2 CPU quota
// (cpu.max, e.g. docker --cpus) rounded up; at least 1. Default thread
// counts divide this, not every CPU of the host.
#pragma once

#include <sched.h>

namespace quern {

int UsableCores();

// Names the calling thread (at most 15 characters are kept), as top -H,
// ps -L and debuggers show it.
void NameThisThread(const char* name);

// Asks the scheduler for short time slices for the calling thread (Linux
// 6.12 and later; elsewhere nothing happens). For threads that wake, do a
// little and sleep (network I/O): when they wake on a core busy with long
// computation they run at once instead of after the running slice ends.
// Their share of the CPU is unchanged.
void PreferShortSlices();

// While alive, the calling thread runs under `policy` (SCHED_OTHER or
// SCHED_BATCH), and the threads and processes it creates inherit it
// (pthreads and posix_spawn do by default); the policy before is restored at
// the end. Does nothing when the thread's policy is another (real-time, idle)
// or the change is refused.
// Used for a library's network threads created inside a call (gRPC's, under
// SCHED_BATCH): a SCHED_BATCH thread that wakes does not preempt the thread
// running on its core, it runs when that one sleeps or its slice ends, so a
// thread that computes and hands answers to them is not interrupted at every
// hand-off; and, the other way, for work those threads do that creates the
// server's own threads (a model loaded over gRPC), which must not inherit it.
class ScopedSchedulingPolicy {
 public:
  explicit ScopedSchedulingPolicy(int policy);
  ~ScopedSchedulingPolicy();
  ScopedSchedulingPolicy(const ScopedSchedulingPolicy&) = delete;
  ScopedSchedulingPolicy& operator=(const ScopedSchedulingPolicy&) = delete;

 private:
  int before_ = -1;  // the policy to restore; -1: nothing was changed
};

// CPU time (user + system, every thread) this process has used so far, in
// seconds: what benchmarks and `quern perf` divide by the requests they made.
double ProcessCpuSeconds();

}  // namespace quern
