// latent_attention_forward on the GPU (ops/latent_attention.h): MLA over the
// latent cache with the absorbed kv_b_proj, for any number of sequences in
// one call (a decode step of a batch), float32 throughout.
//
// Four launches whatever the batch:
//   absorb_q   q_lat[r, h] = q_nope[r, h] W_UK_h, a tile of 16 query rows per
//              block so that W_UK_h is read once per tile;
//   attend     a block per (query row, group of 16 heads, chunk of keys):
//              the chunk's c_kv and k_pe rows are read once for the group's
//              16 heads (the idea of FlashMLA: every head of a query shares
//              the latent keys and values), scores, an online softmax and
//              the unnormalised sum of p c_kv over tiles of 64 keys;
//   combine    the chunks' partial results of a (row, head), merged by their
//              maxima into o_lat = softmax(s) c_kv;
//   absorb_out ctx[r, h] = o_lat[r, h] W_UV_h^T, a tile of 16 rows per block.
// Sparse (DSA) queries read their keys through the index list. Sums run in
// another order than the CPU's: results agree to float32 rounding.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "ops/cuda/common.cuh"

namespace ds::ops::cuda {
namespace {

constexpr int kGroup = 16;    // heads per attend block
constexpr int kKeyTile = 64;  // keys per step of an attend block
constexpr int kThreads = 256;
constexpr int kRowTile = 16;    // query rows per absorb block
constexpr int kMaxChunks = 32;  // key chunks per (row, head group)

// One query row (a token of one sequence), for the kernels.
struct Row {
  const float* q;       // [H, nope + rope]
  float* ctx;           // [H, v_dim]
  const float* c_kv;    // [tokens, kvl]
  const float* k_pe;    // [tokens, rope]
  const int32_t* keys;  // null: keys 0..nkeys-1; else their indices
  int64_t nkeys;
};

struct Dims {
  int H, nope, rope, vd, kvl, kvlp, vp, qk;
  float scale;
};

__device__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// q_lat [R, H, kvlp] for rows [r0, r0 + 16) of head blockIdx.x.
__global__ void absorb_q(float* q_lat, const Row* rows, int64_t R, const float* absorbed, Dims d) {
  extern __shared__ float qs[];  // [kRowTile, nope]
  const int h = blockIdx.x;
  const int64_t r0 = int64_t{blockIdx.y} * kRowTile;
  const int nr = static_cast<int>(min64(kRowTile, R - r0));
  for (int i = threadIdx.x; i < kRowTile * d.nope; i += blockDim.x) {
    const int r = i / d.nope, k = i % d.nope;
    qs[i] = r < nr ? rows[r0 + r].q[h * d.qk + k] : 0.0f;
  }
  __syncthreads();
  const float* w = absorbed + static_cast<int64_t>(h) * d.nope * d.kvlp;  // [nope, kvlp]
  for (int c = threadIdx.x; c < d.kvlp; c += blockDim.x) {
    float acc[kRowTile] = {};
    for (int k = 0; k < d.nope; ++k) {
      const float wv = w[static_cast<int64_t>(k) * d.kvlp + c];
#pragma unroll
      for (int r = 0; r < kRowTile; ++r) acc[r] += qs[r * d.nope + k] * wv;
    }
#pragma unroll
    for (int r = 0; r < kRowTile; ++r)
      if (r < nr) q_lat[((r0 + r) * d.H + h) * d.kvlp + c] = acc[r];
  }
}

// Partial results of keys [k0, k1) of row blockIdx.z for heads
// [g * 16, g * 16 + 16): m, l [16] and o [16, kvl], at part index
// ((row * groups + g) * chunks + chunk). Per tile of 64 keys:
//   scores   thread (key t % 64, quarter t / 64 of the latent dims) sums its
//            quarter for all 16 heads, the query held transposed in shared
//            memory so that one 16-byte load serves 4 heads; the quarters
//            are added through shared memory;
//   softmax  warp w updates the running max and sum of heads 2w, 2w + 1;
//   p c_kv   thread owns latent columns t, t + 256, ... for all 16 heads.
// s[h] += v * q[h] for the group's 16 heads; q (16-byte aligned) is one
// row of the transposed query, which every lane of the warp reads at once.
__device__ __forceinline__ void accumulate_heads(float (&s)[kGroup], float v, const float* q) {
  const float4* q4 = reinterpret_cast<const float4*>(q);
#pragma unroll
  for (int j = 0; j < kGroup / 4; ++j) {
    const float4 w = q4[j];
    s[4 * j] += w.x * v;
    s[4 * j + 1] += w.y * v;
    s[4 * j + 2] += w.z * v;
    s[4 * j + 3] += w.w * v;
  }
}

constexpr int kPStride = 20;  // floats per key row of p: 16 heads, 16-byte aligned, fewer bank conflicts

__global__ void __launch_bounds__(kThreads) attend(float* part_m, float* part_l, float* part_o, const float* q_lat,
                                                   const Row* rows, int64_t chunk_keys, int chunks, Dims d) {
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  float* qlT = smem;                       // [kvl, 16]
  float* qpT = qlT + d.kvl * kGroup;       // [rope, 16]
  float* sp = qpT + d.rope * kGroup;       // [4, 64, 16] quarter sums
  float* pT = sp + 4 * kKeyTile * kGroup;  // [64, kPStride]
  float* m = pT + kKeyTile * kPStride;     // [16]
  float* l = m + kGroup;                   // [16]
  float* corr = l + kGroup;                // [16]
  const int chunk = blockIdx.x, g = blockIdx.y;
  const int64_t r = blockIdx.z;
  const Row row = rows[r];
  const int heads = min(kGroup, d.H - g * kGroup);
  const int64_t k0 = chunk * chunk_keys, k1 = min64(row.nkeys, k0 + chunk_keys);
  for (int i = threadIdx.x; i < kGroup * d.kvl; i += blockDim.x) {
    const int hh = i / d.kvl, c = i % d.kvl;
    qlT[c * kGroup + hh] = hh < heads ? q_lat[(r * d.H + g * kGroup + hh) * d.kvlp + c] : 0.0f;
  }
  for (int i = threadIdx.x; i < kGroup * d.rope; i += blockDim.x) {
    const int hh = i / d.rope, c = i % d.rope;
    qpT[c * kGroup + hh] = hh < heads ? row.q[(g * kGroup + hh) * d.qk + d.nope + c] : 0.0f;
  }
  if (threadIdx.x < kGroup) {
    m[threadIdx.x] = -INFINITY;
    l[threadIdx.x] = 0.0f;
  }
  constexpr int kCols = 2;  // latent columns per thread: kvl up to 512
  float acc[kGroup][kCols] = {};
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kt = threadIdx.x % kKeyTile, quarter = threadIdx.x / kKeyTile;
  const int lq = (d.kvl + 3) / 4, rq = (d.rope + 3) / 4;
  const int c0 = quarter * lq, c1 = min(d.kvl, c0 + lq), e0 = quarter * rq, e1 = min(d.rope, e0 + rq);
  for (int64_t t0 = k0; t0 < k1; t0 += kKeyTile) {
    const int nt = static_cast<int>(min64(kKeyTile, k1 - t0));
    {
      float s[kGroup] = {};
      if (kt < nt) {
        const int64_t t = row.keys ? row.keys[t0 + kt] : t0 + kt;
        const float* cr = row.c_kv + t * d.kvl;
        for (int c = c0; c < c1; ++c) accumulate_heads(s, cr[c], qlT + c * kGroup);
        const float* kr = row.k_pe + t * d.rope;
        for (int c = e0; c < e1; ++c) accumulate_heads(s, kr[c], qpT + c * kGroup);
      }
      float4* out = reinterpret_cast<float4*>(sp + (quarter * kKeyTile + kt) * kGroup);
#pragma unroll
      for (int j = 0; j < kGroup / 4; ++j) out[j] = make_float4(s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3]);
    }
    __syncthreads();
    // Scores: thread -> (key kt, heads 4 * quarter .. + 4), quarters added in order.
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int hh = 4 * quarter + j;
      float v = 0;
#pragma unroll
      for (int q = 0; q < 4; ++q) v += sp[(q * kKeyTile + kt) * kGroup + hh];
      pT[kt * kPStride + hh] = kt < nt ? v * d.scale : -INFINITY;
    }
    __syncthreads();
    for (int hh = warp * 2; hh < warp * 2 + 2; ++hh) {
      const float a = pT[lane * kPStride + hh], b = pT[(lane + 32) * kPStride + hh];
      const float tile_max = warp_max(fmaxf(a, b));
      const float m_old = m[hh], m_new = fmaxf(m_old, tile_max);
      const float ea = m_new == -INFINITY ? 0.0f : expf(a - m_new), eb = m_new == -INFINITY ? 0.0f : expf(b - m_new);
      pT[lane * kPStride + hh] = ea;
      pT[(lane + 32) * kPStride + hh] = eb;
      const float sum = warp_sum(ea + eb);
      if (lane == 0) {
        const float c = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
        corr[hh] = c;
        l[hh] = l[hh] * c + sum;
        m[hh] = m_new;
      }
    }
    __syncthreads();
#pragma unroll
    for (int hh = 0; hh < kGroup; ++hh)
#pragma unroll
      for (int j = 0; j < kCols; ++j) acc[hh][j] *= corr[hh];
    for (int k = 0; k < nt; ++k) {
      const int64_t t = row.keys ? row.keys[t0 + k] : t0 + k;
      const float* cr = row.c_kv + t * d.kvl;
      const float4* p4 = reinterpret_cast<const float4*>(pT + k * kPStride);
      float p[kGroup];
#pragma unroll
      for (int j = 0; j < kGroup / 4; ++j) {
        const float4 v = p4[j];
        p[4 * j] = v.x;
        p[4 * j + 1] = v.y;
        p[4 * j + 2] = v.z;
        p[4 * j + 3] = v.w;
      }
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int c = threadIdx.x + j * kThreads;
        if (c < d.kvl) {
          const float v = cr[c];
#pragma unroll
          for (int hh = 0; hh < kGroup; ++hh) acc[hh][j] += p[hh] * v;
        }
      }
    }
    __syncthreads();
  }
  const int groups = (d.H + kGroup - 1) / kGroup;
  const int64_t pi = (r * groups + g) * chunks + chunk;
  for (int hh = 0; hh < heads; ++hh) {
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int c = threadIdx.x + j * kThreads;
      if (c < d.kvl) part_o[(pi * kGroup + hh) * d.kvl + c] = acc[hh][j];
    }
  }
  if (threadIdx.x < heads) {
    part_m[pi * kGroup + threadIdx.x] = m[threadIdx.x];
    part_l[pi * kGroup + threadIdx.x] = l[threadIdx.x];
  }
}

// o_lat [R, H, kvlp] (a row's padding columns 0) from the chunks' partials.
__global__ void combine(float* o_lat, const float* part_m, const float* part_l, const float* part_o, int chunks,
                        Dims d) {
  const int h = blockIdx.x;
  const int64_t r = blockIdx.y;
  const int groups = (d.H + kGroup - 1) / kGroup, g = h / kGroup, hh = h % kGroup;
  const int64_t p0 = (r * groups + g) * chunks;
  float M = -INFINITY;
  for (int c = 0; c < chunks; ++c) M = fmaxf(M, part_m[(p0 + c) * kGroup + hh]);
  float L = 0;
  for (int c = 0; c < chunks; ++c) {
    const float mc = part_m[(p0 + c) * kGroup + hh];
    if (mc != -INFINITY) L += part_l[(p0 + c) * kGroup + hh] * expf(mc - M);
  }
  for (int col = threadIdx.x; col < d.kvlp; col += blockDim.x) {
    float o = 0;
    if (col < d.kvl)
      for (int c = 0; c < chunks; ++c) {
        const float mc = part_m[(p0 + c) * kGroup + hh];
        if (mc != -INFINITY) o += part_o[((p0 + c) * kGroup + hh) * d.kvl + col] * expf(mc - M);
      }
    o_lat[(r * d.H + h) * d.kvlp + col] = L > 0 ? o / L : 0.0f;
  }
}

// ctx[r, h] = o_lat[r, h] W_UV_h^T for rows [r0, r0 + 16) of head blockIdx.x.
__global__ void absorb_out(const Row* rows, int64_t R, const float* o_lat, const float* absorbed, Dims d) {
  extern __shared__ float os[];  // [kRowTile, kvl]
  const int h = blockIdx.x;
  const int64_t r0 = int64_t{blockIdx.y} * kRowTile;
  const int nr = static_cast<int>(min64(kRowTile, R - r0));
  for (int i = threadIdx.x; i < kRowTile * d.kvl; i += blockDim.x) {
    const int r = i / d.kvl, c = i % d.kvl;
    os[i] = r < nr ? o_lat[((r0 + r) * d.H + h) * d.kvlp + c] : 0.0f;
  }
  __syncthreads();
  const float* w = absorbed + static_cast<int64_t>(d.H) * d.nope * d.kvlp + static_cast<int64_t>(h) * d.kvl * d.vp;
  for (int v = threadIdx.x; v < d.vd; v += blockDim.x) {
    float acc[kRowTile] = {};
    for (int c = 0; c < d.kvl; ++c) {
      const float wv = w[static_cast<int64_t>(c) * d.vp + v];
#pragma unroll
      for (int r = 0; r < kRowTile; ++r) acc[r] += os[r * d.kvl + c] * wv;
    }
#pragma unroll
    for (int r = 0; r < kRowTile; ++r)
      if (r < nr) rows[r0 + r].ctx[h * d.vd + v] = acc[r];
  }
}

int64_t round16(int64_t x) { return (x + 15) / 16 * 16; }

void set_smem(const void* kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    DS_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

}  // namespace

void latent_attention_forward(const LatentQueries* seqs, int64_t count, int64_t ldq, int64_t ldc, const float* absorbed,
                              const LatentAttentionDims& ld) {
  DS_CUDA_REQUIRE(ld.heads >= 1 && ld.nope >= 0 && ld.rope >= 0 && ld.v_dim >= 1 && ld.kv_lora >= 1,
                  "latent_attention: bad sizes");
  DS_CUDA_REQUIRE(ld.kv_lora <= 2 * kThreads, "latent_attention: kv_lora over 512 has no CUDA kernel yet");
  const Dims d{
      static_cast<int>(ld.heads),          static_cast<int>(ld.nope),           static_cast<int>(ld.rope),
      static_cast<int>(ld.v_dim),          static_cast<int>(ld.kv_lora),        static_cast<int>(round16(ld.kv_lora)),
      static_cast<int>(round16(ld.v_dim)), static_cast<int>(ld.nope + ld.rope), ld.scale};
  DS_CUDA_REQUIRE(count >= 0 && ldq >= int64_t{d.H} * d.qk && ldc >= int64_t{d.H} * d.vd,
                  "latent_attention: row strides too small");
  if (count == 0) return;
  std::vector<Row> rows;
  int64_t max_keys = 0;
  for (int64_t i = 0; i < count; ++i) {
    const LatentQueries& sq = seqs[i];
    DS_CUDA_REQUIRE(sq.n >= 1 && sq.past >= 0 && (!sq.keys || sq.n == 1),
                    ("latent_attention: sequence " + std::to_string(i) + ": bad sizes").c_str());
    DS_CUDA_REQUIRE(sq.q && sq.ctx && sq.c_kv && (sq.k_pe || d.rope == 0),
                    ("latent_attention: sequence " + std::to_string(i) + ": null pointer").c_str());
    for (int64_t j = 0; j < sq.n; ++j) {
      const int64_t nkeys = sq.keys ? sq.past + 1 : sq.past + j + 1;
      rows.push_back({sq.q + j * ldq, sq.ctx + j * ldc, sq.c_kv, sq.k_pe, sq.keys, nkeys});
      max_keys = std::max(max_keys, nkeys);
    }
  }
  const int64_t R = static_cast<int64_t>(rows.size());
  DS_CUDA_REQUIRE(R < 65536, "latent_attention: more than 65535 query rows in one call");
  const int groups = (d.H + kGroup - 1) / kGroup;
  // Enough chunks to give every multiprocessor a few blocks, of at least a
  // tile of keys each.
  const int64_t want = std::max<int64_t>(1, 1024 / (R * groups));
  const int chunks = static_cast<int>(std::min<int64_t>({kMaxChunks, want, (max_keys + kKeyTile - 1) / kKeyTile}));
  const int64_t chunk_keys = (max_keys + chunks - 1) / chunks;

  static Scratch rows_s, qlat_s, olat_s, m_s, l_s, o_s;
  auto* rows_d = static_cast<Row*>(rows_s.get(rows.size() * sizeof(Row)));
  DS_CUDA(cudaMemcpyAsync(rows_d, rows.data(), rows.size() * sizeof(Row), cudaMemcpyHostToDevice, stream()));
  const int64_t parts = R * groups * chunks * kGroup;
  auto* q_lat = static_cast<float*>(qlat_s.get(static_cast<size_t>(R * d.H * d.kvlp) * sizeof(float)));
  auto* o_lat = static_cast<float*>(olat_s.get(static_cast<size_t>(R * d.H * d.kvlp) * sizeof(float)));
  auto* pm = static_cast<float*>(m_s.get(static_cast<size_t>(parts) * sizeof(float)));
  auto* pl = static_cast<float*>(l_s.get(static_cast<size_t>(parts) * sizeof(float)));
  auto* po = static_cast<float*>(o_s.get(static_cast<size_t>(parts * d.kvl) * sizeof(float)));

  const unsigned row_tiles = static_cast<unsigned>((R + kRowTile - 1) / kRowTile);
  const size_t smem_q = size_t{kRowTile} * std::max(d.nope, 1) * sizeof(float);
  set_smem(reinterpret_cast<const void*>(absorb_q), smem_q);
  absorb_q<<<dim3(d.H, row_tiles), kThreads, smem_q, stream()>>>(q_lat, rows_d, R, absorbed, d);
  DS_CUDA_LAUNCHED();
  const size_t smem_a =
      (size_t{kGroup} * (d.kvl + d.rope + 4 * kKeyTile + 3) + size_t{kKeyTile} * kPStride) * sizeof(float);
  set_smem(reinterpret_cast<const void*>(attend), smem_a);
  attend<<<dim3(chunks, groups, static_cast<unsigned>(R)), kThreads, smem_a, stream()>>>(pm, pl, po, q_lat, rows_d,
                                                                                         chunk_keys, chunks, d);
  DS_CUDA_LAUNCHED();
  combine<<<dim3(d.H, static_cast<unsigned>(R)), 128, 0, stream()>>>(o_lat, pm, pl, po, chunks, d);
  DS_CUDA_LAUNCHED();
  const size_t smem_o = size_t{kRowTile} * d.kvl * sizeof(float);
  set_smem(reinterpret_cast<const void*>(absorb_out), smem_o);
  absorb_out<<<dim3(d.H, row_tiles), 128, smem_o, stream()>>>(rows_d, R, o_lat, absorbed, d);
  DS_CUDA_LAUNCHED();
}

}  // namespace ds::ops::cuda
