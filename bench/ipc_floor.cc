// The floor under any server that runs a model in another process and waits
// for it: two processes pass one byte back and forth over a Unix socket pair
// (both sides blocking), and the CPU time of both per round trip is printed —
// spread over the cores as the scheduler places them, and with both on one
// core (where a wake-up needs no other core to leave its idle state).
//   build/release/bench/ipc_floor [round trips, default 200000]
#include <sched.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

double CpuSeconds(int who) {
  rusage r{};
  getrusage(who, &r);
  return static_cast<double>(r.ru_utime.tv_sec + r.ru_stime.tv_sec) +
         static_cast<double>(r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1e6;
}

// Runs the ping-pong in a child process (so that RUSAGE_CHILDREN holds only
// this run) and prints one line.
void Measure(const char* label, int n, int cpu) {
  const pid_t runner = fork();
  if (runner < 0) std::exit(1);
  if (runner > 0) {
    waitpid(runner, nullptr, 0);
    return;
  }
  if (cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof(set), &set);  // inherited by the peer
  }
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) != 0) std::_Exit(1);
  char b = 0;
  const pid_t peer = fork();
  if (peer == 0) {
    for (int i = 0; i < n; ++i) {
      if (read(sv[1], &b, 1) != 1 || write(sv[1], &b, 1) != 1) std::_Exit(1);
    }
    std::_Exit(0);
  }
  const auto t0 = std::chrono::steady_clock::now();
  const double c0 = CpuSeconds(RUSAGE_SELF);
  for (int i = 0; i < n; ++i) {
    if (write(sv[0], &b, 1) != 1 || read(sv[0], &b, 1) != 1) std::_Exit(1);
  }
  const double mine = CpuSeconds(RUSAGE_SELF) - c0;
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  waitpid(peer, nullptr, 0);
  const double peers = CpuSeconds(RUSAGE_CHILDREN);
  std::printf("%-14s %8.1f %10.1f %10.1f %10.1f\n", label, wall / n * 1e6, mine / n * 1e6, peers / n * 1e6,
              (mine + peers) / n * 1e6);
  std::fflush(stdout);
  std::_Exit(0);
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 200000;
  if (n <= 0) return 2;
  std::printf("%d round trips of one byte; µs per round trip\n", n);
  std::printf("%-14s %8s %10s %10s %10s\n", "placement", "wall", "CPU one", "CPU other", "CPU both");
  std::fflush(stdout);  // before the forks, or their copies of the buffer print it again
  Measure("any cores", n, -1);
  Measure("one core", n, 0);
  return 0;
}
