#include "core/block_cache.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define QUERN_BLOCK_CACHE_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define QUERN_BLOCK_CACHE_LSAN 1
#endif
#endif
#ifdef QUERN_BLOCK_CACHE_LSAN
#include <sanitizer/lsan_interface.h>
#endif

namespace quern {

namespace {

// LeakSanitizer looks for pointers in what malloc gave out, not in mapped
// memory: a block in use (which may hold the only pointer to something, a
// string tensor's strings) is shown to it, and hidden again once freed (what
// a kept block still holds is stale and must not keep a leak reachable).
void ShowToLsan([[maybe_unused]] void* base, [[maybe_unused]] size_t bytes) {
#ifdef QUERN_BLOCK_CACHE_LSAN
  __lsan_register_root_region(base, bytes);
#endif
}

void HideFromLsan([[maybe_unused]] void* base, [[maybe_unused]] size_t bytes) {
#ifdef QUERN_BLOCK_CACHE_LSAN
  __lsan_unregister_root_region(base, bytes);
#endif
}

void* Map(size_t bytes) {
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return base == MAP_FAILED ? nullptr : base;
}

// `base` (a block of `had` bytes) as a block of `bytes`, perhaps moved; nullptr
// (and `base` as it was) when the system cannot.
void* Remap(void* base, size_t had, size_t bytes) {
  void* moved = mremap(base, had, bytes, MREMAP_MAYMOVE);
  return moved == MAP_FAILED ? nullptr : moved;
}

void Unmap(void* base, size_t bytes) {
  munmap(base, bytes);
}

// Each block starts with this header, kAlignment bytes before the pointer
// handed out: the class size of a mapped block (what munmap takes), 0 for
// one from the C library.
struct Header {
  size_t class_bytes;
  size_t asked_bytes = 0;  // the class the request asked for (BlockCache::ThreadScope), <= class_bytes
  uint64_t scope = 0;      // the ThreadScope it was taken in (0: none)
};
constexpr size_t kHeader = BlockCache::kAlignment;
constexpr size_t kPage = 4096;

Header* HeaderOf(void* p) {
  return reinterpret_cast<Header*>(static_cast<std::byte*>(p) - kHeader);
}
void* UserOf(void* base) {
  return static_cast<std::byte*>(base) + kHeader;
}

// The calling thread's large blocks in its innermost BlockCache::ThreadScope,
// which every scope of the process numbers apart.
struct ThreadBlocks {
  int64_t held = 0;
  int64_t peak = 0;
  uint64_t scope = 0;
};
thread_local ThreadBlocks t_blocks;
std::atomic<uint64_t> g_scopes{0};

// A block of `base` handed out for a request of class `asked`.
void* HandOut(void* base, size_t asked) {
  Header* h = HeaderOf(UserOf(base));
  h->asked_bytes = asked;
  h->scope = t_blocks.scope;
  t_blocks.held += static_cast<int64_t>(asked);
  t_blocks.peak = std::max(t_blocks.peak, t_blocks.held);
  return UserOf(base);
}

}  // namespace

BlockCache::ThreadScope::ThreadScope()
    : outer_held_(t_blocks.held), outer_peak_(t_blocks.peak), outer_scope_(t_blocks.scope) {
  t_blocks = {0, 0, g_scopes.fetch_add(1, std::memory_order_relaxed) + 1};
}

BlockCache::ThreadScope::~ThreadScope() {
  const ThreadBlocks inner = t_blocks;
  t_blocks.scope = outer_scope_;
  t_blocks.held = outer_held_ + inner.held;
  t_blocks.peak = std::max(outer_peak_, outer_held_ + inner.peak);
}

size_t BlockCache::ThreadScope::peak() const {
  return static_cast<size_t>(t_blocks.peak);
}

BlockCache::BlockCache(Options options, const Clock& clock)
    : options_(std::move(options)), clock_(clock), releaser_([this] { ReleaseLoop(); }) {}

BlockCache::~BlockCache() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  wake_.SignalAll();
  releaser_.join();
  MutexLock lock(mu_);
  for (auto& [bytes, blocks] : kept_) {
    for (const Kept& k : blocks) Unmap(k.base, bytes);
  }
  kept_.clear();
}

size_t BlockCache::ClassBytes(size_t size) const {
  if (size < options_.min_cached_bytes) return 0;
  const size_t total = size + kHeader;
  const size_t step = std::max(std::bit_floor(total) / 8, kPage);
  return (total + step - 1) / step * step;
}

void* BlockCache::TakeKept(std::map<size_t, std::deque<Kept>>::iterator it) {
  void* base = it->second.back().base;
  use_.kept_bytes -= it->first;
  it->second.pop_back();
  if (it->second.empty()) kept_.erase(it);
  return base;
}

void* BlockCache::AllocLasting(size_t size) {
  if (size == 0) size = 1;
  if (size > (SIZE_MAX >> 2)) return nullptr;
  void* base = std::aligned_alloc(kAlignment, (size + kHeader + kAlignment - 1) / kAlignment * kAlignment);
  if (base == nullptr) return nullptr;
  new (base) Header{0};
  return UserOf(base);
}

void* BlockCache::Alloc(size_t size) {
  if (size == 0) size = 1;
  if (size > (SIZE_MAX >> 2)) return nullptr;  // no machine has it; the sums below stay in range
  const size_t bytes = ClassBytes(size);
  if (bytes == 0) return AllocLasting(size);
  {
    MutexLock lock(mu_);
    auto it = kept_.lower_bound(bytes);
    if (it != kept_.end() && it->first <= 2 * bytes) {
      const size_t got = it->first;
      void* base = TakeKept(it);
      use_.in_use_bytes += got;
      ShowToLsan(base, got);
      return HandOut(base, bytes);
    }
    if (!kept_.empty()) {
      // None fits: the nearest kept block larger (else the largest) is resized to this class
      // instead of mapping one more beside it (what it keeps of its pages stays in place).
      if (it == kept_.end()) --it;
      const size_t had = it->first;
      void* old = TakeKept(it);
      use_.in_use_bytes += bytes;
      ++use_.resized;
      lock.Unlock();
      if (void* base = Remap(old, had, bytes)) {
        new (base) Header{bytes};
        ShowToLsan(base, bytes);
        return HandOut(base, bytes);
      }
      Unmap(old, had);  // it could not be resized: a new block instead
      lock.Lock();
      --use_.resized;
      ++use_.returned;
      ++use_.mapped;
    } else {
      use_.in_use_bytes += bytes;  // counted before mapping, so that InUse never misses it
      ++use_.mapped;
    }
  }
  void* base = Map(bytes);
  if (base == nullptr) {
    MutexLock lock(mu_);
    use_.in_use_bytes -= bytes;
    --use_.mapped;
    return nullptr;
  }
  new (base) Header{bytes};
  ShowToLsan(base, bytes);
  return HandOut(base, bytes);
}

void BlockCache::Free(void* p) {
  if (p == nullptr) return;
  void* base = HeaderOf(p);
  const size_t bytes = HeaderOf(p)->class_bytes;
  if (bytes == 0) {
    std::free(base);
    return;
  }
  HideFromLsan(base, bytes);
  // Only a block this thread's open scope took is its to give back.
  if (HeaderOf(p)->scope == t_blocks.scope) t_blocks.held -= static_cast<int64_t>(HeaderOf(p)->asked_bytes);
  bool wake = false;
  {
    MutexLock lock(mu_);
    kept_[bytes].push_back({base, clock_.NowNs()});
    use_.in_use_bytes -= bytes;
    use_.kept_bytes += bytes;
    wake = sleeping_;
    sleeping_ = false;
  }
  if (wake) wake_.Signal();
}

BlockCache::Use BlockCache::InUse() const {
  MutexLock lock(mu_);
  return use_;
}

void BlockCache::ReturnKept() {
  std::vector<std::pair<void*, size_t>> kept;
  {
    MutexLock lock(mu_);
    for (auto& [bytes, blocks] : kept_) {
      for (const Kept& k : blocks) kept.emplace_back(k.base, bytes);
      use_.kept_bytes -= bytes * blocks.size();
    }
    kept_.clear();
    use_.returned += static_cast<int64_t>(kept.size());
  }
  for (const auto& [base, bytes] : kept) Unmap(base, bytes);  // outside the lock, as the release loop does
}

void BlockCache::ReleaseLoop() {
  std::vector<std::pair<void*, size_t>> expired;
  MutexLock lock(mu_);
  while (!stop_) {
    if (kept_.empty()) {
      sleeping_ = true;  // a Free wakes it
      wake_.Wait(lock);
      continue;
    }
    // The oldest kept block decides when to look again.
    const int64_t now = clock_.NowNs();
    int64_t next = INT64_MAX;
    for (auto it = kept_.begin(); it != kept_.end();) {
      auto& blocks = it->second;
      while (!blocks.empty() && now - blocks.front().freed_ns >= options_.idle_release_ns) {
        expired.emplace_back(blocks.front().base, it->first);
        blocks.pop_front();
      }
      if (blocks.empty()) {
        it = kept_.erase(it);
      } else {
        next = std::min(next, blocks.front().freed_ns + options_.idle_release_ns);
        ++it;
      }
    }
    if (!expired.empty()) {
      for (const auto& [base, bytes] : expired) use_.kept_bytes -= bytes;
      use_.returned += static_cast<int64_t>(expired.size());
      lock.Unlock();  // munmap outside the lock: Alloc and Free go on meanwhile
      for (const auto& [base, bytes] : expired) Unmap(base, bytes);
      expired.clear();
      lock.Lock();
      if (kept_.empty() && use_.in_use_bytes == 0 && options_.on_idle) {
        lock.Unlock();
        options_.on_idle();
        lock.Lock();
      }
      continue;
    }
    wake_.WaitUntil(lock, clock_, next);
  }
}

}  // namespace quern
