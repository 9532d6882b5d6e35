// A llama.cpp "deepseek2" GGUF file (DeepSeek-V2/V3, as llama.cpp's
// converter, llama-quantize or `deepseek export --format gguf` write it) as
// a Hugging Face folder this engine runs: config.json from the file's keys,
// float32 safetensors from its tensors (F32, F16, BF16, Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0, Q4_K and Q6_K dequantized as ggml dequantizes them, except
// matrices in Q8_0, Q4_K, Q4_1 or Q6_K with whole blocks a row, kept as
// their blocks (U8 rows, ops/block_quant.h); attn_k_b and attn_v_b
// joined back into kv_b_proj, stacked experts split), tokenizer.json and
// tokenizer_config.json from tokenizer.ggml.*. The inverse of
// model/gguf_export.h: an f32 export imports to the same weights.
//
// Refused with one error naming what: another architecture, a tensor type
// not in that list, a file without the tensors or keys deepseek2 needs, a
// tokenizer that is not byte-level BPE with a pre-tokenizer this engine has.
#pragma once

#include <string>

namespace ds::model {

// Writes the folder `out_dir` (created; must not exist or be empty).
void import_gguf(const std::string& gguf_path, const std::string& out_dir);

// Whether `path` is a regular file that begins with GGUF's magic.
bool is_gguf_file(const std::string& path);

}  // namespace ds::model
