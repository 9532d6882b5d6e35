#include "model/family.h"

#include <algorithm>
#include <filesystem>

#include "core/error.h"

namespace ds::model {

void Family::write_random(const std::string& out_dir, uint64_t seed, float std, DType dtype,
                          const std::string& tokenizer) const {
  const auto dtypes = init_dtypes();
  DS_CHECK(std::find(dtypes.begin(), dtypes.end(), dtype) != dtypes.end(), "init: a {} model is not written as {}",
           name(), dtype_name(dtype));
  std::vector<float> params(static_cast<size_t>(numel()));
  init(params.data(), seed, std);
  export_hf(out_dir, params.data(), dtype, "init");
  copy_tokenizer(tokenizer, out_dir);
}

void copy_tokenizer(const std::string& tokenizer, const std::string& out_dir) {
  if (tokenizer.empty()) return;
  DS_CHECK(std::filesystem::is_regular_file(tokenizer), "init: --tokenizer '{}' is not a file", tokenizer);
  std::filesystem::copy_file(tokenizer, std::filesystem::path(out_dir) / "tokenizer.json",
                             std::filesystem::copy_options::overwrite_existing);
}

}  // namespace ds::model
