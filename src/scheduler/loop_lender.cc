#include "scheduler/loop_lender.h"

#include <algorithm>

#include "scheduler/dynamic_batcher.h"

namespace quern {

LoopLender::LoopLender() = default;

LoopLender::~LoopLender() {
  // Models still listed are left to their workers.
  for (auto& slot : slots_) {
    if (slot) DynamicBatcher::LendEnd(*slot);
  }
}

LoopLender* LoopLender::Lending(CallerLoop* loop) {
  auto* lender = static_cast<LoopLender*>(loop);  // the only kind of CallerLoop
  // Its owner first: paused_ is the owner thread's to read.
  if (lender == nullptr || lender->owner_ != std::this_thread::get_id()) return nullptr;
  return lender->paused_ ? nullptr : lender;
}

bool LoopLender::Add(const std::shared_ptr<LendSlot>& slot) {
  if (std::find(slots_.begin(), slots_.end(), slot) != slots_.end()) return false;
  slots_.push_back(slot);
  return true;
}

bool LoopLender::RunDue(int64_t* wait_ns) {
  *wait_ns = -1;
  if (paused_) {  // the models' workers take what is queued
    for (auto& slot : slots_) {
      if (slot) DynamicBatcher::LendEnd(*slot);
    }
    slots_.clear();
    return false;
  }
  bool ran = false;
  // By index: a batch's answers may queue into other models from this
  // thread, which lists them here meanwhile (they are looked at in this pass).
  size_t kept = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    std::shared_ptr<LendSlot> slot = slots_[i];  // a copy: Add may move the vector
    if (!slot) continue;
    const DynamicBatcher::LendOutcome out = DynamicBatcher::LendRun(*slot);
    ran = ran || out.ran;
    if (!out.keep) {
      slots_[i].reset();  // no longer listed: a later Add in this pass lists it again
      continue;
    }
    if (out.wait_ns >= 0 && (*wait_ns < 0 || out.wait_ns < *wait_ns)) *wait_ns = out.wait_ns;
    slots_[kept++] = std::move(slot);
  }
  slots_.resize(kept);
  return ran;
}

}  // namespace quern
