// ResponseSequencer: releases completions in the order their tickets were
// issued (preserve_ordering). A completion that finishes early waits, inside
// the sequencer, until every earlier ticket has completed; it then runs on the
// thread that completed the last missing ticket.
//
// Every ticket must be completed exactly once, or later completions wait
// forever. Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>

#include "core/mutex.h"

namespace quern {

class ResponseSequencer {
 public:
  uint64_t NextTicket() {
    MutexLock lock(mu_);
    return issued_++;
  }

  // Runs `release` now if `ticket` is the oldest outstanding one (followed by
  // any later ones already waiting), else parks it.
  void Complete(uint64_t ticket, std::function<void()> release) {
    MutexLock lock(mu_);
    parked_.emplace(ticket, std::move(release));
    if (releasing_) return;  // the releasing thread will pick it up
    releasing_ = true;
    while (!parked_.empty() && parked_.begin()->first == next_) {
      auto fn = std::move(parked_.begin()->second);
      parked_.erase(parked_.begin());
      ++next_;
      lock.Unlock();
      fn();
      lock.Lock();
    }
    releasing_ = false;
  }

 private:
  Mutex mu_;
  uint64_t issued_ QUERN_GUARDED_BY(mu_) = 0;
  uint64_t next_ QUERN_GUARDED_BY(mu_) = 0;
  bool releasing_ QUERN_GUARDED_BY(mu_) = false;
  std::map<uint64_t, std::function<void()>> parked_ QUERN_GUARDED_BY(mu_);
};

}  // namespace quern
