#include "core/held.h"

#include <algorithm>
#include <bit>

#include "core/dtype.h"
#include "core/error.h"

namespace ds {

void HeldFloats::keep(const float* x, int64_t n, bool bf16) {
  DS_CHECK(n >= 0 && (n == 0 || x), "HeldFloats: bad tensor ({} values)", n);
  *this = HeldFloats{};
  n_ = n;
  if (!bf16) {
    f32_.assign(x, x + n);
    return;
  }
  const int64_t bad = std::find_if(x, x + n, [](float v) { return (std::bit_cast<uint32_t>(v) & 0xffffu) != 0; }) - x;
  DS_CHECK(bad == n, "internal: value {} of a tensor held in bf16 is not a bf16 value ({})", bad, x[bad]);
  bf16_.resize(static_cast<size_t>(n));
  convert(bf16_.data(), DType::BF16, x, DType::F32, static_cast<size_t>(n));
}

void HeldFloats::take(Buffer<float>&& b, bool bf16) {
  if (bf16) {
    keep(b.data(), static_cast<int64_t>(b.size()), true);
    Buffer<float>().swap(b);
    return;
  }
  *this = HeldFloats{};
  n_ = static_cast<int64_t>(b.size());
  f32_ = std::move(b);
}

const float* HeldFloats::values(Buffer<float>& scratch) const {
  if (bf16_.empty()) return f32_.data();
  scratch.resize(static_cast<size_t>(n_));
  convert(scratch.data(), DType::F32, bf16_.data(), DType::BF16, static_cast<size_t>(n_));
  return scratch.data();
}

void hold_bf16(std::span<Buffer<float>* const> buffers, std::span<HeldFloats> held) {
  DS_CHECK(buffers.size() == held.size(), "internal: {} buffers to hold in {} places", buffers.size(), held.size());
  for (size_t i = 0; i < buffers.size(); ++i)
    if (!buffers[i]->empty()) held[i].take(std::move(*buffers[i]), true);
}

void widen(std::span<Buffer<float>* const> buffers, std::span<HeldFloats> held) {
  DS_CHECK(buffers.size() == held.size(), "internal: {} buffers to widen from {} places", buffers.size(), held.size());
  Buffer<float> wide;
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (held[i].empty()) continue;
    const float* v = held[i].values(wide);
    buffers[i]->assign(v, v + held[i].size());
    held[i].clear();
  }
}

}  // namespace ds
