// Vector helpers shared by tether's CPU kernels (decode_attention.cpp, elementwise.cpp): eight floats
// as one GCC/Clang vector, loads, the lanes' fixed-order total and an exponential for x <= 0.
#pragma once

#include <cstdint>
#include <cstring>

namespace tether_simd {

constexpr int64_t kLanes = 8;  // partial sums of every reduction (one AVX2 vector of floats)

// The lanes' total, in a fixed tree.
inline float lanes_total(const float* lanes) {
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

// kLanes floats as one vector (GCC/Clang vector extension: AVX2 here, two NEON registers on Arm).
// a * b + c contracts to a fused multiply-add wherever the target has one, in vector and scalar
// code alike, so a lane computes exactly what the scalar expression does.
typedef float v8f __attribute__((vector_size(kLanes * sizeof(float))));

inline v8f load8(const float* p) {
  v8f x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline v8f load_part(const float* p, int64_t m) {  // the first m floats, zeros after
  v8f x = {};
  std::memcpy(&x, p, m * sizeof(float));
  return x;
}

typedef int32_t v8i __attribute__((vector_size(kLanes * sizeof(int32_t))));

// e^x for x <= 0 (a score minus its row's maximum), eight at a time: Cephes' expf polynomial (~1 ulp).
// Below -87 it returns e^-87 (a weight under 2^-125 next to the maximum's 1); a NaN gives NaN.
inline v8f exp8_nonpositive(v8f x) {
  const v8f zero = {};
  x = x < zero - 87.0f ? zero - 87.0f : x;
  v8f t = x * 1.44269504088896341f + 0.5f;  // x = n ln2 + r, n = floor(t), |r| <= ln2 / 2
  t = t == t ? t : zero;  // NaN: a finite n (x carries the NaN)
  v8f n = __builtin_convertvector(__builtin_convertvector(t, v8i), v8f);  // t toward zero
  n = n > t ? n - 1.0f : n;  // then down
  n = n >= zero - 126.0f ? n : zero - 126.0f;
  v8f r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;  // ln2 in two parts, the first exact in few bits
  const v8f r2 = r * r;
  v8f y = zero + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r2 + r + 1.0f;
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;  // 2^n
  v8f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// In place, x[t] -> exp(x[t] - peak) for the n floats at x (each <= peak, or NaN), by `exp` (an
// exponential for x <= 0, eight at a time); returns the lanes' partial totals, term t in lane
// t % kLanes. The last few are padded to a vector whose padded lanes exponentiate -87 (0 minus the
// peak could be +inf: an overflowing conversion to int inside the exponential) and count 0.
template <typename Exp>
inline v8f exponentiate_in_place(float* __restrict x, int64_t n, float peak, Exp exp) {
  v8f lanes = {};
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    const v8f e = exp(load8(x + t) - peak);
    std::memcpy(x + t, &e, sizeof(e));
    lanes += e;
  }
  if (t < n) {
    const int64_t m = n - t;
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const v8i is_real = lane < static_cast<int32_t>(m);
    const v8f zero = {};
    const v8f e = is_real ? exp(is_real ? load_part(x + t, m) - peak : zero - 87.0f) : zero;
    std::memcpy(x + t, &e, m * sizeof(float));
    lanes += e;
  }
  return lanes;
}

}  // namespace tether_simd
