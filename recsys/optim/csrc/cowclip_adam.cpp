// Fused CowClip-Adam backward+update for one pooled-sum embedding table (CPU).
//
// recsys::cowclip_adam_step_ performs, in place, exactly the update of
//   recsys.optim.cowclip.cowclip_adam_step(weight, state, indices, offsets, grad_output, psw,
//       update_scope="batch", l2_scope="batch", bias_correction="row", eps_mode=...)
// except for state.step (a 0-dim counter the Python wrapper increments):
//
//   1. (row, occurrence) pairs are radix-sorted by row (stable, so occurrences of a row stay in
//      index order and their bags are non-decreasing);
//   2. per unique row k (parallel with at::parallel_for over unique rows):
//        g = sum_i grad_output[bag(i)] * psw[i]     (same summation order as index_add_)
//        cnt = distinct bags containing k
//        g += 2*l2*w                               (if l2 > 0)
//        clip = r*cnt*max(||w||, r*sqrt(D)*zeta);  g *= clip / max(||g||, clip)   (if clip)
//        Adam with per-row bias correction t = ++row_step[k]
//   Rows not in the batch are never read or written.
//
// Returns an int64 tensor [2]: (unique rows U, rows whose gradient was scaled down).
// Arithmetic mirrors the float32 torch ops of the reference (scalars rounded to float first).
// Only <ATen/ATen.h> and <torch/library.h>: no Python.h; built by recsys/optim/cowclip_kernel.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// Stable LSD radix sort of 64-bit keys by bits [lo, lo + nbits). `tmp` is scratch of keys.size().
void radix_sort_bits(std::vector<uint64_t>& keys, std::vector<uint64_t>& tmp, int lo, int nbits) {
  if (nbits <= 0 || keys.size() < 2) return;
  const int passes = (nbits + 10) / 11;
  const int digit = (nbits + passes - 1) / passes;
  const uint64_t mask = (uint64_t(1) << digit) - 1;
  std::vector<int64_t> hist(size_t(1) << digit);
  const size_t n = keys.size();
  for (int p = 0; p < passes; ++p) {
    const int shift = lo + p * digit;
    std::fill(hist.begin(), hist.end(), 0);
    for (size_t i = 0; i < n; ++i) hist[(keys[i] >> shift) & mask]++;
    int64_t sum = 0;
    for (auto& h : hist) {
      const int64_t c = h;
      h = sum;
      sum += c;
    }
    for (size_t i = 0; i < n; ++i) tmp[hist[(keys[i] >> shift) & mask]++] = keys[i];
    keys.swap(tmp);
  }
}

at::Tensor cowclip_adam_step_cpu(
    at::Tensor weight, at::Tensor exp_avg, at::Tensor exp_avg_sq, at::Tensor row_step,
    const at::Tensor& indices, const at::Tensor& offsets, const at::Tensor& grad_output,
    const std::optional<at::Tensor>& per_sample_weights,
    double lr, double beta1, double beta2, double eps, double r, double zeta, double l2,
    bool clip, bool keras_eps) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [N, D]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "weight must be float32");
  TORCH_CHECK(weight.is_contiguous() && exp_avg.is_contiguous() && exp_avg_sq.is_contiguous(),
              "weight, exp_avg, exp_avg_sq must be contiguous");
  TORCH_CHECK(exp_avg.sizes() == weight.sizes() && exp_avg_sq.sizes() == weight.sizes(),
              "optimizer state shape does not match weight");
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat && exp_avg_sq.scalar_type() == at::kFloat,
              "exp_avg, exp_avg_sq must be float32");
  TORCH_CHECK(row_step.dim() == 1 && row_step.size(0) == weight.size(0) &&
                  row_step.scalar_type() == at::kLong && row_step.is_contiguous(),
              "row_step must be a contiguous int64 [N]");
  TORCH_CHECK(indices.dim() == 1 && offsets.dim() == 1, "indices and offsets must be 1-D");
  TORCH_CHECK(indices.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong,
              "indices and offsets must be int64");
  TORCH_CHECK(indices.is_contiguous() && offsets.is_contiguous(), "indices/offsets must be contiguous");
  TORCH_CHECK(grad_output.dim() == 2 && grad_output.scalar_type() == at::kFloat && grad_output.is_contiguous(),
              "grad_output must be a contiguous float32 [B, D]");
  const int64_t N = weight.size(0), D = weight.size(1);
  const int64_t L = indices.numel();
  const int64_t B = offsets.numel() - 1;
  TORCH_CHECK(B >= 0, "offsets must have B+1 entries");
  TORCH_CHECK(grad_output.size(0) == B, "offsets has ", B, " bags but grad_output has ", grad_output.size(0), " rows");
  TORCH_CHECK(grad_output.size(1) == D, "grad_output dim ", grad_output.size(1), " != weight dim ", D);
  TORCH_CHECK(L < (int64_t(1) << 32), "too many indices for one call");
  const float* psw = nullptr;
  if (per_sample_weights.has_value() && per_sample_weights->defined()) {
    const auto& p = *per_sample_weights;
    TORCH_CHECK(p.dim() == 1 && p.numel() == L && p.scalar_type() == at::kFloat && p.is_contiguous(),
                "per_sample_weights must be a contiguous float32 [L]");
    psw = p.data_ptr<float>();
  }
  auto stats = at::zeros({2}, at::kLong);
  if (L == 0) return stats;

  const int64_t* idx = indices.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[B] == L, "offsets must start at 0 and end at len(indices)");

  // bag of each occurrence
  std::vector<int32_t> bag_of(L);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s = off[b], e = off[b + 1];
    TORCH_CHECK(s <= e, "offsets must be non-decreasing");
    for (int64_t i = s; i < e; ++i) bag_of[i] = static_cast<int32_t>(b);
  }

  // keys: row in the upper 32 bits (N < 2^32), occurrence in the lower 32 bits
  TORCH_CHECK(N < (int64_t(1) << 32), "table too large");
  std::vector<uint64_t> keys(L), tmp(L);
  for (int64_t i = 0; i < L; ++i) {
    const int64_t k = idx[i];
    TORCH_CHECK(k >= 0 && k < N, "embedding ids out of range [0, ", N, "): ", k);
    keys[i] = (uint64_t(k) << 32) | uint64_t(i);
  }
  int nbits = 0;
  while (nbits < 32 && (uint64_t(1) << nbits) < uint64_t(N)) ++nbits;
  radix_sort_bits(keys, tmp, 32, nbits);
  std::vector<uint64_t>().swap(tmp);

  // segment starts of unique rows
  std::vector<int64_t> seg;
  seg.reserve(std::min<int64_t>(L, N) + 1);
  seg.push_back(0);
  for (int64_t i = 1; i < L; ++i)
    if ((keys[i] >> 32) != (keys[i - 1] >> 32)) seg.push_back(i);
  const int64_t U = static_cast<int64_t>(seg.size());
  seg.push_back(L);

  float* W = weight.data_ptr<float>();
  float* M = exp_avg.data_ptr<float>();
  float* V = exp_avg_sq.data_ptr<float>();
  int64_t* RS = row_step.data_ptr<int64_t>();
  const float* G = grad_output.data_ptr<float>();

  // scalars as the float32 torch ops of the reference see them
  const float b1f = static_cast<float>(beta1), b2f = static_cast<float>(beta2);
  const float omb1 = static_cast<float>(1.0 - beta1), omb2 = static_cast<float>(1.0 - beta2);
  const float lrf = static_cast<float>(lr), epsf = static_cast<float>(eps);
  const float l2x2 = static_cast<float>(2.0 * l2);
  const float rf = static_cast<float>(r);
  const float zeta_p = static_cast<float>(r * std::sqrt(static_cast<double>(D)) * zeta);
  std::atomic<int64_t> n_clipped{0};

  // 1 - b^t rounds to 1.0f once b^t < 2^-25: skip powf there (its underflow path is slow)
  const float t_sat1 = b1f > 0.f && b1f < 1.f ? 30.f / -std::log(b1f) : 1e30f;
  const float t_sat2 = b2f > 0.f && b2f < 1.f ? 30.f / -std::log(b2f) : 1e30f;

  // Software prefetch: rows are visited in increasing order but sparsely, so the hardware
  // prefetcher does not help; fetch w/m/v/row_step of a row kPF rows ahead, and the
  // grad_output rows of the occurrence kPFO ahead.
  constexpr int64_t kPF = 6, kPFO = 8;
  auto prefetch_row = [&](int64_t u) {
    const int64_t k = static_cast<int64_t>(keys[seg[u]] >> 32);
    for (int64_t d = 0; d < D; d += 16) {
      __builtin_prefetch(W + k * D + d, 1, 3);
      __builtin_prefetch(M + k * D + d, 1, 3);
      __builtin_prefetch(V + k * D + d, 1, 3);
    }
    __builtin_prefetch(RS + k, 1, 3);
  };
  auto prefetch_occ = [&](int64_t j) {
    const int64_t i = static_cast<int64_t>(keys[j] & 0xffffffffu);
    const float* go = G + int64_t(bag_of[i]) * D;
    for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(go + d, 0, 3);
  };

  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1));
  at::parallel_for(0, U, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> g(D);
    int64_t local_clipped = 0;
    for (int64_t u = begin; u < std::min(end, begin + kPF); ++u) prefetch_row(u);
    for (int64_t j = seg[begin]; j < std::min(seg[end], seg[begin] + kPFO); ++j) prefetch_occ(j);
    for (int64_t u = begin; u < end; ++u) {
      if (u + kPF < end) prefetch_row(u + kPF);
      const int64_t s = seg[u], e = seg[u + 1];
      const int64_t k = static_cast<int64_t>(keys[s] >> 32);
      std::fill(g.begin(), g.end(), 0.f);
      int64_t cnt = 0, last_bag = -1;
      const int64_t jend = seg[end];
      for (int64_t j = s; j < e; ++j) {
        if (j + kPFO < jend) prefetch_occ(j + kPFO);
        const int64_t i = static_cast<int64_t>(keys[j] & 0xffffffffu);
        const int64_t b = bag_of[i];
        if (b != last_bag) {
          ++cnt;
          last_bag = b;
        }
        const float* go = G + b * D;
        if (psw) {
          const float wt = psw[i];
          for (int64_t d = 0; d < D; ++d) {
            const float c = go[d] * wt;
            g[d] += c;
          }
        } else {
          for (int64_t d = 0; d < D; ++d) g[d] += go[d];
        }
      }
      float* w = W + k * D;
      float* m = M + k * D;
      float* v = V + k * D;
      if (l2 != 0.0) {
        for (int64_t d = 0; d < D; ++d) {
          const float t = l2x2 * w[d];
          g[d] += t;
        }
      }
      if (clip) {
        double ws = 0.0, gs = 0.0;
        for (int64_t d = 0; d < D; ++d) {
          ws += double(w[d]) * double(w[d]);
          gs += double(g[d]) * double(g[d]);
        }
        const float wnorm = static_cast<float>(std::sqrt(ws));
        const float gnorm = static_cast<float>(std::sqrt(gs));
        const float clip_t = (rf * static_cast<float>(cnt)) * std::max(wnorm, zeta_p);
        const float denom = std::max(gnorm, clip_t);
        const float scale = denom > 0.f ? clip_t / denom : 1.f;
        if (gnorm > clip_t) ++local_clipped;
        for (int64_t d = 0; d < D; ++d) g[d] *= scale;
      }
      const int64_t t = RS[k] + 1;
      RS[k] = t;
      const float tf = static_cast<float>(t);
      const float bc1 = tf > t_sat1 ? 1.f : 1.f - std::pow(b1f, tf);
      const float bc2s = tf > t_sat2 ? 1.f : std::sqrt(1.f - std::pow(b2f, tf));
      if (keras_eps) {
        const float step = lrf * bc2s / bc1;
        for (int64_t d = 0; d < D; ++d) {
          const float gd = g[d];
          const float md = m[d] * b1f + omb1 * gd;
          const float vd = v[d] * b2f + omb2 * gd * gd;
          m[d] = md;
          v[d] = vd;
          const float q = md / (std::sqrt(vd) + epsf);
          w[d] -= step * q;
        }
      } else {
        for (int64_t d = 0; d < D; ++d) {
          const float gd = g[d];
          const float md = m[d] * b1f + omb1 * gd;
          const float vd = v[d] * b2f + omb2 * gd * gd;
          m[d] = md;
          v[d] = vd;
          const float num = lrf * (md / bc1);
          const float den = std::sqrt(vd) / bc2s + epsf;
          w[d] -= num / den;
        }
      }
    }
    n_clipped.fetch_add(local_clipped, std::memory_order_relaxed);
  });

  auto* st = stats.data_ptr<int64_t>();
  st[0] = U;
  st[1] = n_clipped.load();
  return stats;
}

}  // namespace

TORCH_LIBRARY(recsys, m) {
  m.def(
      "cowclip_adam_step_(Tensor(a!) weight, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!) row_step, Tensor indices, Tensor offsets, Tensor grad_output, "
      "Tensor? per_sample_weights, float lr, float beta1, float beta2, float eps, float r, "
      "float zeta, float l2, bool clip, bool keras_eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(recsys, CPU, m) {
  m.impl("cowclip_adam_step_", &cowclip_adam_step_cpu);
}
