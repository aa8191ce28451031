// tether's CPU attention kernel: one query token per row, fp32, over keys and values that each row
// reads contiguously (DecodeKV's slots, or a gather from the paged pool).
//
// out[s, h, g, :] = softmax_t(scale * q[s, h, g, :] . k[r, h, t, :]) @ v[r, h, t, :] over the keys
// t in [first_s, lengths[s]), first_s = lengths[s] - window when a sliding window is given, where
// r = kv_rows[s] (several query rows may read one sequence's keys: a prefill chunk's tokens), or
// r = s without kv_rows (decode: a row per sequence).
//
// The two batched matmuls it replaces (q @ K^T, then softmax @ V) each stream K or V from memory
// with G (query heads per KV head, often 2-8) rows per matrix, where MKL reached about a third of the
// memory bandwidth (128 rows x 2 KV heads x 166 keys x 64 dims: 2.0-2.2 ms a layer against 0.87 ms to
// merely read K and V; AMD EPYC, 2 threads). Here each (row, KV head) is one task: its G score rows,
// their softmax and the weighted sum of values in one pass over K and one over V.
//
// Numerics: the same sums in another order (fp32; ~1e-7 relative to the matmul path), and the
// exponential of Cephes' expf (~1 ulp): std::exp does not vectorise without -ffast-math, and a
// scalar exp per score cost more than both matmuls. Every sum runs in a fixed order that depends
// only on its length (kLanes partial sums, term i into lane i % kLanes, lanes added in a fixed tree),
// never on the compiler's vectorisation, the data's alignment, the thread or the other rows: a row's
// output is a function of its query, its keys and values and its length alone (the engine's batch
// invariance: a token attends to the same bits as a decode row, in a prefill chunk of any size, or in a
// speculative span).
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
constexpr int64_t kLanes = 8;  // partial sums of every reduction (one AVX2 vector of floats)

// The lanes' total, in a fixed tree.
inline float lanes_total(const float* lanes) {
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

// sum_i a[i] * b[i], term i into lane i % kLanes.
inline float dot_fixed(const float* __restrict a, const float* __restrict b, int64_t n) {
  float lanes[kLanes] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += a[i + j] * b[i + j];
  }
  for (int64_t j = 0; i + j < n; ++j) lanes[j] += a[i + j] * b[i + j];
  return lanes_total(lanes);
}

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
        scores[g * n + t] = dot_fixed(q + g * D, kt, D) * scale;
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
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) sg[t] = exp_nonpositive(sg[t] - peak);
    float lanes[kLanes] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int64_t t = 0;
    for (; t + kLanes <= n; t += kLanes) {
      for (int64_t j = 0; j < kLanes; ++j) lanes[j] += sg[t + j];
    }
    for (int64_t j = 0; t + j < n; ++j) lanes[j] += sg[t + j];
    inv_total[g] = 1.0f / lanes_total(lanes);
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

// q [S, H, G, D]; k, v [R, H, C, D] (any strides with v's last and one of k's last two equal to 1);
// lengths [S] int64 (keys of each row, at most C); window 0 for none; kv_rows [S] int64 in [0, R), or
// None for R = S and row s reading k[s], v[s]. -> [S, H, G, D].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor lengths,
                               double scale, int64_t window,
                               c10::optional<torch::Tensor> kv_rows_opt) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: q, k, v must be 4-d");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && lengths.device().is_cpu(),
              "decode_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "decode_attention: fp32 q, k, v only");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.dim() == 1, "decode_attention: lengths [S] int64");
  const int64_t S = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3), C = k.size(2), R = k.size(0);
  torch::Tensor kv_rows = kv_rows_opt.has_value() ? kv_rows_opt->contiguous() : torch::Tensor();
  const bool is_indexed = kv_rows.defined();
  TORCH_CHECK(!is_indexed || (kv_rows.device().is_cpu() && kv_rows.scalar_type() == at::kLong &&
                              kv_rows.dim() == 1 && kv_rows.size(0) == S),
              "decode_attention: kv_rows must be None or [S] int64 on the CPU");
  TORCH_CHECK((is_indexed || R == S) && k.size(1) == H && k.size(3) == D && v.size(0) == R && v.size(1) == H &&
                  v.size(2) == C && v.size(3) == D && lengths.size(0) == S,
              "decode_attention: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ", lengths ",
              lengths.sizes(), " do not match");
  TORCH_CHECK(G <= kMaxGroup, "decode_attention: at most ", kMaxGroup, " query heads per KV head, got ", G);
  TORCH_CHECK(v.stride(3) == 1 && (k.stride(3) == 1 || k.stride(2) == 1),
              "decode_attention: values need unit stride over dims, keys over dims or tokens");
  q = q.contiguous();
  lengths = lengths.contiguous();
  if (is_indexed) {
    const int64_t* rp = kv_rows.data_ptr<int64_t>();
    for (int64_t s = 0; s < S; ++s) {
      TORCH_CHECK(rp[s] >= 0 && rp[s] < R, "decode_attention: kv_rows[", s, "] = ", rp[s], " outside [0, ", R, ")");
    }
  }
  auto out = torch::empty_like(q);
  if (S * H == 0 || G * D == 0) return out;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* rp = is_indexed ? kv_rows.data_ptr<int64_t>() : nullptr;
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
      const int64_t r = is_indexed ? rp[s] : s;
      const float* kb = kp + r * ks0 + h * ks1;
      const float* vb = vp + r * vs0 + h * vs1;
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
  m.def("decode_attention", &decode_attention, "fp32 CPU attention, a query row at a time, over per-row contiguous KV",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("lengths"), pybind11::arg("scale"),
        pybind11::arg("window"), pybind11::arg("kv_rows") = pybind11::none());
}
