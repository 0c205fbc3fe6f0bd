#include "core/memory.h"

#include <cstdlib>  // defines __GLIBC__ on glibc
#include <cstring>
#include <utility>
#include <vector>

#include "core/mutex.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace quern {
namespace {

struct BodyPool {
  Mutex mu;
  std::vector<std::string> kept QUERN_GUARDED_BY(mu);  // the last given back at the end
  size_t bytes QUERN_GUARDED_BY(mu) = 0;
};

BodyPool& Pool() {
  static BodyPool* pool = [] {  // never destroyed: bodies may be given back while the process exits
    auto* p = new BodyPool();
    MutexLock lock(p->mu);
    p->kept.reserve(kBodyPoolStrings);
    return p;
  }();
  return *pool;
}

}  // namespace

void ReturnFreedMemory() {
  std::vector<std::string> kept;  // freed after the lock, before the trim
  {
    BodyPool& pool = Pool();
    MutexLock lock(pool.mu);
    kept.swap(pool.kept);
    pool.kept.reserve(kBodyPoolStrings);
    pool.bytes = 0;
  }
  kept = {};
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

bool LimitMallocArenas() {
#if defined(__GLIBC__)
  if (std::getenv("MALLOC_ARENA_MAX")) return false;
  if (const char* tunables = std::getenv("GLIBC_TUNABLES"); tunables && std::strstr(tunables, "arena_max")) {
    return false;
  }
  return mallopt(M_ARENA_MAX, kServeMallocArenas) == 1;
#else
  return false;
#endif
}

std::string TakeBodyBuffer(size_t size) {
  std::string s;
  if (kBodyPoolOn && size >= kBodyPoolMinBytes / 2 && size <= kBodyPoolMaxBytes) {
    BodyPool& pool = Pool();
    MutexLock lock(pool.mu);
    for (size_t i = pool.kept.size(); i-- > 0;) {
      const size_t cap = pool.kept[i].capacity();
      if (cap >= size && cap / 2 <= size) {
        s = std::move(pool.kept[i]);
        pool.kept.erase(pool.kept.begin() + static_cast<std::ptrdiff_t>(i));
        pool.bytes -= cap;
        break;
      }
    }
  }
  // Returns `size`, not the length handed to the lambda: GCC 12's libstdc++
  // passes the grown capacity there when it reallocates.
  s.resize_and_overwrite(size, [size](char*, size_t) { return size; });
  return s;
}

void GiveBodyBuffer(std::string&& s) {
  std::string given = std::move(s);
  s.clear();  // `s` is left empty either way
  const size_t cap = given.capacity();
  if (!kBodyPoolOn || cap < kBodyPoolMinBytes || cap > 2 * kBodyPoolMaxBytes) return;
  std::vector<std::string> evicted;  // freed after the lock
  BodyPool& pool = Pool();
  MutexLock lock(pool.mu);
  // The newest is kept, the oldest make room: strings of sizes the traffic
  // no longer sends (a burst of other sizes) do not hold the pool for good.
  size_t oldest = 0;
  while (oldest < pool.kept.size() &&
         (pool.kept.size() - oldest >= kBodyPoolStrings || pool.bytes + cap > kBodyPoolBytes)) {
    pool.bytes -= pool.kept[oldest].capacity();
    evicted.push_back(std::move(pool.kept[oldest++]));
  }
  pool.kept.erase(pool.kept.begin(), pool.kept.begin() + static_cast<std::ptrdiff_t>(oldest));
  pool.bytes += cap;
  pool.kept.push_back(std::move(given));
}

BodyPoolUse BodyPoolInUse() {
  BodyPool& pool = Pool();
  MutexLock lock(pool.mu);
  return {pool.kept.size(), pool.bytes};
}

}  // namespace quern
