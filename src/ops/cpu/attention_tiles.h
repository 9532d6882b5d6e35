// The forward attention's register-tile kernels (ops/cpu/attention.cc), for
// other CPU attention ops that fold key tiles the same way: dispatched to
// the best SIMD target at each call. See attention.cc for the tiling they
// serve; the shapes and layouts are as there:
//   key tiles of at most kTileK keys, transposed [K][kKeyLd] (zeros past the
//   keys, to the next multiple of 16); scores s and probabilities p in rows
//   of kTileK floats; value and output rows of a multiple of 16 floats.
// Query row r of a call sees the tile's keys [0, diag + r + 1), clamped to
// [0, nk]: diag >= nk means every row sees every key.
#pragma once

#include <cstdint>

namespace ds::ops::tiles {

inline constexpr int64_t kTileK = 128;
// Rows of a transposed key tile: 144 floats apart, not 128, so that the rows
// the score kernel walks down do not map to a few sets of the L1 cache.
inline constexpr int64_t kKeyLd = kTileK + 16;

constexpr int64_t round_up16(int64_t n) { return (n + 15) / 16 * 16; }

// s[r][c] = scale * q[r] . k[c] for r < nq and the keys c row r's block of
// block_rows() rows may see, rounded up to 16 (kt: [K][ldk]).
void score_tile(float* s, int64_t lds, const float* q, int64_t ldq, const float* kt, int64_t ldk, int64_t nq,
                int64_t nk, int64_t diag, int64_t K, float scale);
// Folds rows [0, rows) of masked scores s (n columns, a multiple of 16) into
// the running max m, sum l and unnormalized output o (ldo columns, rescaled);
// s becomes the rows' unnormalized p. A row with nothing allowed yet keeps
// m = -inf, l = 0 and gets p = 0.
void fold_rows(float* s, int64_t lds, int64_t rows, int64_t n, float* m, float* l, float* o, int64_t ldo);
// o[r][c] += sum_j p[r][j] v[j][c] for r < nq, c < cols (a multiple of 16).
void value_tile(float* o, int64_t ldo, const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t nq, int64_t nk,
                int64_t diag, int64_t cols);
// Query rows per block of the score and P V kernels on the dispatched
// target (4 or 8).
int64_t block_rows();
// kt [K, ld] (columns [0, width)) = rows[0..n) (n <= kTileK, K floats each)
// transposed; columns n .. width - 1 zero.
void gather_keys(float* kt, int64_t ld, int64_t width, const float* const* rows, int64_t n, int64_t K);

}  // namespace ds::ops::tiles
