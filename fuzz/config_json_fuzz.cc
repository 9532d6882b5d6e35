// libFuzzer target for the Hugging Face config.json readers (V2/V3/V3.2
// and DeepSeek-V4). Any input must either give a validated config or raise
// ds::Error; a crash, a sanitizer
// report or another exception type is a finding. Built by fuzz/CMakeLists.txt
// (cmake -DDEEPSEEK_FUZZ=ON with clang) or scripts/fuzz.sh:
//   build-fuzz/fuzz/config_json_fuzz -max_len=4096 fuzz/corpus/config_json
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "model/config.h"
#include "model/v4_config.h"
#include "json_mutator.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const ds::model::ModelConfig c = ds::model::ModelConfig::from_hf_json_text(text, "fuzz");
    // A config that passed validate() must give sane derived numbers without
    // tripping the sanitizers (integer overflow, division by zero).
    volatile double scale = c.softmax_scale();
    volatile int64_t qk = c.qk_head_dim();
    volatile int64_t moe_layers = 0;
    const int64_t layers = c.num_hidden_layers < 8 ? c.num_hidden_layers : 8;
    for (int64_t l = 0; l < layers; ++l) moe_layers = moe_layers + (c.is_moe_layer(l) ? 1 : 0);
    if (c.num_hidden_layers > 0) moe_layers = moe_layers + (c.is_moe_layer(c.num_hidden_layers - 1) ? 1 : 0);
    (void)scale;
    (void)qk;
  } catch (const ds::Error&) {
  }
  try {
    const ds::model::V4Config c = ds::model::V4Config::from_hf_json_text(text, "fuzz");
    volatile int64_t params = c.parameter_count();
    volatile int64_t ratios = 0;
    for (int64_t l = 0; l < c.num_hidden_layers + c.num_nextn_predict_layers && l < 8; ++l)
      ratios = ratios + c.compress_ratio(l);
    (void)params;
  } catch (const ds::Error&) {
  }
  return 0;
}

// Half JSON-aware node mutations (fuzz/json_mutator.h), half libFuzzer's own.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned seed) {
  return ds_fuzz::mutate(data, size, max_size, seed, /*prefix=*/0, /*split_nul=*/false);
}
