// The number of cores this process may use: the CPUs of its affinity mask
// (taskset, a container's cpuset), lowered by a cgroup v2 CPU quota
// (cpu.max, e.g. docker --cpus) rounded up; at least 1. Default thread
// counts divide this, not every CPU of the host.
#pragma once

namespace quern {

int UsableCores();

}  // namespace quern
