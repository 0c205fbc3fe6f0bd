// Injectable time source. Every timeout, deadline and batching delay in Quern
// reads a Clock, and so do the timestamps it writes, so tests replace the
// real one with FakeClock to set what the code reads. Waiting is not
// injected yet: a thread that waits (CondVar::WaitFor) waits in real time,
// so a test of a wait still lets real time pass. NowNs is monotonic time (for
// durations and deadlines); WallNs is the date (for timestamps people read
// and deadlines given as dates).
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
  // Wall-clock now: nanoseconds since the Unix epoch. Not monotonic.
  // Thread-safe.
  virtual int64_t WallNs() const = 0;
  int64_t WallMs() const { return WallNs() / 1'000'000; }
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
};

// Returns the process-wide real clock (never null, never destroyed).
const Clock& RealClockInstance();

// A clock that moves only when told to; its date moves with it. Thread-safe.
class FakeClock final : public Clock {
 public:
  // 2026-01-01T00:00:00Z.
  static constexpr int64_t kDefaultWallStartNs = 1'767'225'600'000'000'000;

  explicit FakeClock(int64_t start_ns = 1'000'000'000, int64_t wall_start_ns = kDefaultWallStartNs)
      : now_(start_ns), wall_minus_now_(wall_start_ns - start_ns) {}
  int64_t NowNs() const override { return now_.load(std::memory_order_acquire); }
  int64_t WallNs() const override { return NowNs() + wall_minus_now_; }
  void AdvanceUs(int64_t us) { now_.fetch_add(us * 1000, std::memory_order_acq_rel); }
  void AdvanceNs(int64_t ns) { now_.fetch_add(ns, std::memory_order_acq_rel); }

 private:
  std::atomic<int64_t> now_;
  const int64_t wall_minus_now_;
};

}  // namespace quern
