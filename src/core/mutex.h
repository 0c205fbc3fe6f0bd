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

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <shared_mutex>

#include "core/thread_annotations.h"

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
class CondVar {
 public:
  void Wait(MutexLock& lock) { cv_.wait(lock.lock_); }
  template <typename Rep, typename Period>
  void WaitFor(MutexLock& lock, std::chrono::duration<Rep, Period> timeout) {
    cv_.wait_for(lock.lock_, timeout);
  }
  template <typename Predicate>
  void Wait(MutexLock& lock, Predicate pred) {
    cv_.wait(lock.lock_, std::move(pred));
  }
  // False when the time passed with `pred` still false.
  template <typename Rep, typename Period, typename Predicate>
  bool WaitFor(MutexLock& lock, std::chrono::duration<Rep, Period> timeout, Predicate pred) {
    return cv_.wait_for(lock.lock_, timeout, std::move(pred));
  }
  template <typename Clock, typename Duration, typename Predicate>
  bool WaitUntil(MutexLock& lock, std::chrono::time_point<Clock, Duration> deadline, Predicate pred) {
    return cv_.wait_until(lock.lock_, deadline, std::move(pred));
  }
  template <typename Clock, typename Duration>
  void WaitUntil(MutexLock& lock, std::chrono::time_point<Clock, Duration> deadline) {
    cv_.wait_until(lock.lock_, deadline);
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace quern
