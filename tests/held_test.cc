// core/held.h: a tensor held in float32 comes back as it was; one held in
// bf16 takes half the bytes and comes back as it was when its values are
// bf16 values, and refuses values that are not (a lossy hold would change
// gradients silently); hold_bf16 and widen move a set of buffers there and
// back.
#include "core/held.h"

#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace {
namespace held_test {

using ds::Buffer;
using ds::HeldFloats;

std::vector<float> bf16_values(int n) {
  std::vector<float> v;
  for (int i = 0; i < n; ++i)
    v.push_back(ds::bf16_to_f32(ds::f32_to_bf16(std::sin(0.37f * static_cast<float>(i)) * 3)));
  v.push_back(std::numeric_limits<float>::infinity());
  v.push_back(-0.0f);
  return v;
}

TEST(HeldFloats, KeepsFloat32AsItIsAndBf16ValuesInHalfTheBytes) {
  const std::vector<float> x = bf16_values(1000);
  const int64_t n = static_cast<int64_t>(x.size());
  for (const bool bf16 : {false, true}) {
    HeldFloats h;
    h.keep(x.data(), n, bf16);
    EXPECT_EQ(h.size(), n);
    EXPECT_EQ(h.is_bf16(), bf16);
    EXPECT_EQ(h.bytes(), static_cast<size_t>(n) * (bf16 ? 2 : 4));
    Buffer<float> scratch;
    const float* v = h.values(scratch);
    for (int64_t i = 0; i < n; ++i)
      EXPECT_EQ(std::bit_cast<uint32_t>(v[i]), std::bit_cast<uint32_t>(x[static_cast<size_t>(i)])) << i;
  }
}

TEST(HeldFloats, RefusesAValueThatIsNotBf16) {
  std::vector<float> x = bf16_values(10);
  x[3] = 1.0f + 0x1p-12f;  // needs more than bf16's 8 significant bits
  HeldFloats h;
  EXPECT_THROW(h.keep(x.data(), static_cast<int64_t>(x.size()), true), ds::Error);
  h.keep(x.data(), static_cast<int64_t>(x.size()), false);  // float32 holds it
  Buffer<float> scratch;
  EXPECT_EQ(h.values(scratch)[3], x[3]);
}

TEST(HeldFloats, HoldAndWidenMoveBuffersThereAndBack) {
  const std::vector<float> x = bf16_values(300);
  Buffer<float> a(x.begin(), x.end()), b, c(x.begin(), x.begin() + 7);
  std::array<Buffer<float>*, 3> buffers = {&a, &b, &c};
  std::array<HeldFloats, 3> held;
  ds::hold_bf16(buffers, held);
  EXPECT_TRUE(a.empty() && b.empty() && c.empty());
  EXPECT_EQ(held[0].bytes() + held[1].bytes() + held[2].bytes(), (x.size() + 7) * 2);
  ds::widen(buffers, held);
  EXPECT_EQ(std::vector<float>(a.begin(), a.end()), x);
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(std::vector<float>(c.begin(), c.end()), std::vector<float>(x.begin(), x.begin() + 7));
  EXPECT_TRUE(held[0].empty() && held[2].empty());
}

}  // namespace held_test
}  // namespace
