#include "core/idle_release.h"

#include <utility>

#include "core/cpus.h"
#include "core/log.h"

namespace quern {

IdleRelease::IdleRelease(const Clock& clock, int64_t idle_ns)
    : clock_(clock), idle_ns_(idle_ns > 0 ? idle_ns : 1), thread_([this] { Loop(); }) {}

IdleRelease::~IdleRelease() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  wake_.SignalAll();
  thread_.join();
}

void IdleRelease::Add(const void* key, std::function<Outcome()> release) {
  MutexLock lock(mu_);
  Entry& e = entries_[key];
  e.release = std::move(release);
  e.due_ns = 0;
}

void IdleRelease::Remove(const void* key) {
  MutexLock lock(mu_);
  while (running_ == key) ran_.Wait(lock);
  entries_.erase(key);
}

void IdleRelease::Touch(const void* key) {
  MutexLock lock(mu_);
  auto it = entries_.find(key);
  if (it == entries_.end() || it->second.due_ns != 0) return;
  it->second.due_ns = clock_.NowNs() + idle_ns_;
  wake_.Signal();  // it may be due before anything the thread waits for
}

int64_t IdleRelease::calls() const {
  MutexLock lock(mu_);
  return calls_;
}

void IdleRelease::Loop() {
  NameThisThread("quern-release");
  MutexLock lock(mu_);
  while (!stop_) {
    const int64_t now = clock_.NowNs();
    int64_t next = 0;
    const void* due = nullptr;
    for (const auto& [key, e] : entries_) {
      if (e.due_ns == 0) continue;
      if (e.due_ns <= now) {
        due = key;
        break;
      }
      if (next == 0 || e.due_ns < next) next = e.due_ns;
    }
    if (due == nullptr) {
      if (next == 0) {
        wake_.Wait(lock);  // nothing is due: no timer (a Touch wakes it)
      } else {
        wake_.WaitUntil(lock, clock_, next);
      }
      continue;
    }
    Entry& e = entries_[due];
    e.due_ns = 0;  // a Touch while it runs arms it again (then it is looked at idle_ns after that)
    std::function<Outcome()> release = e.release;
    running_ = due;
    ++calls_;
    lock.Unlock();
    Outcome out = Outcome::kHeld;
    try {
      out = release();
    } catch (const std::exception& ex) {
      Log(LogLevel::kWarning, std::string("releasing idle memory failed: ") + ex.what());
    } catch (...) {
      Log(LogLevel::kWarning, "releasing idle memory failed");
    }
    release = nullptr;  // what it captured goes without the lock held
    lock.Lock();
    running_ = nullptr;
    ran_.SignalAll();
    auto it = entries_.find(due);
    if (it != entries_.end() && out == Outcome::kHeld && it->second.due_ns == 0) {
      it->second.due_ns = clock_.NowNs() + idle_ns_;
    }
  }
}

}  // namespace quern
