// MaxText's checkpoint names for a decoder layer's residuals, and the remat
// policies (by MaxText's names) that choose which of them a training step
// keeps. Configuration only: the layer itself is model/layer.h.
#pragma once

#include <bitset>
#include <string>
#include <utility>
#include <vector>

namespace ds::model {

// MaxText's checkpoint names (see layers/attention_mla.py, linears.py, moe.py,
// and for DeepSeek-V4's shared K=V latent, kv_proj, attention_compressed.py).
enum class Residual : int {
  decoder_layer_input,
  query_wa_proj,
  mla_q,
  kv_wa_proj,
  mla_kv,
  query_proj,
  key_proj,
  value_proj,
  kv_proj,
  attention_out,
  context,  // the attention kernel's residuals: its output and log-sum-exp
  out_proj,
  mlpwi_0,
  mlpwi_1,
  mlpwo,
  moe_mlpwi_0,
  moe_mlpwi_1,
  moe_mlpwo,
  count
};
inline constexpr int kResidualCount = static_cast<int>(Residual::count);
const char* residual_name(Residual r);

// The set of residuals a training step keeps in memory.
struct RematPolicy {
  std::bitset<kResidualCount> keep;
  bool kept(Residual r) const { return keep[static_cast<int>(r)]; }
  // MaxText's remat_policy values: full, none, minimal, minimal_with_context
  // (minimal_flash), save_dot_with_context_except_mlp, save_dot_except_mlpwi,
  // save_dot_except_mlp, save_qkv_proj, save_out_proj, custom. `custom` takes
  // per-name settings ("remat" or "device"; every name not given is remat,
  // decoder_layer_input is device). Offloading and quantization policies are
  // errors (no host offload on CPU).
  static RematPolicy from_name(const std::string& name,
                               const std::vector<std::pair<std::string, std::string>>& custom = {});
  // Every residual kept (nothing recomputed).
  static RematPolicy keep_all();
};

}  // namespace ds::model
