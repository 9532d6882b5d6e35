#include "model/family.h"

#include <algorithm>

#include "core/error.h"

namespace ds::model {

void Family::write_random(const std::string& out_dir, uint64_t seed, float std, DType dtype) const {
  const auto dtypes = init_dtypes();
  DS_CHECK(std::find(dtypes.begin(), dtypes.end(), dtype) != dtypes.end(), "init: a {} model is not written as {}",
           name(), dtype_name(dtype));
  std::vector<float> params(static_cast<size_t>(numel()));
  init(params.data(), seed, std);
  export_hf(out_dir, params.data(), dtype, "init");
}

}  // namespace ds::model
