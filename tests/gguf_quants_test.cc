// ggml's block formats read back (io/gguf_quants.h): each block built here
// from chosen quants, scales and mins packed as ggml-common.h lays them out,
// and every value read back must be the format's formula of those numbers
// (x = d (q - 8) for Q4_0, d sc q - dmin m for Q4_K, ...). A wrong nibble
// order, bit position or scale unpacking gives other values.
#include "io/gguf_quants.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace {
namespace gguf_quants_test {

namespace gguf = ds::io::gguf;
using gguf::TensorType;

void put_half(std::vector<uint8_t>& b, size_t at, float v) {
  const uint16_t h = ds::f32_to_f16(v);
  std::memcpy(&b[at], &h, 2);
}

std::vector<float> read(TensorType t, const std::vector<uint8_t>& b, int64_t n) {
  std::vector<float> y(static_cast<size_t>(n));
  gguf::dequantize(t, b.data(), n, y.data());
  return y;
}

// Quants 0 .. levels - 1 in an order that is not their position.
int quant(int i, int levels) { return (i * 7 + 3) % levels; }

TEST(GgufQuants, FourAndFiveBitBlocks) {
  // Q4_0 / Q4_1: byte j holds values j (low nibble) and j + 16 (high).
  std::vector<uint8_t> q40(18), q41(20);
  put_half(q40, 0, 0.5f);
  put_half(q41, 0, 0.25f);
  put_half(q41, 2, -1.0f);
  for (int j = 0; j < 16; ++j) {
    q40[2 + j] = static_cast<uint8_t>(quant(j, 16) | (quant(j + 16, 16) << 4));
    q41[4 + j] = static_cast<uint8_t>(quant(j, 16) | (quant(j + 16, 16) << 4));
  }
  const auto y40 = read(TensorType::Q4_0, q40, 32), y41 = read(TensorType::Q4_1, q41, 32);
  for (int i = 0; i < 32; ++i) {
    EXPECT_EQ(y40[i], 0.5f * static_cast<float>(quant(i, 16) - 8)) << i;
    EXPECT_EQ(y41[i], 0.25f * static_cast<float>(quant(i, 16)) - 1.0f) << i;
  }
  // Q5_0 / Q5_1: the fifth bit of value i is bit i of qh.
  std::vector<uint8_t> q50(22), q51(24);
  put_half(q50, 0, 2.0f);
  put_half(q51, 0, 0.5f);
  put_half(q51, 2, 3.0f);
  uint32_t qh = 0;
  for (int i = 0; i < 32; ++i) qh |= static_cast<uint32_t>(quant(i, 32) >> 4) << i;
  std::memcpy(&q50[2], &qh, 4);
  std::memcpy(&q51[4], &qh, 4);
  for (int j = 0; j < 16; ++j) {
    q50[6 + j] = static_cast<uint8_t>((quant(j, 32) & 0xF) | ((quant(j + 16, 32) & 0xF) << 4));
    q51[8 + j] = q50[6 + j];
  }
  const auto y50 = read(TensorType::Q5_0, q50, 32), y51 = read(TensorType::Q5_1, q51, 32);
  for (int i = 0; i < 32; ++i) {
    EXPECT_EQ(y50[i], 2.0f * static_cast<float>(quant(i, 32) - 16)) << i;
    EXPECT_EQ(y51[i], 0.5f * static_cast<float>(quant(i, 32)) + 3.0f) << i;
  }
}

TEST(GgufQuants, EightBitAndFloatRows) {
  std::vector<uint8_t> q8(34);
  put_half(q8, 0, 0.125f);
  for (int i = 0; i < 32; ++i) q8[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(i * 9 - 140 + 7));
  const auto y = read(TensorType::Q8_0, q8, 32);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(y[i], 0.125f * static_cast<float>(static_cast<int8_t>(i * 9 - 133))) << i;
  std::vector<uint8_t> h(4);
  put_half(h, 0, -1.5f);
  const uint16_t b = ds::f32_to_bf16(3.25f);
  std::memcpy(&h[2], &b, 2);
  EXPECT_EQ(read(TensorType::F16, {h[0], h[1]}, 1)[0], -1.5f);
  EXPECT_EQ(read(TensorType::BF16, {h[2], h[3]}, 1)[0], 3.25f);
  EXPECT_THROW(read(TensorType::Q8_0, q8, 31), ds::Error);
  EXPECT_FALSE(gguf::can_dequantize(TensorType::Q2_K));
}

TEST(GgufQuants, Q4KScalesMinsAndNibbles) {
  // Eight sub-blocks of 32 with 6-bit scales and mins, packed into 12 bytes:
  // j < 4: scales[j] = sc | (sc_{j+4} >> 4) << 6, scales[j + 4] = m | (m_{j+4} >> 4) << 6;
  // j >= 4: scales[j + 4] = (sc & 15) | (m & 15) << 4.
  int sc[8], m[8];
  for (int j = 0; j < 8; ++j) sc[j] = (j * 23 + 5) % 64, m[j] = (j * 41 + 17) % 64;
  std::vector<uint8_t> b(144);
  put_half(b, 0, 0.5f);
  put_half(b, 2, 0.25f);
  for (int j = 0; j < 4; ++j) {
    b[4 + j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    b[4 + j + 4] = static_cast<uint8_t>(m[j] | ((m[j + 4] >> 4) << 6));
  }
  for (int j = 4; j < 8; ++j) b[4 + j + 4] = static_cast<uint8_t>((sc[j] & 15) | ((m[j] & 15) << 4));
  // Chunk c of 64 values: byte 32 c + l holds value 64 c + l (low) and 64 c + 32 + l (high).
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l)
      b[16 + 32 * c + l] = static_cast<uint8_t>(quant(64 * c + l, 16) | (quant(64 * c + 32 + l, 16) << 4));
  const auto y = read(TensorType::Q4_K, b, 256);
  for (int i = 0; i < 256; ++i) {
    const int j = i / 32;
    EXPECT_EQ(y[i],
              0.5f * static_cast<float>(sc[j]) * static_cast<float>(quant(i, 16)) - 0.25f * static_cast<float>(m[j]))
        << i;
  }
}

TEST(GgufQuants, Q6KLowHighAndSignedScales) {
  // Value e: its low 4 bits in ql, its high 2 in qh, scales[e / 16] signed.
  int q[256];
  for (int e = 0; e < 256; ++e) q[e] = quant(e, 64);
  int8_t scales[16];
  for (int s = 0; s < 16; ++s) scales[s] = static_cast<int8_t>(s * 19 - 120);
  std::vector<uint8_t> b(210, 0);
  for (int n = 0; n < 2; ++n)
    for (int l = 0; l < 32; ++l) {
      const int base = 128 * n;
      b[64 * n + l] = static_cast<uint8_t>((q[base + l] & 15) | ((q[base + 64 + l] & 15) << 4));
      b[64 * n + 32 + l] = static_cast<uint8_t>((q[base + 32 + l] & 15) | ((q[base + 96 + l] & 15) << 4));
      b[128 + 32 * n + l] = static_cast<uint8_t>((q[base + l] >> 4) | ((q[base + 32 + l] >> 4) << 2) |
                                                 ((q[base + 64 + l] >> 4) << 4) | ((q[base + 96 + l] >> 4) << 6));
    }
  std::memcpy(&b[192], scales, 16);
  put_half(b, 208, 0.125f);
  const auto y = read(TensorType::Q6_K, b, 256);
  for (int e = 0; e < 256; ++e)
    EXPECT_EQ(y[e], 0.125f * static_cast<float>(scales[e / 16]) * static_cast<float>(q[e] - 32)) << e;
}

}  // namespace gguf_quants_test
}  // namespace
