// MLA latent attention: the absorbed float32 kernel against the double
// reference that expands every cached key and value, for one new token,
// several new tokens over a long cache, a fresh sequence (past 0), one head,
// MLA's real head sizes, caches longer than one chunk of keys and more query
// rows than one score tile, on every SIMD target; a batch of sequences gives
// each the bits it gets alone, for any thread count; the absorbed weights
// come from any dtype; each case again without the absorbed copy, reading
// kv_b in its own dtype; bad sizes are errors.
#include "ops/latent_attention.h"

#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "ops/block_quant.h"
#include "ops/reference/latent_attention.h"
#include "test_util.h"

namespace ds {
namespace {
namespace latent_attention_test {

using ops::LatentAttentionDims;

ops::WeightView f32_weight(const std::vector<float>& w, const LatentAttentionDims& d) {
  return {w.data(), DType::F32, d.heads * (d.nope + d.v_dim), d.kv_lora};
}

// kv_b rounded to bf16: its codes, their values and the view.
struct Bf16Weight {
  std::vector<uint16_t> bits;
  std::vector<float> values;
  ops::WeightView view;
  Bf16Weight(const std::vector<float>& w, const LatentAttentionDims& d) : bits(w.size()), values(w.size()) {
    for (size_t i = 0; i < w.size(); ++i) {
      bits[i] = f32_to_bf16(w[i]);
      values[i] = bf16_to_f32(bits[i]);
    }
    view = {bits.data(), DType::BF16, d.heads * (d.nope + d.v_dim), d.kv_lora};
  }
};

// A random sequence: queries, cache and kv_b.
struct Case {
  std::vector<float> q, ckv, kpe, w, absorbed;
  Case(const LatentAttentionDims& d, int64_t n, int64_t T, uint64_t seed)
      : q(test::randn(n * d.heads * (d.nope + d.rope), seed)),
        ckv(test::randn(T * d.kv_lora, seed + 1)),
        kpe(test::randn(T * d.rope, seed + 2)),
        w(test::randn(d.heads * (d.nope + d.v_dim) * d.kv_lora, seed + 3, 0.3f)),
        absorbed(ops::absorb_kv_b(f32_weight(w, d), d)) {}
};

void check(const LatentAttentionDims& d, int64_t n, int64_t past, uint64_t seed) {
  const int64_t H = d.heads, qk = d.nope + d.rope, T = past + n;
  const Case c(d, n, T, seed);
  std::vector<double> want;
  ref::latent_attention_forward(want, test::to_double(c.q), test::to_double(c.ckv), test::to_double(c.kpe),
                                test::to_double(c.w), n, past, d);
  test::for_each_simd_target([&](const char*) {
    std::vector<float> ctx(n * H * d.v_dim, -1.0f);
    ops::latent_attention_forward(ctx.data(), H * d.v_dim, c.q.data(), H * qk, c.ckv.data(), c.kpe.data(),
                                  c.absorbed.data(), n, past, d);
    test::expect_close(ctx, want, 2e-5, 2e-5, "ctx");
    // Without the absorbed copy, kv_b in bf16: W_UK_h widened from it, W_UV_h
    // as a linear layer over its rows; against the reference over the same
    // bf16 weights.
    LatentAttentionDims dk = d;
    const Bf16Weight kv_b(c.w, d);
    dk.kv_b = &kv_b.view;
    std::vector<double> want_bf16;
    ref::latent_attention_forward(want_bf16, test::to_double(c.q), test::to_double(c.ckv), test::to_double(c.kpe),
                                  test::to_double(kv_b.values), n, past, d);
    std::fill(ctx.begin(), ctx.end(), -1.0f);
    ops::latent_attention_forward(ctx.data(), H * d.v_dim, c.q.data(), H * qk, c.ckv.data(), c.kpe.data(), nullptr, n,
                                  past, dk);
    test::expect_close(ctx, want_bf16, 2e-5, 2e-5, "ctx from a bf16 kv_b");
  });
}

TEST(LatentAttention, OneNewTokenOverTheCache) { check({4, 12, 8, 12, 16, 0.2f}, 1, 9, 1); }
TEST(LatentAttention, SeveralNewTokensSeeOnlyTheirPast) { check({4, 12, 8, 12, 16, 0.2f}, 5, 37, 2); }
TEST(LatentAttention, AFreshSequence) { check({2, 6, 4, 5, 7, 0.3f}, 6, 0, 3); }
TEST(LatentAttention, OneHeadNoRope) { check({1, 8, 0, 4, 8, 0.35f}, 3, 2, 4); }
TEST(LatentAttention, MlaHeadSizes) { check({2, 128, 64, 128, 512, 1.0f / 13.86f}, 2, 70, 5); }
// Keys in three chunks (the last partial).
TEST(LatentAttention, ALongCacheInChunks) { check({3, 8, 4, 8, 24, 0.25f}, 4, 1100, 6); }
// New tokens on both sides of a key tile's edge (128), then of a chunk's
// (512): the first queries see none of the last tile or chunk.
TEST(LatentAttention, NewTokensAcrossATileEdge) { check({3, 8, 4, 8, 24, 0.25f}, 5, 126, 8); }
TEST(LatentAttention, NewTokensAcrossAChunkEdge) { check({3, 8, 4, 8, 24, 0.25f}, 4, 510, 9); }
// 5 x 40 = 200 query rows in several tiles of rows, the key tile's edge
// falling inside one of them.
TEST(LatentAttention, ManyQueryRows) { check({40, 8, 4, 6, 16, 0.3f}, 5, 126, 7); }

// Sequences of a batch: dense ones of different lengths (one over several
// chunks) and sparse queries over chosen keys.
struct Batch {
  LatentAttentionDims d{5, 16, 8, 16, 32, 0.2f};
  std::vector<Case> cases;
  std::vector<int64_t> n{1, 3, 1, 1}, past{40, 700, 7, 9};
  std::vector<std::vector<int32_t>> keys{{}, {}, {}, {0, 2, 3, 5, 6, 8, 9, 16, 31, 40}};
  Batch() {
    for (size_t i = 0; i < n.size(); ++i) cases.emplace_back(d, n[i], past[i] + n[i] + 32, 40 + 10 * i);
    for (auto& c : cases) c.absorbed = cases[0].absorbed;  // one layer's weights
  }
  int64_t qk() const { return d.nope + d.rope; }
  ops::LatentQueries seq(size_t i, float* ctx) const {
    ops::LatentQueries s;
    s.q = cases[i].q.data();
    s.ctx = ctx;
    s.c_kv = cases[i].ckv.data();
    s.k_pe = cases[i].kpe.data();
    s.n = n[i];
    s.past = keys[i].empty() ? past[i] : static_cast<int64_t>(keys[i].size()) - 1;
    s.keys = keys[i].empty() ? nullptr : keys[i].data();
    return s;
  }
  // Every sequence's ctx, from one call or one call per sequence; with
  // from_kv_b, without the absorbed copy.
  std::vector<std::vector<float>> run(bool together, bool from_kv_b = false) const {
    const Bf16Weight kv_b(cases[0].w, d);
    LatentAttentionDims dd = d;
    if (from_kv_b) dd.kv_b = &kv_b.view;
    const float* absorbed = from_kv_b ? nullptr : cases[0].absorbed.data();
    std::vector<std::vector<float>> ctx;
    for (size_t i = 0; i < n.size(); ++i) ctx.emplace_back(n[i] * d.heads * d.v_dim, -1.0f);
    std::vector<ops::LatentQueries> seqs;
    for (size_t i = 0; i < n.size(); ++i) seqs.push_back(seq(i, ctx[i].data()));
    if (together) {
      ops::latent_attention_forward(seqs.data(), static_cast<int64_t>(seqs.size()), d.heads * qk(), d.heads * d.v_dim,
                                    absorbed, dd);
    } else {
      for (const auto& s : seqs) ops::latent_attention_forward(&s, 1, d.heads * qk(), d.heads * d.v_dim, absorbed, dd);
    }
    return ctx;
  }
};

TEST(LatentAttention, ABatchGivesEachSequenceItsOwnBits) {
  const Batch b;
  test::for_each_simd_target([&](const char*) {
    EXPECT_EQ(b.run(true), b.run(false));
    EXPECT_EQ(b.run(true, true), b.run(false, true));
  });
  // And the sparse query is the reference over its chosen keys.
  const auto ctx = b.run(true);
  const auto& c = b.cases[3];
  const auto& keys = b.keys[3];
  const int64_t k = static_cast<int64_t>(keys.size());
  std::vector<double> ck(k * b.d.kv_lora), pk(k * b.d.rope), want;
  for (int64_t i = 0; i < k; ++i) {
    std::copy_n(c.ckv.begin() + keys[i] * b.d.kv_lora, b.d.kv_lora, ck.begin() + i * b.d.kv_lora);
    std::copy_n(c.kpe.begin() + keys[i] * b.d.rope, b.d.rope, pk.begin() + i * b.d.rope);
  }
  ref::latent_attention_forward(want, test::to_double(c.q), ck, pk, test::to_double(b.cases[0].w), 1, k - 1, b.d);
  test::expect_close(ctx[3], want, 2e-5, 2e-5, "sparse ctx");
}

// More than 8 query rows read kv_b's W_UV_h 8 rows a call: a sequence's
// bits are still those it gets alone (10 rows together, 1, 5 and 4 apart).
TEST(LatentAttention, KvBRowsInCallsOfEightChangeNoBit) {
  const LatentAttentionDims d{3, 8, 4, 8, 32, 0.3f};
  const std::vector<int64_t> n{1, 5, 4}, past{30, 12, 0};
  std::vector<Case> cases;
  for (size_t i = 0; i < n.size(); ++i) cases.emplace_back(d, n[i], past[i] + n[i], 60 + 10 * i);
  const Bf16Weight kv_b(cases[0].w, d);
  LatentAttentionDims dk = d;
  dk.kv_b = &kv_b.view;
  const int64_t qk = d.nope + d.rope;
  auto run = [&](bool together) {
    std::vector<std::vector<float>> ctx;
    std::vector<ops::LatentQueries> seqs;
    for (size_t i = 0; i < n.size(); ++i) ctx.emplace_back(n[i] * d.heads * d.v_dim, -1.0f);
    for (size_t i = 0; i < n.size(); ++i) {
      ops::LatentQueries s;
      s.q = cases[i].q.data();
      s.ctx = ctx[i].data();
      s.c_kv = cases[i].ckv.data();
      s.k_pe = cases[i].kpe.data();
      s.n = n[i];
      s.past = past[i];
      seqs.push_back(s);
    }
    if (together)
      ops::latent_attention_forward(seqs.data(), 3, d.heads * qk, d.heads * d.v_dim, nullptr, dk);
    else
      for (const auto& s : seqs) ops::latent_attention_forward(&s, 1, d.heads * qk, d.heads * d.v_dim, nullptr, dk);
    return ctx;
  };
  test::for_each_simd_target([&](const char*) { EXPECT_EQ(run(true), run(false)); });
}

TEST(LatentAttention, SameBitsForAnyThreadCount) {
  const Batch b;
  test::for_each_simd_target([&](const char*) {
    test::expect_same_for_any_thread_count([&] { return b.run(true); });
    test::expect_same_for_any_thread_count([&] { return b.run(true, true); });
  });
}

// Many rows go in smaller tiles when there are more threads to share them
// among; the bits do not change.
TEST(LatentAttention, RowTilesForMoreThreadsChangeNoBit) {
  const LatentAttentionDims d{40, 8, 4, 6, 16, 0.3f};
  const int64_t n = 5, past = 150, qk = d.nope + d.rope;
  const Case c(d, n, past + n, 11);
  test::for_each_simd_target([&](const char*) {
    test::expect_same_for_any_thread_count([&] {
      std::vector<float> ctx(n * d.heads * d.v_dim);
      ops::latent_attention_forward(ctx.data(), d.heads * d.v_dim, c.q.data(), d.heads * qk, c.ckv.data(),
                                    c.kpe.data(), c.absorbed.data(), n, past, d);
      return ctx;
    });
  });
}

TEST(LatentAttention, AbsorbedWeightsFromNarrowDtypesAreTheWidenedOnes) {
  const LatentAttentionDims d{3, 8, 4, 6, 16, 0.3f};
  auto w = test::randn(d.heads * (d.nope + d.v_dim) * d.kv_lora, 9);
  std::vector<uint16_t> bits(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    bits[i] = f32_to_bf16(w[i]);
    w[i] = bf16_to_f32(bits[i]);
  }
  const ops::WeightView bf16{bits.data(), DType::BF16, d.heads * (d.nope + d.v_dim), d.kv_lora};
  EXPECT_EQ(ops::absorb_kv_b(bf16, d), ops::absorb_kv_b(f32_weight(w, d), d));
  // Block-scaled e4m3 in blocks of 4 x 8, which a head's 14 rows do not
  // line up with: the same as absorbing the whole weight widened first.
  const int64_t rows = d.heads * (d.nope + d.v_dim);
  std::vector<uint8_t> q(w.size());
  std::vector<float> scale((rows + 3) / 4 * (d.kv_lora / 8));
  ops::quantize_fp8_blocks(q.data(), scale.data(), w.data(), rows, d.kv_lora, 4, 8);
  ops::WeightView fp8{q.data(), DType::F8E4M3, rows, d.kv_lora, scale.data(), 4, 8};
  std::vector<float> widened(w.size());
  ops::widen_rows(widened.data(), fp8, 0, rows);
  EXPECT_EQ(ops::absorb_kv_b(fp8, d), ops::absorb_kv_b(f32_weight(widened, d), d));
  // absorbed_kv_b_bytes says what the copy takes, padding included (v 6
  // and, below, kv_lora 20 and v 7 padded to multiples of 16).
  EXPECT_EQ(ops::absorbed_kv_b_bytes(d), ops::absorb_kv_b(bf16, d).size() * sizeof(float));
  const LatentAttentionDims odd{2, 5, 3, 7, 20, 0.3f};
  const auto wo = test::randn(odd.heads * (odd.nope + odd.v_dim) * odd.kv_lora, 4);
  EXPECT_EQ(ops::absorbed_kv_b_bytes(odd), ops::absorb_kv_b(f32_weight(wo, odd), odd).size() * sizeof(float));
}

// Without the absorbed copy, kv_b is read in its own dtype: bf16, q8_0, and
// block-scaled e4m3 whose scale blocks a head's W_UV_h rows do not start
// on (those rows are widened first). Each against the reference over the
// widened weight, with x multiplied as it is (--quantized-x f32); q8_0's
// default rounding of x to 8 bits a block stays within its own bound.
TEST(LatentAttention, KvBInItsOwnDtypeIsTheWidenedWeight) {
  const LatentAttentionDims d{3, 8, 4, 4, 32, 0.3f};
  const int64_t n = 2, past = 20, T = past + n, H = d.heads, qk = d.nope + d.rope;
  const int64_t rows = H * (d.nope + d.v_dim);
  const Case c(d, n, T, 21);
  std::vector<uint16_t> bits(c.w.size());
  for (size_t i = 0; i < c.w.size(); ++i) bits[i] = f32_to_bf16(c.w[i]);
  std::vector<uint8_t> q8(static_cast<size_t>(rows * ops::block_row_bytes(DType::Q8_0, d.kv_lora)));
  ops::quantize_rows(DType::Q8_0, c.w.data(), rows, d.kv_lora, q8.data());
  std::vector<uint8_t> e4m3(c.w.size());
  std::vector<float> scale((rows + 3) / 4 * (d.kv_lora / 8));
  ops::quantize_fp8_blocks(e4m3.data(), scale.data(), c.w.data(), rows, d.kv_lora, 4, 8);
  const std::vector<ops::WeightView> weights{{bits.data(), DType::BF16, rows, d.kv_lora},
                                             {q8.data(), DType::Q8_0, rows, d.kv_lora},
                                             {e4m3.data(), DType::F8E4M3, rows, d.kv_lora, scale.data(), 4, 8}};
  for (const ops::QuantizedX qx : {ops::QuantizedX::kF32, ops::QuantizedX::kInt8}) {
    const ops::QuantizedX saved = ops::quantized_x();
    ops::set_quantized_x(qx);
    for (const ops::WeightView& w : weights) {
      std::vector<float> widened(c.w.size());
      ops::widen_rows(widened.data(), w, 0, rows);
      std::vector<double> want;
      ref::latent_attention_forward(want, test::to_double(c.q), test::to_double(c.ckv), test::to_double(c.kpe),
                                    test::to_double(widened), n, past, d);
      LatentAttentionDims dk = d;
      dk.kv_b = &w;
      std::vector<float> ctx(n * H * d.v_dim, -1.0f);
      ops::latent_attention_forward(ctx.data(), H * d.v_dim, c.q.data(), H * qk, c.ckv.data(), c.kpe.data(), nullptr, n,
                                    past, dk);
      const bool rounds_x = qx == ops::QuantizedX::kInt8 && w.dtype == DType::Q8_0;
      const std::string what = "ctx from kv_b " + std::string(dtype_name(w.dtype));
      test::expect_close(ctx, want, rounds_x ? 2e-2 : 2e-5, rounds_x ? 2e-2 : 2e-5, what.c_str());
    }
    ops::set_quantized_x(saved);
  }
}

TEST(LatentAttention, BadSizesAreErrors) {
  std::vector<float> buf(4096);
  const LatentAttentionDims d{2, 4, 2, 4, 8, 1.0f};
  EXPECT_THROW(
      ops::latent_attention_forward(buf.data(), 8, buf.data(), 12, buf.data(), buf.data(), buf.data(), 0, 1, d), Error);
  EXPECT_THROW(
      ops::latent_attention_forward(buf.data(), 8, buf.data(), 11, buf.data(), buf.data(), buf.data(), 1, 1, d), Error);
  EXPECT_THROW(ops::latent_attention_forward(buf.data(), 8, buf.data(), 12, buf.data(), nullptr, buf.data(), 1, 1, d),
               Error);
  ops::LatentQueries sparse;
  const int32_t keys[2] = {0, 1};
  sparse.q = sparse.c_kv = sparse.k_pe = buf.data();
  sparse.ctx = buf.data();
  sparse.n = 2;  // sparse queries come one at a time
  sparse.past = 1;
  sparse.keys = keys;
  EXPECT_THROW(ops::latent_attention_forward(&sparse, 1, 12, 8, buf.data(), d), Error);
  EXPECT_THROW(ops::absorb_kv_b(ops::WeightView{buf.data(), DType::F32, 15, 8}, d), Error);
  EXPECT_THROW(ops::latent_attention_forward(buf.data(), 8, buf.data(), 12, buf.data(), buf.data(), buf.data(), 1, 1,
                                             LatentAttentionDims{2, 4, 2, 4, 0, 1.0f}),
               Error);
  // Neither the absorbed copy nor kv_b; a kv_b of the wrong shape; float32
  // and e4m3 whose W_UV_h rows start inside a scale block (reads_kv_b says
  // no: the absorbed copy is for those).
  EXPECT_THROW(ops::latent_attention_forward(buf.data(), 8, buf.data(), 12, buf.data(), buf.data(), nullptr, 1, 1, d),
               Error);
  LatentAttentionDims dk = d;
  const ops::WeightView wrong{buf.data(), DType::BF16, 15, 8};
  const ops::WeightView f32{buf.data(), DType::F32, 16, 8};
  const ops::WeightView fp8{buf.data(), DType::F8E4M3, 16, 8, buf.data(), 3, 8};
  for (const ops::WeightView* w : {&wrong, &f32, &fp8}) {
    dk.kv_b = w;
    EXPECT_THROW(
        ops::latent_attention_forward(buf.data(), 8, buf.data(), 12, buf.data(), buf.data(), nullptr, 1, 1, dk), Error);
  }
  EXPECT_FALSE(ops::reads_kv_b(f32, d));
  EXPECT_FALSE(ops::reads_kv_b(fp8, d));
  EXPECT_TRUE(ops::reads_kv_b(ops::WeightView{buf.data(), DType::F8E4M3, 16, 8, buf.data(), 4, 8}, d));
}

}  // namespace latent_attention_test
}  // namespace
}  // namespace ds
