// Loads of the cache's element types as float, shared by the CPU attention kernels.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }
