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

}  // namespace ds
