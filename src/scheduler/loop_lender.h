// LoopLender: an event loop's thread that runs its own requests' batches.
//
// On a server with one core, a request handed from the network thread to an
// instance's worker and its answer handed back cost each batch two sleeps
// and two wake-ups of threads that share that core (a few µs of kernel time
// per request on a virtual machine, as much as the rest of the request's
// handling); nothing runs in parallel in exchange. A loop thread that lends
// itself runs the batches instead: a request it queues wakes no worker; once
// the loop has handled every ready event (the point at which it would sleep
// and the worker would run) it asks each model it queued into for the batch
// a worker would take now (the same queue policy: batching delay, everyone
// here, preferred sizes) and runs it on a free instance, on its own thread.
// The answers are then the loop's own handlers.
//
// A model takes a loop's loan only for short batches (see
// DynamicBatcher::kLoopLendBelowNs). Its workers take the queue when the
// loop finds the instance busy (the worker looks after its batch), when
// batches grow long, while the loop is paused, and when work from another
// thread wakes one (it takes the loop's queued tasks with it, unless the
// loop gets there first). A queued task no loop may run (a large input,
// another thread's) keeps the loops out of the model's queue until the
// queue has emptied. A worker that is awake leaves the queue to the
// loop while the loop looked at it within DynamicBatcher::kLendGraceNs; one
// asleep is not woken for the loop's tasks, so a loop held by a long
// request (a model load it serves synchronously) delays them as it delays
// its other connections. Deadlines and cancellations of queued tasks are
// still kept by the model's reaper while every instance is busy.
//
// The loop passes it with each request it submits (SubmitOptions::loop,
// through the engine to ScheduleOptions::loop): no thread-local, so only
// requests their front end hands it to are lent.
//
// Thread safety: a LoopLender belongs to the thread that created it; Add is
// called by DynamicBatcher on that thread (Lending checks it), RunDue by the
// loop.
#pragma once

#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "core/mutex.h"
#include "quern/engine.h"

namespace quern {

class DynamicBatcher;

// A model's link to the lenders that queued into it: cleared (under mu) when
// the model stops, so a lender that still lists it looks no further.
struct LendSlot {
  Mutex mu;
  DynamicBatcher* batcher QUERN_GUARDED_BY(mu) = nullptr;
};

class LoopLender final : public CallerLoop {
 public:
  // Belongs to the calling thread.
  LoopLender();
  ~LoopLender() override;
  LoopLender(const LoopLender&) = delete;
  LoopLender& operator=(const LoopLender&) = delete;

  // `loop` when it is a LoopLender called on its own thread and not paused:
  // a lender that may take work now; null otherwise.
  static LoopLender* Lending(CallerLoop* loop);

  // While paused (e.g. while the loop must answer refusals at once) models
  // see no lender: what it queues goes to their workers, and the next
  // RunDue hands the models it lists to their workers too.
  void set_paused(bool paused) override { paused_ = paused; }

  // Remembers a model that holds work for this lender (DynamicBatcher,
  // on this thread). Whether it was listed already.
  bool Add(const std::shared_ptr<LendSlot>& slot);

  // Runs, on this thread, the batches its models would send off now, one per
  // model at most. Returns whether any ran (their answers may now be
  // pending handlers). `*wait_ns` is set to how long the loop may wait for
  // events before it should call again (-1: until an event, nothing is
  // waiting for time to pass).
  bool RunDue(int64_t* wait_ns) override;

  // Models listed.
  size_t listed() const { return slots_.size(); }

 private:
  const std::thread::id owner_ = std::this_thread::get_id();
  std::vector<std::shared_ptr<LendSlot>> slots_;
  bool paused_ = false;
};

}  // namespace quern
