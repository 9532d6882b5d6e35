// The pieces of DeepSeek-V3.2's lightning indexer (DSA), as DeepSeek's V3.2
// inference code computes them. For every query t it scores the causal keys s
//   score(t, s) = sum_h w[t, h] * ReLU(q[t, h] . k[s])
// from fp8 (e4m3) quantized, Hadamard-rotated queries and one shared key per
// token, and MLA then attends only to the top index_topk keys.
//
// Quantization: blocks of kIndexerQuantBlock values along the last dim (a
// vector shorter than that is one block), amax clamped below at 1e-4, scale
// amax * (1/448) or, with ue8m0 scales, the power of two 2^ceil(log2(amax/448));
// codes e4m3(clamp(x / scale, -448, 448)) rounded to nearest even. The
// stage code folds the scales into the dequantized vectors (q * scale_q) .
// (k * scale_k), which is the reference's scale_q * scale_k * (q8 . k8).
#pragma once

#include <cstdint>

namespace ds::ops {

inline constexpr int64_t kIndexerQuantBlock = 128;

// x [rows, d] in place: x <- H_d x * d^-1/2 with H_d the Sylvester-ordered
// Hadamard matrix (H_1 = [1], H_2n = [[H, H], [H, -H]]); d a power of two.
void hadamard_rows(float* x, int64_t rows, int64_t d);

// y = (x - mean) / sqrt(var + eps) * w + b per row of [rows, d] (biased
// variance); y may alias x.
void layer_norm_rows(float* y, const float* x, const float* w, const float* b, int64_t rows, int64_t d, float eps);

// Scales per row of d values: ceil(d / kIndexerQuantBlock).
inline int64_t indexer_scale_blocks(int64_t d) { return (d + kIndexerQuantBlock - 1) / kIndexerQuantBlock; }

// codes [rows, d] e4m3 and scales [rows, indexer_scale_blocks(d)].
void fp8_quantize_rows(uint8_t* codes, float* scales, const float* x, int64_t rows, int64_t d, bool ue8m0);
// y [rows, d] = decode(codes) * scale of the value's block.
void fp8_dequantize_rows(float* y, const uint8_t* codes, const float* scales, int64_t rows, int64_t d);

// scores [n, T] (row stride lds) for n queries against keys 0..T-1:
//   scores[j, s] = sum_h w[j, h] * ReLU(q[j, h, :] . k[s, :])
// q [n, heads, d] and w [n, heads] float32; the keys stay quantized (codes
// [T, d], scales [T, blocks]) and are dequantized a tile at a time.
// Single-threaded (callers give each thread its own queries).
void indexer_scores(float* scores, int64_t lds, const float* q, const float* w, int64_t n, int64_t heads, int64_t d,
                    const uint8_t* key_codes, const float* key_scales, int64_t T);

// The min(k, visible) largest of scores[0, visible): their indices in
// ascending order in out; ties go to the lower index, NaN ranks lowest.
// Returns the count written.
int64_t topk_indices(int32_t* out, const float* scores, int64_t visible, int64_t k);

}  // namespace ds::ops
