// Element types and their conversions to and from float32.
//
// Every narrowing conversion rounds to nearest, ties to even. fp8 follows the
// OCP FP8 formats used by DeepSeek-V3 checkpoints and PyTorch:
//   e4m3 ("e4m3fn"): bias 7, no infinities, max finite 448, NaN = S.1111.111;
//                    out-of-range finite values and +-inf saturate to +-448.
//   e5m2:            bias 15, IEEE-like with infinities, max finite 57344;
//                    out-of-range finite values saturate to +-57344, inf stays inf.
// NaN maps to NaN in every format.
//
// Two formats exist only as packed weights (DeepSeek-V4's MXFP4 experts):
//   e2m1 (f4_e2m1): 4-bit codes, sign, 2 exponent bits (bias 1), 1 mantissa
//                   bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; no infinities or NaN.
//                   Two codes a byte, element 2j in the low nibble of byte j,
//                   so the dtype has no size per element (dtype_size refuses).
//   e8m0:           a power-of-two scale byte, 2^(e - 127); 0xff is NaN.
//
// Two more exist only as packed weight rows, blocks of values with their
// scales inside, byte for byte ggml's (ops/block_quant.h):
//   q8_0:           32 values a block: an f16 scale d, 32 int8; x = d q.
//   q4_k:           256 values a block: f16 d and dmin, 6-bit scales and
//                   mins of 8 sub-blocks of 32, 4-bit codes; x = d sc q - dmin m.
//   q4_1:           32 values a block: f16 d and m, 4-bit codes; x = d q + m
//                   (q4_k's stand-in for rows that are not whole blocks of 256).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>

namespace ds {

enum class DType : uint8_t { F32, BF16, F16, F8E4M3, F8E5M2, I32, U32, I64, F4E2M1, Q8_0, Q4_K, Q4_1, Q6_K };

size_t dtype_size(DType t);  // bytes per element; throws for the packed f4_e2m1, q8_0, q4_k and q4_1
std::string_view dtype_name(DType t);
bool dtype_is_float(DType t);  // the dtypes convert() takes (not the packed f4_e2m1)

uint16_t f32_to_bf16(float x);
float bf16_to_f32(uint16_t h);
uint16_t f32_to_f16(float x);
float f16_to_f32(uint16_t h);
// The same, inline: exact, by placing the bits (kernels read an f16 scale
// per block of 32 weights). NaN becomes a quiet NaN of its sign.
inline float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {  // zero and subnormals: mant * 2^-24, exact in float32
    const float v = static_cast<float>(mant) * 0x1p-24f;
    return sign ? -v : v;
  }
  if (exp == 0x1f) {
    const float v = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
    return sign ? -v : v;
  }
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}
uint8_t f32_to_e4m3(float x);
float e4m3_to_f32(uint8_t b);
uint8_t f32_to_e5m2(float x);
float e5m2_to_f32(uint8_t b);
float e2m1_to_f32(uint8_t code);  // the low 4 bits of code
// Nearest e2m1 code, ties to the even code, saturating at +-6 (NaN, which
// has no code, too: to the largest magnitude of its sign).
uint8_t f32_to_e2m1(float x);
float e8m0_to_f32(uint8_t e);

// Converts n elements between any two floating dtypes (through float32).
void convert(void* dst, DType dst_type, const void* src, DType src_type, size_t n);

// x[i] = bf16_to_f32(f32_to_bf16(x[i])) for i < n: float32 values rounded to
// the nearest bf16 (what a bf16 matmul input holds), vectorized.
void round_to_bf16(float* x, size_t n);
// convert() between float32 and bf16 on the calling thread alone (no thread
// team, vectorized), for kernels that run inside a parallel region.
void f32_to_bf16_row(uint16_t* out, const float* in, size_t n);
void bf16_to_f32_row(float* out, const uint16_t* in, size_t n);

// Index of the first NaN or infinity among n elements of a floating dtype
// (e4m3's NaN codes included), or -1 if all are finite; for integer dtypes
// always -1. Runs at memory speed: a checkpoint is scanned once at load.
int64_t find_non_finite(const void* data, DType t, size_t n);

template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() { return DType::F32; }
template <>
constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <>
constexpr DType dtype_of<uint32_t>() { return DType::U32; }
template <>
constexpr DType dtype_of<int64_t>() { return DType::I64; }

}  // namespace ds
