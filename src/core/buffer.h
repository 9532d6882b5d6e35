// Scratch buffers for hot paths: a std::vector whose elements are left
// uninitialised on construction and resize, for storage every element of
// which is written before it is read. Spares a memset of every activation
// buffer on every step.
#pragma once

#include <memory>
#include <vector>

namespace ds {

template <typename T, typename A = std::allocator<T>>
class DefaultInitAllocator : public A {
  using traits = std::allocator_traits<A>;

 public:
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U, typename traits::template rebind_alloc<U>>;
  };
  using A::A;
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;  // default-initialisation: no zeroing for arithmetic types
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    traits::construct(static_cast<A&>(*this), p, std::forward<Args>(args)...);
  }
};

template <typename T>
using Buffer = std::vector<T, DefaultInitAllocator<T>>;

}  // namespace ds
