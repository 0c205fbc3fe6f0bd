// Waits in tests for another thread's progress, with a bound in real time.
#pragma once

#include <chrono>
#include <thread>

namespace quern::testing {

// Waits until `cond` holds, up to ten seconds of real time; whether it did.
template <typename F>
bool Eventually(F cond) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!cond()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::yield();
  }
  return true;
}

}  // namespace quern::testing
