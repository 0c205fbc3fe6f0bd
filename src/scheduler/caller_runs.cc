// DynamicBatcher's batches run by a caller's thread instead of a worker:
// a caller that runs its own batch (RunHere: Engine::Run's blocking caller,
// a front end's thread lending itself for a short batch, a shared run beside
// a busy instance) and a lending loop that runs its queued batches later
// (LendRun, LendEnd). Schedule (dynamic_batcher.cc) decides which applies;
// the workers' loop is there too.
#include <algorithm>
#include <cstdint>

#include "scheduler/dynamic_batcher.h"  // the class these members belong to
#include "scheduler/loop_lender.h"

namespace quern {

bool DynamicBatcher::LoopMayRunLocked() const {
  if (stopping_ || wide_ || ns_per_item_ <= 0 || foreign_queued_) return false;
  const auto items = static_cast<double>(std::min(queue_.items(), queue_.batch_limit()));
  return ns_per_item_ * items < kLoopLendBelowNs;
}

void DynamicBatcher::DropLenderLocked() {
  --lenders_;
  if (queue_.empty()) return;
  if (busy_workers_ < narrow_workers() && MayTake(false)) WakeNarrowLocked();
  // While every instance is busy the reaper drops what dies in the queue
  // (it slept while the loop watched it).
  if (!AnyTaker() && ReaperNeedsWake(0, clock_->NowNs())) reaper_cv_.Signal();
}

DynamicBatcher::LendOutcome DynamicBatcher::LendRun(LendSlot& slot) {
  LendOutcome out;
  // The slot is held only while the batch is taken: once counted among the
  // callers' runs the batcher outlives the run (Shutdown waits for them),
  // and another loop may take the model's next batch meanwhile.
  MutexLock slot_lock(slot.mu);
  DynamicBatcher* const b = slot.batcher;
  if (b == nullptr) return out;  // stopped: its workers run what is queued
  MutexLock lock(b->mu_);
  const int claimed = b->queue_.empty() || !b->LoopMayRunLocked() ? -1 : b->ClaimLocked(/*wide_ok=*/false);
  if (claimed < 0) {  // nothing queued, or left to the workers (a busy one looks after its batch)
    b->DropLenderLocked();
    return out;
  }
  int64_t now = b->clock_->NowNs();
  b->lend_until_ns_ = now + kLendGraceNs;
  BatchQueue::Decision d = b->queue_.Next(now, /*flush=*/b->SendNowLocked(), b->narrow_workers() - b->busy_workers_);
  if (d.batch.empty() && d.dropped.empty()) {
    out.keep = true;
    out.wait_ns = d.wake_at_ns > 0 ? std::max<int64_t>(d.wake_at_ns - now, 0) : -1;
    return out;
  }
  const auto tasks = static_cast<int64_t>(d.batch.size());
  b->BeginLocked(claimed, d, now, /*shared=*/false);
  ++b->callers_running_;
  if (!d.batch.empty()) ++b->lent_batches_;
  // What the batch leaves queued waits on the reaper while no worker may take it (as a worker's does).
  if (!b->queue_.empty() && !b->AnyTaker() && b->ReaperNeedsWake(0, now)) b->reaper_cv_.Signal();
  lock.Unlock();
  slot_lock.Unlock();
  for (auto& dropped : d.dropped) b->on_drop_(std::move(dropped.task), dropped.status);
  const Ran ran = b->Process(claimed, std::move(d.batch));
  lock.Lock();
  b->EndLocked(claimed, tasks, d, ran, /*shared=*/false, /*tune=*/true);
  out.ran = true;
  if (b->stopping_ || b->queue_.empty()) {
    // Stopping: the workers drain the queue (Shutdown woke them).
    --b->lenders_;
  } else if (!b->LoopMayRunLocked()) {
    b->DropLenderLocked();  // the rest is the workers' (queued meanwhile by another thread, or long)
  } else {
    now = b->clock_->NowNs();
    b->lend_until_ns_ = now + kLendGraceNs;
    out.keep = true;
    out.wait_ns = 0;
  }
  // Last: once the count is down, Shutdown may return and the batcher go.
  if (--b->callers_running_ == 0) b->callers_cv_.SignalAll();
  return out;
}

void DynamicBatcher::LendEnd(LendSlot& slot) {
  MutexLock slot_lock(slot.mu);
  if (slot.batcher == nullptr) return;
  MutexLock lock(slot.batcher->mu_);
  slot.batcher->DropLenderLocked();
}

int64_t DynamicBatcher::lent_batches() const {
  MutexLock lock(mu_);
  return lent_batches_;
}

bool DynamicBatcher::RunsBriefly(int64_t below_ns) const {
  if (below_ns <= 0) return true;
  // Only into an idle model (nothing running, nothing queued but this): a
  // model with company for this request batches on its workers, while the
  // caller's thread goes on receiving.
  if (running_tasks_ > 0 || queue_.size() > 1) return false;
  return ns_per_item_ > 0 && ns_per_item_ * static_cast<double>(queue_.items()) < static_cast<double>(below_ns);
}

int DynamicBatcher::ShareLocked() const {
  if (stopping_ || shared_running_ >= max_shared_runs_ || wide_running_) return -1;
  // Only while every instance that may take work is busy (not while the
  // others wait for the wide one), and batches are known to be short.
  if (busy_workers_ < narrow_workers() || !MayTake(false)) return -1;
  if (alone_ns_per_item_ <= 0 || alone_ns_per_item_ >= kSharedBelowNs) return -1;
  int best = -1;
  for (int i = 0; i < narrow_workers(); ++i) {
    if (best < 0 || shared_on_[static_cast<size_t>(i)] < shared_on_[static_cast<size_t>(best)]) best = i;
  }
  return best;
}

int DynamicBatcher::ClaimLocked(bool wide_ok) const {
  if (stopping_) return -1;
  if (wide_ && MayTake(true)) return wide_ok ? num_workers_ - 1 : -1;
  if (busy_workers_ >= narrow_workers() || !MayTake(false)) return -1;
  for (int i = 0; i < narrow_workers(); ++i) {
    if (!busy_[static_cast<size_t>(i)]) return i;
  }
  return -1;
}

void DynamicBatcher::RunHere(int worker, BatchQueue::Decision d, bool shared, bool tune) {
  for (auto& dropped : d.dropped) on_drop_(std::move(dropped.task), dropped.status);
  const auto tasks = static_cast<int64_t>(d.batch.size());
  const Ran ran = Process(worker, std::move(d.batch));
  MutexLock lock(mu_);
  EndLocked(worker, tasks, d, ran, shared, tune);
  if (--callers_running_ == 0) callers_cv_.SignalAll();
  // The instance's own worker may have waited for it (work queued, or the
  // batcher stopping); it or another that may take the work looks now.
  if (stopping_) {
    SignalAllLocked();
  } else if (!queue_.empty()) {
    if (wide_ && MayTake(true)) {
      wide_cv_.Signal();
    } else if (MayTake(false)) {
      WakeNarrowLocked();
    }
  }
}

}  // namespace quern
