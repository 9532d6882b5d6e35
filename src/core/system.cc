#include "core/system.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "core/error.h"

namespace ds {

int64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 0;
  return static_cast<int64_t>(pages) * static_cast<int64_t>(page);
}

int64_t available_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return physical_memory_bytes();
}

void check_fits_in_memory(int64_t bytes, const char* what) {
  const int64_t have = physical_memory_bytes();
  if (have <= 0) return;
  DS_CHECK(bytes >= 0 && bytes <= have, "{} needs {:.1f} GiB, more than this machine's {:.1f} GiB of memory", what,
           bytes / 1073741824.0, have / 1073741824.0);
}

void keep_freed_memory_in_heap() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 512 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
#endif
}

void advise_random_reads(const void* p, size_t n) {
  if (!p || n == 0) return;
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
  const auto end = reinterpret_cast<uintptr_t>(p) + n;
  madvise(reinterpret_cast<void*>(begin), end - begin, MADV_RANDOM);
}

void release_file_pages(const void* p, size_t n) {
  if (!p || n == 0) return;
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
  const auto end = reinterpret_cast<uintptr_t>(p) + n;
  madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

void prefetch_pages(std::vector<std::pair<const void*, size_t>> ranges) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  std::vector<uintptr_t> pages;
  for (const auto& [p, n] : ranges) {
    if (!p || n == 0) continue;
    const auto b = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
    const auto e = reinterpret_cast<uintptr_t>(p) + n;
    for (uintptr_t a = b; a < e; a += page) pages.push_back(a);
  }
  std::sort(pages.begin(), pages.end());
  pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
  // Runs of adjacent pages in one call.
  for (size_t i = 0; i < pages.size();) {
    size_t j = i + 1;
    while (j < pages.size() && pages[j] == pages[j - 1] + page) ++j;
    madvise(reinterpret_cast<void*>(pages[i]), (j - i) * page, MADV_WILLNEED);
    i = j;
  }
}

}  // namespace ds
