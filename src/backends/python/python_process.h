// One Python process running one instance of a Python model: started with
// the interpreter the model's configuration names, it talks to the server
// over a Unix socket (small frames: a 4-byte little-endian length and a
// payload) and exchanges tensors through a memfd both sides map (see
// stub.py for the other side). The server holds a pipe the process watches,
// so the process exits when the server does, however the server ends.
//
// Thread-compatible: one instance thread uses a process at a time; its log
// reader thread only forwards the process's stdout and stderr.
#pragma once

#include <sched.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "quern/status.h"

namespace quern {

struct PythonLaunch {
  std::string model_name;
  int instance = 0;
  // The interpreter: a path, or a name looked up in PATH ("python3").
  std::string python;
  // What the process reads first: the launch description (JSON).
  std::string launch_json;
  // How long the process may take to import model.py and initialize().
  int64_t start_timeout_ms = 120000;
};

class PythonProcess {
 public:
  // Starts the process and waits until the model is initialized; an error
  // carries the last line of the Python traceback when there is one.
  static Result<std::unique_ptr<PythonProcess>> Start(const PythonLaunch& launch);

  // Asks the process to run finalize() and exit, waits a short while, then
  // kills it.
  ~PythonProcess();

  PythonProcess(const PythonProcess&) = delete;
  PythonProcess& operator=(const PythonProcess&) = delete;

  // Shared memory comes in kSlots slots, each a memfd of its own: a batch's
  // inputs and outputs share one slot, and the batch's output tensors may
  // borrow the slot's bytes (no copy out) until they are released; a slot is
  // free while nothing borrows it.
  static constexpr int kSlots = 4;
  // One more, slot kBlsSlot: the tensors of the process's calls to other
  // models (BLS), both ways. The process writes a call's inputs there, this
  // side the answer's outputs (after reading the inputs); either side grows
  // it. Never borrowed: what is read from it is copied.
  static constexpr int kBlsSlot = kSlots;
  // A free slot, or -1 when every slot is borrowed.
  int FreeSlot() const;
  // Whether slot `slot` is free (nothing borrows its bytes).
  bool SlotFree(int slot) const { return !slots_[slot].map || slots_[slot].map.use_count() == 1; }
  // Free slots besides `slot`.
  int FreeSlotsBesides(int slot) const;
  // Slot `slot` at least `bytes` long (grown when needed; the slot is free).
  Status Reserve(int slot, size_t bytes);
  std::byte* shm(int slot) const { return slots_[slot].map ? slots_[slot].map->addr : nullptr; }
  size_t shm_size(int slot) const { return slots_[slot].map ? slots_[slot].map->size : 0; }
  // Keeps slot `slot`'s current mapping alive (and the slot borrowed).
  std::shared_ptr<const void> Borrow(int slot) const { return slots_[slot].map; }
  // Maps slot `slot` again after the process grew it to `bytes` (checked
  // against the file's real size).
  Status Remap(int slot, size_t bytes);
  // Gives the pages of slot `slot` from `keep` bytes on back to the system
  // (the file keeps its size, so both sides' mappings stay valid: a page
  // written again is a new zeroed page). Only for a slot that is free while
  // no batch runs (neither side touches it meanwhile). Returns the bytes of
  // the range given back (pages that held nothing count too); 0 on failure.
  size_t Punch(int slot, size_t keep);

  Status Send(std::string_view payload);
  // The next frame; `timeout_ms` <= 0 waits without limit. On a timeout the
  // process is killed (DEADLINE_EXCEEDED); when it has died, UNAVAILABLE
  // says how. Either way the process is finished afterwards. When
  // `abort_fd` (>= 0) becomes readable the process is killed as well
  // (CANCELLED). When `wake_fd` (>= 0) becomes readable before a whole
  // frame has arrived, UNKNOWN "woken" returns at once and the process runs on (the
  // caller reads `wake_fd` empty). With `kill_on_timeout` false, a timeout
  // returns DEADLINE_EXCEEDED and the process runs on too.
  Result<std::string> Receive(int64_t timeout_ms, int abort_fd = -1, int wake_fd = -1, bool kill_on_timeout = true);
  // A frame that has arrived, without waiting: nullopt when no whole frame
  // has (what part of one has is kept; at most 1 MiB is read per call).
  // UNAVAILABLE when the process has closed its socket (it is not waited
  // for here: finished() or the destructor reaps it).
  Result<std::optional<std::string>> ReceiveReady();
  // For a process placed on this thread's CPU (RunOn), after Send: gives the
  // CPU up (sched_yield) until a whole frame has arrived or `spin_ns` have
  // passed, so that the process runs and answers without either side
  // sleeping and being woken. True when Receive will return at once; false
  // otherwise (Receive then waits, and reports what went wrong, if anything).
  bool YieldForFrame(int64_t spin_ns);

  // Places the process's main thread (the one that runs the model's code)
  // on `cpu` alone; RunAnywhere gives it back the CPUs it started with.
  // Threads and processes it starts meanwhile inherit the one CPU. True
  // when the process runs on `cpu` alone now (false: a CPU it may not use,
  // or the call failed; it runs where it did).
  bool RunOn(int cpu);
  void RunAnywhere();
  // The CPU it is held on, or -1.
  int held_cpu() const { return held_cpu_; }

  // Whether the process has ended (one that died since its last batch is
  // reaped here).
  bool finished();
  pid_t pid() const { return pid_; }

 private:
  explicit PythonProcess(std::string tag) : tag_(std::move(tag)) {}
  struct Mapping {
    std::byte* addr = nullptr;
    size_t size = 0;
    ~Mapping();
  };
  struct Slot {
    int fd = -1;
    std::shared_ptr<Mapping> map;
  };
  // Kills the process (when `kill`), reaps it and says how it ended.
  std::string Reap(bool kill);
  Status MapSlot(int slot, size_t bytes);
  // Takes the first whole frame of inbox_ into `frame` (false: none whole yet); a frame over the
  // limit kills the process.
  Result<bool> PopFrame(std::string& frame);

  std::string tag_;  // "model 'x' instance 0"
  pid_t pid_ = -1;
  int control_fd_ = -1;   // frames to the process
  int reply_fd_ = -1;     // frames from it
  int pid_fd_ = -1;       // pidfd of the process: readable once it has exited
  int life_fd_ = -1;      // write end of the pipe the process watches
  int log_stop_fd_ = -1;  // written when the process is reaped: the log reader ends
  int log_stop_read_fd_ = -1;
  Slot slots_[kSlots + 1];
  int held_cpu_ = -1;
  bool have_start_cpus_ = false;
  cpu_set_t start_cpus_;  // what it was allowed when it started
  std::string inbox_;     // bytes read from the socket, not yet a whole frame
  std::thread log_reader_;
};

// The interpreter a model's configuration names through the parameter
// "quern.python": a Python executable, or a virtual environment's folder
// (its bin/python3); relative paths are taken from the model's folder.
// Unset: the environment variable QUERN_PYTHON, else the system's
// /usr/bin/python3, else python3 from PATH.
Result<std::string> ResolvePythonInterpreter(const std::string& configured, const std::filesystem::path& model_dir,
                                             const std::string& model_name);

}  // namespace quern
