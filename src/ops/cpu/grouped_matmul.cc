// Grouped (ragged) matmul on oneDNN's sgemm. See ops/grouped_matmul.h for the
// math and the accumulation rules.
//
// Every product (out, dlhs, drhs) is cut into tiles: a block of rows and a
// block of columns of one group's output, with the whole reduction inside the
// tile. Each tile is one single-threaded gemm call, and the tiles are dealt out
// to the threads in contiguous runs of about equal work. Many small groups (the
// usual expert case) then keep every thread busy without a gemm per group
// being too small to thread, and a few large groups are still split across
// threads by their tiles. With fewer tiles than two per thread, the tiles run
// one after the other and gemm threads each of them itself.
//
// The tiling depends only on the shapes, never on the thread count, and no
// reduction is ever split, neither between tiles nor (inside gemm) between
// threads, so every output element, drhs included, is the same
// single-threaded dot product whatever the number of threads: the results are
// bitwise reproducible.
#include "ops/grouped_matmul.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <vector>

#include "core/error.h"
#include "ops/matmul.h"

namespace ds::ops {

namespace {

// Tile edges. Columns are the fast dimension of every output: a wide tile
// amortizes the packing of its lhs rows over many columns (1024 measured ~10%
// faster than 256 or 512 on 16 experts of 128 rows). Rows beyond 512 gain
// little from more reuse of the packed rhs block, and splitting them is what
// spreads one big group over the threads.
constexpr int64_t kTileRows = 512;
constexpr int64_t kTileCols = 1024;

// One gemm call: rows [r0, r0+rows) and columns [c0, c0+cols) of group g's output.
struct Tile {
  int64_t g, r0, rows, c0, cols;
};

// Splits n into ceil(n / max_block) blocks of nearly equal size, rounded up to
// a multiple of 16 floats so that column blocks start on a cache line.
int64_t block_size(int64_t n, int64_t max_block) {
  const int64_t blocks = (n + max_block - 1) / max_block;
  const int64_t b = (n + blocks - 1) / blocks;
  return std::min(n, (b + 15) / 16 * 16);
}

// Tiles of every group whose output is rows_of(g) x cols, reduction red_of(g).
// Returns the tiles and their work (multiply-adds plus packing of both
// operands), in group order.
template <typename RowsOf, typename RedOf>
void make_tiles(std::vector<Tile>& tiles, std::vector<double>& work, int64_t G, RowsOf rows_of, int64_t cols,
                RedOf red_of) {
  for (int64_t g = 0; g < G; ++g) {
    const int64_t rows = rows_of(g), red = red_of(g);
    if (rows == 0 || cols == 0) continue;
    const int64_t rb = block_size(rows, kTileRows), cb = block_size(cols, kTileCols);
    for (int64_t r0 = 0; r0 < rows; r0 += rb)
      for (int64_t c0 = 0; c0 < cols; c0 += cb) {
        const int64_t tr = std::min(rb, rows - r0), tc = std::min(cb, cols - c0);
        tiles.push_back({g, r0, tr, c0, tc});
        work.push_back(static_cast<double>(red) * (static_cast<double>(tr) * tc + tr + tc) + 1.0);
      }
  }
}

// Runs fn(tile) for every tile, each on one thread. Thread t of T takes the
// tiles whose work midpoint falls in [t/T, (t+1)/T) of the total: contiguous
// runs of equal work, so a thread keeps working within the same group (and its
// rhs stays in cache) as long as possible.
template <typename Fn>
void run_tiles(const std::vector<Tile>& tiles, const std::vector<double>& work, Fn fn) {
  const int64_t n = static_cast<int64_t>(tiles.size());
  if (n == 0) return;
  std::vector<double> mid(n);
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    mid[i] = total + 0.5 * work[i];
    total += work[i];
  }
  // With fewer tiles than two per thread, dealing them out would leave threads
  // idle; instead each tile's gemm splits itself over the threads (keeping
  // every reduction whole, like the tiles do).
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  if (n < 2 * threads) {
    for (const Tile& t : tiles) fn(t);
    return;
  }
  // Inside this region every gemm runs on its calling thread. An exception
  // must not leave the region, so the first one is carried out of it.
  std::exception_ptr error;
#pragma omp parallel
  {
    const int T = omp_get_num_threads(), t = omp_get_thread_num();
    for (int64_t i = 0; i < n; ++i) {
      const int owner = std::min(T - 1, static_cast<int>(mid[i] / total * T));
      if (owner != t) continue;
      try {
        fn(tiles[i]);
      } catch (...) {
#pragma omp critical(grouped_matmul_error)
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

// Start row of each group and checks of the sizes against M.
std::vector<int64_t> group_offsets(const int32_t* group_sizes, int64_t G, int64_t M, int64_t K, int64_t N,
                                   const char* what) {
  DS_CHECK(G >= 0 && M >= 0 && K >= 0 && N >= 0, "{}: negative size G={} M={} K={} N={}", what, G, M, K, N);
  DS_CHECK(G == 0 || group_sizes != nullptr, "{}: group_sizes is null for G={}", what, G);
  std::vector<int64_t> offset(G + 1, 0);
  for (int64_t g = 0; g < G; ++g) {
    DS_CHECK(group_sizes[g] >= 0, "{}: group_sizes[{}] = {} is negative", what, g, group_sizes[g]);
    offset[g + 1] = offset[g] + group_sizes[g];
  }
  DS_CHECK(offset[G] <= M, "{}: sum(group_sizes) = {} exceeds the {} rows of lhs (G={})", what, offset[G], M, G);
  return offset;
}

// Zeroes rows [r0, M) of a [M, cols] matrix: rows that belong to no group.
void zero_rows(float* x, int64_t r0, int64_t M, int64_t cols) {
  // (An empty matrix may come with a null pointer, which memset must not see.)
  if (r0 < M && cols > 0) std::memset(x + r0 * cols, 0, static_cast<size_t>((M - r0) * cols) * sizeof(float));
}

}  // namespace

// out[rows of g] = lhs[rows of g] @ rhs[g]. The tile columns are columns of out,
// i.e. columns of rhs[g] [K, N], or rows of the stored rhs[g] [N, K] when trans_rhs.
void grouped_matmul_forward(float* out, const float* lhs, const float* rhs, const int32_t* group_sizes, int64_t G,
                            int64_t M, int64_t K, int64_t N, bool trans_rhs) {
  const std::vector<int64_t> off = group_offsets(group_sizes, G, M, K, N, "grouped_matmul_forward");
  std::vector<Tile> tiles;
  std::vector<double> work;
  make_tiles(
      tiles, work, G, [&](int64_t g) { return off[g + 1] - off[g]; }, N, [&](int64_t) { return K; });
  // Converted once for gemm_dtype(), not once per tile.
  const PreparedOperand lhs_p(lhs, off[G] * K), rhs_p(rhs, G * K * N);
  run_tiles(tiles, work, [&](const Tile& t) {
    const int64_t r = off[t.g] + t.r0;
    const GemmOperand lhs = lhs_p.operand(), rg = rhs_p.operand() + t.g * K * N;
    if (!trans_rhs)
      gemm(false, false, t.rows, t.cols, K, 1.0f, lhs + r * K, K, rg + t.c0, N, 0.0f, out + r * N + t.c0, N);
    else
      gemm(false, true, t.rows, t.cols, K, 1.0f, lhs + r * K, K, rg + t.c0 * K, K, 0.0f, out + r * N + t.c0, N);
  });
  zero_rows(out, off[G], M, N);
}

// dlhs[rows of g] = dout[rows of g] @ rhs[g]^T, tiled over rows and the K
// columns of dlhs. drhs[g] += lhs[rows of g]^T @ dout[rows of g] (or its
// transpose when trans_rhs), tiled over drhs[g]'s own rows and columns, so the
// sum over the group's rows stays inside one gemm call.
void grouped_matmul_backward(float* dlhs, float* drhs, const float* dout, const float* lhs, const float* rhs,
                             const int32_t* group_sizes, int64_t G, int64_t M, int64_t K, int64_t N, bool trans_rhs) {
  const std::vector<int64_t> off = group_offsets(group_sizes, G, M, K, N, "grouped_matmul_backward");
  std::vector<Tile> tiles;
  std::vector<double> work;
  // Converted once for gemm_dtype(), not once per tile.
  const PreparedOperand dout_p(dout, off[G] * N), lhs_p(drhs ? lhs : nullptr, drhs ? off[G] * K : 0),
      rhs_p(dlhs ? rhs : nullptr, dlhs ? G * K * N : 0);
  if (dlhs) {
    make_tiles(
        tiles, work, G, [&](int64_t g) { return off[g + 1] - off[g]; }, K, [&](int64_t) { return N; });
    run_tiles(tiles, work, [&](const Tile& t) {
      const int64_t r = off[t.g] + t.r0;
      const GemmOperand dout = dout_p.operand(), rg = rhs_p.operand() + t.g * K * N;
      float* d = dlhs + r * K + t.c0;
      if (!trans_rhs)  // rhs[g] [K, N]: dlhs = dout rhs^T, columns c0.. are rows of rhs[g]
        gemm(false, true, t.rows, t.cols, N, 1.0f, dout + r * N, N, rg + t.c0 * N, N, 0.0f, d, K);
      else  // rhs[g] [N, K]: dlhs = dout rhs, columns c0.. are columns of rhs[g]
        gemm(false, false, t.rows, t.cols, N, 1.0f, dout + r * N, N, rg + t.c0, K, 0.0f, d, K);
    });
    zero_rows(dlhs, off[G], M, K);
  }
  if (drhs) {
    tiles.clear();
    work.clear();
    // Empty groups make no tiles: their drhs is left untouched.
    const int64_t rows = trans_rhs ? N : K, cols = trans_rhs ? K : N;
    make_tiles(
        tiles, work, G, [&](int64_t g) { return off[g + 1] == off[g] ? 0 : rows; }, cols,
        [&](int64_t g) { return off[g + 1] - off[g]; });
    run_tiles(tiles, work, [&](const Tile& t) {
      const int64_t r = off[t.g], m = off[t.g + 1] - off[t.g];
      const GemmOperand dout = dout_p.operand(), lhs = lhs_p.operand();
      float* d = drhs + t.g * K * N + t.r0 * cols + t.c0;
      if (!trans_rhs)  // drhs[g] [K, N] += lhs_g^T dout_g
        gemm(true, false, t.rows, t.cols, m, 1.0f, lhs + r * K + t.r0, K, dout + r * N + t.c0, N, 1.0f, d, N);
      else  // drhs[g] [N, K] += dout_g^T lhs_g
        gemm(true, false, t.rows, t.cols, m, 1.0f, dout + r * N + t.r0, N, lhs + r * K + t.c0, K, 1.0f, d, K);
    });
  }
}

}  // namespace ds::ops
