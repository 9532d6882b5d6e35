#include "core/parallel.h"

#include <omp.h>

#include "core/error.h"

namespace ds {

int num_threads() { return omp_get_max_threads(); }

void set_num_threads(int n) {
  DS_CHECK(n >= 1, "thread count must be at least 1, got {}", n);
  omp_set_num_threads(n);
}

}  // namespace ds
