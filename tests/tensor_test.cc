// Tests for Tensor: construction and ownership, views that share storage,
// reshape (against an independent oracle that decides from element offsets
// whether a view can express the new shape), copies across strides and dtypes,
// and the errors for bad dims, indices and dtypes.
#include "core/tensor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace ds {
namespace {
namespace tensor_test {

// 0, 1, 2, ... as a float32 tensor of `shape`.
Tensor iota(const Shape& shape) {
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  std::iota(v.begin(), v.end(), 0.0f);
  return Tensor::from_vector(v, shape);
}

// Element offsets (in elements, from the start of storage) of a view in
// logical row-major order, computed here from shape, strides and offset.
std::vector<int64_t> offsets(const Shape& shape, const Shape& strides, int64_t offset) {
  std::vector<int64_t> out;
  const int64_t n = shape_numel(shape);
  std::vector<int64_t> idx(shape.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = offset;
    for (size_t d = 0; d < shape.size(); ++d) off += idx[d] * strides[d];
    out.push_back(off);
    for (size_t d = shape.size(); d-- > 0;) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}
std::vector<int64_t> offsets(const Tensor& t) { return offsets(t.shape(), t.strides(), t.offset()); }

// Oracle: can a view with `shape` visit exactly these offsets in this order?
// Such a view exists iff the offset is an affine function of the index; the
// stride of each dim is then the step seen when that dim alone goes 0 -> 1.
bool expressible(const std::vector<int64_t>& offs, const Shape& shape) {
  if (offs.empty()) return true;
  Shape strides(shape.size(), 0);
  int64_t step = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] > 1) strides[d] = offs[static_cast<size_t>(step)] - offs[0];
    step *= shape[d];
  }
  return offsets(shape, strides, offs[0]) == offs;
}

std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Tensor, ShapeHelpers) {
  EXPECT_EQ(shape_str({2, 3}), "[2, 3]");
  EXPECT_EQ(shape_numel({2, 3, 4}), 24);
  EXPECT_EQ(shape_numel({}), 1);  // a scalar
  EXPECT_EQ(shape_numel({5, 0}), 0);
}

TEST(Tensor, ZerosAndEmpty) {
  Tensor z = Tensor::zeros({3, 4}, DType::F32);
  EXPECT_TRUE(z.defined());
  EXPECT_EQ(z.shape(), (Shape{3, 4}));
  EXPECT_EQ(z.strides(), (Shape{4, 1}));
  EXPECT_EQ(z.numel(), 12);
  EXPECT_EQ(z.nbytes(), 48u);
  EXPECT_TRUE(z.is_contiguous());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(z.raw()) % 64, 0u);  // 64-byte aligned storage
  for (float v : z.to_vector()) EXPECT_EQ(v, 0.0f);
  Tensor zb = Tensor::zeros({5}, DType::BF16);
  EXPECT_EQ(zb.nbytes(), 10u);
  for (float v : zb.to_vector()) EXPECT_EQ(v, 0.0f);
  Tensor e = Tensor::empty({2, 3, 5}, DType::I64);
  EXPECT_EQ(e.strides(), (Shape{15, 5, 1}));
  EXPECT_EQ(e.nbytes(), 240u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(e.raw()) % 64, 0u);
  EXPECT_THROW(Tensor::zeros({2, -1}, DType::F32), Error);
  EXPECT_FALSE(Tensor().defined());
  EXPECT_THROW(Tensor().raw(), Error);
}

TEST(Tensor, BorrowKeepsOwnerAliveThroughViews) {
  bool freed = false;
  std::vector<float> buf = {1, 2, 3, 4, 5, 6};
  auto keep = std::shared_ptr<void>(buf.data(), [&freed](void*) { freed = true; });
  Tensor view;
  {
    Tensor t = Tensor::borrow(buf.data(), {2, 3}, DType::F32, keep);
    keep.reset();
    EXPECT_EQ(t.raw(), buf.data());  // no copy
    view = t.transpose(0, 1).narrow(0, 1, 2);
    EXPECT_FALSE(freed);
  }
  EXPECT_FALSE(freed);  // only the view is left, and it pins the memory
  buf[4] = 50;          // writes to the owner are visible through the view
  EXPECT_EQ(view.to_vector(), (std::vector<float>{2, 50, 3, 6}));
  view = Tensor();
  EXPECT_TRUE(freed);

  EXPECT_THROW(Tensor::borrow(nullptr, {2}, DType::F32), Error);
  Tensor none = Tensor::borrow(nullptr, {0, 4}, DType::F32);  // empty: null is fine
  EXPECT_EQ(none.numel(), 0);
}

TEST(Tensor, FromVector) {
  Tensor t = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {3, 2});
  EXPECT_EQ(t.dtype(), DType::F32);
  EXPECT_EQ(t.data<float>()[3], 4.0f);
  EXPECT_EQ(t.to_vector(), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_THROW(Tensor::from_vector({1, 2, 3}, {2, 2}), Error);
}

TEST(Tensor, NarrowSliceSelectShareStorage) {
  Tensor x = iota({4, 5});
  const float* base = x.data<float>();

  Tensor n = x.narrow(1, 1, 3);  // [4, 3]
  EXPECT_TRUE(n.shares_storage_with(x));
  EXPECT_EQ(n.data<float>(), base + 1);
  EXPECT_EQ(n.shape(), (Shape{4, 3}));
  EXPECT_EQ(n.strides(), (Shape{5, 1}));
  EXPECT_EQ(n.to_vector(), (std::vector<float>{1, 2, 3, 6, 7, 8, 11, 12, 13, 16, 17, 18}));
  EXPECT_EQ(x.narrow(-2, 3, 1).to_vector(), (std::vector<float>{15, 16, 17, 18, 19}));

  Tensor rows = x.slice(0, 1, 4, 2);  // rows 1, 3: [2, 5]
  EXPECT_TRUE(rows.shares_storage_with(x));
  EXPECT_EQ(rows.data<float>(), base + 5);
  EXPECT_EQ(rows.strides(), (Shape{10, 1}));
  EXPECT_EQ(rows.to_vector(), (std::vector<float>{5, 6, 7, 8, 9, 15, 16, 17, 18, 19}));
  Tensor cols = x.slice(1, 0, 5, 2);  // cols 0, 2, 4: [4, 3]
  EXPECT_EQ(cols.shape(), (Shape{4, 3}));
  EXPECT_EQ(cols.strides(), (Shape{5, 2}));
  EXPECT_EQ(cols.to_vector(), (std::vector<float>{0, 2, 4, 5, 7, 9, 10, 12, 14, 15, 17, 19}));
  EXPECT_EQ(x.slice(1, 1, 5, 3).to_vector(), (std::vector<float>{1, 4, 6, 9, 11, 14, 16, 19}));  // 1:5:3 -> 1, 4

  Tensor col = x.select(1, 2);  // [4]
  EXPECT_TRUE(col.shares_storage_with(x));
  EXPECT_EQ(col.data<float>(), base + 2);
  EXPECT_EQ(col.strides(), (Shape{5}));
  EXPECT_EQ(col.to_vector(), (std::vector<float>{2, 7, 12, 17}));
  Tensor row = x.select(0, 3);
  EXPECT_EQ(row.data<float>(), base + 15);
  EXPECT_EQ(row.to_vector(), (std::vector<float>{15, 16, 17, 18, 19}));
  Tensor scalar = row.select(0, 4);  // 0-dim
  EXPECT_EQ(scalar.ndim(), 0);
  EXPECT_EQ(scalar.to_vector(), (std::vector<float>{19}));

  // Views of views compose offsets and strides; writes go to the shared storage.
  Tensor vv = x.slice(1, 1, 5, 2).narrow(0, 2, 2);  // rows 2,3 cols 1,3
  EXPECT_EQ(vv.to_vector(), (std::vector<float>{11, 13, 16, 18}));
  vv.data<float>()[0] = -1;
  EXPECT_EQ(x.to_vector()[11], -1.0f);
}

TEST(Tensor, TransposePermuteShareStorage) {
  Tensor x = iota({2, 3, 4});
  Tensor t = x.transpose(0, 2);  // [4, 3, 2]
  EXPECT_TRUE(t.shares_storage_with(x));
  EXPECT_EQ(t.raw(), x.raw());
  EXPECT_EQ(t.shape(), (Shape{4, 3, 2}));
  EXPECT_EQ(t.strides(), (Shape{1, 4, 12}));
  EXPECT_FALSE(t.is_contiguous());
  Tensor p = x.permute({2, 0, -2});  // [4, 2, 3]
  EXPECT_TRUE(p.shares_storage_with(x));
  EXPECT_EQ(p.shape(), (Shape{4, 2, 3}));
  auto tv = t.to_vector(), pv = p.to_vector();
  for (int64_t a = 0; a < 2; ++a)
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t c = 0; c < 4; ++c) {
        const float want = static_cast<float>(a * 12 + b * 4 + c);
        EXPECT_EQ(tv[c * 6 + b * 2 + a], want);
        EXPECT_EQ(pv[c * 6 + a * 3 + b], want);
      }
  EXPECT_THROW(x.permute({0, 1}), Error);
  EXPECT_THROW(x.permute({0, 1, 1}), Error);
  EXPECT_THROW(x.permute({0, 1, 3}), Error);
}

TEST(Tensor, ReshapeContiguous) {
  Tensor x = iota({2, 3, 4});
  Tensor r = x.reshape({6, 4});
  EXPECT_TRUE(r.shares_storage_with(x));
  EXPECT_EQ(r.raw(), x.raw());
  EXPECT_EQ(r.strides(), (Shape{4, 1}));
  EXPECT_EQ(r.to_vector(), x.to_vector());
  EXPECT_EQ(x.reshape({4, -1}).shape(), (Shape{4, 6}));
  EXPECT_EQ(x.reshape({-1}).shape(), (Shape{24}));
  EXPECT_EQ(x.reshape({1, -1, 1, 2}).shape(), (Shape{1, 12, 1, 2}));
  EXPECT_EQ(x.reshape({-1}).strides(), (Shape{1}));
  EXPECT_THROW(x.reshape({5, -1}), Error);   // 24 is not a multiple of 5
  EXPECT_THROW(x.reshape({-1, -1}), Error);  // only one inferred dim
  EXPECT_THROW(x.reshape({5, 5}), Error);    // element count differs
  EXPECT_THROW(x.reshape({-2, 12}), Error);
}

TEST(Tensor, ReshapeOfExpressibleViews) {
  Tensor x = iota({4, 5});
  // Narrow on the outer dim keeps rows whole: still one dense block.
  Tensor n = x.narrow(0, 1, 2).reshape({10});
  EXPECT_TRUE(n.shares_storage_with(x));
  EXPECT_EQ(n.data<float>(), x.data<float>() + 5);
  EXPECT_EQ(n.to_vector(), (std::vector<float>{5, 6, 7, 8, 9, 10, 11, 12, 13, 14}));
  // Narrow on the inner dim: rows can still be split or size-1 dims added.
  Tensor c = x.narrow(1, 0, 4).reshape({2, 2, 2, 2});
  EXPECT_EQ(c.strides(), (Shape{10, 5, 2, 1}));
  EXPECT_EQ(c.to_vector(), x.narrow(1, 0, 4).to_vector());

  // Transposes of size-1 dims change nothing in memory.
  Tensor y = iota({3, 1, 4});
  Tensor ty = y.transpose(0, 1);  // [1, 3, 4]
  EXPECT_TRUE(ty.is_contiguous());
  EXPECT_EQ(ty.reshape({12}).to_vector(), y.to_vector());
  EXPECT_EQ(ty.reshape({12}).raw(), y.raw());
  // A size-1 dim whose stride is arbitrary must not block the reshape.
  Tensor z = iota({2, 3}).reshape({2, 3, 1}).permute({0, 2, 1});  // [2, 1, 3]
  EXPECT_TRUE(z.is_contiguous());
  EXPECT_EQ(z.reshape({6}).to_vector(), (std::vector<float>{0, 1, 2, 3, 4, 5}));

  // Splitting the dims of a transposed matrix (each dim on its own).
  Tensor t = iota({4, 6}).transpose(0, 1);  // [6, 4] strides [1, 6]
  Tensor s = t.reshape({2, 3, 4});
  EXPECT_EQ(s.strides(), (Shape{3, 1, 6}));
  EXPECT_EQ(s.to_vector(), t.to_vector());
}

TEST(Tensor, ReshapeNeedingACopyThrowsWithHint) {
  Tensor x = iota({4, 5});
  const std::string msg = what_of([&] { x.narrow(1, 1, 3).reshape({-1}); });
  EXPECT_NE(msg.find("contiguous()"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4, 3]"), std::string::npos) << msg;  // names the shapes
  EXPECT_THROW(x.transpose(0, 1).reshape({20}), Error);
  EXPECT_THROW(iota({4, 3}).slice(0, 0, 4, 2).reshape({6}), Error);
  // Rows 0 and 2 of a [4, 1, 3]: offsets 0 1 2 6 7 8, not one stride apart,
  // even though the size-1 dim's stride (3) chains with the inner dim.
  Tensor g = iota({4, 1, 3}).slice(0, 0, 4, 2);
  EXPECT_EQ(g.strides(), (Shape{6, 3, 1}));
  EXPECT_THROW(g.reshape({6}), Error);
  // The copy path: contiguous() first, then reshape.
  EXPECT_EQ(g.contiguous().reshape({6}).to_vector(), (std::vector<float>{0, 1, 2, 6, 7, 8}));
}

// Factorizations of n into `parts` factors (including 1s), in order.
void factorizations(int64_t n, int parts, Shape& cur, std::vector<Shape>& out) {
  if (parts == 1) {
    cur.push_back(n);
    out.push_back(cur);
    cur.pop_back();
    return;
  }
  for (int64_t f = 1; f <= n; ++f) {
    if (n % f) continue;
    cur.push_back(f);
    factorizations(n / f, parts - 1, cur, out);
    cur.pop_back();
  }
}

TEST(Tensor, ReshapeAgreesWithOffsetOracle) {
  // Random views (permute, step slices, narrows, selects) of random shapes,
  // reshaped to every factorization of their size into 1..4 dims: reshape
  // must succeed exactly when the oracle says a view exists, and the view it
  // returns must visit the same storage offsets in the same order.
  std::mt19937 gen(1234);
  auto rnd = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(gen); };
  int succeeded = 0, refused = 0;
  for (int trial = 0; trial < 300; ++trial) {
    Shape shape(static_cast<size_t>(rnd(1, 4)));
    for (auto& d : shape) d = rnd(1, 4);
    Tensor v = iota(shape);
    for (int op = 0; op < 3; ++op) {
      const int64_t dim = rnd(0, v.ndim() - 1);
      switch (rnd(0, 3)) {
        case 0: {
          std::vector<int64_t> order(static_cast<size_t>(v.ndim()));
          std::iota(order.begin(), order.end(), 0);
          std::shuffle(order.begin(), order.end(), gen);
          v = v.permute(order);
          break;
        }
        case 1: {
          const int64_t start = rnd(0, v.size(dim) - 1);
          v = v.slice(dim, start, v.size(dim), rnd(1, 2));
          break;
        }
        case 2: {
          const int64_t start = rnd(0, v.size(dim) - 1);
          v = v.narrow(dim, start, rnd(1, v.size(dim) - start));
          break;
        }
        case 3:
          if (v.ndim() > 1) v = v.select(dim, rnd(0, v.size(dim) - 1));
          break;
      }
    }
    const auto offs = offsets(v);
    const auto values = v.to_vector();
    std::vector<Shape> targets;
    for (int parts = 1; parts <= 4; ++parts) {
      Shape cur;
      factorizations(v.numel(), parts, cur, targets);
    }
    for (const Shape& target : targets) {
      const bool can = expressible(offs, target);
      std::optional<Tensor> r;
      try {
        r = v.reshape(target);
      } catch (const Error&) {
      }
      ASSERT_EQ(r.has_value(), can) << "reshape " << shape_str(v.shape()) << " strides " << shape_str(v.strides())
                                    << " to " << shape_str(target);
      if (r) {
        ++succeeded;
        ASSERT_EQ(offsets(*r), offs) << shape_str(v.shape()) << " -> " << shape_str(target);
        ASSERT_TRUE(r->shares_storage_with(v));
        ASSERT_EQ(r->to_vector(), values);
      } else {
        ++refused;
      }
    }
  }
  // Both outcomes must actually occur for the comparison to mean anything.
  EXPECT_GT(succeeded, 100);
  EXPECT_GT(refused, 100);
}

TEST(Tensor, ContiguousOfTransposedView) {
  Tensor x = iota({2, 3});
  Tensor c = x.transpose(0, 1).contiguous();
  EXPECT_FALSE(c.shares_storage_with(x));
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.shape(), (Shape{3, 2}));
  EXPECT_EQ(c.strides(), (Shape{2, 1}));
  EXPECT_EQ(c.to_vector(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  // contiguous() always copies, even when already dense.
  EXPECT_FALSE(x.contiguous().shares_storage_with(x));
}

TEST(Tensor, ToBf16AndBack) {
  std::vector<float> v = {1.0f, -2.5f, 3.14159265f, 1e-3f, 65504.0f, 1.00390625f, -0.0f, 1e30f};
  Tensor x = Tensor::from_vector(v, {2, 4});
  Tensor b = x.to(DType::BF16);
  EXPECT_EQ(b.dtype(), DType::BF16);
  EXPECT_EQ(b.nbytes(), 16u);
  const auto* h = static_cast<const uint16_t*>(b.raw());
  Tensor back = b.to(DType::F32);
  auto got = back.to_vector();
  for (size_t i = 0; i < v.size(); ++i) {
    EXPECT_EQ(h[i], f32_to_bf16(v[i])) << i;
    EXPECT_EQ(got[i], bf16_to_f32(f32_to_bf16(v[i]))) << i;
    // bf16 keeps 8 significant bits, so rounding to nearest errs by at most
    // half an ulp: 2^-8 relative (reached by the tie 1 + 2^-8).
    EXPECT_LE(std::fabs(got[i] - v[i]), std::fabs(v[i]) * 0x1p-8f) << i;
  }
  // A strided view converts in logical order.
  Tensor bt = x.transpose(0, 1).to(DType::F16).to(DType::F32);
  EXPECT_EQ(bt.to_vector()[1], v[4] /* 65504 is exact in f16 */);
}

TEST(Tensor, CopyFromStridedAndAcrossDtypes) {
  // Source: transposed [3, 4] -> [4, 3]; destination: every other column of [4, 5].
  Tensor src = iota({3, 4}).transpose(0, 1);
  Tensor dst = Tensor::zeros({4, 5}, DType::F32);
  dst.slice(1, 0, 5, 2).copy_from(src);
  EXPECT_EQ(dst.to_vector(), (std::vector<float>{0, 0, 4, 0, 8, 1, 0, 5, 0, 9, 2, 0, 6, 0, 10, 3, 0, 7, 0, 11}));

  // Into a bf16 view from a float32 strided source: converted element by element.
  std::vector<float> vals = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f};
  Tensor f = Tensor::from_vector(vals, {2, 3});
  Tensor hb = Tensor::zeros({3, 4}, DType::BF16);
  hb.narrow(1, 1, 2).copy_from(f.transpose(0, 1));  // [3, 2]
  auto hv = hb.to_vector();
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 2; ++j)
      EXPECT_EQ(hv[static_cast<size_t>(i * 4 + 1 + j)], bf16_to_f32(f32_to_bf16(vals[static_cast<size_t>(j * 3 + i)])));
  // Strided bf16 -> strided e4m3.
  Tensor e = Tensor::zeros({2, 6}, DType::F8E4M3);
  e.slice(1, 0, 6, 2).copy_from(hb.narrow(1, 1, 2).transpose(0, 1));  // [2, 3]
  const auto* eb = static_cast<const uint8_t*>(e.raw());
  for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(eb[2 * j], f32_to_e4m3(hv[static_cast<size_t>(j * 4 + 1)]));

  // Overlapping source and destination: shift each row right by one.
  Tensor x = iota({2, 4});
  x.narrow(1, 1, 3).copy_from(x.narrow(1, 0, 3));
  EXPECT_EQ(x.to_vector(), (std::vector<float>{0, 0, 1, 2, 4, 4, 5, 6}));

  // Integer tensors copy within their own dtype, never across.
  std::vector<int32_t> iv = {1, 2, 3, 4, 5, 6};
  Tensor it = Tensor::borrow(iv.data(), {2, 3}, DType::I32);
  Tensor ic = Tensor::zeros({3, 2}, DType::I32);
  ic.copy_from(it.transpose(0, 1));
  EXPECT_EQ(ic.data<int32_t>()[1], 4);
  EXPECT_THROW(Tensor::zeros({2, 3}, DType::F32).copy_from(it), Error);
  EXPECT_THROW(it.to_vector(), Error);
  EXPECT_THROW(dst.copy_from(src), Error);  // [4, 3] into [4, 5]
}

TEST(Tensor, OutOfRangeDimsAndIndicesThrow) {
  Tensor x = iota({4, 5});
  EXPECT_THROW(x.size(2), Error);
  EXPECT_THROW(x.size(-3), Error);
  EXPECT_EQ(x.size(-1), 5);
  EXPECT_THROW(x.narrow(2, 0, 1), Error);
  EXPECT_THROW(x.narrow(1, 3, 3), Error);
  EXPECT_THROW(x.narrow(1, -1, 2), Error);
  EXPECT_THROW(x.narrow(1, 0, -1), Error);
  EXPECT_THROW(x.slice(0, 0, 5), Error);
  EXPECT_THROW(x.slice(0, 3, 2), Error);
  EXPECT_THROW(x.slice(0, 0, 4, 0), Error);
  EXPECT_THROW(x.slice(0, 0, 4, -1), Error);
  EXPECT_THROW(x.select(0, 4), Error);
  EXPECT_THROW(x.select(1, -1), Error);
  EXPECT_THROW(x.select(2, 0), Error);
  EXPECT_THROW(x.transpose(0, 2), Error);
  EXPECT_THROW(x.transpose(-3, 0), Error);
  const std::string msg = what_of([&] { x.narrow(1, 3, 3); });
  EXPECT_NE(msg.find("[4, 5]"), std::string::npos) << msg;
}

TEST(Tensor, DataWithWrongDtypeThrows) {
  Tensor b = Tensor::zeros({2}, DType::BF16);
  EXPECT_THROW(b.data<float>(), Error);
  Tensor i = Tensor::zeros({2}, DType::I32);
  EXPECT_NO_THROW(i.data<int32_t>());
  EXPECT_THROW(i.data<float>(), Error);
  EXPECT_THROW(i.data<uint32_t>(), Error);
  EXPECT_THROW(Tensor::zeros({2}, DType::F32).data<int64_t>(), Error);
  const std::string msg = what_of([&] { b.data<float>(); });
  EXPECT_NE(msg.find("bf16"), std::string::npos) << msg;
}

TEST(Tensor, ZeroSized) {
  Tensor z = Tensor::zeros({0, 3}, DType::F32);
  EXPECT_EQ(z.numel(), 0);
  EXPECT_EQ(z.nbytes(), 0u);
  EXPECT_TRUE(z.to_vector().empty());
  EXPECT_EQ(z.reshape({3, 0}).shape(), (Shape{3, 0}));
  EXPECT_EQ(z.reshape({0}).shape(), (Shape{0}));
  EXPECT_THROW(z.reshape({1}), Error);
  EXPECT_EQ(z.transpose(0, 1).contiguous().shape(), (Shape{3, 0}));
  EXPECT_EQ(z.to(DType::BF16).numel(), 0);
  Tensor x = iota({2, 3});
  EXPECT_EQ(x.narrow(1, 1, 0).numel(), 0);
  EXPECT_EQ(x.slice(1, 3, 3).shape(), (Shape{2, 0}));
  EXPECT_TRUE(x.slice(0, 2, 2).to_vector().empty());
  Tensor e = Tensor::empty({0}, DType::BF16);
  e.copy_from(Tensor::zeros({0}, DType::F32));
  EXPECT_EQ(Tensor::empty({4, 0, 2}, DType::F32).strides(), (Shape{0, 2, 1}));
}

TEST(Tensor, IsContiguous) {
  Tensor x = iota({3, 4});
  EXPECT_TRUE(x.is_contiguous());
  EXPECT_FALSE(x.transpose(0, 1).is_contiguous());
  EXPECT_TRUE(x.narrow(0, 1, 2).is_contiguous());
  EXPECT_FALSE(x.narrow(1, 1, 2).is_contiguous());
  EXPECT_TRUE(x.narrow(1, 1, 1).narrow(0, 0, 1).is_contiguous());  // a single element
  EXPECT_TRUE(x.select(0, 1).is_contiguous());
  EXPECT_FALSE(x.select(1, 1).is_contiguous());
  EXPECT_FALSE(x.slice(0, 0, 3, 2).is_contiguous());
  EXPECT_TRUE(iota({1, 4}).transpose(0, 1).reshape({4, 1}).is_contiguous());
  EXPECT_TRUE(x.reshape({2, 1, 6}).is_contiguous());
}

}  // namespace tensor_test
}  // namespace
}  // namespace ds
