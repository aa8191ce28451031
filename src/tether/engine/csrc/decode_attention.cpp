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
// their softmax and the weighted sum of values in one pass over K and one over V. Consecutive rows
// that read one sequence (a prefill chunk's queries) go up to kMaxBlock to a
// task and share those passes: eight keys at a time against every query vector of the block, then
// chunks of values every row reads while they sit in L1. A 3,000-token prompt's attention ran 1.7x
// faster that way than a row at a time (1 thread); end to end the engine's prefill then ran at 0.87-1.04x
// a transformers forward (500-3,000 tokens), faster than its own SDPA path from 1,500 tokens on.
//
// Numerics: the same sums in another order (fp32; ~1e-7 relative to the matmul path), and the
// exponential of Cephes' expf (~1 ulp), eight at a time: std::exp does not vectorise without
// -ffast-math. Every sum runs in a fixed order that depends only on its length (a dot product and a
// softmax total: kLanes partial sums, term i into lane i % kLanes, lanes added in a fixed tree; a
// weighted sum of values: key by key), never on the compiler's vectorisation, the data's alignment,
// the thread, the block or the other rows: a row's output is a function of its query, its keys and
// values and its length alone (the engine's batch invariance: a token attends to the same bits as a
// decode row, in a prefill chunk of any size, or in a speculative span).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

using namespace tether_simd;

constexpr int64_t kMaxGroup = 64;  // query heads per KV head
constexpr int64_t kMaxBlock = 16;  // query rows of one sequence that share a pass over its keys
constexpr int64_t kMaxBlockScores = int64_t{1} << 22;  // a block's scores (16 MB); past it, fewer rows
constexpr int64_t kValueChunk = 64;  // keys whose values stay in L1 while every query of a block reads them

#if defined(__clang__) || __GNUC__ >= 12
#define TETHER_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define TETHER_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, v8i{__VA_ARGS__})
#endif

// Eight lane vectors -> their eight totals, each lanes_total's tree: ((l0 + l4) + (l2 + l6)) +
// ((l1 + l5) + (l3 + l7)) (an addition's operands may swap: it is commutative, bit for bit).
inline v8f totals8(v8f a0, v8f a1, v8f a2, v8f a3, v8f a4, v8f a5, v8f a6, v8f a7) {
  // b_k[j] = a_k[j] + a_k[j + 4], two keys a vector
  const v8f p0 = TETHER_SHUFFLE(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) + TETHER_SHUFFLE(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8f p1 = TETHER_SHUFFLE(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) + TETHER_SHUFFLE(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8f p2 = TETHER_SHUFFLE(a4, a5, 0, 1, 2, 3, 8, 9, 10, 11) + TETHER_SHUFFLE(a4, a5, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8f p3 = TETHER_SHUFFLE(a6, a7, 0, 1, 2, 3, 8, 9, 10, 11) + TETHER_SHUFFLE(a6, a7, 4, 5, 6, 7, 12, 13, 14, 15);
  // c_k = (b_k[0] + b_k[2], b_k[1] + b_k[3]), four keys a vector
  const v8f c0 = TETHER_SHUFFLE(p0, p1, 0, 1, 4, 5, 8, 9, 12, 13) + TETHER_SHUFFLE(p0, p1, 2, 3, 6, 7, 10, 11, 14, 15);
  const v8f c1 = TETHER_SHUFFLE(p2, p3, 0, 1, 4, 5, 8, 9, 12, 13) + TETHER_SHUFFLE(p2, p3, 2, 3, 6, 7, 10, 11, 14, 15);
  // c_k[0] + c_k[1]
  return TETHER_SHUFFLE(c0, c1, 0, 2, 4, 6, 8, 10, 12, 14) + TETHER_SHUFFLE(c0, c1, 1, 3, 5, 7, 9, 11, 13, 15);
}

// q . keys[i] for eight keys: dimension d into lane d % kLanes (fused multiply-adds in order of d),
// then the lanes' fixed tree. Eight independent sums, so the multiply-adds do not wait on each other.
template <int64_t D_>
inline v8f dot8(const float* __restrict q, const float* const* keys, int64_t d_rt) {
  const int64_t D = D_ > 0 ? D_ : d_rt;
  v8f a0 = {}, a1 = {}, a2 = {}, a3 = {}, a4 = {}, a5 = {}, a6 = {}, a7 = {};
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes) {
    const v8f qi = load8(q + i);
    a0 += qi * load8(keys[0] + i);
    a1 += qi * load8(keys[1] + i);
    a2 += qi * load8(keys[2] + i);
    a3 += qi * load8(keys[3] + i);
    a4 += qi * load8(keys[4] + i);
    a5 += qi * load8(keys[5] + i);
    a6 += qi * load8(keys[6] + i);
    a7 += qi * load8(keys[7] + i);
  }
  if (i < D) {  // the last D % kLanes dimensions; the other lanes add 0 * 0
    const int64_t m = D - i;
    const v8f qi = load_part(q + i, m);
    a0 += qi * load_part(keys[0] + i, m);
    a1 += qi * load_part(keys[1] + i, m);
    a2 += qi * load_part(keys[2] + i, m);
    a3 += qi * load_part(keys[3] + i, m);
    a4 += qi * load_part(keys[4] + i, m);
    a5 += qi * load_part(keys[5] + i, m);
    a6 += qi * load_part(keys[6] + i, m);
    a7 += qi * load_part(keys[7] + i, m);
  }
  return totals8(a0, a1, a2, a3, a4, a5, a6, a7);
}

// Scores of NQ query vectors (qs, D floats apart) against keys [t0, t1) at kb + t * kst (keys [C, D]),
// times scale: vector v's score for key t at scores[v * ns + t - t0]. Keys go eight at a time, each
// group read once for every query vector; a last group of fewer is copied into `pad` (8 * D floats,
// zeros past it). A score depends on its query and key alone, never on the group or the other queries.
template <int64_t D_>
void score_keys(const float* __restrict qs, int64_t NQ, const float* __restrict kb, int64_t kst, int64_t t0,
                int64_t t1, int64_t d_rt, float scale, float* __restrict scores, int64_t ns, float* __restrict pad) {
  const int64_t D = D_ > 0 ? D_ : d_rt;
  const float* keys[kLanes];
  for (int64_t t = t0; t < t1; t += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, t1 - t);
    if (m == kLanes) {
      for (int64_t i = 0; i < kLanes; ++i) keys[i] = kb + (t + i) * kst;
    } else {
      std::fill(pad, pad + kLanes * D, 0.0f);
      for (int64_t i = 0; i < kLanes; ++i) {
        if (i < m) std::memcpy(pad + i * D, kb + (t + i) * kst, D * sizeof(float));
        keys[i] = pad + i * D;
      }
    }
    for (int64_t v = 0; v < NQ; ++v) {
      const v8f s = dot8<D_>(qs + v * D, keys, D) * scale;
      if (m == kLanes) {
        std::memcpy(scores + v * ns + (t - t0), &s, sizeof(s));
      } else {
        for (int64_t i = 0; i < m; ++i) scores[v * ns + (t - t0) + i] = s[i];
      }
    }
  }
}

// In place, the n scores of one query vector -> exp(score - max); returns 1 / their total (lanes in a
// fixed order: term t into lane t % kLanes). Every score goes through exp8_nonpositive, the last few
// padded to a vector.
inline float exponentiate(float* __restrict sg, int64_t n) {
  float peak = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : peak)
  for (int64_t t = 0; t < n; ++t) peak = sg[t] > peak ? sg[t] : peak;
  const v8f lanes = exponentiate_in_place(sg, n, peak, [](v8f x) { return exp8_nonpositive(x); });
  float totals[kLanes];
  std::memcpy(totals, &lanes, sizeof(totals));
  return 1.0f / lanes_total(totals);
}

// acc[d] += w[i] * v_i[d] for the n values v_i at vb + i * vst, in order of i: each acc[d] a chain of
// fused multiply-adds, the same bits however a row's keys are cut into calls.
template <int64_t D_>
inline void accumulate(float* __restrict acc, const float* __restrict w, const float* __restrict vb, int64_t vst,
                       int64_t n, int64_t d_rt) {
  const int64_t D = D_ > 0 ? D_ : d_rt;
  int64_t d0 = 0;
  for (; d0 + 8 * kLanes <= D; d0 += 8 * kLanes) {  // 64 dimensions in eight registers
    v8f a[8];
    for (int64_t j = 0; j < 8; ++j) a[j] = load8(acc + d0 + j * kLanes);
    for (int64_t i = 0; i < n; ++i) {
      const float* __restrict vi = vb + i * vst + d0;
      const float wi = w[i];
      for (int64_t j = 0; j < 8; ++j) a[j] += wi * load8(vi + j * kLanes);
    }
    std::memcpy(acc + d0, a, sizeof(a));
  }
  for (; d0 + kLanes <= D; d0 += kLanes) {  // then eight at a time
    v8f a = load8(acc + d0);
    for (int64_t i = 0; i < n; ++i) a += w[i] * load8(vb + i * vst + d0);
    std::memcpy(acc + d0, &a, sizeof(a));
  }
  if (d0 < D) {
    for (int64_t i = 0; i < n; ++i) {
      const float* __restrict vi = vb + i * vst;
      const float wi = w[i];
      for (int64_t d = d0; d < D; ++d) acc[d] += wi * vi[d];
    }
  }
}

// Per-thread buffers of attend_block.
struct Scratch {
  std::vector<float> scores, acc, pad, queries;
  float inv_total[kMaxBlock * kMaxGroup];
};

// B query rows of one sequence and KV head (keys [C, D]): row b's G query vectors at qs + b * qstride,
// attending keys [first[b], length[b]); output row b at os + b * qstride. The rows share each pass
// over the keys and values; every row's numbers are those it gets alone (B = 1, a decode row).
template <int64_t D_>
void attend_block(const float* __restrict qs, int64_t qstride, int64_t B, int64_t G, const int64_t* first,
                  const int64_t* length, const float* __restrict kb, int64_t kst, const float* __restrict vb,
                  int64_t vst, int64_t d_rt, float scale, Scratch& scratch, float* __restrict os) {
  const int64_t D = D_ > 0 ? D_ : d_rt;
  int64_t t0 = std::numeric_limits<int64_t>::max(), t1 = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (length[b] > first[b]) {
      t0 = std::min(t0, first[b]);
      t1 = std::max(t1, length[b]);
    }
  }
  if (t1 == 0) {  // no key to attend to: zeros (the engine never asks for this)
    for (int64_t b = 0; b < B; ++b) std::fill(os + b * qstride, os + b * qstride + G * D, 0.0f);
    return;
  }
  const int64_t ns = t1 - t0, NQ = B * G;
  if (static_cast<int64_t>(scratch.scores.size()) < NQ * ns) scratch.scores.resize(NQ * ns);
  if (static_cast<int64_t>(scratch.acc.size()) < NQ * D) scratch.acc.resize(NQ * D);
  if (static_cast<int64_t>(scratch.pad.size()) < kLanes * D) scratch.pad.resize(kLanes * D);
  float* scores = scratch.scores.data();
  float* acc = scratch.acc.data();
  // The query vectors side by side ([B * G, D]), as score_keys reads them.
  const float* queries = qs;
  if (B > 1 && qstride != G * D) {
    if (static_cast<int64_t>(scratch.queries.size()) < NQ * D) scratch.queries.resize(NQ * D);
    for (int64_t b = 0; b < B; ++b) {
      std::memcpy(scratch.queries.data() + b * G * D, qs + b * qstride, G * D * sizeof(float));
    }
    queries = scratch.queries.data();
  }
  score_keys<D_>(queries, NQ, kb, kst, t0, t1, D, scale, scores, ns, scratch.pad.data());
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = length[b] - first[b];
    for (int64_t g = 0; g < G; ++g) {
      const int64_t v = b * G + g;
      scratch.inv_total[v] = n > 0 ? exponentiate(scores + v * ns + (first[b] - t0), n) : 0.0f;
    }
  }
  std::fill(acc, acc + NQ * D, 0.0f);
  for (int64_t ta = t0; ta < t1; ta += kValueChunk) {  // values in chunks every row reads while cached
    const int64_t tb = std::min(t1, ta + kValueChunk);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t lo = std::max(ta, first[b]), hi = std::min(tb, length[b]);
      if (lo >= hi) continue;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t v = b * G + g;
        accumulate<D_>(acc + v * D, scores + v * ns + (lo - t0), vb + lo * vst, vst, hi - lo, D);
      }
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    float* ob = os + b * qstride;
    if (length[b] <= first[b]) {
      std::fill(ob, ob + G * D, 0.0f);
      continue;
    }
    for (int64_t g = 0; g < G; ++g) {
      const int64_t v = b * G + g;
      for (int64_t d = 0; d < D; ++d) ob[g * D + d] = acc[v * D + d] * scratch.inv_total[v];
    }
  }
}

// One (sequence, KV head) over keys held transposed ([D, C]: kb + d * ksd + t): q [G, D], n keys from
// `first`. A row of scores grows by one dimension at a time; then exponentiate and accumulate as above.
template <int64_t D_>
void attend_transposed(const float* __restrict q, const float* __restrict kb, int64_t kst, int64_t ksd,
                       const float* __restrict vb, int64_t vst, int64_t first, int64_t n, int64_t G, int64_t d_rt,
                       float scale, Scratch& scratch, float* __restrict out) {
  const int64_t D = D_ > 0 ? D_ : d_rt;
  if (static_cast<int64_t>(scratch.scores.size()) < G * n) scratch.scores.resize(G * n);
  if (static_cast<int64_t>(scratch.acc.size()) < G * D) scratch.acc.resize(G * D);
  float* scores = scratch.scores.data();
  float* acc = scratch.acc.data();
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
  std::fill(acc, acc + G * D, 0.0f);
  for (int64_t g = 0; g < G; ++g) {
    const float inv_total = exponentiate(scores + g * n, n);
    accumulate<D_>(acc + g * D, scores + g * n, vb + first * vst, vst, n, D);
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv_total;
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
  // Each row's keys [first, length): the window's start, or 0.
  std::vector<int64_t> firsts(S), lens(S);
  for (int64_t s = 0; s < S; ++s) {
    lens[s] = std::min<int64_t>(std::max<int64_t>(lp[s], 0), C);
    firsts[s] = window > 0 ? std::max<int64_t>(0, lens[s] - window) : 0;
  }
  // Blocks: runs of up to kMaxBlock consecutive rows that read the same sequence (a prefill chunk's
  // query rows), fewer where their scores would pass kMaxBlockScores; a decode row is a block of its own.
  std::vector<int64_t> starts;
  int64_t lo = 0, hi = 0;  // the current block's keys [lo, hi)
  for (int64_t s = 0; s < S; ++s) {
    const int64_t new_lo = std::min(lo, firsts[s]), new_hi = std::max(hi, lens[s]);
    const bool is_same = is_indexed && s > 0 && rp[s] == rp[s - 1] && s - starts.back() < kMaxBlock &&
                         (s - starts.back() + 1) * G * (new_hi - new_lo) <= kMaxBlockScores;
    if (is_same) {
      lo = new_lo;
      hi = new_hi;
    } else {
      starts.push_back(s);
      lo = firsts[s];
      hi = lens[s];
    }
  }
  const int64_t num_blocks = static_cast<int64_t>(starts.size());
  starts.push_back(S);
  const bool is_by_token = ksd == 1;  // keys [C, D]; else held transposed [D, C] (a row at a time)
  at::parallel_for(0, num_blocks * H, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t block = idx / H, h = idx % H;
      const int64_t s0 = starts[block], B = starts[block + 1] - s0;
      const int64_t r = is_indexed ? rp[s0] : s0;
      const float* kb = kp + r * ks0 + h * ks1;
      const float* vb = vp + r * vs0 + h * vs1;
      const float* qs = qp + (s0 * H + h) * G * D;
      float* os = op + (s0 * H + h) * G * D;
      if (is_by_token) {
        const int64_t* fb = firsts.data() + s0;
        const int64_t* lb = lens.data() + s0;
        if (D == 64) {
          attend_block<64>(qs, H * G * D, B, G, fb, lb, kb, kst, vb, vst, D, fscale, scratch, os);
        } else if (D == 128) {
          attend_block<128>(qs, H * G * D, B, G, fb, lb, kb, kst, vb, vst, D, fscale, scratch, os);
        } else {
          attend_block<0>(qs, H * G * D, B, G, fb, lb, kb, kst, vb, vst, D, fscale, scratch, os);
        }
        continue;
      }
      for (int64_t b = 0; b < B; ++b) {  // transposed keys: a row at a time
        const int64_t s = s0 + b, first = firsts[s], n = lens[s] - first;
        const float* qb = qs + b * H * G * D;
        float* ob = os + b * H * G * D;
        if (n <= 0) {
          std::fill(ob, ob + G * D, 0.0f);
        } else if (D == 64) {
          attend_transposed<64>(qb, kb, kst, ksd, vb, vst, first, n, G, D, fscale, scratch, ob);
        } else if (D == 128) {
          attend_transposed<128>(qb, kb, kst, ksd, vb, vst, first, n, G, D, fscale, scratch, ob);
        } else {
          attend_transposed<0>(qb, kb, kst, ksd, vb, vst, first, n, G, D, fscale, scratch, ob);
        }
      }
    }
  });
  return out;
}

// The extension's Python module: this kernel and elementwise.cpp's (built into one library by
// tether.engine.native).
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up);
torch::Tensor sampling_weights(torch::Tensor logits, double temperature, int64_t chunk);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "fp32 CPU attention, a query row at a time, over per-row contiguous KV",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("lengths"), pybind11::arg("scale"),
        pybind11::arg("window"), pybind11::arg("kv_rows") = pybind11::none());
  m.def("silu_mul", &silu_mul, "silu(gate) * up, fp32, every element by the same vector code",
        pybind11::arg("gate"), pybind11::arg("up"));
  m.def("sampling_weights", &sampling_weights, "in place exp(x / t - max) per row; returns chunk sums",
        pybind11::arg("logits"), pybind11::arg("temperature"), pybind11::arg("chunk"));
}
