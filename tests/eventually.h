// Waits in tests for another thread's progress, with a bound in real time.
#pragma once

#include <chrono>
#include <thread>

namespace quern::testing {

// Waits until `cond` holds, up to thirty seconds of real time (a generous
// bound: a sanitizer build on a machine whose cores other processes keep
// busy); whether it did. It yields for the first millisecond, then sleeps
// 100 us between checks, leaving the CPU to the thread it waits for.
template <typename F>
bool Eventually(F cond) {
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + std::chrono::seconds(30);
  while (!cond()) {
    const auto now = std::chrono::steady_clock::now();
    if (now > until) return false;
    if (now - start < std::chrono::milliseconds(1)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  return true;
}

}  // namespace quern::testing
