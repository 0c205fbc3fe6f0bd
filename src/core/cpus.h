// Cores and threads.
//
// The number of cores this process may use: the CPUs of its affinity mask
// (taskset, a container's cpuset), lowered by a cgroup v2 CPU quota
// (cpu.max, e.g. docker --cpus) rounded up; at least 1. Default thread
// counts divide this, not every CPU of the host.
#pragma once

#include <sched.h>

#include <cstdint>

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

// The opposite: the calling thread (SCHED_BATCH, the default slice) does not
// preempt the thread running on its core when it wakes; it runs when that
// one sleeps or its slice ends. For I/O threads while nothing is urgent:
// reading the next request in the middle of a batch computing on the same
// core gains nothing and costs the batch two context switches and its cache.
// Its share of the CPU is unchanged. Both do nothing unless the thread runs
// under SCHED_OTHER or SCHED_BATCH.
void DeferToRunningThreads();

// A thread's scheduling policy and, for the fair policies, the slice it
// asked for (sched_setattr's sched_runtime in ns; what the kernel reports
// where it has no custom slices).
struct SchedulingAttributes {
  int policy = SCHED_OTHER;
  uint64_t slice_ns = 0;
};

// The calling thread's.
SchedulingAttributes CurrentScheduling();

// While alive, the calling thread runs with `want` (policy SCHED_OTHER or
// SCHED_BATCH, and its slice), and the threads and processes it creates
// inherit them (pthreads and posix_spawn do by default); what it had before
// is restored at the end. Does nothing when the thread's policy is another
// (real-time, idle) or the change is refused.
// Used two ways. For a library's network threads created inside a call
// (gRPC's, under SCHED_BATCH): a SCHED_BATCH thread that wakes does not
// preempt the thread running on its core, it runs when that one sleeps or
// its slice ends, so a thread that computes and hands answers to them is not
// interrupted at every hand-off. And for loading models from any thread (an
// HTTP I/O thread with short slices, a gRPC thread under SCHED_BATCH): the
// model's threads and processes get the engine's creator's attributes.
class ScopedScheduling {
 public:
  explicit ScopedScheduling(SchedulingAttributes want);
  ~ScopedScheduling();
  ScopedScheduling(const ScopedScheduling&) = delete;
  ScopedScheduling& operator=(const ScopedScheduling&) = delete;

 private:
  bool changed_ = false;
  SchedulingAttributes before_;
  int32_t nice_ = 0;
};

// CPU time (user + system, every thread) this process has used so far, in
// seconds: what benchmarks and `quern perf` divide by the requests they made.
double ProcessCpuSeconds();

}  // namespace quern
