#include "io/gguf_quants.h"

#include <cstring>

#include "core/dtype.h"
#include "core/error.h"

namespace ds::io::gguf {

namespace {

float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

void q4_0(const uint8_t* b, float* y) {
  const float d = half(b);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>((b[2 + j] & 0xF) - 8);
    y[j + 16] = d * static_cast<float>((b[2 + j] >> 4) - 8);
  }
}

void q5_0(const uint8_t* b, float* y) {
  const float d = half(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  for (int j = 0; j < 16; ++j) {
    const int lo = (b[6 + j] & 0xF) | (((qh >> j) & 1) << 4);
    const int hi = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    y[j] = d * static_cast<float>(lo - 16);
    y[j + 16] = d * static_cast<float>(hi - 16);
  }
}

// Q4_1 and Q5_1: x = d q + m, q unsigned.
void q4_1(const uint8_t* b, float* y) {
  const float d = half(b), m = half(b + 2);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(b[4 + j] & 0xF) + m;
    y[j + 16] = d * static_cast<float>(b[4 + j] >> 4) + m;
  }
}

void q5_1(const uint8_t* b, float* y) {
  const float d = half(b), m = half(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  for (int j = 0; j < 16; ++j) {
    const int lo = (b[8 + j] & 0xF) | (((qh >> j) & 1) << 4);
    const int hi = (b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    y[j] = d * static_cast<float>(lo) + m;
    y[j + 16] = d * static_cast<float>(hi) + m;
  }
}

void q8_0(const uint8_t* b, float* y) {
  const float d = half(b);
  for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(static_cast<int8_t>(b[2 + j]));
}

void q4_k(const uint8_t* b, float* y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int c = 0; c < 4; ++c, q += 32) {
    int sc0, m0, sc1, m1;
    q4_k_scale_min(scales, 2 * c, &sc0, &m0);
    q4_k_scale_min(scales, 2 * c + 1, &sc1, &m1);
    for (int l = 0; l < 32; ++l) {
      y[64 * c + l] = d * static_cast<float>(sc0) * static_cast<float>(q[l] & 0xF) - dmin * static_cast<float>(m0);
      y[64 * c + 32 + l] = d * static_cast<float>(sc1) * static_cast<float>(q[l] >> 4) - dmin * static_cast<float>(m1);
    }
  }
}

void q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half(b + 208);
  for (int n = 0; n < 2; ++n, ql += 64, qh += 32, sc += 8, y += 128)
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
      y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
      y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
      y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
    }
}

}  // namespace

bool can_dequantize(TensorType t) {
  switch (t) {
    case TensorType::F32:
    case TensorType::F16:
    case TensorType::BF16:
    case TensorType::Q4_0:
    case TensorType::Q4_1:
    case TensorType::Q5_0:
    case TensorType::Q5_1:
    case TensorType::Q8_0:
    case TensorType::Q4_K:
    case TensorType::Q6_K:
      return true;
    default:
      return false;
  }
}

void dequantize(TensorType t, const uint8_t* src, int64_t n, float* dst) {
  const BlockSize b = block_size(t);
  DS_CHECK(can_dequantize(t) && b.elements > 0 && n % b.elements == 0, "gguf: cannot read {} values of {}", n,
           type_name(t));
  const int64_t blocks = n / b.elements;
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* s = src + i * b.bytes;
    float* y = dst + i * b.elements;
    switch (t) {
      case TensorType::F32:
        std::memcpy(y, s, 4);
        break;
      case TensorType::F16:
        *y = half(s);
        break;
      case TensorType::BF16: {
        uint16_t h;
        std::memcpy(&h, s, 2);
        *y = bf16_to_f32(h);
        break;
      }
      case TensorType::Q4_0:
        q4_0(s, y);
        break;
      case TensorType::Q4_1:
        q4_1(s, y);
        break;
      case TensorType::Q5_0:
        q5_0(s, y);
        break;
      case TensorType::Q5_1:
        q5_1(s, y);
        break;
      case TensorType::Q8_0:
        q8_0(s, y);
        break;
      case TensorType::Q4_K:
        q4_k(s, y);
        break;
      default:
        q6_k(s, y);
        break;
    }
  }
}

}  // namespace ds::io::gguf
