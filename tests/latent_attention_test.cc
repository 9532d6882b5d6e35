// MLA latent decode attention: the absorbed float32 kernel against the
// double reference that expands every cached key and value, for one new
// token, several new tokens over a long cache, a fresh sequence (past 0),
// one head and MLA's real head sizes; bad sizes are errors.
#include "ops/latent_attention.h"

#include <vector>

#include "core/error.h"
#include "ops/reference/latent_attention.h"
#include "test_util.h"

namespace ds {
namespace {

using ops::LatentAttentionDims;

void check(const LatentAttentionDims& d, int64_t n, int64_t past, uint64_t seed) {
  const int64_t H = d.heads, qk = d.nope + d.rope, T = past + n;
  const auto q = test::randn(n * H * qk, seed), ckv = test::randn(T * d.kv_lora, seed + 1),
             kpe = test::randn(T * d.rope, seed + 2),
             w = test::randn(H * (d.nope + d.v_dim) * d.kv_lora, seed + 3, 0.3f);
  std::vector<float> ctx(n * H * d.v_dim, -1.0f);
  ops::latent_attention_forward(ctx.data(), H * d.v_dim, q.data(), H * qk, ckv.data(), kpe.data(), w.data(), n, past,
                                d);
  std::vector<double> want;
  ref::latent_attention_forward(want, test::to_double(q), test::to_double(ckv), test::to_double(kpe),
                                test::to_double(w), n, past, d);
  test::expect_close(ctx, want, 2e-5, 2e-5, "ctx");
}

TEST(LatentAttention, OneNewTokenOverTheCache) { check({4, 12, 8, 12, 16, 0.2f}, 1, 9, 1); }
TEST(LatentAttention, SeveralNewTokensSeeOnlyTheirPast) { check({4, 12, 8, 12, 16, 0.2f}, 5, 37, 2); }
TEST(LatentAttention, AFreshSequence) { check({2, 6, 4, 5, 7, 0.3f}, 6, 0, 3); }
TEST(LatentAttention, OneHeadNoRope) { check({1, 8, 0, 4, 8, 0.35f}, 3, 2, 4); }
TEST(LatentAttention, MlaHeadSizes) { check({2, 128, 64, 128, 512, 1.0f / 13.86f}, 2, 70, 5); }

TEST(LatentAttention, BadSizesAreErrors) {
  std::vector<float> buf(4096);
  const LatentAttentionDims d{2, 4, 2, 4, 8, 1.0f};
  EXPECT_THROW(
      ops::latent_attention_forward(buf.data(), 8, buf.data(), 12, buf.data(), buf.data(), buf.data(), 0, 1, d), Error);
  EXPECT_THROW(
      ops::latent_attention_forward(buf.data(), 8, buf.data(), 11, buf.data(), buf.data(), buf.data(), 1, 1, d), Error);
}

}  // namespace
}  // namespace ds
