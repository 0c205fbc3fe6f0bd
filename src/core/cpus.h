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

// CPU time (user + system, every thread) this process has used so far, in
// seconds: what benchmarks and `quern perf` divide by the requests they made.
double ProcessCpuSeconds();

}  // namespace quern
