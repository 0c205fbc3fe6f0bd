// Injectable time source. Every timeout, deadline and batching delay in Quern
// reads a Clock, so tests replace the real one with FakeClock and never sleep.
// Times are nanoseconds on a monotonic time line (not wall-clock time).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace quern {

class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic now, in nanoseconds. Thread-safe.
  virtual int64_t NowNs() const = 0;
};

// steady_clock. Thread-safe; use Clock::Real() for the process-wide instance.
class RealClock final : public Clock {
 public:
  int64_t NowNs() const override {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
};

// Returns the process-wide real clock (never null, never destroyed).
const Clock& RealClockInstance();

// A clock that moves only when told to. Thread-safe.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(int64_t start_ns = 1'000'000'000) : now_(start_ns) {}
  int64_t NowNs() const override { return now_.load(std::memory_order_acquire); }
  void AdvanceUs(int64_t us) { now_.fetch_add(us * 1000, std::memory_order_acq_rel); }
  void AdvanceNs(int64_t ns) { now_.fetch_add(ns, std::memory_order_acq_rel); }

 private:
  std::atomic<int64_t> now_;
};

}  // namespace quern
