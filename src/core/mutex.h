// Mutexes the thread-safety analysis understands (core/thread_annotations.h):
// std::mutex and std::shared_mutex with capability annotations, scoped locks
// for them, and a condition variable that waits with a MutexLock held.
//
//   Mutex mu_;
//   std::deque<Task> queue_ QUERN_GUARDED_BY(mu_);
//   ...
//   MutexLock lock(mu_);
//   cv_.Wait(lock, [&]() QUERN_REQUIRES(mu_) { return !queue_.empty(); });
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <shared_mutex>

#include "core/thread_annotations.h"
#include "quern/clock.h"

namespace quern {

class QUERN_CAPABILITY("mutex") Mutex {
 public:
  void Lock() QUERN_ACQUIRE() { mu_.lock(); }
  // Takes the lock if it is free; whether it did.
  bool TryLock() QUERN_TRY_ACQUIRE(true) { return mu_.try_lock(); }
  void Unlock() QUERN_RELEASE() { mu_.unlock(); }
  std::mutex& native() { return mu_; }

 private:
  std::mutex mu_;
};

class QUERN_CAPABILITY("mutex") SharedMutex {
 public:
  void Lock() QUERN_ACQUIRE() { mu_.lock(); }
  void Unlock() QUERN_RELEASE() { mu_.unlock(); }
  void LockShared() QUERN_ACQUIRE_SHARED() { mu_.lock_shared(); }
  void UnlockShared() QUERN_RELEASE_SHARED() { mu_.unlock_shared(); }

 private:
  std::shared_mutex mu_;
};

// Holds a Mutex for its scope.
class QUERN_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) QUERN_ACQUIRE(mu) : lock_(mu.native()) {}
  ~MutexLock() QUERN_RELEASE() = default;
  MutexLock(const MutexLock&) = delete;
  // Lets go for a while (to run work outside the lock), then takes it back.
  void Unlock() QUERN_RELEASE() { lock_.unlock(); }
  void Lock() QUERN_ACQUIRE() { lock_.lock(); }
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  friend class CondVar;
  std::unique_lock<std::mutex> lock_;
};

// Holds a SharedMutex exclusively, or shared, for its scope.
class QUERN_SCOPED_CAPABILITY WriterLock {
 public:
  explicit WriterLock(SharedMutex& mu) QUERN_ACQUIRE(mu) : mu_(mu) { mu_.Lock(); }
  ~WriterLock() QUERN_RELEASE() { mu_.Unlock(); }
  WriterLock(const WriterLock&) = delete;
  WriterLock& operator=(const WriterLock&) = delete;

 private:
  SharedMutex& mu_;
};

class QUERN_SCOPED_CAPABILITY ReaderLock {
 public:
  explicit ReaderLock(SharedMutex& mu) QUERN_ACQUIRE_SHARED(mu) : mu_(mu) { mu_.LockShared(); }
  ~ReaderLock() QUERN_RELEASE() { mu_.UnlockShared(); }
  ReaderLock(const ReaderLock&) = delete;
  ReaderLock& operator=(const ReaderLock&) = delete;

 private:
  SharedMutex& mu_;
};

// A condition variable for Mutex: waits release the lock and take it back.
// Predicates run with the lock held (annotate them QUERN_REQUIRES(mu)).
// A wait with a time limit waits on a Clock (quern/clock.h), so a FakeClock
// ends it in tests: there is no wait in real time here.
class CondVar {
 public:
  void Wait(MutexLock& lock) { cv_.wait(lock.lock_); }
  template <typename Predicate>
  void Wait(MutexLock& lock, Predicate pred) {
    cv_.wait(lock.lock_, std::move(pred));
  }
  // Until notified, `clock` reaches `deadline_ns` (its NowNs time), or
  // spuriously; true when the deadline has passed.
  bool WaitUntil(MutexLock& lock, const Clock& clock, int64_t deadline_ns) {
    return clock.WaitUntil(cv_, lock.lock_, deadline_ns);
  }
  // Until `pred` holds (true) or `clock` reaches `deadline_ns` with it false
  // (false).
  // (`pred` runs with the lock held, which the analysis cannot see through
  // a MutexLock: it is not analysed here, as std::condition_variable's own
  // predicate loop is not.)
  template <typename Predicate>
  bool WaitUntil(MutexLock& lock, const Clock& clock, int64_t deadline_ns,
                 Predicate pred) QUERN_NO_THREAD_SAFETY_ANALYSIS {
    while (!pred()) {
      if (clock.WaitUntil(cv_, lock.lock_, deadline_ns)) return pred();
    }
    return true;
  }
  // The same for `timeout` from now on `clock`.
  template <typename Rep, typename Period, typename Predicate>
  bool WaitFor(MutexLock& lock, const Clock& clock, std::chrono::duration<Rep, Period> timeout, Predicate pred) {
    return WaitUntil(lock, clock, Deadline(clock, timeout), std::move(pred));
  }
  template <typename Rep, typename Period>
  bool WaitFor(MutexLock& lock, const Clock& clock, std::chrono::duration<Rep, Period> timeout) {
    return WaitUntil(lock, clock, Deadline(clock, timeout));
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  template <typename Rep, typename Period>
  static int64_t Deadline(const Clock& clock, std::chrono::duration<Rep, Period> timeout) {
    // Saturated: a timeout past the clock's range waits without end.
    const int64_t now = clock.NowNs();
    const std::chrono::duration<double, std::nano> ns = timeout;
    if (ns.count() >= static_cast<double>(INT64_MAX - now)) return INT64_MAX;
    return now + std::max<int64_t>(static_cast<int64_t>(ns.count()), 0);
  }
  std::condition_variable cv_;
};

// Lets `timeout` pass on `clock` (a FakeClock's test moves it on). For a
// loop that polls what nothing signals.
template <typename Rep, typename Period>
void SleepFor(const Clock& clock, std::chrono::duration<Rep, Period> timeout) {
  Mutex mu;
  CondVar cv;
  MutexLock lock(mu);
  cv.WaitFor(lock, clock, timeout, [] { return false; });
}

}  // namespace quern
