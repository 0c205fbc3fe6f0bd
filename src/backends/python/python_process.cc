#include "backends/python/python_process.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "backends/python/python_sources.h"
#include "core/cpus.h"
#include "core/log.h"

extern char** environ;

namespace quern {
namespace {

// The descriptors the process finds (stub.py describes them).
constexpr int kChildControlFd = 3;
constexpr int kChildReplyFd = 4;
constexpr int kChildLifeFd = 6;
constexpr int kChildShmFds[PythonProcess::kSlots + 1] = {5, 7, 8, 9, 10};  // the last: kBlsSlot
// Frames are descriptions of tensors, never the tensors: a larger one is a
// broken process.
constexpr uint32_t kMaxFrameBytes = 64u << 20;
// The most bytes one ReceiveReady reads (what a frame has beyond waits for the next call).
constexpr size_t kReadyBytes = 1u << 20;
constexpr size_t kMaxShmBytes = size_t{1} << 34;  // as stub.py's MAX_SHM_BYTES
constexpr size_t kShmGranule = size_t{1} << 20;

// Runs in `python -c`: reads the stub's source from the control socket and
// runs it (nothing is written to disk, nothing depends on installed files).
// Before anything else, the process asks the kernel to kill it when the
// server's thread that started it ends (PR_SET_PDEATHSIG: a model stuck in
// a C call holding the GIL cannot notice the server is gone). argv[2]: the
// server's pid, checked after, so that a server gone before it took effect
// is noticed.
constexpr char kBootstrap[] =
    "import os, sys, ctypes\n"
    "_libc = ctypes.CDLL(None)\n"
    "_libc.prctl(1, 9, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    os._exit(0)\n"
    "def _read_exact(n):\n"
    "    b = bytearray()\n"
    "    while len(b) < n:\n"
    "        c = os.read(3, n - len(b))\n"
    "        if not c:\n"
    "            os._exit(0)\n"
    "        b += c\n"
    "    return bytes(b)\n"
    "def _read_frame():\n"
    "    return _read_exact(int.from_bytes(_read_exact(4), 'little'))\n"
    "exec(compile(_read_frame(), '<quern python stub>', 'exec'))\n";

std::string ErrnoText(int e) {
  return std::strerror(e);
}

// Runs `fn` on one thread started on first use and never ended (nor
// destroyed: it outlives static destruction), and waits for it.
void SpawnOnLongLivedThread(const std::function<void()>& fn) {
  struct Spawner {
    std::mutex mu;
    std::condition_variable cv;
    const std::function<void()>* job = nullptr;
    uint64_t started = 0, finished = 0;
    Spawner() {
      std::thread([this] {
        NameThisThread("quern-spawn");
        std::unique_lock<std::mutex> lock(mu);
        for (;;) {
          cv.wait(lock, [this] { return job != nullptr; });
          const std::function<void()>* j = job;
          lock.unlock();
          (*j)();
          lock.lock();
          job = nullptr;
          ++finished;
          cv.notify_all();
        }
      }).detach();
    }
  };
  static Spawner* spawner = new Spawner();  // never destroyed
  static std::mutex one_at_a_time;
  std::lock_guard<std::mutex> turn(one_at_a_time);
  std::unique_lock<std::mutex> lock(spawner->mu);
  const uint64_t mine = spawner->finished + 1;
  spawner->job = &fn;
  spawner->cv.notify_all();
  spawner->cv.wait(lock, [&] { return spawner->finished >= mine; });
}

// Every process below `root` (its children, theirs, ...), read from /proc.
std::vector<pid_t> Descendants(pid_t root) {
  std::multimap<pid_t, pid_t> children;  // parent -> child
  if (DIR* d = ::opendir("/proc")) {
    while (dirent* e = ::readdir(d)) {
      char* end = nullptr;
      const long pid = std::strtol(e->d_name, &end, 10);
      if (pid <= 0 || *end != '\0') continue;
      char path[64];
      std::snprintf(path, sizeof path, "/proc/%ld/stat", pid);
      FILE* f = std::fopen(path, "re");
      if (!f) continue;
      char buf[512];
      const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
      std::fclose(f);
      buf[n] = '\0';
      const char* close = std::strrchr(buf, ')');
      if (!close) continue;
      char state = 0;
      long ppid = 0;
      if (std::sscanf(close + 1, " %c %ld", &state, &ppid) == 2) {
        children.emplace(static_cast<pid_t>(ppid), static_cast<pid_t>(pid));
      }
    }
    ::closedir(d);
  }
  std::vector<pid_t> out;
  std::vector<pid_t> todo{root};
  while (!todo.empty() && out.size() < 100000) {
    const pid_t p = todo.back();
    todo.pop_back();
    auto [b, e] = children.equal_range(p);
    for (auto it = b; it != e; ++it) {
      out.push_back(it->second);
      todo.push_back(it->second);
    }
  }
  return out;
}

void CloseFd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// Forwards the process's stdout and stderr to the server's stderr, one
// line at a time with the model's name, until the pipe closes or `stop_fd`
// becomes readable (the process was reaped; a child of it may still hold
// the pipe).
void ForwardLog(std::string tag, int log_fd, int stop_fd) {
  std::string pending;
  char buf[4096];
  auto emit = [&](std::string_view line) {
    if (CurrentLogOptions().format == LogFormat::kJson) return Log(LogLevel::kInfo, line, {{"source", tag}});
    std::string out = "quern: " + tag + ": ";
    out.append(line);
    out += '\n';
    ssize_t ignored = ::write(STDERR_FILENO, out.data(), out.size());
    (void)ignored;
  };
  auto flush_lines = [&](bool all) {
    size_t start = 0;
    for (size_t nl; (nl = pending.find('\n', start)) != std::string::npos; start = nl + 1) {
      emit(std::string_view(pending).substr(start, nl - start));
    }
    pending.erase(0, start);
    // A line longer than 4 KiB is forwarded in pieces.
    while (pending.size() > 4096 || (all && !pending.empty())) {
      const size_t n = std::min<size_t>(pending.size(), 4096);
      emit(std::string_view(pending).substr(0, n));
      pending.erase(0, n);
    }
  };
  bool stopping = false;
  // Once stopping, what is already in the pipe is forwarded, up to 1 MiB (a
  // process outside the model's group could keep writing).
  size_t drained = 0;
  for (;;) {
    pollfd fds[2] = {{log_fd, POLLIN, 0}, {stop_fd, POLLIN, 0}};
    const int ready = ::poll(fds, stopping ? 1 : 2, stopping ? 0 : -1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) break;  // stopping and nothing left to read
    if (!stopping && fds[1].revents) stopping = true;
    if (fds[0].revents) {
      const ssize_t n = ::read(log_fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0 || (stopping && (drained += static_cast<size_t>(n)) > (size_t{1} << 20))) break;
      pending.append(buf, static_cast<size_t>(n));
      flush_lines(false);
    }
  }
  flush_lines(true);
  ::close(log_fd);  // stop_fd stays open until the owner has joined (a write to it must not raise SIGPIPE)
}

std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return "was killed by signal " + std::to_string(sig) + (name ? std::string(" (SIG") + name + ")" : "");
  }
  return "ended (status " + std::to_string(status) + ")";
}

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The descriptors the child gets (each becomes its kChild*Fd).
struct ChildFds {
  int control, reply, life, log;
  const int* shm;  // PythonProcess::kSlots + 1 of them
};

// Starts the interpreter with the bootstrap, its descriptors in place and
// default signal handling: posix_spawnp's result (0 = started, *pid set).
int SpawnInterpreter(const PythonLaunch& launch, const ChildFds& fds, pid_t* pid) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, fds.log, STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds.log, STDERR_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds.control, kChildControlFd);
  posix_spawn_file_actions_adddup2(&actions, fds.reply, kChildReplyFd);
  posix_spawn_file_actions_adddup2(&actions, fds.life, kChildLifeFd);
  for (int i = 0; i <= PythonProcess::kSlots; ++i)
    posix_spawn_file_actions_adddup2(&actions, fds.shm[i], kChildShmFds[i]);
  posix_spawn_file_actions_addclosefrom_np(&actions, kChildShmFds[PythonProcess::kSlots] + 1);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  for (int sig : {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD}) sigaddset(&defaults, sig);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  // A process group of its own: a terminal's Ctrl-C is the server's to handle.
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETPGROUP);

  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const std::string_view kv(*e);
    if (kv.starts_with("PYTHONDONTWRITEBYTECODE=") || kv.starts_with("PYTHONUNBUFFERED=")) continue;
    env.emplace_back(kv);
  }
  // No __pycache__ in the repository (it would also look like a change of
  // the model); output reaches the log line by line.
  env.emplace_back("PYTHONDONTWRITEBYTECODE=1");
  env.emplace_back("PYTHONUNBUFFERED=1");
  std::vector<char*> envp;
  for (auto& kv : env) envp.push_back(kv.data());
  envp.push_back(nullptr);
  std::string python = launch.python, dash_c = "-c", bootstrap = kBootstrap,
              title = "quern-python:" + launch.model_name + ":" + std::to_string(launch.instance);
  std::string server_pid = std::to_string(::getpid());
  char* argv[] = {python.data(), dash_c.data(), bootstrap.data(), title.data(), server_pid.data(), nullptr};

  // From a thread that lives as long as the process: the child's
  // PR_SET_PDEATHSIG fires when the thread that started it ends, and the
  // thread asking (a gRPC or poll thread) may end long before the server.
  int rc = 0;
  SpawnOnLongLivedThread([&] { rc = ::posix_spawnp(pid, python.c_str(), &actions, &attr, argv, envp.data()); });
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  return rc;
}

}  // namespace

Result<std::unique_ptr<PythonProcess>> PythonProcess::Start(const PythonLaunch& launch) {
  const std::string tag = "model '" + launch.model_name + "' instance " + std::to_string(launch.instance);
  std::unique_ptr<PythonProcess> p(new PythonProcess(tag));

  // Frames go to the process on one socket and come back on another. On one
  // socket, the server reading an answer frees buffer space the process's
  // socket charged for it, and that wakes the process, already waiting for
  // the next batch on the same socket, for nothing: a second sleep and
  // wake-up per batch.
  int control[2], reply[2], life[2], log[2], stop[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, control) != 0) {
    return Err(Unavailable(tag + ": cannot create a socket for its Python process: " + ErrnoText(errno)));
  }
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, reply) != 0) {
    ::close(control[0]);
    ::close(control[1]);
    return Err(Unavailable(tag + ": cannot create a socket for its Python process: " + ErrnoText(errno)));
  }
  p->control_fd_ = control[0];
  p->reply_fd_ = reply[0];
  int child_control = control[1];
  int child_reply = reply[1];
  // Slots start at one granule (memory is only used where written); no
  // side can shrink them under the other's mapping.
  for (int i = 0; i <= kSlots; ++i) {
    int& fd = p->slots_[i].fd;
    fd = ::memfd_create(("quern:" + launch.model_name).substr(0, 200).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ::ftruncate(fd, kShmGranule) != 0 || ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
      ::close(child_control);
      ::close(child_reply);
      return Err(Unavailable(tag + ": cannot create shared memory for its Python process: " + ErrnoText(errno)));
    }
  }
  if (Status st = p->MapSlot(0, kShmGranule); !st.ok()) {
    ::close(child_control);
    ::close(child_reply);
    return Err(st);
  }
  if (::pipe2(life, O_CLOEXEC) != 0) {
    ::close(child_control);
    ::close(child_reply);
    return Err(Unavailable(tag + ": cannot create a pipe: " + ErrnoText(errno)));
  }
  p->life_fd_ = life[1];
  if (::pipe2(log, O_CLOEXEC) != 0) {
    ::close(child_control);
    ::close(child_reply);
    ::close(life[0]);
    return Err(Unavailable(tag + ": cannot create a pipe: " + ErrnoText(errno)));
  }
  if (::pipe2(stop, O_CLOEXEC) != 0) {
    ::close(child_control);
    ::close(child_reply);
    ::close(life[0]);
    ::close(log[0]);
    ::close(log[1]);
    return Err(Unavailable(tag + ": cannot create a pipe: " + ErrnoText(errno)));
  }

  // The child's descriptors, moved above the ones they become so that no
  // dup2 is a no-op that would leave close-on-exec set.
  auto high = [](int fd) {
    const int moved = ::fcntl(fd, F_DUPFD_CLOEXEC, 11);  // above every kChild*Fd
    ::close(fd);
    return moved;
  };
  child_control = high(child_control);
  child_reply = high(child_reply);
  const int child_life = high(life[0]);
  const int child_log = high(log[1]);
  int child_shm[kSlots + 1];
  for (int i = 0; i <= kSlots; ++i) child_shm[i] = ::fcntl(p->slots_[i].fd, F_DUPFD_CLOEXEC, 11);

  pid_t pid = -1;
  const ChildFds fds{child_control, child_reply, child_life, child_log, child_shm};
  const int rc = SpawnInterpreter(launch, fds, &pid);
  ::close(child_control);
  ::close(child_reply);
  ::close(child_life);
  ::close(child_log);
  for (int fd : child_shm) ::close(fd);
  if (rc != 0) {
    ::close(log[0]);
    ::close(stop[0]);
    ::close(stop[1]);
    return Err(Unavailable(tag + ": cannot start the Python interpreter '" + launch.python + "': " + ErrnoText(rc)));
  }
  p->pid_ = pid;
  CPU_ZERO(&p->start_cpus_);
  p->have_start_cpus_ = ::sched_getaffinity(pid, sizeof p->start_cpus_, &p->start_cpus_) == 0;
  p->pid_fd_ = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));  // -1 before Linux 5.3: the socket alone
  p->log_stop_fd_ = stop[1];
  p->log_stop_read_fd_ = stop[0];
  p->log_reader_ = std::thread(ForwardLog, tag, log[0], stop[0]);

  const int64_t deadline = NowMs() + launch.start_timeout_ms;
  Status sent = p->Send(std::string_view(kStubSource, sizeof(kStubSource) - 1));
  if (sent.ok()) sent = p->Send(std::string_view(kUtilsSource, sizeof(kUtilsSource) - 1));
  if (sent.ok()) sent = p->Send(launch.launch_json);
  if (!sent.ok()) return Err(sent);
  auto ready = p->Receive(std::max<int64_t>(1, deadline - NowMs()));
  if (!ready) {
    if (ready.error().code() == StatusCode::kDeadlineExceeded) {
      return Err(DeadlineExceeded(tag + ": model.py did not finish loading and initialize() within " +
                                  std::to_string(launch.start_timeout_ms) +
                                  " ms (quern.initialize_timeout_ms); its Python process was killed"));
    }
    return Err(ready.error());
  }
  if (*ready == "R") return p;
  std::string why = ready->empty() ? std::string("an empty reply") : ready->substr(1);
  if (!ready->empty() && (*ready)[0] == 'F') {
    p->Reap(false);
    return Err(Unavailable(tag + " failed to load model.py: " + why));
  }
  return Err(Internal(tag + ": its Python process answered the start with an unknown frame"));
}

PythonProcess::~PythonProcess() {
  if (pid_ > 0) {
    // finalize() may take a moment; the process exits on its own.
    if (Send("S").ok()) {
      pollfd fds[2] = {{reply_fd_, POLLIN, 0}, {pid_fd_, POLLIN, 0}};
      const int64_t deadline = NowMs() + 5000;
      for (int64_t left; pid_ > 0 && (left = deadline - NowMs()) > 0;) {
        const int r = ::poll(fds, pid_fd_ >= 0 ? 2 : 1, static_cast<int>(left));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0 || fds[1].revents) break;  // timed out, or it has exited
        char c;
        const ssize_t n = ::read(reply_fd_, &c, 1);
        if (n <= 0) break;  // closed: the process is exiting
      }
    }
    if (pid_ > 0) Reap(true);
  }
  // Reaping told the log reader to stop (every spawned process is reaped).
  if (log_reader_.joinable()) log_reader_.join();
  CloseFd(log_stop_fd_);
  CloseFd(log_stop_read_fd_);
  CloseFd(control_fd_);
  CloseFd(reply_fd_);
  // Mappings borrowed by output tensors stay until those are released.
  for (auto& slot : slots_) CloseFd(slot.fd);
  CloseFd(life_fd_);
  CloseFd(pid_fd_);
}

std::string PythonProcess::Reap(bool kill) {
  if (pid_ <= 0) return "had already ended";
  // The exit is observed without reaping (WNOWAIT), so that the pid, still
  // a zombie, cannot belong to another process when the group is killed:
  // processes model.py forked (multiprocessing workers) share its group and
  // its descriptors, and die with it.
  siginfo_t info{};
  bool exited = false;
  if (!kill) {
    // It closed the socket or ended: give it a moment to finish exiting, so
    // that its own exit code is reported rather than our kill.
    for (int i = 0; i < 20; ++i) {
      info.si_pid = 0;
      if (::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT) != 0 && errno != EINTR) break;
      if ((exited = info.si_pid == pid_)) break;
      ::usleep(10000);
    }
  }
  int status = 0;
  pid_t r = -1;
  // ECHILD: someone else reaped it (an embedding program's SIGCHLD
  // handling); its pid may be another process's by now, so nothing is killed.
  if (::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT) == 0 || errno != ECHILD) {
    // What model.py started, in its group or not (a child that called
    // setsid()), is killed with it. The process is stopped first, so that
    // none of its children is reaped (its pid free for another process)
    // between the look and the kill; twice, for a child forked meanwhile.
    ::kill(pid_, SIGSTOP);
    for (int round = 0; round < 2; ++round) {
      for (pid_t d : Descendants(pid_)) ::kill(d, SIGKILL);
    }
    ::kill(-pid_, SIGKILL);
    if (!exited) ::kill(pid_, SIGKILL);
    while ((r = ::waitpid(pid_, &status, 0)) < 0 && errno == EINTR) {
    }
  }
  CloseFd(pid_fd_);
  pid_ = -1;
  if (log_stop_fd_ >= 0) {
    const char c = 's';
    ssize_t ignored = ::write(log_stop_fd_, &c, 1);
    (void)ignored;
  }
  return r > 0 ? DescribeExit(status) : "could not be waited for";
}

PythonProcess::Mapping::~Mapping() {
  if (addr) ::munmap(addr, size);
}

bool PythonProcess::finished() {
  if (pid_ <= 0) return true;
  pollfd fd{pid_fd_, POLLIN, 0};
  if (pid_fd_ >= 0 && ::poll(&fd, 1, 0) > 0) {
    // It died between batches: reaped now, so the next batch starts a new one.
    Log(LogLevel::kWarning, tag_ + ": its Python process " + Reap(false) + " while idle");
    return true;
  }
  return false;
}

bool PythonProcess::RunOn(int cpu) {
  if (cpu >= 0 && cpu == held_cpu_) return true;
  if (pid_ <= 0 || !have_start_cpus_ || cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &start_cpus_)) {
    return false;
  }
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  if (::sched_setaffinity(pid_, sizeof one, &one) != 0) return false;
  held_cpu_ = cpu;
  return true;
}

void PythonProcess::RunAnywhere() {
  if (held_cpu_ < 0 || pid_ <= 0) return;
  if (::sched_setaffinity(pid_, sizeof start_cpus_, &start_cpus_) == 0) held_cpu_ = -1;
}

int PythonProcess::FreeSlot() const {
  for (int i = 0; i < kSlots; ++i) {
    // Only this thread adds borrowers, so a count of one cannot grow behind
    // our back.
    if (!slots_[i].map || slots_[i].map.use_count() == 1) return i;
  }
  return -1;
}

int PythonProcess::FreeSlotsBesides(int slot) const {
  int n = 0;
  for (int i = 0; i < kSlots; ++i) {
    if (i != slot && (!slots_[i].map || slots_[i].map.use_count() == 1)) ++n;
  }
  return n;
}

Status PythonProcess::MapSlot(int slot, size_t bytes) {
  slots_[slot].map.reset();
  void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, slots_[slot].fd, 0);
  if (m == MAP_FAILED) return Unavailable(tag_ + ": cannot map " + std::to_string(bytes) + " bytes of shared memory");
  auto map = std::make_shared<Mapping>();
  map->addr = static_cast<std::byte*>(m);
  map->size = bytes;
  slots_[slot].map = std::move(map);
  return Status::Ok();
}

Status PythonProcess::Reserve(int slot, size_t bytes) {
  if (bytes <= shm_size(slot)) return Status::Ok();
  if (bytes > kMaxShmBytes) {
    return ResourceExhausted(tag_ + ": a batch needs " + std::to_string(bytes) + " bytes of shared memory; at most " +
                             std::to_string(kMaxShmBytes));
  }
  struct stat st {};
  if (::fstat(slots_[slot].fd, &st) != 0) return Unavailable(tag_ + ": cannot read the shared memory's size");
  size_t size = static_cast<size_t>(st.st_size);
  if (size > kMaxShmBytes) {
    // Only the process could have made it so: the whole file is not mapped.
    return ResourceExhausted(tag_ + ": its shared memory was grown to " + std::to_string(size) + " bytes; at most " +
                             std::to_string(kMaxShmBytes));
  }
  if (size < bytes) {
    size = std::min(std::max(bytes, size * 2), kMaxShmBytes);
    size = (size + kShmGranule - 1) / kShmGranule * kShmGranule;
    if (::ftruncate(slots_[slot].fd, static_cast<off_t>(size)) != 0) {
      return ResourceExhausted(tag_ + ": cannot grow the shared memory to " + std::to_string(size) +
                               " bytes: " + ErrnoText(errno));
    }
  }
  return MapSlot(slot, size);
}

Status PythonProcess::Remap(int slot, size_t bytes) {
  if (bytes <= shm_size(slot)) return Status::Ok();
  struct stat st {};
  if (::fstat(slots_[slot].fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes || bytes > kMaxShmBytes) {
    return Internal(tag_ + ": its Python process reported shared memory of " + std::to_string(bytes) +
                    " bytes, which the file does not hold");
  }
  return MapSlot(slot, bytes);
}

size_t PythonProcess::Punch(int slot, size_t keep) {
  struct stat st {};
  if (slots_[slot].fd < 0 || ::fstat(slots_[slot].fd, &st) != 0) return 0;
  const auto size = static_cast<size_t>(st.st_size);
  const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t from = (keep + page - 1) / page * page;
  if (from >= size) return 0;
  if (::fallocate(slots_[slot].fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(from),
                  static_cast<off_t>(size - from)) != 0) {
    return 0;
  }
  return size - from;
}

Status PythonProcess::Send(std::string_view payload) {
  if (pid_ <= 0) return Unavailable(tag_ + ": its Python process is not running");
  // The process reads frames up to the same bound (and a length must fit its 32 bits).
  if (payload.size() > kMaxFrameBytes) {
    return ResourceExhausted(tag_ + ": a frame of " + std::to_string(payload.size()) +
                             " bytes for its Python process (a batch's request ids and parameters); at most " +
                             std::to_string(kMaxFrameBytes));
  }
  const uint32_t n = static_cast<uint32_t>(payload.size());
  const unsigned char head[4] = {static_cast<unsigned char>(n), static_cast<unsigned char>(n >> 8),
                                 static_cast<unsigned char>(n >> 16), static_cast<unsigned char>(n >> 24)};
  // One sendmsg for the header and the payload: one wake-up on the other side.
  iovec iov[2] = {{const_cast<unsigned char*>(head), sizeof head}, {const_cast<char*>(payload.data()), payload.size()}};
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = 2;
  bool ok = true;
  while (msg.msg_iovlen > 0) {
    const ssize_t w = ::sendmsg(control_fd_, &msg, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      ok = false;
      break;
    }
    size_t left = static_cast<size_t>(w);
    while (msg.msg_iovlen > 0 && left >= msg.msg_iov[0].iov_len) {
      left -= msg.msg_iov[0].iov_len;
      ++msg.msg_iov;
      --msg.msg_iovlen;
    }
    if (msg.msg_iovlen > 0) {
      msg.msg_iov[0].iov_base = static_cast<char*>(msg.msg_iov[0].iov_base) + left;
      msg.msg_iov[0].iov_len -= left;
    }
  }
  if (ok) return Status::Ok();
  return Unavailable(tag_ + ": its Python process " + Reap(false));
}

bool PythonProcess::YieldForFrame(int64_t spin_ns) {
  if (pid_ <= 0) return false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin_ns);
  char buf[65536];
  for (;;) {
    if (inbox_.size() >= 4) {
      const auto* h = reinterpret_cast<const unsigned char*>(inbox_.data());
      const uint32_t n = h[0] | (h[1] << 8) | (h[2] << 16) | (uint32_t{h[3]} << 24);
      if (n > kMaxFrameBytes || inbox_.size() - 4 >= n) return true;
    }
    sched_yield();
    const ssize_t n = ::recv(reply_fd_, buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0) {
      inbox_.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n == 0 || (errno != EAGAIN && errno != EINTR)) return false;  // Receive says why
    if (std::chrono::steady_clock::now() >= until) return false;
  }
}

Result<bool> PythonProcess::PopFrame(std::string& frame) {
  if (inbox_.size() < 4) return false;
  const auto* h = reinterpret_cast<const unsigned char*>(inbox_.data());
  const uint32_t n = h[0] | (h[1] << 8) | (h[2] << 16) | (uint32_t{h[3]} << 24);
  if (n > kMaxFrameBytes) {
    inbox_.clear();
    Reap(true);
    return Err(Internal(tag_ + ": its Python process sent a frame of " + std::to_string(n) + " bytes; it was killed"));
  }
  if (inbox_.size() - 4 < n) return false;
  frame = inbox_.substr(4, n);
  inbox_.erase(0, 4 + size_t{n});
  return true;
}

Result<std::optional<std::string>> PythonProcess::ReceiveReady() {
  if (pid_ <= 0) return Err(Unavailable(tag_ + ": its Python process is not running"));
  char buf[65536];
  for (size_t read = 0;;) {
    std::string frame;
    auto popped = PopFrame(frame);
    if (!popped) return Err(popped.error());
    if (*popped) return std::optional<std::string>(std::move(frame));
    if (read >= kReadyBytes) return std::optional<std::string>();  // the rest of a long frame: next time
    pollfd fd = {reply_fd_, POLLIN, 0};
    const int r = ::poll(&fd, 1, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return std::optional<std::string>();
    const ssize_t n = ::read(reply_fd_, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return std::optional<std::string>();
    if (n <= 0) {  // (not reaped here, where a scrape would wait for it: finished() or the destructor does)
      inbox_.clear();
      return Err(Unavailable(tag_ + ": its Python process closed its socket"));
    }
    inbox_.append(buf, static_cast<size_t>(n));
    read += static_cast<size_t>(n);
  }
}

Result<std::string> PythonProcess::Receive(int64_t timeout_ms, int abort_fd, int wake_fd, bool kill_on_timeout) {
  if (pid_ <= 0) return Err(Unavailable(tag_ + ": its Python process is not running"));
  const int64_t deadline = timeout_ms > 0 ? NowMs() + timeout_ms : 0;
  char buf[65536];
  for (;;) {
    std::string frame;
    auto popped = PopFrame(frame);
    if (!popped) return Err(popped.error());
    if (*popped) return frame;
    // The process's pidfd as well: a child of it holding the socket would
    // hide the process's death from the socket.
    // (a negative fd, no abort_fd or wake_fd, is skipped by poll)
    pollfd fds[4] = {{reply_fd_, POLLIN, 0}, {abort_fd, POLLIN, 0}, {wake_fd, POLLIN, 0}, {pid_fd_, POLLIN, 0}};
    const nfds_t nfds = pid_fd_ >= 0 ? 4 : 3;
    const int64_t left = deadline ? deadline - NowMs() : -1;
    int r = 0;
    if (!deadline || left > 0) {
      r = ::poll(fds, nfds, deadline ? static_cast<int>(std::min<int64_t>(left, 1 << 30)) : -1);
      if (r < 0 && errno == EINTR) continue;
    }
    if (r > 0 && (fds[1].revents & POLLIN)) {
      inbox_.clear();
      Reap(true);
      return Err(Cancelled("abandoned"));
    }
    if (r > 0 && (fds[2].revents & POLLIN) && !(fds[0].revents & POLLIN))
      return Err(Status(StatusCode::kUnknown, "woken"));
    if (r > 0 && !(fds[0].revents & POLLIN)) {
      inbox_.clear();
      return Err(Unavailable(tag_ + ": its Python process " + Reap(false)));
    }
    if (r == 0) {
      if (!kill_on_timeout) return Err(DeadlineExceeded("timed out"));  // (what has arrived is kept)
      inbox_.clear();
      Reap(true);
      return Err(DeadlineExceeded("timed out"));
    }
    const ssize_t n = ::read(reply_fd_, buf, sizeof buf);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) {
      inbox_.clear();
      return Err(Unavailable(tag_ + ": its Python process " + Reap(false)));
    }
    inbox_.append(buf, static_cast<size_t>(n));
  }
}

Result<std::string> ResolvePythonInterpreter(const std::string& configured, const std::filesystem::path& model_dir,
                                             const std::string& model_name) {
  namespace fs = std::filesystem;
  if (configured.empty()) {
    // The server's default: QUERN_PYTHON, else the system's interpreter,
    // else python3 from PATH.
    if (const char* env = std::getenv("QUERN_PYTHON"); env && *env) return std::string(env);
    if (::access("/usr/bin/python3", X_OK) == 0) return std::string("/usr/bin/python3");
    return std::string("python3");
  }
  fs::path p(configured);
  if (p.is_relative()) p = model_dir / p;
  std::error_code ec;
  if (fs::is_directory(p, ec)) {
    for (const char* name : {"bin/python3", "bin/python"}) {
      if (::access((p / name).c_str(), X_OK) == 0) return (p / name).string();
    }
    return Err(InvalidArgument("model '" + model_name + "': parameter quern.python names the folder '" + p.string() +
                               "', which holds no bin/python3 (expected a virtual environment)"));
  }
  if (::access(p.c_str(), X_OK) != 0) {
    return Err(InvalidArgument("model '" + model_name + "': parameter quern.python names '" + p.string() +
                               "', which is not an executable Python interpreter: " + ErrnoText(errno)));
  }
  return p.string();
}

}  // namespace quern
