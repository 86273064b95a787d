// The vectorisable tanh of the compiled kernels (embedding.cpp, fitting.cpp), one per
// precision: written so that the compiler turns the loops that call it into vector code (with
// -fno-trapping-math, see build.py).
#pragma once

#include <cstdint>
#include <cstring>

namespace {

// tanh(x) = 1 − 2/(1 + e^{2x}) with e^y = 2^k·p(r), |r| ≤ ln2/2, p of degree 13 (error below
// double rounding); written so that the compiler vectorises it. Absolute error ~1e-16.
inline double tanh_of(double x) {
  double y = 2.0 * x;
  y = y < -40.0 ? -40.0 : (y > 40.0 ? 40.0 : y);
  const double shift = 6755399441055744.0;  // 1.5·2^52: the rounded k lands in the low bits
  double big = y * 1.4426950408889634 + shift;
  double k = big - shift;
  double r = (y - k * 0.693147180369123816490) - k * 1.90821492927058770002e-10;
  double p = 1.0 / 6227020800.0;
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  std::uint64_t bits;
  std::memcpy(&bits, &big, 8);
  bits = (bits << 52) + (std::uint64_t(1023) << 52);
  double scale;
  std::memcpy(&scale, &bits, 8);
  return 1.0 - 2.0 / (p * scale + 1.0);
}

// The same in single precision (degree 7, error below float rounding).
inline float tanh_of(float x) {
  float y = 2.0f * x;
  y = y < -20.0f ? -20.0f : (y > 20.0f ? 20.0f : y);
  const float shift = 12582912.0f;  // 1.5·2^23
  float big = y * 1.44269504f + shift;
  float k = big - shift;
  float r = (y - k * 0.693359375f) + k * 2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  std::uint32_t bits;
  std::memcpy(&bits, &big, 4);
  bits = (bits << 23) + (std::uint32_t(127) << 23);
  float scale;
  std::memcpy(&scale, &bits, 4);
  return 1.0f - 2.0f / (p * scale + 1.0f);
}

}  // namespace
