// tether's CPU decode attention: one query token per sequence, fp32, over keys and values that each
// sequence holds contiguously (DecodeKV's slots, or a gather from the paged pool).
//
// out[s, h, g, :] = softmax_t(scale * q[s, h, g, :] . k[s, h, t, :]) @ v[s, h, t, :] over the keys
// t in [first_s, lengths[s]), first_s = lengths[s] - window when a sliding window is given.
//
// The two batched matmuls it replaces (q @ K^T, then softmax @ V) each stream K or V from memory
// with G (query heads per KV head, often 2-8) rows per matrix, where MKL reached about a third of the
// memory bandwidth (128 rows x 2 KV heads x 166 keys x 64 dims: 2.0-2.2 ms a layer against 0.87 ms to
// merely read K and V; AMD EPYC, 2 threads). Here each (sequence, KV head) is one task: its G score
// rows, their softmax and the weighted sum of values in one pass over K and one over V.
//
// Numerics: the same sums in another order (fp32; ~1e-7 relative to the matmul path), and the
// exponential of Cephes' expf (~1 ulp): std::exp does not vectorise without -ffast-math, and a
// scalar exp per score cost more than both matmuls.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// e^x for x <= 0 (a score minus its row's maximum). Below -87 it returns e^-87 (a weight under
// 2^-125 next to the maximum's 1); a NaN gives NaN (through r; n is kept finite for the int cast).
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);  // x = n ln2 + r, |r| <= ln2 / 2
  n = n >= -126.0f ? n : -126.0f;  // false for NaN: a finite n
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;  // ln2 in two parts, the first exact in few bits
  const float r2 = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r2 + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

constexpr int64_t kMaxGroup = 64;  // query heads per KV head

// One (sequence, KV head): q [G, D] (row g at q + g * D), keys at kb + t * kst + d * ksd (either
// stride 1), values at vb + t * vst + d; n keys from `first`. D_ > 0 fixes the head size at compile
// time (the common 64 and 128); 0 reads it from `d_rt`.
template <int64_t D_>
void attend_one(const float* __restrict q, const float* __restrict kb, int64_t kst, int64_t ksd,
                const float* __restrict vb, int64_t vst, int64_t first, int64_t n, int64_t G, int64_t d_rt,
                float scale, float* __restrict scores, float* __restrict acc, float* __restrict out) {
  const int64_t D = D_ > 0 ? D_ : d_rt;
  if (ksd == 1) {  // keys [C, D]: a dot product per (key, query head)
    for (int64_t t = 0; t < n; ++t) {
      const float* __restrict kt = kb + (first + t) * kst;
      for (int64_t g = 0; g < G; ++g) {
        const float* __restrict qg = q + g * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * kt[d];
        scores[g * n + t] = dot * scale;
      }
    }
  } else {  // keys [D, C]: a row of scores grows by one dimension at a time
    std::fill(scores, scores + G * n, 0.0f);
    for (int64_t d = 0; d < D; ++d) {
      const float* __restrict kd = kb + d * ksd + first * kst;
      for (int64_t g = 0; g < G; ++g) {
        const float qd = q[g * D + d] * scale;
        float* __restrict sg = scores + g * n;
#pragma omp simd
        for (int64_t t = 0; t < n; ++t) sg[t] += qd * kd[t];
      }
    }
  }
  float inv_total[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    float* __restrict sg = scores + g * n;
    float peak = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : peak)
    for (int64_t t = 0; t < n; ++t) peak = sg[t] > peak ? sg[t] : peak;
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < n; ++t) {
      const float w = exp_nonpositive(sg[t] - peak);
      sg[t] = w;
      total += w;
    }
    inv_total[g] = 1.0f / total;
  }
  std::fill(acc, acc + G * D, 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    const float* __restrict vt = vb + (first + t) * vst;
    for (int64_t g = 0; g < G; ++g) {
      const float w = scores[g * n + t];
      float* __restrict ag = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += w * vt[d];
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv_total[g];
  }
}

}  // namespace

// q [S, H, G, D]; k, v [S, H, C, D] (any strides with v's last and one of k's last two equal to 1);
// lengths [S] int64 (keys of each sequence, at most C); window 0 for none. -> [S, H, G, D].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor lengths,
                               double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: q, k, v must be 4-d");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && lengths.device().is_cpu(),
              "decode_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "decode_attention: fp32 q, k, v only");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.dim() == 1, "decode_attention: lengths [S] int64");
  const int64_t S = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3), C = k.size(2);
  TORCH_CHECK(k.size(0) == S && k.size(1) == H && k.size(3) == D && v.size(0) == S && v.size(1) == H &&
                  v.size(2) == C && v.size(3) == D && lengths.size(0) == S,
              "decode_attention: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ", lengths ",
              lengths.sizes(), " do not match");
  TORCH_CHECK(G <= kMaxGroup, "decode_attention: at most ", kMaxGroup, " query heads per KV head, got ", G);
  TORCH_CHECK(v.stride(3) == 1 && (k.stride(3) == 1 || k.stride(2) == 1),
              "decode_attention: values need unit stride over dims, keys over dims or tokens");
  q = q.contiguous();
  lengths = lengths.contiguous();
  auto out = torch::empty_like(q);
  if (S * H == 0 || G * D == 0) return out;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), kst = k.stride(2), ksd = k.stride(3);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vst = v.stride(2);
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, S * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * std::max<int64_t>(C, 1)), acc(G * D);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t s = idx / H, h = idx % H;
      const int64_t length = std::min<int64_t>(std::max<int64_t>(lp[s], 0), C);
      const int64_t first = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      const int64_t n = length - first;
      float* os = op + idx * G * D;
      if (n <= 0) {  // no key to attend to: zeros (the engine never asks for this)
        std::fill(os, os + G * D, 0.0f);
        continue;
      }
      const float* qs = qp + idx * G * D;
      const float* kb = kp + s * ks0 + h * ks1;
      const float* vb = vp + s * vs0 + h * vs1;
      if (D == 64) {
        attend_one<64>(qs, kb, kst, ksd, vb, vst, first, n, G, D, fscale, scores.data(), acc.data(), os);
      } else if (D == 128) {
        attend_one<128>(qs, kb, kst, ksd, vb, vst, first, n, G, D, fscale, scores.data(), acc.data(), os);
      } else {
        attend_one<0>(qs, kb, kst, ksd, vb, vst, first, n, G, D, fscale, scores.data(), acc.data(), os);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "fp32 CPU decode attention over per-sequence contiguous KV");
}
