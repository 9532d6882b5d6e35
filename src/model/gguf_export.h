// A DeepSeek-V2/V3 Hugging Face folder (config.json, safetensors weights,
// tokenizer.json) as one GGUF file that llama.cpp loads as its "deepseek2"
// architecture, written as llama.cpp's own convert_hf_to_gguf.py writes it:
//
//  - MLA stored as one-head MQA (head_count_kv 1, key_length kv_lora_rank +
//    qk_rope_head_dim, value_length kv_lora_rank) with kv_b_proj split per
//    head into attn_k_b (transposed) and attn_v_b;
//  - routed experts stacked into ffn_{gate,up,down}_exps, the aux-loss-free
//    bias as exp_probs_b.bias, sigmoid gating (expert_gating_func 2), group
//    routing (expert_group_count, expert_group_used_count);
//  - YaRN as rope.scaling.* with yarn_log_multiplier = 0.1 * mscale_all_dim
//    (llama.cpp divides it by 0.1 again);
//  - the MTP layer left out (llama.cpp's trunk does not read it);
//  - norms, biases and the router in F32; every other matrix in the type
//    asked for (f32, f16, bf16, q8_0; a q8_0 tensor whose rows do not divide
//    into blocks of 32 is written in f16, as the converter does), or by
//    model/quantize.h's recipes: q4_k_m (the stacked experts Q4_K, the rest
//    Q8_0) and q4_k (every matrix Q4_K but the output, Q8_0), Q4_K rows that
//    are not whole blocks of 256 in Q4_1, this engine's quantizer making
//    the blocks;
//  - the folder's weights in any float dtype, or as `deepseek quantize`
//    blocks (dequantized, then written in the type asked for);
//  - the byte-level BPE tokenizer as tokenizer.ggml.* ("gpt2", the
//    pre-tokenizer named by its regexes: "deepseek-v3" for DeepSeek-V3's).
//
// Refused with one error: other families (V3.2's indexer, V4, mHC,
// Engram), fp8 folders, tokenizers llama.cpp would split differently, and
// q-LoRA models of the layer counts llama.cpp takes for DeepSeek-V2-Lite.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ds::model {

// Writes `out`; returns its size in bytes. `type`: f32, f16, bf16, q8_0,
// q4_k or q4_k_m.
uint64_t export_gguf(const std::string& hf_dir, const std::string& out, const std::string& type);

// DeepSeek-V3's pre-tokenizer regexes (tokenizer.json's Split patterns, in
// order), which llama.cpp names "deepseek-v3".
const std::vector<std::string>& deepseek_v3_pre_splits();

}  // namespace ds::model
