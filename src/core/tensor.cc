#include "core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <numeric>

namespace ds {

std::string_view device_name(Device d) { return d == Device::CPU ? "cpu" : "cuda"; }

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    DS_CHECK(d >= 0, "shape {} has a negative dimension", shape_str(s));
    DS_CHECK(!__builtin_mul_overflow(n, d, &n), "shape {} has more elements than fit in 64 bits", shape_str(s));
  }
  return n;
}

Shape Tensor::contiguous_strides(const Shape& shape) {
  Shape st(shape.size());
  int64_t acc = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    st[i] = acc;
    acc *= shape[i];
  }
  return st;
}

static void check_shape(const Shape& shape) {
  for (int64_t d : shape) DS_CHECK(d >= 0, "negative dimension in shape {}", shape_str(shape));
}

Tensor Tensor::empty(const Shape& shape, DType dtype) {
  check_shape(shape);
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  auto st = std::make_shared<Storage>();
  st->bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  size_t alloc = (st->bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, alloc ? alloc : 64);
  DS_CHECK(p != nullptr, "out of memory allocating {} bytes for a {} tensor {}", alloc, dtype_name(dtype),
           shape_str(shape));
  st->data = p;
  st->keepalive = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  t.storage_ = std::move(st);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  std::memset(t.storage_->data, 0, t.storage_->bytes);
  return t;
}

Tensor Tensor::borrow(void* data, const Shape& shape, DType dtype, std::shared_ptr<void> keepalive, Device device) {
  check_shape(shape);
  DS_CHECK(data != nullptr || shape_numel(shape) == 0, "borrowing a null pointer for shape {}", shape_str(shape));
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  auto st = std::make_shared<Storage>();
  st->data = data;
  st->bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  st->device = device;
  st->keepalive = std::move(keepalive);
  t.storage_ = std::move(st);
  return t;
}

Tensor Tensor::from_vector(const std::vector<float>& values, const Shape& shape) {
  DS_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape), "from_vector: {} values for shape {}",
           values.size(), shape_str(shape));
  Tensor t = empty(shape, DType::F32);
  std::memcpy(t.raw(), values.data(), values.size() * sizeof(float));
  return t;
}

int64_t Tensor::wrap_dim(int64_t dim) const {
  int64_t n = ndim();
  if (dim < 0) dim += n;
  DS_CHECK(dim >= 0 && dim < n, "dimension {} out of range for a tensor of shape {}", dim, shape_str(shape_));
  return dim;
}

int64_t Tensor::size(int64_t dim) const { return shape_[wrap_dim(dim)]; }

bool Tensor::is_contiguous() const {
  int64_t acc = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != acc) return false;
    acc *= shape_[i];
  }
  return true;
}

void* Tensor::raw() const {
  DS_CHECK(defined(), "access to an undefined tensor");
  return static_cast<char*>(storage_->data) + offset_ * static_cast<int64_t>(dtype_size(dtype_));
}

Tensor Tensor::narrow(int64_t dim, int64_t start, int64_t length) const {
  dim = wrap_dim(dim);
  DS_CHECK(start >= 0 && length >= 0 && start + length <= shape_[dim],
           "narrow(dim={}, start={}, length={}) out of range for shape {}", dim, start, length, shape_str(shape_));
  Tensor t = *this;
  t.offset_ += start * strides_[dim];
  t.shape_[dim] = length;
  return t;
}

Tensor Tensor::slice(int64_t dim, int64_t start, int64_t end, int64_t step) const {
  dim = wrap_dim(dim);
  DS_CHECK(step > 0, "slice step must be positive, got {}", step);
  DS_CHECK(start >= 0 && start <= end && end <= shape_[dim], "slice(dim={}, {}:{}) out of range for shape {}", dim,
           start, end, shape_str(shape_));
  Tensor t = *this;
  t.offset_ += start * strides_[dim];
  t.shape_[dim] = (end - start + step - 1) / step;
  t.strides_[dim] *= step;
  return t;
}

Tensor Tensor::select(int64_t dim, int64_t index) const {
  dim = wrap_dim(dim);
  DS_CHECK(index >= 0 && index < shape_[dim], "select index {} out of range for dim {} of shape {}", index, dim,
           shape_str(shape_));
  Tensor t = *this;
  t.offset_ += index * strides_[dim];
  t.shape_.erase(t.shape_.begin() + dim);
  t.strides_.erase(t.strides_.begin() + dim);
  return t;
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  d0 = wrap_dim(d0);
  d1 = wrap_dim(d1);
  Tensor t = *this;
  std::swap(t.shape_[d0], t.shape_[d1]);
  std::swap(t.strides_[d0], t.strides_[d1]);
  return t;
}

Tensor Tensor::permute(const std::vector<int64_t>& order) const {
  DS_CHECK(static_cast<int64_t>(order.size()) == ndim(), "permute order has {} entries for shape {}", order.size(),
           shape_str(shape_));
  std::vector<bool> seen(order.size(), false);
  Tensor t = *this;
  for (size_t i = 0; i < order.size(); ++i) {
    int64_t d = wrap_dim(order[i]);
    DS_CHECK(!seen[d], "permute order repeats dimension {}", d);
    seen[d] = true;
    t.shape_[i] = shape_[d];
    t.strides_[i] = strides_[d];
  }
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  int64_t infer = -1, known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      DS_CHECK(infer < 0, "reshape to {}: only one dimension may be -1", shape_str(shape));
      infer = static_cast<int64_t>(i);
    } else {
      DS_CHECK(shape[i] >= 0, "reshape to {}: negative dimension", shape_str(shape));
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    DS_CHECK(known > 0 && numel() % known == 0, "reshape of {} to {}: sizes do not divide", shape_str(shape_),
             shape_str(shape));
    shape[infer] = numel() / known;
  }
  DS_CHECK(shape_numel(shape) == numel(), "reshape of {} ({} elements) to {} ({} elements)", shape_str(shape_), numel(),
           shape_str(shape), shape_numel(shape));
  if (numel() == 0) {
    Tensor t = *this;
    t.strides_ = contiguous_strides(shape);
    t.shape_ = std::move(shape);
    return t;
  }
  // Dims of size 1 carry no layout information (their stride is never used to
  // reach an element), so they are dropped from the old shape first.
  Shape os, ost;
  for (size_t i = 0; i < shape_.size(); ++i) {
    if (shape_[i] != 1) {
      os.push_back(shape_[i]);
      ost.push_back(strides_[i]);
    }
  }
  // From the innermost dim outwards, old dims merge into chunks that are
  // contiguous among themselves (stride[k] == stride[k+1] * size[k+1]). Each
  // chunk must be covered exactly by a run of new dims, which then get strides
  // stepping through the chunk from its innermost stride `base`. A new dim that
  // would straddle two chunks cannot be expressed without a copy.
  const int64_t nn = static_cast<int64_t>(shape.size());
  Shape new_strides(shape.size(), 1);
  int64_t view_d = nn - 1;
  int64_t base = os.empty() ? 1 : ost.back();
  int64_t chunk_numel = 1, view_numel = 1;
  for (int64_t d = static_cast<int64_t>(os.size()) - 1; d >= 0; --d) {
    chunk_numel *= os[d];
    if (d > 0 && ost[d - 1] == chunk_numel * base) continue;  // chunk goes on
    while (view_d >= 0 && (view_numel < chunk_numel || shape[view_d] == 1)) {
      new_strides[view_d] = view_numel * base;
      view_numel *= shape[view_d];
      --view_d;
    }
    DS_CHECK(view_numel == chunk_numel, "reshape of {} (strides {}) to {} needs a copy; call contiguous() first",
             shape_str(shape_), shape_str(strides_), shape_str(shape));
    if (d > 0) {
      base = ost[d - 1];
      chunk_numel = view_numel = 1;
    }
  }
  // Whatever new dims remain are leading dims of size 1 (the element counts
  // match); their stride is irrelevant and stays 1.
  Tensor t = *this;
  t.shape_ = std::move(shape);
  t.strides_ = std::move(new_strides);
  return t;
}

// Visits every element offset of a strided view in logical (row-major) order.
template <typename F>
static void for_each_offset(const Shape& shape, const Shape& strides, F&& f) {
  const int64_t n = shape_numel(shape);
  if (n == 0) return;
  const size_t nd = shape.size();
  std::vector<int64_t> idx(nd, 0);
  int64_t off = 0;
  for (int64_t i = 0; i < n; ++i) {
    f(i, off);
    for (size_t d = nd; d-- > 0;) {
      if (++idx[d] < shape[d]) {
        off += strides[d];
        break;
      }
      off -= strides[d] * (shape[d] - 1);
      idx[d] = 0;
    }
  }
}

void Tensor::copy_from(const Tensor& src) {
  DS_CHECK(src.shape_ == shape_, "copy_from: shape {} into {}", shape_str(src.shape_), shape_str(shape_));
  DS_CHECK(device() == Device::CPU && src.device() == Device::CPU, "copy_from: only CPU tensors are copied here");
  DS_CHECK(src.dtype_ == dtype_ || (dtype_is_float(dtype_) && dtype_is_float(src.dtype_)),
           "copy_from: cannot convert {} to {}", dtype_name(src.dtype_), dtype_name(dtype_));
  if (numel() == 0) return;
  if (src.dtype_ == dtype_ && is_contiguous() && src.is_contiguous()) {
    std::memmove(raw(), src.raw(), nbytes());
    return;
  }
  const size_t es = dtype_size(dtype_), ss = dtype_size(src.dtype_);
  const size_t n = static_cast<size_t>(numel());
  // Gather the source into a dense buffer in logical order (also protects
  // against this view overlapping the source), convert in bulk, then scatter
  // into this view.
  std::vector<char> packed;
  const char* dense = static_cast<const char*>(src.raw());
  if (!src.is_contiguous() || src.dtype_ == dtype_) {
    packed.resize(n * ss);
    const char* sbase = static_cast<const char*>(src.raw());
    for_each_offset(src.shape_, src.strides_, [&](int64_t i, int64_t off) {
      std::memcpy(packed.data() + i * ss, sbase + off * static_cast<int64_t>(ss), ss);
    });
    dense = packed.data();
  }
  std::vector<char> converted;
  if (src.dtype_ != dtype_) {
    converted.resize(n * es);
    convert(converted.data(), dtype_, dense, src.dtype_, n);
    dense = converted.data();
  }
  char* dbase = static_cast<char*>(raw());
  if (is_contiguous()) {
    std::memcpy(dbase, dense, n * es);
    return;
  }
  for_each_offset(shape_, strides_, [&](int64_t i, int64_t off) {
    std::memcpy(dbase + off * static_cast<int64_t>(es), dense + i * es, es);
  });
}

Tensor Tensor::contiguous() const { return to(dtype_); }

Tensor Tensor::to(DType dtype) const {
  Tensor t = empty(shape_, dtype);
  t.copy_from(*this);
  return t;
}

std::vector<float> Tensor::to_vector() const {
  Tensor t = to(DType::F32);
  const float* p = t.data<float>();
  return std::vector<float>(p, p + t.numel());
}

}  // namespace ds
