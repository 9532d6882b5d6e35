// Facts about the machine the program runs on.
#pragma once

#include <cstdint>

namespace ds {

// Physical memory in bytes (0 if the system does not say).
int64_t physical_memory_bytes();

// ds::Error unless `bytes` of new memory for `what` fit in this machine's
// physical memory: requests a crafted or mistyped size would turn into an
// allocation failure (or the OOM killer) halfway through are refused first.
void check_fits_in_memory(int64_t bytes, const char* what);

// Keeps freed memory in the process's heap. Activation buffers of a few MB
// are allocated and freed in every layer of every step; glibc would serve
// each from a fresh mmap (or trim it back to the system) and fault its pages
// in again each time. The program and the benchmarks call this first.
void keep_freed_memory_in_heap();

}  // namespace ds
