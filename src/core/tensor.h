// Tensor: a typed, strided view over a block of storage.
//
// Storage is shared (a Tensor is a cheap handle) and either owned (allocated
// here, 64-byte aligned) or borrowed (someone else's memory, e.g. an mmapped
// checkpoint, kept alive by an opaque handle). Views (slice, narrow, reshape,
// transpose, permute) share the storage and never copy. Strides are counted in
// elements.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"

namespace ds {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

struct Storage {
  void* data = nullptr;
  size_t bytes = 0;
  Device device = Device::CPU;
  std::shared_ptr<void> keepalive;  // frees (owned) or pins (borrowed) the memory
};

class Tensor {
 public:
  Tensor() = default;

  // New zero-filled CPU tensor.
  static Tensor zeros(const Shape& shape, DType dtype);
  // New CPU tensor with unspecified contents.
  static Tensor empty(const Shape& shape, DType dtype);
  // Wraps memory owned elsewhere; `keepalive` (may be null) is held as long as
  // any view of this tensor lives. The memory must hold numel * dtype_size bytes.
  static Tensor borrow(void* data, const Shape& shape, DType dtype,
                       std::shared_ptr<void> keepalive = nullptr, Device device = Device::CPU);
  // A float32 tensor holding a copy of `values`.
  static Tensor from_vector(const std::vector<float>& values, const Shape& shape);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device : Device::CPU; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t ndim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t dim) const;
  int64_t numel() const { return shape_numel(shape_); }
  int64_t offset() const { return offset_; }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;
  bool shares_storage_with(const Tensor& other) const { return storage_ == other.storage_; }

  // Pointer to the first element of this view.
  void* raw() const;
  template <typename T>
  T* data() const {
    DS_CHECK(dtype_of<T>() == dtype_, "tensor data<{}>() on a {} tensor of shape {}",
             dtype_name(dtype_of<T>()), dtype_name(dtype_), shape_str(shape_));
    return static_cast<T*>(raw());
  }

  // Views. Negative dims count from the end.
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int64_t dim, int64_t index) const;  // drops `dim`
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor permute(const std::vector<int64_t>& order) const;
  // Reshape without a copy; one dimension may be -1. Fails (with a hint to call
  // contiguous()) when the strides cannot express the new shape.
  Tensor reshape(Shape shape) const;

  // Dense copy (always a new storage), optionally converting the dtype.
  Tensor contiguous() const;
  Tensor to(DType dtype) const;
  // Copies `src` (same shape, any strides and floating dtype) into this view.
  void copy_from(const Tensor& src);

  std::vector<float> to_vector() const;  // float32 values in logical order

 private:
  std::shared_ptr<Storage> storage_;
  DType dtype_ = DType::F32;
  Shape shape_, strides_;
  int64_t offset_ = 0;  // in elements

  int64_t wrap_dim(int64_t dim) const;
  static Shape contiguous_strides(const Shape& shape);
};

}  // namespace ds
