// Where a tensor's memory lives. Kept apart from core/tensor.h so that
// device code (ops/cuda/, compiled by nvcc) can name devices without the
// library's formatting headers.
#pragma once

#include <cstdint>
#include <string_view>

namespace ds {

enum class Device : uint8_t { CPU, CUDA };
std::string_view device_name(Device d);

}  // namespace ds
