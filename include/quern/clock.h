// Injectable time source, for reading time and for waiting. Quern's own
// timeouts, deadlines, batching delays, retry pauses and polls read a Clock
// and wait through it (a condition variable wait with a time limit exists
// only through a Clock: core/mutex.h), and so do the timestamps it writes;
// tests replace the real one with FakeClock, whose waits end when the test
// moves it. (Socket timeouts of the libraries underneath, Asio's and gRPC's
// event loops and ONNX Runtime keep real time.) NowNs is monotonic time (for
// durations and deadlines); WallNs is the date (for timestamps people read
// and deadlines given as dates).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

namespace quern {

class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic now, in nanoseconds. Thread-safe.
  virtual int64_t NowNs() const = 0;
  // Wall-clock now: nanoseconds since the Unix epoch. Not monotonic.
  // Thread-safe.
  virtual int64_t WallNs() const = 0;
  int64_t WallMs() const { return WallNs() / 1'000'000; }

  // Waits on `cv` with `lock` held (released while waiting, held again on
  // return) until `cv` is notified, this clock reaches `deadline_ns` (NowNs
  // time), or spuriously; the caller re-checks its condition, as with any
  // condition variable. Returns true when the deadline has passed.
  // Thread-safe. (core/mutex.h's CondVar::WaitUntil is the usual way in.)
  virtual bool WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                         int64_t deadline_ns) const = 0;
};

// steady_clock and system_clock. Thread-safe; use RealClockInstance() for
// the process-wide instance.
class RealClock final : public Clock {
 public:
  int64_t NowNs() const override {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  int64_t WallNs() const override {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  bool WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, int64_t deadline_ns) const override {
    const std::chrono::steady_clock::time_point deadline{std::chrono::nanoseconds(deadline_ns)};
    return cv.wait_until(lock, deadline) == std::cv_status::timeout || NowNs() >= deadline_ns;
  }
};

// Returns the process-wide real clock (never null, never destroyed).
const Clock& RealClockInstance();

// A clock that moves only when told to; its date moves with it. A wait
// (WaitUntil) ends when AdvanceNs/AdvanceUs moves the clock to its deadline
// (the advancing thread wakes it: it takes the waiter's mutex to notify, so
// it must not hold that mutex itself), or when its condition variable is
// notified. Thread-safe. It must outlive every wait on it.
class FakeClock final : public Clock {
 public:
  // 2026-01-01T00:00:00Z.
  static constexpr int64_t kDefaultWallStartNs = 1'767'225'600'000'000'000;

  explicit FakeClock(int64_t start_ns = 1'000'000'000, int64_t wall_start_ns = kDefaultWallStartNs)
      : now_(start_ns), wall_minus_now_(wall_start_ns - start_ns) {}
  FakeClock(const FakeClock&) = delete;
  FakeClock& operator=(const FakeClock&) = delete;

  int64_t NowNs() const override { return now_.load(std::memory_order_acquire); }
  int64_t WallNs() const override { return NowNs() + wall_minus_now_; }
  bool WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, int64_t deadline_ns) const override;
  // Moves the clock on and wakes the waits whose deadline it reached.
  void AdvanceNs(int64_t ns);
  void AdvanceUs(int64_t us) { AdvanceNs(us * 1000); }
  // How many threads are waiting on this clock now (a test waits for the
  // code under test to be waiting before it moves the clock).
  int waiters() const;

 private:
  struct Waiter {
    std::mutex* mu;
    std::condition_variable* cv;
    int64_t deadline_ns;
    int firing = 0;  // advancing threads about to notify it (guarded by mu_)
  };

  std::atomic<int64_t> now_;
  const int64_t wall_minus_now_;
  mutable std::mutex mu_;
  mutable std::condition_variable fired_;  // a Waiter's `firing` went down
  mutable std::vector<Waiter*> waiters_;   // guarded by mu_
};

}  // namespace quern
