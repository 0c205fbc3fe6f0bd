// SerialWorker: one thread that runs jobs in the order they were posted, for
// work that may block (a model load, a round trip to Redis) and must not run
// on an event loop's thread, where every other connection of that loop
// would wait for it.
//
// Bounded: at most `max_queued` jobs wait; Post refuses beyond (the caller
// answers "busy"). Stop drops the jobs not started (destroying them outside
// the lock) and waits for the one running; Post after Stop refuses.
// Thread safety: every method may be called from any thread; a job must
// not Stop its own worker.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <string>
#include <thread>

#include "core/mutex.h"

namespace quern {

class SerialWorker {
 public:
  // Starts the thread, named `name` (15 characters at most are kept).
  SerialWorker(std::string name, size_t max_queued);
  ~SerialWorker();  // Stop()

  // Queues `job`; false (job not taken) when max_queued wait already, or
  // after Stop.
  bool Post(std::function<void()> job);

  void Stop();

 private:
  void Run();

  const std::string name_;
  const size_t max_queued_;
  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> jobs_ QUERN_GUARDED_BY(mu_);
  bool stopping_ QUERN_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace quern
