// The process's memory.
#pragma once

namespace quern {

// Returns the free pages the C library's allocator holds to the system
// (glibc keeps what a large load freed in its free lists, where it counts in
// the process's resident memory); elsewhere nothing happens. Costs a walk
// over the heap: call it after rare, large events such as loading a model.
void ReturnFreedMemory();

}  // namespace quern
