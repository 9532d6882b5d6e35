// Facts about the machine the program runs on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace ds {

// Physical memory in bytes (0 if the system does not say).
int64_t physical_memory_bytes();

// Memory the system can give without swapping (/proc/meminfo's
// MemAvailable; physical memory where it does not say).
int64_t available_memory_bytes();

// ds::Error unless `bytes` of new memory for `what` fit in this machine's
// physical memory: requests a crafted or mistyped size would turn into an
// allocation failure (or the OOM killer) halfway through are refused first.
void check_fits_in_memory(int64_t bytes, const char* what);

// Keeps freed memory in the process's heap. Activation buffers of a few MB
// are allocated and freed in every layer of every step; glibc would serve
// each from a fresh mmap (or trim it back to the system) and fault its pages
// in again each time. The program and the benchmarks call this first.
void keep_freed_memory_in_heap();

// Tells the kernel that [p, p + n) of a file mapping is read at random
// (madvise MADV_RANDOM: no readahead around a fault), so that reading a row
// of a large mmapped table brings in that row's pages, not its neighbours'.
// Best effort: a kernel that refuses changes nothing but the RSS.
void advise_random_reads(const void* p, size_t n);

// Unmaps from this process the pages of [p, p + n) of a read-only file
// mapping that it has touched (madvise MADV_DONTNEED): they stay in the
// kernel's page cache, and a later read faults them back in from there,
// but they no longer count in the process's resident memory. For a table
// much larger than what one step reads. Best effort, as above. Only ever
// for a file mapping: on ordinary (anonymous) memory it would zero the pages.
void release_file_pages(const void* p, size_t n);

// Asks the kernel to start reading the pages of the given byte ranges of a
// file mapping now (madvise MADV_WILLNEED, each page once), so that the
// faults of a gather that follows find them in memory: the reads overlap
// instead of one fault waiting for each. ranges are (address, bytes) pairs.
// Best effort, as above.
void prefetch_pages(std::vector<std::pair<const void*, size_t>> ranges);

}  // namespace ds
