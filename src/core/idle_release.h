// IdleRelease: gives back, on a thread of its own, memory its owners have
// kept without using it for a while.
//
// An owner that keeps memory between uses (a Python model's shared memory
// slots, grown to its largest batch) registers a release function and
// touches its key at each use. A touch arms a resting key: `idle_ns` later
// the thread calls its function, which gives back what the owner has not
// used since the function's previous call (the part of a slot beyond what
// the last batches needed, all of it after a pause) and says whether
// anything is still kept. If so the key is looked at again `idle_ns` later;
// if not it rests until its next touch. So memory follows the load as
// BlockCache's does: what a burst took is given back within two idle times
// of its end, and a steady load costs one look per idle time.
//
// Waiting: through the Clock it is given (a FakeClock moves it in tests),
// and only while some key is armed: with nothing kept it sleeps without a
// timer.
//
// The release function runs on the thread, without the IdleRelease's lock
// held but with the key's registration pinned: Remove waits for a running
// call of that key to end. A release function must not call Add, Remove or
// Touch and should not block: one that would wait for its owner (a lock
// held by a running batch) should say it still keeps memory and be looked
// at again.
//
// Thread-safe. The destructor stops the thread; keys still registered are
// not released.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <thread>

#include "core/mutex.h"
#include "quern/clock.h"

namespace quern {

class IdleRelease {
 public:
  // What a release function says: kHeld (memory is still kept, what the
  // owner used lately or all of it while the owner was busy: look again
  // idle_ns later) or kReleased (nothing is kept: rest until the next Touch).
  enum class Outcome { kHeld, kReleased };

  IdleRelease(const Clock& clock, int64_t idle_ns);
  ~IdleRelease();
  IdleRelease(const IdleRelease&) = delete;
  IdleRelease& operator=(const IdleRelease&) = delete;

  // Registers `key` (not yet due: a Touch arms it). Replaces a function
  // registered under the same key.
  void Add(const void* key, std::function<Outcome()> release);
  // Unregisters `key`: once this returns its function is not running and
  // will not run. Not from a release function.
  void Remove(const void* key);
  // `key` was used now: a resting key is armed (its function runs idle_ns
  // from now); an armed one stays as it is. An unknown key is ignored.
  void Touch(const void* key);

  // Release functions called so far (tests, metrics).
  int64_t calls() const;

 private:
  struct Entry {
    std::function<Outcome()> release;
    int64_t due_ns = 0;  // when its function runs next; 0: resting until touched
  };
  void Loop();

  const Clock& clock_;
  const int64_t idle_ns_;
  mutable Mutex mu_;
  CondVar wake_;
  std::map<const void*, Entry> entries_ QUERN_GUARDED_BY(mu_);
  const void* running_ QUERN_GUARDED_BY(mu_) = nullptr;  // the key whose function runs now
  CondVar ran_;                                          // signalled when a call ends
  bool stop_ QUERN_GUARDED_BY(mu_) = false;
  int64_t calls_ QUERN_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace quern
