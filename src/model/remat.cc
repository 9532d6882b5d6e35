#include "model/remat.h"

#include <initializer_list>

#include "core/error.h"

namespace ds::model {

namespace {

constexpr const char* kNames[kResidualCount] = {"decoder_layer_input",
                                                "query_wa_proj",
                                                "mla_q",
                                                "kv_wa_proj",
                                                "mla_kv",
                                                "query_proj",
                                                "key_proj",
                                                "value_proj",
                                                "kv_proj",
                                                "attention_out",
                                                "context",
                                                "out_proj",
                                                "mlpwi_0",
                                                "mlpwi_1",
                                                "mlpwo",
                                                "moe_mlpwi_0",
                                                "moe_mlpwi_1",
                                                "moe_mlpwo"};

using R = Residual;

RematPolicy with(std::initializer_list<Residual> names) {
  RematPolicy p;
  p.keep.set(static_cast<int>(R::decoder_layer_input));  // the scan carry: always on the device
  for (Residual r : names) p.keep.set(static_cast<int>(r));
  return p;
}

}  // namespace

const char* residual_name(Residual r) { return kNames[static_cast<int>(r)]; }

RematPolicy RematPolicy::keep_all() {
  RematPolicy p;
  p.keep.set();
  return p;
}

RematPolicy RematPolicy::from_name(const std::string& name,
                                   const std::vector<std::pair<std::string, std::string>>& custom) {
  // MLA never produces MaxText's fused qkv_proj tensor, nor kv_proj (V4's
  // shared K=V latent, which those policies keep with the query).
  const auto qkv = {R::query_proj, R::key_proj, R::value_proj, R::kv_proj};
  auto plus = [](std::initializer_list<Residual> a, std::initializer_list<Residual> b) {
    std::vector<Residual> v(a);
    v.insert(v.end(), b);
    return v;
  };
  auto of = [](const std::vector<Residual>& v) {
    RematPolicy p = with({});
    for (Residual r : v) p.keep.set(static_cast<int>(r));
    return p;
  };
  // In the sparse (grouped) expert path MaxText tags the routed w0 with
  // mlpwi_0 and moe_mlpwi_0, w1 only with moe_mlpwi_1, wo with mlpwo and
  // moe_mlpwo; layer_forward follows the same rule.
  if (name == "full" || name == "none") return with({});
  if (name == "minimal") return of(plus(qkv, {R::out_proj, R::mlpwi_0, R::mlpwi_1, R::mlpwo}));
  if (name == "minimal_with_context" || name == "minimal_flash")
    return of(plus(qkv, {R::out_proj, R::mlpwi_0, R::mlpwi_1, R::mlpwo, R::context}));
  if (name == "save_dot_with_context_except_mlp") return of(plus(qkv, {R::context, R::out_proj}));
  if (name == "save_dot_except_mlpwi") return of(plus(qkv, {R::out_proj, R::mlpwo}));
  if (name == "save_dot_except_mlp") return of(plus(qkv, {R::out_proj}));
  if (name == "save_qkv_proj") return of(plus(qkv, {}));
  if (name == "save_out_proj") return with({R::out_proj});
  if (name == "custom") {
    RematPolicy p = with({});
    for (const auto& [key, value] : custom) {
      int idx = -1;
      for (int i = 0; i < kResidualCount; ++i)
        if (key == kNames[i]) idx = i;
      // MaxText's other configurable names: tensors this model never makes.
      const bool foreign = key == "mlpwi" || key == "qkv_proj" || key == "indexer_cutoff_threshold";
      DS_CHECK(idx >= 0 || foreign, "remat_policy custom: unknown name '{}'", key);
      DS_CHECK(value == "remat" || value == "device" || value == "offload",
               "remat_policy custom: {} must be remat, device or offload, got '{}'", key, value);
      DS_CHECK(value != "offload",
               "remat_policy custom: {}: offload needs a host-offloading accelerator; on CPU "
               "use device or remat",
               key);
      if (idx >= 0) p.keep.set(static_cast<size_t>(idx), value == "device");
    }
    return p;
  }
  if (name.find("offloaded") != std::string::npos || name.find("quantization") != std::string::npos)
    DS_FAIL(
        "remat_policy {} offloads to host memory or saves quantization residuals, which the CPU backend does not "
        "have; use one of full, minimal, minimal_with_context, save_dot_with_context_except_mlp, "
        "save_dot_except_mlpwi, save_dot_except_mlp, save_qkv_proj, save_out_proj, custom",
        name);
  DS_FAIL(
      "unknown remat_policy '{}' (full, none, minimal, minimal_with_context, save_dot_with_context_except_mlp, "
      "save_dot_except_mlpwi, save_dot_except_mlp, save_qkv_proj, save_out_proj, custom)",
      name);
}

}  // namespace ds::model
