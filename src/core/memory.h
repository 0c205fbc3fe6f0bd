// The process's memory.
#pragma once

#include <cstddef>
#include <string>

namespace quern {

// Frees the strings the body pool keeps (below) and returns the free pages
// the C library's allocator holds to the system (glibc keeps what a large
// load freed in its free lists, where it counts in the process's resident
// memory; elsewhere that part does nothing). Costs a walk over the heap:
// call it after rare, large events such as loading a model.
void ReturnFreedMemory();

// For a serving process, called before its threads start (`quern serve` does;
// an embedder decides for its own process): the C library's allocator keeps
// at most kServeMallocArenas heaps. glibc gives threads that allocate at
// once heaps of their own (up to eight per core); the large buffers a burst
// of images frees (decoded images, outputs, a runtime's temporaries) stay in
// each of them, and the resident peak is their sum (on the default detector
// served by OpenVINO, 16 clients: about 50 MB of it). A setting of the user's
// own (MALLOC_ARENA_MAX, or arena_max in GLIBC_TUNABLES) is kept. Whether it
// changed the limit.
bool LimitMallocArenas();
inline constexpr int kServeMallocArenas = 2;

// Request bodies of a known length are received into strings of this pool:
// once a request is done with its body, the string is kept for the next
// body of a similar size instead of freed. A body of 4 KiB to 1 MiB costs
// glibc's large-chunk path on each malloc and free (bins searched, the small
// free lists merged first); a client sends alike requests, so the last
// string given back is the likeliest to fit, and its memory is still warm.
// Bounded: at most kBodyPoolBytes and kBodyPoolStrings kept (the oldest
// make room for the newest); thread-safe. Off in AddressSanitizer builds, so
// that a view that outlived its body is found there (a kept string would
// stay readable, with another request's bytes in it).
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kBodyPoolOn = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kBodyPoolOn = false;
#else
inline constexpr bool kBodyPoolOn = true;
#endif
#else
inline constexpr bool kBodyPoolOn = true;
#endif
inline constexpr size_t kBodyPoolMinBytes = size_t{4} << 10;
inline constexpr size_t kBodyPoolMaxBytes = size_t{1} << 20;
inline constexpr size_t kBodyPoolBytes = size_t{8} << 20;
inline constexpr size_t kBodyPoolStrings = 64;

// A string of `size` bytes whose contents are unspecified (the caller
// writes every byte): a kept one whose capacity fits (at least `size`, at
// most twice it), else a new one.
std::string TakeBodyBuffer(size_t size);

// Keeps `s` for a later TakeBodyBuffer when its capacity is in the pool's
// range and the pool has room; frees it otherwise. `s` is left empty.
void GiveBodyBuffer(std::string&& s);

// The strings and bytes (capacities) the pool keeps now.
struct BodyPoolUse {
  size_t strings = 0;
  size_t bytes = 0;
};
BodyPoolUse BodyPoolInUse();

}  // namespace quern
