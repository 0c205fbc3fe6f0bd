#include "quern/clock.h"

#include <algorithm>

namespace quern {

const Clock& RealClockInstance() {
  static const RealClock* clock = new RealClock();
  return *clock;
}

bool FakeClock::WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, int64_t deadline_ns) const {
  if (NowNs() >= deadline_ns) return true;
  Waiter self{lock.mutex(), &cv, deadline_ns};
  {
    std::lock_guard g(mu_);
    waiters_.push_back(&self);
  }
  // Checked again once registered: an AdvanceNs that moved the clock before
  // this saw no waiter to wake. One that moves it after finds this waiter
  // and takes `lock`'s mutex to notify, so it waits for cv.wait to let go.
  if (NowNs() < deadline_ns) cv.wait(lock);
  // Leaves the registry with `lock` released: an advancing thread that
  // picked this waiter may be blocked on its mutex, and `self` must outlive
  // its notify.
  lock.unlock();
  {
    std::unique_lock g(mu_);
    fired_.wait(g, [&] { return self.firing == 0; });
    waiters_.erase(std::find(waiters_.begin(), waiters_.end(), &self));
  }
  lock.lock();
  return NowNs() >= deadline_ns;
}

void FakeClock::AdvanceNs(int64_t ns) {
  const int64_t now = now_.fetch_add(ns, std::memory_order_acq_rel) + ns;
  std::vector<Waiter*> due;
  {
    std::lock_guard g(mu_);
    for (Waiter* w : waiters_) {
      if (w->deadline_ns <= now) {
        ++w->firing;
        due.push_back(w);
      }
    }
  }
  // Each waiter is let go as soon as it is notified: one waiting for its
  // record to be free never waits on another waiter's mutex.
  for (Waiter* w : due) {
    {
      std::lock_guard waiter_lock(*w->mu);
      w->cv->notify_all();
    }
    {
      std::lock_guard g(mu_);
      --w->firing;
    }
    fired_.notify_all();
  }
}

int FakeClock::waiters() const {
  std::lock_guard g(mu_);
  return static_cast<int>(waiters_.size());
}

}  // namespace quern
