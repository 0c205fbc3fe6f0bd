// Memory for the large buffers a model run allocates and frees again on every
// run (its activations, its outputs), at the few sizes its batch sizes need.
//
// A large block (`min_cached_bytes` or more) comes from the system (mmap) the
// first time its size class is asked for; when freed it is kept, and the next
// request of its class, or of a class down to half its size, takes it back (the
// smallest that fits; of one class, the last freed: its pages are the warmest).
// When no kept block fits, the smallest larger kept block (else the largest
// kept one, whatever its size) is resized (mremap) rather than a new one
// mapped beside it: a change of batch sizes reuses what the old ones held
// instead of adding to it. (Two models whose runs need very different sizes
// can take each other's kept blocks this way; the one resized back faults
// its pages in again.) A kept block that no request took for `idle_release_ns`
// goes back to the system (munmap), so memory follows the load: a burst of
// large batches leaves nothing behind once it has been over for that long,
// while a steady load reuses its blocks and never maps anew. (ONNX Runtime's
// own arena keeps what its largest run needed until the process ends.)
// Smaller requests go to the C library's allocator.
//
// Size classes: a request is rounded up to the next multiple of an eighth of
// its power of two (at most 12.5 % more), whole pages. Every pointer returned
// is aligned to kAlignment bytes.
//
// Waiting: a thread of the cache's own returns idle blocks; it waits through
// the Clock it is given (a FakeClock moves it in tests) and only while blocks
// are kept: an idle process with nothing kept has it asleep without a timer.
//
// Thread-safe. The destructor stops that thread and returns every kept block;
// blocks still in use at that point are never returned (free them first).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <thread>

#include "core/mutex.h"
#include "quern/clock.h"

namespace quern {

class BlockCache {
 public:
  static constexpr size_t kAlignment = 64;

  struct Options {
    size_t min_cached_bytes = size_t{256} << 10;  // smaller: the C library's allocator
    int64_t idle_release_ns = 5'000'000'000;      // a kept block unused this long is returned
    // Called by the releasing thread (without the cache's lock) after it returned blocks and
    // none is kept or in use any more: the load is over (the server returns the C library's free
    // pages then: core/memory.h's ReturnFreedMemory).
    std::function<void()> on_idle;
  };

  // What the cache holds now.
  struct Use {
    size_t in_use_bytes = 0;  // large blocks handed out and not yet freed (their mapped size)
    size_t kept_bytes = 0;    // large blocks freed and kept for reuse
    int64_t mapped = 0;       // large blocks mapped since the start
    int64_t returned = 0;     // large blocks returned to the system since the start
    int64_t resized = 0;      // kept blocks resized to another class (none kept fitted)
  };

  BlockCache(Options options, const Clock& clock);
  ~BlockCache();
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // `size` bytes (0 is treated as 1), aligned to kAlignment; nullptr when the
  // system has no memory left (or `size` is beyond any: over SIZE_MAX / 4).
  void* Alloc(size_t size);
  // `size` bytes from the C library whatever the size, aligned to kAlignment,
  // and not counted in InUse: for what lives as long as its owner (a
  // session's weights), which keeping or timing would only waste. nullptr as
  // Alloc.
  void* AllocLasting(size_t size);
  // Takes back what Alloc or AllocLasting returned (nullptr: nothing).
  void Free(void* p);

  Use InUse() const;

  // The large blocks the calling thread takes from any BlockCache while the
  // scope is open: opened around a model's run on its thread, the run memory
  // the run needed at once (its activations and outputs; small buffers, from
  // the C library, are not counted). A block counts as the class its request
  // asked for (not the larger kept block that may serve it, which depends on
  // what other runs freed before), from when it is taken until this thread
  // frees it within the scope (a block another thread frees, or freed after
  // the scope it was taken in ended, stays counted; one taken before the
  // scope and freed in it counts nothing). A scope opened inside another (a
  // run that runs another model's batch on its thread) counts in the outer
  // one too.
  class ThreadScope {
   public:
    ThreadScope();
    ~ThreadScope();
    ThreadScope(const ThreadScope&) = delete;
    ThreadScope& operator=(const ThreadScope&) = delete;
    // The most this scope's blocks held at once so far.
    size_t peak() const;

   private:
    int64_t outer_held_;
    int64_t outer_peak_;
    uint64_t outer_scope_;
  };

  // Returns every kept block to the system now, as if each had been idle
  // long enough (a model's load is done with what it measured, say).
  void ReturnKept();

  // The mapped size of a large request of `size` bytes (its class, header
  // included); 0 for a request below min_cached_bytes.
  size_t ClassBytes(size_t size) const;

 private:
  struct Kept {
    void* base;
    int64_t freed_ns;
  };

  // The last block freed of `it`'s class, out of the kept ones.
  void* TakeKept(std::map<size_t, std::deque<Kept>>::iterator it) QUERN_REQUIRES(mu_);
  void ReleaseLoop();

  const Options options_;
  const Clock& clock_;
  mutable Mutex mu_;
  CondVar wake_;
  // Kept blocks by class size, the oldest first.
  std::map<size_t, std::deque<Kept>> kept_ QUERN_GUARDED_BY(mu_);
  Use use_ QUERN_GUARDED_BY(mu_);
  bool stop_ QUERN_GUARDED_BY(mu_) = false;
  bool sleeping_ QUERN_GUARDED_BY(mu_) = false;  // the release thread waits without a time limit
  std::thread releaser_;
};

}  // namespace quern
