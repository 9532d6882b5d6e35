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

// Quantize-dequantize simulations (DeepSeek-V4's official code applies them
// inside attention): y = decode(encode(clamp(x / s, -max, max))) * s for every
// `block` consecutive values of x [n] (n a multiple of block); y may alias x.
//   fp8: e4m3 (max 448), the scale rule above (amax floor 1e-4; ue8m0: a
//        power of two), V4's K=V latent in blocks of 64;
//   fp4: e2m1 (max 6), amax floor 6 * 2^-126, s = 2^ceil(log2(amax / 6)),
//        V4's indexer queries and keys in blocks of 32.
void fp8_round_blocks(float* y, const float* x, int64_t n, int64_t block, bool ue8m0);
void fp4_round_blocks(float* y, const float* x, int64_t n, int64_t block);
// DeepSeek-V4.1's fp4 simulation of the compressed entries: an e4m3 scale
// per block (not a power of two), s = e4m3(max(amax, 6 * 2^-9) / 6) rounded
// to nearest even, y = e2m1(clamp(x / s, -6, 6)) s.
void fp4_round_blocks_e4m3(float* y, const float* x, int64_t n, int64_t block);
// The same rounding kept as codes: e2m1 packed two a byte (element 2j in
// the low nibble of byte j) [n / 2] and each block's e4m3 scale byte
// [n / block]; decoding gives fp4_round_blocks_e4m3's values exactly.
void fp4_encode_blocks_e4m3(uint8_t* packed, uint8_t* scales, const float* x, int64_t n, int64_t block);
void fp4_decode_blocks_e4m3(float* y, const uint8_t* packed, const uint8_t* scales, int64_t n, int64_t block);

// The same roundings (fp8 with power-of-two scales) kept as codes: each
// block's scale as an e8m0 byte (2^(e - 127)) in scales [n / block], and
// e4m3 codes [n] or e2m1 codes packed two a byte (element 2j in the low
// nibble of byte j) [n / 2]. Decoding gives exactly what the round
// functions return (fp4: through a WeightView of dtype f4_e2m1).
void fp8_encode_blocks(uint8_t* codes, uint8_t* scales, const float* x, int64_t n, int64_t block);
void fp4_encode_blocks(uint8_t* packed, uint8_t* scales, const float* x, int64_t n, int64_t block);
// y [n] from fp8_encode_blocks' codes and scales.
void fp8_decode_blocks(float* y, const uint8_t* codes, const uint8_t* scales, int64_t n, int64_t block);

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

// ---------------------------------------------------------------- training
// The indexer as MaxText trains it and the paper describes it: float32, no
// fp8 rounding (and so no Hadamard rotation, which is orthogonal and leaves
// every q . k unchanged). A packed batch of B rows of T tokens (N = B T);
// key s is visible from query t of the same row when s <= t and, with
// segment ids `seg` [N] (null: one segment per row), seg[s] == seg[t].
// Maps [B, T, T] hold row t's keys s at [b, t, s]. Every function is
// deterministic for any thread count (no reduction is split).

// Backward of layer_norm_rows: dx `=`, dw and db `+=`.
void layer_norm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w, int64_t rows,
                         int64_t d, float eps);

// scores [B, T, T] = sum_h w[t, h] ReLU(q[t, h] . k[s]) where s is visible
// from t, -inf elsewhere. q [N, heads, d], k [N, d], w [N, heads].
void indexer_dense_scores(float* scores, const float* q, const float* k, const float* w, const int32_t* seg, int64_t B,
                          int64_t T, int64_t heads, int64_t d);
// Its backward from dscores [B, T, T] (read only where visible): dq, dk, dw `=`.
void indexer_dense_scores_backward(float* dq, float* dk, float* dw, const float* dscores, const float* q,
                                   const float* k, const float* w, const int32_t* seg, int64_t B, int64_t T,
                                   int64_t heads, int64_t d);

// selected [B, T, T]: 1 for the min(k, visible) best keys of every query
// (topk_indices' choice: ties to the lower index), 0 elsewhere.
void indexer_select(uint8_t* selected, const float* scores, int64_t B, int64_t T, int64_t k);

// The main attention's distribution over the keys, the indexer's target:
//   target[b, t, :] = L1-normalised sum_h softmax_s(scale q[t, h] . k[s, h])
// over the visible keys (and, with `selected`, only the selected ones),
// 0 elsewhere. q, k [N, heads, dk] (MLA's query_proj and key_proj).
void attention_key_distribution(float* target, const float* q, const float* k, const int32_t* seg,
                                const uint8_t* selected, int64_t B, int64_t T, int64_t heads, int64_t dk, float scale);

// MaxText's indexer loss before its mean: the sum over the B T queries of
//   sum_s target (log(target + 1e-8) - log(pred + 1e-8)),
// pred = softmax of scores over the visible (and, with `selected`, selected)
// keys. dscores `=` dloss x its gradient (0 where not visible or selected).
double indexer_kl(float* dscores, const float* scores, const float* target, const uint8_t* selected, int64_t B,
                  int64_t T, double dloss);

}  // namespace ds::ops
