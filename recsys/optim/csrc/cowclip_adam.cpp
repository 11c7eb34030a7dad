// Fused CowClip-Adam backward+update for pooled-sum embedding tables (CPU).
//
// Two ops, one kernel:
//
//   recsys::cowclip_adam_tables_   all tables of a table-batched group in ONE call, shaped like
//       FBGEMM's CPU TBE backward: flat weights / momentum1 / momentum2 / row_step buffers, a
//       per-feature table description, the KJT's indices and offsets [F*B+1] for all features and
//       grad_output [B, total_D]. Used by recsys.optim.cowclip_tbe.CowClipAdamTBE (inline mode).
//   recsys::cowclip_adam_step_     one table [N, D] per call (the original op; tests, bench).
//
// Per table (feature f reads table t; every table is read by one feature) this is, in place,
// exactly the update of
//   recsys.optim.cowclip.cowclip_adam_step(weight_t, state_t, indices_f, offsets_f, grad_output[:, cols_f],
//       psw_f, update_scope="batch", l2_scope="batch", bias_correction="row", eps_mode=...)
// except for state.step (a 0-dim counter the Python wrapper of the one-table op increments):
//
//   phase 1 (per table, bags in order): occurrences are deduplicated with an open-addressing hash
//     table keyed by row (no sort). grad_output is read once, sequentially (bag b's row is read
//     once per table, instead of once per occurrence in row order as a sort-based pass would),
//     and accumulated into a per-unique-row buffer in occurrence order (the summation order of
//     the reference's index_add_):
//        g_k   = sum_i grad_output[bag(i)] * psw[i]
//        cnt_k = distinct bags containing k       (bags arrive in order: count changes of bag)
//   phase 2 (per unique row, software-prefetched w/m/v/row_step rows a few rows ahead):
//        g += 2*l2*w                                (if l2 > 0)
//        clip = r*cnt*max(||w||, r*sqrt(D)*zeta);  g *= clip / max(||g||, clip)   (if clip)
//        Adam with per-row bias correction t = ++row_step[k]
//   Rows not in the batch are never read or written.
//
// Parallelism: over tables (torch's parallel_for, one task per table, phases 1+2 back to back so the
// accumulator is still in cache) when there are at least as many tables as threads, else per table
// with phase 2 parallel over unique rows. Tables own disjoint rows, unique rows are independent,
// so results do not depend on the thread count.
//
// No per-call allocation proportional to anything: scratch (hash table, accumulators) is
// thread-local, grow-only, and sized by the batch (occurrences per table), never by the table.
// Bias corrections 1-b1^t and sqrt(1-b2^t) come from a cached per-(beta1, beta2) table for
// t < 2^15 instead of two powf calls per row.
//
// Arithmetic mirrors the float32 torch ops of the reference (scalars rounded to float first);
// norms are accumulated in double (4 independent lanes).
// LibTorch stable ABI only (torch/csrc/stable, the C shim; no ATen, no Python.h), compiled with
// TORCH_TARGET_VERSION = 2.11: one build loads on every torch from 2.11 on (setup.py, the JIT build
// in recsys/optim/cowclip_kernel.py). Exceptions thrown inside a parallel region are carried out of
// it by hand (parallel_for_checked), because the shim's parallel_for would replace their message.

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

using Tensor = torch::stable::Tensor;
using torch::headeronly::ScalarType;

// The ops' argument checks: a RuntimeError in Python whose text is just the message.
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream msg;
  (msg << ... << args);
  throw std::runtime_error(msg.str());
}

#define RECSYS_CHECK(cond, ...) \
  do {                          \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (0)

// torch::stable::parallel_for, with an exception thrown by fn rethrown as it was (the shim turns
// it into an error code and a generic message otherwise). fn must not be called concurrently on
// overlapping work, as with at::parallel_for.
template <typename Fn>
void parallel_for_checked(int64_t begin, int64_t end, int64_t grain, const Fn& fn) {
  std::exception_ptr error;
  std::mutex mu;
  torch::stable::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    try {
      fn(b, e);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!error) error = std::current_exception();
    }
  });
  if (error) std::rethrow_exception(error);
}

// A zero-filled int64 CPU tensor (the ops' stats outputs), through the C shim.
Tensor zeros_long(std::initializer_list<int64_t> sizes) {
  std::vector<int64_t> sz(sizes), st(sz.size(), 1);
  for (int64_t i = static_cast<int64_t>(sz.size()) - 2; i >= 0; --i) st[i] = st[i + 1] * sz[i + 1];
  AtenTensorHandle h = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(sz.size()), sz.data(), st.data(),
                                                  aoti_torch_dtype_int64(), aoti_torch_device_type_cpu(), 0, &h));
  Tensor t(h);
  std::memset(t.mutable_data_ptr(), 0, static_cast<size_t>(t.numel()) * sizeof(int64_t));
  return t;
}

bool same_sizes(const Tensor& a, const Tensor& b) {
  if (a.dim() != b.dim()) return false;
  for (int64_t i = 0; i < a.dim(); ++i)
    if (a.size(i) != b.size(i)) return false;
  return true;
}

// ------------------------------------------------------------------------------------------
// hyperparameters, as float32 like the reference's torch ops see them

struct BiasTable {
  float b1 = -1.f, b2 = -1.f;
  std::vector<float> bc1, bc2s;  // index t (>= 1)
};

constexpr int64_t kBiasTableSize = int64_t(1) << 15;

inline float t_saturation(float b) {
  // 1 - b^t rounds to 1.0f once b^t < 2^-25: skip powf there (its underflow path is slow)
  return b > 0.f && b < 1.f ? 30.f / -std::log(b) : 1e30f;
}

// Cached bias-correction table per (beta1, beta2); a few distinct pairs at most per process.
std::shared_ptr<const BiasTable> bias_table(float b1, float b2) {
  static std::mutex mu;
  static std::vector<std::shared_ptr<const BiasTable>> cache;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& c : cache)
    if (c->b1 == b1 && c->b2 == b2) return c;
  auto t = std::make_shared<BiasTable>();
  t->b1 = b1;
  t->b2 = b2;
  t->bc1.resize(kBiasTableSize);
  t->bc2s.resize(kBiasTableSize);
  const float s1 = t_saturation(b1), s2 = t_saturation(b2);
  t->bc1[0] = t->bc2s[0] = 0.f;  // t = 0 never occurs (t = ++row_step >= 1)
  for (int64_t i = 1; i < kBiasTableSize; ++i) {
    const float tf = static_cast<float>(i);
    t->bc1[i] = tf > s1 ? 1.f : 1.f - std::pow(b1, tf);
    t->bc2s[i] = tf > s2 ? 1.f : std::sqrt(1.f - std::pow(b2, tf));
  }
  if (cache.size() >= 8) cache.erase(cache.begin());
  cache.push_back(t);
  return t;
}

struct Hyper {
  float b1, b2, omb1, omb2, lr, eps, l2x2, r;
  bool l2, keras;
  float t_sat1, t_sat2;
  std::shared_ptr<const BiasTable> bias;

  Hyper(double lr_, double beta1, double beta2, double eps_, double r_, double l2_, bool keras_)
      : b1(static_cast<float>(beta1)),
        b2(static_cast<float>(beta2)),
        omb1(static_cast<float>(1.0 - beta1)),
        omb2(static_cast<float>(1.0 - beta2)),
        lr(static_cast<float>(lr_)),
        eps(static_cast<float>(eps_)),
        l2x2(static_cast<float>(2.0 * l2_)),
        r(static_cast<float>(r_)),
        l2(l2_ != 0.0),
        keras(keras_),
        t_sat1(t_saturation(b1)),
        t_sat2(t_saturation(b2)),
        bias(bias_table(b1, b2)) {}

  inline void correction(int64_t t, float& bc1, float& bc2s) const {
    if (t < kBiasTableSize) {
      bc1 = bias->bc1[t];
      bc2s = bias->bc2s[t];
      return;
    }
    const float tf = static_cast<float>(t);
    bc1 = tf > t_sat1 ? 1.f : 1.f - std::pow(b1, tf);
    bc2s = tf > t_sat2 ? 1.f : std::sqrt(1.f - std::pow(b2, tf));
  }
};

// ------------------------------------------------------------------------------------------
// one table's work

template <typename index_t>
struct Job {
  float* W;  // table base [N, D] (row-major, contiguous)
  float* M;
  float* V;
  int64_t* RS;  // row_step [N]
  int64_t N, D;
  const index_t* idx;  // all indices (absolute positions from off[])
  const index_t* off;  // B+1 entries: bag b is idx[off[b] .. off[b+1])
  const float* psw;    // per-index weights (absolute positions) or nullptr
  const float* G;      // grad_output of bag 0, first column of this table
  int64_t ldg;         // grad_output row stride
  int64_t B;
  float zeta_p;  // r * sqrt(D_full) * zeta
  bool clip;
};

// Thread-local, grow-only scratch. Invariant between calls: hash[] is all -1.
struct Scratch {
  std::vector<int32_t> hash;  // slot of the row at this hash position, or -1
  std::vector<int32_t> hpos;  // [U] hash position of slot (to reset hash[] after use)
  std::vector<int64_t> rows;  // [U] row of slot
  std::vector<int32_t> cnt;   // [U] distinct bags
  std::vector<int32_t> last;  // [U] last bag seen
  std::vector<float> acc;     // [U*D] gradient accumulators
  int64_t U = 0;
  int64_t hmask = 0;
  int hbits = 0;

  template <typename T>
  static void grow(std::vector<T>& v, size_t n, T fill = T()) {
    if (v.size() < n) v.resize(std::max(n, v.size() + v.size() / 2), fill);
  }
  void reserve(int64_t L, int64_t D) {
    hbits = 4;
    while ((int64_t(1) << hbits) < 2 * L) ++hbits;
    hmask = (int64_t(1) << hbits) - 1;
    grow(hash, size_t(hmask + 1), int32_t(-1));
    grow(hpos, size_t(L));
    grow(rows, size_t(L));
    grow(cnt, size_t(L));
    grow(last, size_t(L));
    grow(acc, size_t(L * D));
    U = 0;
  }
  void reset_hash() {
    for (int64_t u = 0; u < U; ++u) hash[hpos[u]] = -1;
  }
};

Scratch& thread_scratch() {
  static thread_local Scratch s;
  return s;
}

// Prefetch distances (measured on a 2-core AMD EPYC, D=16; 6/12/24 rows ahead were within noise).
// Phase 1 also prefetches a row's w/m/v/row_step lines when it first meets the row, so their DRAM
// latency overlaps the hashing and accumulation; phase 2 re-prefetches rows ahead for large batches
// whose first touch has been evicted by then.
constexpr int kPrefetchRows = 12;       // phase 2: rows ahead
constexpr bool kPrefetchInsert = true;  // phase 1: prefetch a new row's state
constexpr int kPrefetchBags = 8;        // phase 1: grad_output rows ahead

// Software prefetch into all cache levels. On x86 as inline asm: with GCC 12 (-O3, generic
// x86-64) the __builtin_prefetch calls of the row loop compiled to NO instruction (checked with
// objdump; the first version of this op asked for write prefetches and got none), the asm is kept.
inline void prefetch(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

template <int DD>
inline void prefetch_lines(const float* p, int64_t D) {
  const int64_t n = DD > 0 ? DD : D;
  for (int64_t d = 0; d < n; d += 16) prefetch(p + d);
}

enum class Status { kOk, kBadId, kBadOffsets };

// Phase 1: dedup + accumulate. On a bad id or offsets it restores the hash invariant and returns
// the error (`bad`: the offending id) before anything was written to the table.
template <int DD, typename index_t>
Status accumulate(const Job<index_t>& job, Scratch& s, int64_t& bad) {
  const int64_t D = DD > 0 ? DD : job.D;
  const int64_t B = job.B;
  const index_t* off = job.off;
  const int64_t L = static_cast<int64_t>(off[B]) - static_cast<int64_t>(off[0]);
  s.reserve(std::max<int64_t>(L, 1), D);
  int32_t* H = s.hash.data();
  int32_t* hpos = s.hpos.data();
  int64_t* rows = s.rows.data();
  int32_t* cnt = s.cnt.data();
  int32_t* last = s.last.data();
  float* acc = s.acc.data();
  const int shift = 64 - s.hbits;
  const int64_t mask = s.hmask;
  int64_t U = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t st = off[b], en = off[b + 1];
    if (en < st) {
      s.U = U;
      s.reset_hash();
      s.U = 0;
      return Status::kBadOffsets;
    }
    if (en == st) continue;
    if (b + kPrefetchBags < B) prefetch_lines<DD>(job.G + (b + kPrefetchBags) * job.ldg, D);
    const float* go = job.G + b * job.ldg;
    for (int64_t i = st; i < en; ++i) {
      const int64_t k = static_cast<int64_t>(job.idx[i]);
      if (k < 0 || k >= job.N) {
        s.U = U;
        s.reset_hash();
        s.U = 0;
        bad = k;
        return Status::kBadId;
      }
      const float wt = job.psw ? job.psw[i] : 1.f;  // go * 1.0f == go exactly
      int64_t h = static_cast<int64_t>((uint64_t(k) * 0x9E3779B97F4A7C15ull) >> shift);
      while (true) {
        const int32_t sl = H[h];
        if (sl < 0) {
          const int32_t n = static_cast<int32_t>(U++);
          H[h] = n;
          hpos[n] = static_cast<int32_t>(h);
          rows[n] = k;
          cnt[n] = 1;
          last[n] = static_cast<int32_t>(b);
          float* a = acc + int64_t(n) * D;
          for (int64_t d = 0; d < D; ++d) a[d] = go[d] * wt;
          if (kPrefetchInsert) {
            prefetch_lines<DD>(job.W + k * D, D);
            prefetch_lines<DD>(job.M + k * D, D);
            prefetch_lines<DD>(job.V + k * D, D);
            prefetch(job.RS + k);
          }
          break;
        }
        if (rows[sl] == k) {
          if (last[sl] != b) {
            ++cnt[sl];
            last[sl] = static_cast<int32_t>(b);
          }
          float* a = acc + int64_t(sl) * D;
          for (int64_t d = 0; d < D; ++d) {
            const float c = go[d] * wt;
            a[d] += c;
          }
          break;
        }
        h = (h + 1) & mask;
      }
    }
  }
  s.U = U;
  return Status::kOk;
}

// L2, clip and Adam of one row: g (the accumulated gradient, scratch) -> w, m, v. The pointers never
// alias (__restrict__ lets the loops vectorise; scalars are locals for the same reason).
// Returns whether the gradient was scaled down.
template <int DD>
inline bool row_update(float* __restrict__ g, float* __restrict__ w, float* __restrict__ m,
                       float* __restrict__ v, int64_t D_, int64_t t, int32_t cnt, bool clip, float zeta_p,
                       const Hyper& hp) {
  const int64_t D = DD > 0 ? DD : D_;
  bool clipped = false;
  if (hp.l2) {
    const float l2x2 = hp.l2x2;
    for (int64_t d = 0; d < D; ++d) {
      const float x = l2x2 * w[d];
      g[d] += x;
    }
  }
  if (clip) {
    double ws[4] = {0, 0, 0, 0}, gs[4] = {0, 0, 0, 0};
    int64_t d = 0;
    for (; d + 4 <= D; d += 4) {
      for (int j = 0; j < 4; ++j) {
        ws[j] += double(w[d + j]) * double(w[d + j]);
        gs[j] += double(g[d + j]) * double(g[d + j]);
      }
    }
    for (; d < D; ++d) {
      ws[0] += double(w[d]) * double(w[d]);
      gs[0] += double(g[d]) * double(g[d]);
    }
    const float wnorm = static_cast<float>(std::sqrt((ws[0] + ws[1]) + (ws[2] + ws[3])));
    const float gnorm = static_cast<float>(std::sqrt((gs[0] + gs[1]) + (gs[2] + gs[3])));
    const float clip_t = (hp.r * static_cast<float>(cnt)) * std::max(wnorm, zeta_p);
    const float denom = std::max(gnorm, clip_t);
    const float scale = denom > 0.f ? clip_t / denom : 1.f;
    clipped = gnorm > clip_t;
    for (int64_t j = 0; j < D; ++j) g[j] *= scale;
  }
  float bc1, bc2s;
  hp.correction(t, bc1, bc2s);
  const float b1 = hp.b1, b2 = hp.b2, omb1 = hp.omb1, omb2 = hp.omb2, lr = hp.lr, eps = hp.eps;
  if (hp.keras) {
    const float step = lr * bc2s / bc1;
    for (int64_t d = 0; d < D; ++d) {
      const float gd = g[d];
      const float md = m[d] * b1 + omb1 * gd;
      const float vd = v[d] * b2 + omb2 * gd * gd;
      m[d] = md;
      v[d] = vd;
      const float q = md / (std::sqrt(vd) + eps);
      w[d] -= step * q;
    }
  } else {
    for (int64_t d = 0; d < D; ++d) {
      const float gd = g[d];
      const float md = m[d] * b1 + omb1 * gd;
      const float vd = v[d] * b2 + omb2 * gd * gd;
      m[d] = md;
      v[d] = vd;
      const float num = lr * (md / bc1);
      const float den = std::sqrt(vd) / bc2s + eps;
      w[d] -= num / den;
    }
  }
  return clipped;
}

// Phase 2 over unique rows [u0, u1) of the scratch: L2, clip, Adam. Returns rows clipped.
template <int DD, typename index_t>
int64_t update_rows(const Job<index_t>& job, const Scratch& s, const Hyper& hp, int64_t u0, int64_t u1) {
  const int64_t D = DD > 0 ? DD : job.D;
  const int64_t* rows = s.rows.data();
  const int32_t* cnt = s.cnt.data();
  float* acc = const_cast<float*>(s.acc.data());
  float* W = job.W;
  float* M = job.M;
  float* V = job.V;
  int64_t* RS = job.RS;
  auto prefetch_row = [&](int64_t u) {
    const int64_t k = rows[u];
    prefetch_lines<DD>(W + k * D, D);
    prefetch_lines<DD>(M + k * D, D);
    prefetch_lines<DD>(V + k * D, D);
    prefetch(RS + k);
  };
  for (int64_t u = u0; u < std::min(u1, u0 + kPrefetchRows); ++u) prefetch_row(u);
  int64_t clipped = 0;
  for (int64_t u = u0; u < u1; ++u) {
    if (u + kPrefetchRows < u1) prefetch_row(u + kPrefetchRows);
    const int64_t k = rows[u];
    const int64_t t = RS[k] + 1;
    RS[k] = t;
    clipped += row_update<DD>(acc + u * D, W + k * D, M + k * D, V + k * D, D, t, cnt[u], job.clip, job.zeta_p, hp);
  }
  return clipped;
}

void check_status(Status st, int64_t bad, int64_t N) {
  RECSYS_CHECK(st != Status::kBadOffsets, "offsets must be non-decreasing");
  RECSYS_CHECK(st != Status::kBadId, "embedding ids out of range [0, ", N, "): ", bad);
}

// Whole table in the calling thread (phases 1 and 2). out: (U, clipped).
template <int DD, typename index_t>
void run_job_serial(const Job<index_t>& job, const Hyper& hp, int64_t* out) {
  Scratch& s = thread_scratch();
  int64_t bad = 0;
  const Status st = accumulate<DD>(job, s, bad);  // before check_status reads `bad`
  check_status(st, bad, job.N);
  out[0] = s.U;
  out[1] = update_rows<DD>(job, s, hp, 0, s.U);
  s.reset_hash();
}

// Phase 1 in the calling thread, phase 2 parallel over unique rows.
template <int DD, typename index_t>
void run_job_rows_parallel(const Job<index_t>& job, const Hyper& hp, int64_t* out) {
  Scratch& s = thread_scratch();
  int64_t bad = 0;
  const Status st = accumulate<DD>(job, s, bad);  // before check_status reads `bad`
  check_status(st, bad, job.N);
  std::atomic<int64_t> clipped{0};
  const int64_t grain = std::max<int64_t>(64, 16384 / std::max<int64_t>(job.D, 1));
  try {
    parallel_for_checked(0, s.U, grain, [&](int64_t b, int64_t e) {
      clipped.fetch_add(update_rows<DD>(job, s, hp, b, e), std::memory_order_relaxed);
    });
  } catch (...) {
    s.reset_hash();
    throw;
  }
  out[0] = s.U;
  out[1] = clipped.load();
  s.reset_hash();
}

template <typename index_t, typename Fn>
void dispatch_dim(int64_t D, Fn&& fn) {
  switch (D) {
    case 1: fn(std::integral_constant<int, 1>()); break;
    case 2: fn(std::integral_constant<int, 2>()); break;
    case 4: fn(std::integral_constant<int, 4>()); break;
    case 8: fn(std::integral_constant<int, 8>()); break;
    case 16: fn(std::integral_constant<int, 16>()); break;
    case 32: fn(std::integral_constant<int, 32>()); break;
    case 64: fn(std::integral_constant<int, 64>()); break;
    case 128: fn(std::integral_constant<int, 128>()); break;
    default: fn(std::integral_constant<int, 0>()); break;
  }
}

// Runs all jobs; stats[j] = (U, clipped).
template <typename index_t>
void run_jobs(const std::vector<Job<index_t>>& jobs, const Hyper& hp, int64_t* stats) {
  const int64_t J = static_cast<int64_t>(jobs.size());
  const int nthreads = static_cast<int>(torch::stable::get_num_threads());
  if (J >= nthreads || nthreads <= 1) {  // (nested in a parallel region: the inner loops run inline)
    parallel_for_checked(0, J, 1, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) {
        dispatch_dim<index_t>(jobs[j].D, [&](auto dd) {
          run_job_serial<decltype(dd)::value>(jobs[j], hp, stats + 2 * j);
        });
      }
    });
  } else {
    for (int64_t j = 0; j < J; ++j) {
      dispatch_dim<index_t>(jobs[j].D, [&](auto dd) {
        run_job_rows_parallel<decltype(dd)::value>(jobs[j], hp, stats + 2 * j);
      });
    }
  }
}

void check_state(const Tensor& weight, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                 const Tensor& row_step) {
  RECSYS_CHECK(weight.scalar_type() == ScalarType::Float, "weight must be float32");
  RECSYS_CHECK(weight.is_contiguous() && exp_avg.is_contiguous() && exp_avg_sq.is_contiguous(),
              "weight, exp_avg, exp_avg_sq must be contiguous");
  RECSYS_CHECK(same_sizes(exp_avg, weight) && same_sizes(exp_avg_sq, weight),
              "optimizer state shape does not match weight");
  RECSYS_CHECK(exp_avg.scalar_type() == ScalarType::Float && exp_avg_sq.scalar_type() == ScalarType::Float,
              "exp_avg, exp_avg_sq must be float32");
  RECSYS_CHECK(row_step.dim() == 1 && row_step.scalar_type() == ScalarType::Long && row_step.is_contiguous(),
              "row_step must be a contiguous int64 vector");
}

const float* check_psw(const std::optional<Tensor>& per_sample_weights, int64_t L) {
  if (per_sample_weights.has_value() && per_sample_weights->defined()) {
    const auto& p = *per_sample_weights;
    RECSYS_CHECK(p.dim() == 1 && p.numel() == L && p.scalar_type() == ScalarType::Float && p.is_contiguous(),
                "per_sample_weights must be a contiguous float32 [L]");
    return p.const_data_ptr<float>();
  }
  return nullptr;
}

// ------------------------------------------------------------------------------------------
// one table per call

Tensor cowclip_adam_step_cpu(
    Tensor weight, Tensor exp_avg, Tensor exp_avg_sq, Tensor row_step,
    const Tensor& indices, const Tensor& offsets, const Tensor& grad_output,
    const std::optional<Tensor>& per_sample_weights,
    double lr, double beta1, double beta2, double eps, double r, double zeta, double l2,
    bool clip, bool keras_eps) {
  RECSYS_CHECK(weight.dim() == 2, "weight must be [N, D]");
  check_state(weight, exp_avg, exp_avg_sq, row_step);
  RECSYS_CHECK(row_step.size(0) == weight.size(0), "row_step must be a contiguous int64 [N]");
  RECSYS_CHECK(indices.dim() == 1 && offsets.dim() == 1, "indices and offsets must be 1-D");
  RECSYS_CHECK(indices.scalar_type() == ScalarType::Long && offsets.scalar_type() == ScalarType::Long,
              "indices and offsets must be int64");
  RECSYS_CHECK(indices.is_contiguous() && offsets.is_contiguous(), "indices/offsets must be contiguous");
  RECSYS_CHECK(grad_output.dim() == 2 && grad_output.scalar_type() == ScalarType::Float && grad_output.is_contiguous(),
              "grad_output must be a contiguous float32 [B, D]");
  const int64_t N = weight.size(0), D = weight.size(1);
  const int64_t L = indices.numel();
  const int64_t B = offsets.numel() - 1;
  RECSYS_CHECK(B >= 0, "offsets must have B+1 entries");
  RECSYS_CHECK(grad_output.size(0) == B, "offsets has ", B, " bags but grad_output has ", grad_output.size(0), " rows");
  RECSYS_CHECK(grad_output.size(1) == D, "grad_output dim ", grad_output.size(1), " != weight dim ", D);
  RECSYS_CHECK(N < (int64_t(1) << 32), "table too large");
  RECSYS_CHECK(L < (int64_t(1) << 30) && B < (int64_t(1) << 31), "too many indices for one call");
  const float* psw = check_psw(per_sample_weights, L);
  auto stats = zeros_long({2});
  if (L == 0) return stats;
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  RECSYS_CHECK(off[0] == 0 && off[B] == L, "offsets must start at 0 and end at len(indices)");

  Job<int64_t> job{weight.mutable_data_ptr<float>(), exp_avg.mutable_data_ptr<float>(), exp_avg_sq.mutable_data_ptr<float>(),
                   row_step.mutable_data_ptr<int64_t>(), N, D, indices.const_data_ptr<int64_t>(), off, psw,
                   grad_output.const_data_ptr<float>(), D, B,
                   static_cast<float>(r * std::sqrt(static_cast<double>(D)) * zeta), clip};
  const Hyper hp(lr, beta1, beta2, eps, r, l2, keras_eps);
  std::vector<Job<int64_t>> jobs{job};
  run_jobs(jobs, hp, stats.mutable_data_ptr<int64_t>());
  return stats;
}

// ------------------------------------------------------------------------------------------
// all tables of a table-batched group per call

template <typename index_t>
void tables_impl(Tensor& weights, Tensor& m1, Tensor& m2, Tensor& row_step,
                 const int64_t* meta, const double* zeta, int64_t F, const Tensor& indices,
                 const Tensor& offsets, const Tensor& grad_output, const float* psw,
                 const Hyper& hp, double r, int64_t* stats) {
  const int64_t B = F > 0 ? (offsets.numel() - 1) / F : 0;
  const int64_t L = indices.numel();
  const index_t* idx = indices.const_data_ptr<index_t>();
  const index_t* off = offsets.const_data_ptr<index_t>();
  RECSYS_CHECK(static_cast<int64_t>(off[0]) == 0 && static_cast<int64_t>(off[F * B]) == L,
              "offsets must start at 0 and end at len(indices)");
  const int64_t ldg = grad_output.stride(0);
  float* W = weights.mutable_data_ptr<float>();
  float* M1 = m1.mutable_data_ptr<float>();
  float* M2 = m2.mutable_data_ptr<float>();
  int64_t* RS = row_step.mutable_data_ptr<int64_t>();
  const float* G = grad_output.const_data_ptr<float>();
  std::vector<Job<index_t>> jobs;
  jobs.reserve(F);
  std::vector<int64_t> job_feature;
  job_feature.reserve(F);
  for (int64_t f = 0; f < F; ++f) {
    const int64_t* mf = meta + 6 * f;
    const int64_t woff = mf[0], N = mf[1], D = mf[2], col = mf[3], rstart = mf[4];
    const bool clip = mf[5] != 0;
    const int64_t lo = off[f * B], hi = off[(f + 1) * B];
    if (hi - lo == 0 || B == 0) continue;
    RECSYS_CHECK(hi - lo < (int64_t(1) << 30), "too many indices for one table");
    jobs.push_back(Job<index_t>{W + woff, M1 + woff, M2 + woff, RS + rstart, N, D, idx, off + f * B, psw,
                                G + col, ldg, B,
                                static_cast<float>(r * std::sqrt(static_cast<double>(D)) * zeta[f]), clip});
    job_feature.push_back(f);
  }
  std::vector<int64_t> js(2 * jobs.size(), 0);
  run_jobs(jobs, hp, js.data());
  for (size_t j = 0; j < jobs.size(); ++j) {
    stats[2 * job_feature[j]] = js[2 * j];
    stats[2 * job_feature[j] + 1] = js[2 * j + 1];
  }
}

Tensor cowclip_adam_tables_cpu(
    Tensor weights, Tensor momentum1, Tensor momentum2, Tensor row_step,
    const Tensor& feature_meta, const Tensor& zeta, const Tensor& indices,
    const Tensor& offsets, const Tensor& grad_output,
    const std::optional<Tensor>& per_sample_weights,
    double lr, double beta1, double beta2, double eps, double r, double l2, bool keras_eps) {
  RECSYS_CHECK(weights.dim() == 1, "weights must be the flat 1-D buffer");
  check_state(weights, momentum1, momentum2, row_step);
  RECSYS_CHECK(feature_meta.dim() == 2 && feature_meta.size(1) == 6 && feature_meta.scalar_type() == ScalarType::Long &&
                  feature_meta.is_contiguous(),
              "feature_meta must be a contiguous int64 [F, 6] "
              "(weights_offset, rows, dim, grad_col, row_start, clip)");
  const int64_t F = feature_meta.size(0);
  RECSYS_CHECK(zeta.dim() == 1 && zeta.numel() == F && zeta.scalar_type() == ScalarType::Double && zeta.is_contiguous(),
              "zeta must be a contiguous float64 [F]");
  RECSYS_CHECK(indices.dim() == 1 && offsets.dim() == 1, "indices and offsets must be 1-D");
  RECSYS_CHECK(indices.scalar_type() == offsets.scalar_type() &&
                  (indices.scalar_type() == ScalarType::Long || indices.scalar_type() == ScalarType::Int),
              "indices and offsets must both be int64 or both int32");
  RECSYS_CHECK(indices.is_contiguous() && offsets.is_contiguous(), "indices/offsets must be contiguous");
  RECSYS_CHECK(grad_output.dim() == 2 && grad_output.scalar_type() == ScalarType::Float && grad_output.stride(1) == 1,
              "grad_output must be float32 [B, total_D] with unit column stride");
  RECSYS_CHECK(F > 0 && (offsets.numel() - 1) % F == 0, "offsets must have F*B+1 entries");
  const int64_t B = (offsets.numel() - 1) / F;
  RECSYS_CHECK(grad_output.size(0) == B, "offsets has ", B, " bags per feature but grad_output has ",
              grad_output.size(0), " rows");
  RECSYS_CHECK(B < (int64_t(1) << 31), "too many bags for one call");
  const float* psw = check_psw(per_sample_weights, indices.numel());
  const int64_t* meta = feature_meta.const_data_ptr<int64_t>();
  for (int64_t f = 0; f < F; ++f) {
    const int64_t* mf = meta + 6 * f;
    RECSYS_CHECK(mf[0] >= 0 && mf[1] >= 0 && mf[2] > 0 && mf[0] + mf[1] * mf[2] <= weights.numel(),
                "feature ", f, ": table outside the weights buffer");
    RECSYS_CHECK(mf[3] >= 0 && mf[3] + mf[2] <= grad_output.size(1), "feature ", f, ": columns outside grad_output");
    RECSYS_CHECK(mf[4] >= 0 && mf[4] + mf[1] <= row_step.numel(), "feature ", f, ": rows outside row_step");
    RECSYS_CHECK(mf[1] < (int64_t(1) << 32), "feature ", f, ": table too large");
  }
  {
    // tables are updated in parallel: their rows (and row_step entries) must not overlap
    std::vector<std::pair<int64_t, int64_t>> wr(F), rr(F);
    for (int64_t f = 0; f < F; ++f) {
      wr[f] = {meta[6 * f], meta[6 * f] + meta[6 * f + 1] * meta[6 * f + 2]};
      rr[f] = {meta[6 * f + 4], meta[6 * f + 4] + meta[6 * f + 1]};
    }
    for (auto* v : {&wr, &rr}) {
      std::sort(v->begin(), v->end());
      for (int64_t f = 1; f < F; ++f)
        RECSYS_CHECK((*v)[f].first >= (*v)[f - 1].second || (*v)[f].first == (*v)[f].second ||
                        (*v)[f - 1].first == (*v)[f - 1].second,
                    "features must read distinct, non-overlapping tables");
    }
  }
  auto stats = zeros_long({F, 2});
  if (indices.numel() == 0) return stats;
  const Hyper hp(lr, beta1, beta2, eps, r, l2, keras_eps);
  if (indices.scalar_type() == ScalarType::Long)
    tables_impl<int64_t>(weights, momentum1, momentum2, row_step, meta, zeta.const_data_ptr<double>(), F, indices,
                         offsets, grad_output, psw, hp, r, stats.mutable_data_ptr<int64_t>());
  else
    tables_impl<int32_t>(weights, momentum1, momentum2, row_step, meta, zeta.const_data_ptr<double>(), F, indices,
                         offsets, grad_output, psw, hp, r, stats.mutable_data_ptr<int64_t>());
  return stats;
}

// ------------------------------------------------------------------------------------------
// catch-up of rows behind the global step (update_scope="catchup")
//
// recsys/optim/cowclip/catchup.py has the math (module doc) and the torch version; this is the same
// block scheme, row by row, fused with finding the rows: for every id of the lookup whose row_step
// is behind `step`, the row's w, m, v are advanced in place to `step` and row_step set to it (so a
// repeated id is skipped: no dedup pass). Rows are read and written once, by the thread that owns
// the table. A row's schedule (blocks 1, 2, 4, ... steps cut to bias_cap, the scalar factors of each block) depends
// only on its gap (step is fixed per call): computed once per distinct gap in double, rounded to
// float as the torch version's [P, 1] factors are, and cached for the call.

constexpr double kGL = 0.57735026918962576451;  // 1/sqrt(3): 2-node Gauss-Legendre
constexpr int kCatchPrefetchRowStep = 24;  // ids ahead whose row_step entry is prefetched
constexpr int kCatchPrefetchRows = 8;      // ids ahead whose w/m/v rows are prefetched (if behind)

struct CatchHyper {
  double lr, b1, b2, eps, c, growth;
  bool keras;
  float b1f, b2f, epsf, c_m, c_v, c2;  // float factors of the exact step: b1, b2, eps, (1-b1)c, (1-b2)c^2, c^2
};

// One piece of a row's schedule: an exact step (k == 1: f[0], f[1]) or a block of k >= 2 steps
// (f[0], f[1]: its first step's, as an exact step's; f[3..8]: G's two nodes (g_factors); f[9..12]:
// v's predicted-path terms at the nodes; f[13]: 1/k; f[17..20]: v at the block end).
struct Piece {
  int64_t k;
  float f[24];
};

// G's factors at node x of a block from global step t0: vx = v + (c^2 w^2 - v) * a;
// keras: G = f1 / (sqrt(vx) + eps); torch: G = 1 / (sqrt(vx) * f1 + f2).
inline void g_factors(const CatchHyper& h, double t0, double x, float* out) {
  const double b2x = std::exp(x * std::log(h.b2));
  const double t = t0 + x;
  const double bc1 = -std::expm1(t * std::log(h.b1));
  const double bc2 = -std::expm1(t * std::log(h.b2));
  out[0] = static_cast<float>(1.0 - b2x);
  if (h.keras) {
    out[1] = static_cast<float>(std::sqrt(bc2) / bc1);
    out[2] = 0.f;
  } else {
    out[1] = static_cast<float>(bc1 / std::sqrt(bc2));
    out[2] = static_cast<float>(bc1 * h.eps);
  }
}

// (sum of weights 1-b^k, EMA of j-1, EMA of (j-1)^2) of an EMA with decay b over j = 1..k
inline void ema_lin(double b, double k, double& one, double& y1, double& y2) {
  const double bk = std::pow(b, k);
  one = 1.0 - bk;
  const double a = k - b * one / (1.0 - b);
  const double q = k * k - 2.0 * b / (1.0 - b) * k + b * (1.0 + b) / ((1.0 - b) * (1.0 - b)) * one;
  y1 = a - one;
  y2 = q - 2.0 * a + one;
}

// A block of k steps: where its factors are evaluated. x[0] = 1: the block's first step (the exact
// step at t0 + 1, which predicts the w path); x[1], x[2]: the 2-node Gauss-Legendre pair of
// [0.5, k + 0.5] (G's mean), as in recsys/optim/cowclip/catchup.py's _block.
struct BlockShape {
  double x[3];
};

inline BlockShape block_shape(double k) {
  BlockShape s{};
  const double half = k / 2.0, mid = (k + 1.0) / 2.0;
  s.x[0] = 1.0;
  s.x[1] = mid - half * kGL;
  s.x[2] = mid + half * kGL;
  return s;
}

// The exact step at a global step whose bias corrections are bc1 = 1 - b1^t, bc2 = 1 - b2^t.
inline Piece exact_piece(const CatchHyper& h, double bc1, double bc2) {
  Piece p{};
  p.k = 1;
  if (h.keras) {
    p.f[0] = static_cast<float>(h.lr * std::sqrt(bc2) / bc1);
  } else {
    p.f[0] = static_cast<float>(h.lr / bc1);
    p.f[1] = static_cast<float>(1.0 / std::sqrt(bc2));
  }
  return p;
}

// Piece i of a row current at step t_start: block [t_start + done, + k) of nominal size k_nom
// (left: steps the row still needs; a block cut to left < k_nom is the row's last piece).
Piece make_piece(const CatchHyper& h, int64_t t_start, int64_t done, int64_t k_nom, int64_t left) {
  if (k_nom == 1 || left == 1) {  // the exact step at global step t
    const double t = static_cast<double>(t_start + done + 1);
    return exact_piece(h, -std::expm1(t * std::log(h.b1)), -std::expm1(t * std::log(h.b2)));
  }
  Piece p{};
  const double k = static_cast<double>(std::min(left, k_nom));
  const double t0 = static_cast<double>(t_start + done);
  const BlockShape bs = block_shape(k);
  p.k = static_cast<int64_t>(k);
  const double t1 = t0 + 1.0;  // the block's first step, exact: f[0], f[1] as exact_piece's
  const Piece e = exact_piece(h, -std::expm1(t1 * std::log(h.b1)), -std::expm1(t1 * std::log(h.b2)));
  p.f[0] = e.f[0];
  p.f[1] = e.f[1];
  for (int j = 1; j < 3; ++j) {
    g_factors(h, t0, bs.x[j], p.f + 3 * j);  // f[3..8]: 1 - b2^x and the bias corrections at x
    double one, y1, y2;  // v at x along the predicted path w + (j-1) s: f[9..12]
    ema_lin(h.b2, bs.x[j], one, y1, y2);
    p.f[9 + 2 * (j - 1)] = static_cast<float>(2.0 * h.c * h.c * y1);
    p.f[10 + 2 * (j - 1)] = static_cast<float>(h.c * h.c * y2);
  }
  p.f[13] = static_cast<float>(1.0 / k);
  double one2, y2a, y2b;
  ema_lin(h.b2, k, one2, y2a, y2b);
  p.f[17] = static_cast<float>(h.c * h.c * one2);
  p.f[18] = static_cast<float>(2.0 * h.c * h.c * y2a);
  p.f[19] = static_cast<float>(h.c * h.c * y2b);
  p.f[20] = static_cast<float>(1.0 - one2);
  return p;
}

// The longest block that may start at global step t0: recsys/optim/cowclip/catchup.py's bias_cap
// (BIAS_CAP over the per-step relative change of Adam's bias corrections at t0, floored, >= 1),
// the same formula in double.
constexpr double kBiasCap = 0.1;

inline double bias_cap(const CatchHyper& h, double t0) {
  const double t = std::max(t0, 1.0);
  const double l1 = -std::log(h.b1), l2 = -std::log(h.b2);
  const double rate = (0.5 * l2) / std::expm1(t * l2) + l1 / std::expm1(t * l1);
  return std::max(std::floor(kBiasCap / rate), 1.0);
}

// A full piece (a block not cut by the row's gap) has factors of two kinds: most depend only on
// its size k (f[9..13] and f[17..20], the nodes x, b^x), and the rest on the global step through
// the bias corrections 1 - b^(t0 + x) = 1 - b^t_start * b^done * b^x. The first kind and b^done are the
// same for every row and call: they are computed once per piece index (PieceConsts, per thread,
// rebuilt when the hyper-parameters change); a row then needs b1^t_start and b2^t_start (two
// exps) and, per piece, 3 square roots and a few divisions in double. make_piece's ~15 double
// exp/log/pow per block took about a quarter of the op in the steady state of
// tools/bench/catchup.py (about 2.4 of 8.7 ms at 1/4 size, measured by skipping the schedules;
// about 6% of the op with these constants, profiled). A row's last,
// cut piece still comes from make_piece. Same values as make_piece to double rounding (tested
// through the op against the torch version).
struct PieceConst {
  int64_t k_nom, done;
  int64_t t_free;           // from this global step on, bias_cap does not cut the piece
  double b1_done, b2_done;  // b^done
  double b1x[3], b2x[3];    // b^x at the nodes (block) / b^1 (exact step)
  Piece base;               // the k-only factors (block)
};

struct PieceConsts {
  double hyper[7] = {-1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
  std::vector<PieceConst> at;  // by piece index
  int64_t next_done = 0;       // where the piece after the last one starts, and its nominal size
  double next_size = 1.0;
};

const std::vector<PieceConst>& piece_consts(const CatchHyper& h, int64_t gap) {
  thread_local PieceConsts pc;
  const double key[7] = {h.lr, h.b1, h.b2, h.eps, h.c, h.growth, h.keras ? 1.0 : 0.0};
  if (std::memcmp(key, pc.hyper, sizeof(key)) != 0) {
    pc.at.clear();
    pc.next_done = 0;
    pc.next_size = 1.0;
    std::memcpy(pc.hyper, key, sizeof(key));
  }
  int64_t done = pc.next_done;
  double size = pc.next_size;
  while (done < gap) {  // extend to cover this gap's full pieces
    PieceConst c{};
    c.k_nom = static_cast<int64_t>(size);
    c.done = done;
    // bias_cap grows with t: the first t where it reaches k_nom, by bisection (once per setting)
    int64_t lo = 0, hi = int64_t(1) << 50;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (bias_cap(h, static_cast<double>(mid)) >= static_cast<double>(c.k_nom))
        hi = mid;
      else
        lo = mid + 1;
    }
    c.t_free = lo;
    c.b1_done = std::pow(h.b1, static_cast<double>(done));
    c.b2_done = std::pow(h.b2, static_cast<double>(done));
    if (c.k_nom == 1) {
      c.b1x[0] = h.b1;
      c.b2x[0] = h.b2;
    } else {
      const BlockShape bs = block_shape(static_cast<double>(c.k_nom));
      // the t0-free factors of the block: make_piece's, whose bias-correction ones full_piece replaces
      c.base = make_piece(h, 0, 0, c.k_nom, c.k_nom);
      for (int j = 0; j < 3; ++j) {
        c.b1x[j] = std::exp(bs.x[j] * std::log(h.b1));
        c.b2x[j] = std::exp(bs.x[j] * std::log(h.b2));
      }
    }
    pc.at.push_back(c);
    done += c.k_nom;
    size *= h.growth;
  }
  pc.next_done = done;
  pc.next_size = size;
  return pc.at;
}

// make_piece for a full piece from its constants and b^t_start
inline Piece full_piece(const CatchHyper& h, const PieceConst& c, double b1s, double b2s) {
  const double b1t = b1s * c.b1_done, b2t = b2s * c.b2_done;  // b^t0, t0 = t_start + done
  if (c.k_nom == 1) return exact_piece(h, 1.0 - b1t * c.b1x[0], 1.0 - b2t * c.b2x[0]);  // at t0 + 1
  Piece p = c.base;
  const Piece e = exact_piece(h, 1.0 - b1t * c.b1x[0], 1.0 - b2t * c.b2x[0]);  // the first step, at t0 + 1
  p.f[0] = e.f[0];
  p.f[1] = e.f[1];
  for (int j = 1; j < 3; ++j) {  // g_factors' bias-correction part at node j
    const double bc1 = 1.0 - b1t * c.b1x[j], bc2 = 1.0 - b2t * c.b2x[j];
    if (h.keras) {
      p.f[3 * j + 1] = static_cast<float>(std::sqrt(bc2) / bc1);
    } else {
      p.f[3 * j + 1] = static_cast<float>(bc1 / std::sqrt(bc2));
      p.f[3 * j + 2] = static_cast<float>(bc1 * h.eps);
    }
  }
  return p;
}

void make_schedule(const CatchHyper& h, int64_t t_start, int64_t gap, std::vector<Piece>& out) {
  const std::vector<PieceConst>& pcs = piece_consts(h, gap);
  const double ts = static_cast<double>(t_start);
  const double b1s = std::exp(ts * std::log(h.b1)), b2s = std::exp(ts * std::log(h.b2));
  // piece i: nominal size k_nom(i), cut to what is left and to the bias-correction cap; while no
  // cap has acted, a row's pieces start where the nominal ones do and full ones use their constants
  int64_t done = 0;
  bool nominal = true;
  double size = 1.0;
  for (size_t i = 0; done < gap; ++i) {
    const int64_t k_nom = i < pcs.size() ? pcs[i].k_nom : static_cast<int64_t>(size);
    const int64_t left = gap - done;
    int64_t k = std::min(left, k_nom);
    if (i >= pcs.size() || t_start + done < pcs[i].t_free) {
      const double cap = bias_cap(h, static_cast<double>(t_start + done));
      if (cap < static_cast<double>(k)) k = static_cast<int64_t>(cap);
    }
    if (k < k_nom) nominal = nominal && k == left;  // a cut last piece keeps the row nominal
    if (nominal && k == k_nom) {
      out.push_back(full_piece(h, pcs[i], b1s, b2s));
    } else {
      out.push_back(make_piece(h, t_start, done, k, k));
    }
    done += k;
    size *= h.growth;
  }
}

// The exact step's displacement from the step's new moments m, v (f0, f1: exact_piece's factors)
template <bool KERAS>
inline float exact_step(float m, float v, float f0, float f1, float eps) {
  return KERAS ? m / (std::sqrt(v) + eps) * f0 : (m * f0) / (std::sqrt(v) * f1 + eps);
}

// G at a node from v there (f: the node's factors, g_factors' layout)
template <bool KERAS>
inline float g_of(float vx, const float* f, float eps) {
  return KERAS ? (1.f / (std::sqrt(vx) + eps)) * f[1] : 1.f / (std::sqrt(vx) * f[1] + f[2]);
}

constexpr int64_t kChunk = 16;  // columns a block works on at once (the Lucas rounds' vectors)

// One chunk of a block's columns between its two ends: the frozen step's trace P, P^2 - 4 b1,
// g = lr * mean G, and the Lucas sequences U_k, V_k once the rounds have run.
struct BlockCols {
  double P[kChunk], DIS[kChunk], G[kChunk], U[kChunk], VL[kChunk];
};

// A block's start on n <= kChunk columns: g from the predicted w path, P, and U_1, V_1.
template <bool KERAS>
inline __attribute__((always_inline)) void block_start(const CatchHyper& h, const Piece& p, const float* W,
                                                       const float* M, const float* V, int64_t n, BlockCols& c) {
  // the piece's factors as locals: W, M, V stores could alias p.f, which kept the loops scalar
  const float f0 = p.f[0], f1 = p.f[1], f13 = p.f[13];
  const float n1[3] = {p.f[3], p.f[4], p.f[5]}, n2[3] = {p.f[6], p.f[7], p.f[8]};
  const float pa1 = p.f[9], pb1 = p.f[10], pa2 = p.f[11], pb2 = p.f[12];
  const float epsf = h.epsf, c2 = h.c2, b1f = h.b1f, b2f = h.b2f, c_m = h.c_m, c_v = h.c_v;
  const double b1 = h.b1, half_lr = 0.5 * h.lr, ca = h.c * (1.0 - h.b1);
  const double g_max = h.c > 0.0 ? 2.0 * (1.0 + b1) / ((1.0 - b1) * h.c) : 1e300;
  for (int64_t j = 0; j < n; ++j) {
    const float w = W[j], m = M[j], v = V[j];
    const float dv = (w * w) * c2 - v;
    // the predicted w path: the block's first step (exact, at t0 + 1), continued; stopped at 0
    const float m1 = m * b1f + w * c_m, v1 = v * b2f + (w * w) * c_v;
    float sp = -exact_step<KERAS>(m1, v1, f0, f1, epsf);
    const float lim = std::fabs(w) * f13;
    sp = sp * w < 0.f ? std::min(std::max(sp, -lim), lim) : sp;
    const float ws = w * sp, ss = sp * sp;
    const float vx1 = std::max(v + dv * n1[0] + ws * pa1 + ss * pb1, 0.f);
    const float vx2 = std::max(v + dv * n2[0] + ws * pa2 + ss * pb2, 0.f);
    const double g =
        std::min(static_cast<double>(g_of<KERAS>(vx1, n1, epsf) + g_of<KERAS>(vx2, n2, epsf)) * half_lr, g_max);
    c.G[j] = g;
    c.P[j] = 1.0 - ca * g + b1;
    c.DIS[j] = c.P[j] * c.P[j] - 4.0 * b1;
    c.U[j] = 1.0;  // n = 1: U_1 = 1, V_1 = P (k's top bit)
    c.VL[j] = c.P[j];
  }
}

// The Lucas doubling rounds for a block of k >= 2 steps on nb chunks at once (Q = b1 for all).
// The rounds of one chunk are one dependency chain; rows advanced together give the CPU
// several independent chains to overlap.
inline __attribute__((always_inline)) void lucas_rounds(double b1, int64_t k, BlockCols* cs, int nb, int64_t n) {
  const int top = 63 - __builtin_clzll(static_cast<unsigned long long>(k));  // k's top bit (k >= 2)
  double qn = b1;
  for (int bit = top - 1; bit >= 0; --bit) {
    const bool one = ((k >> bit) & 1) != 0;
    for (int b = 0; b < nb; ++b) {
      BlockCols& c = cs[b];
      for (int64_t j = 0; j < n; ++j) {  // n -> 2n, then 2n + 1 where the bit is set
        const double u = c.U[j] * c.VL[j], vl = c.VL[j] * c.VL[j] - 2.0 * qn;
        c.U[j] = one ? (c.P[j] * u + vl) * 0.5 : u;
        c.VL[j] = one ? (c.DIS[j] * u + c.P[j] * vl) * 0.5 : vl;
      }
    }
    qn = one ? qn * qn * b1 : qn * qn;
  }
}

// A block's end: A^k = (V_k / 2) I + U_k N, N = A - (P/2) I (no cancellation between large
// terms) applied to (w, m), and v at the block end along the straight w path.
inline __attribute__((always_inline)) void block_end(const CatchHyper& h, const Piece& p, float* W, float* M,
                                                     float* V, int64_t n, const BlockCols& c) {
  const float f13 = p.f[13], f17 = p.f[17], f18 = p.f[18], f19 = p.f[19], f20 = p.f[20];
  const double b1 = h.b1, ca = h.c * (1.0 - h.b1);
  for (int64_t j = 0; j < n; ++j) {
    const float w = W[j], m = M[j], v = V[j];
    const double wd = w, md = m, n11 = (c.P[j] - 2.0 * b1) * 0.5, vh = c.VL[j] * 0.5, uk = c.U[j];
    const float we = static_cast<float>(vh * wd + uk * (n11 * wd - c.G[j] * b1 * md));
    const float me = static_cast<float>(vh * md + uk * (ca * wd - n11 * md));
    const float s = (we - w) * f13;
    const float ww = w * w;
    const float ve = ww * f17 + (w * s) * f18 + (s * s) * f19 + v * f20;
    W[j] = we;
    M[j] = me;
    V[j] = std::max(ve, 0.f);
  }
}

// A block of k >= 2 steps on a row's D columns: the frozen-step matrix power
// (recsys/optim/cowclip/catchup.py, _block and _lucas). Per column g = lr * mean G (2 Gauss-Legendre
// nodes, v there along the w path that the block's first step predicts, stopped at 0),
// A = [[1 - h(1-b1), -g b1], [(1-b1) c, b1]] with h = c g (capped so A's spectral radius is <= 1),
// A^k = (V_k / 2) I + U_k (A - (P/2) I) with the Lucas sequences U_n, V_n (P = trace, Q = b1) by
// binary doubling. Columns go in chunks so the doubling rounds (uniform: they follow the bits of k)
// vectorize. In double: the power needs h to far below float's resolution of P = 1 + b1 - h(1-b1)
// (h is ~1e-6 where v holds data gradients; in float, (1-h)^k came out wrong by 1e-4 relative and
// more), and the double arithmetic cost no measurable time against float in tools/bench/catchup.py.
template <bool KERAS>
inline __attribute__((always_inline)) void advance_block(const CatchHyper& h, const Piece& p, float* W, float* M,
                                                         float* V, int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += kChunk) {
    const int64_t n = std::min(kChunk, D - d0);
    BlockCols c;
    block_start<KERAS>(h, p, W + d0, M + d0, V + d0, n, c);
    lucas_rounds(h.b1, p.k, &c, 1, n);
    block_end(h, p, W + d0, M + d0, V + d0, n, c);
  }
}

// One piece of a row's schedule applied to its D floats of w, m, v, in place. Branch-free
// column loops, so they vectorize.
template <bool KERAS>
inline __attribute__((always_inline)) void advance_piece(const CatchHyper& h, const Piece& p, float* W, float* M,
                                                         float* V, int64_t D) {
  const float* f = p.f;
  if (p.k == 1) {
    const float b1f = h.b1f, b2f = h.b2f, epsf = h.epsf, c_m = h.c_m, c_v = h.c_v, f0 = f[0], f1 = f[1];
    for (int64_t d = 0; d < D; ++d) {
      const float w = W[d];
      const float m = M[d] * b1f + w * c_m;
      const float v = V[d] * b2f + (w * w) * c_v;
      W[d] = w - exact_step<KERAS>(m, v, f0, f1, epsf);
      M[d] = m;
      V[d] = v;
    }
    return;
  }
  advance_block<KERAS>(h, p, W, M, V, D);
}

// A row behind, waiting in a group: its buffers and its schedule (pieces).
struct BehindRow {
  float *W, *M, *V;
  const Piece* ps;
  int64_t n;
};

constexpr int kCatchGroup = 8;  // rows advanced together, piece by piece

// Rows of a group whose piece i is a block of one size k (full pieces of one index are): their
// columns go through block_start, then the Lucas rounds of all of them together, then block_end.
// Each chunk's rounds are one dependency chain; side by side the CPU overlaps them.
template <bool KERAS>
inline __attribute__((always_inline)) void advance_blocks_together(const CatchHyper& h, const BehindRow* rows,
                                                                   const int* which, int nb, int64_t i, int64_t D) {
  const int64_t k = rows[which[0]].ps[i].k;
  for (int64_t d0 = 0; d0 < D; d0 += kChunk) {
    const int64_t n = std::min(kChunk, D - d0);
    BlockCols cs[kCatchGroup];
    for (int b = 0; b < nb; ++b) {
      const BehindRow& r = rows[which[b]];
      block_start<KERAS>(h, r.ps[i], r.W + d0, r.M + d0, r.V + d0, n, cs[b]);
    }
    lucas_rounds(h.b1, k, cs, nb, n);
    for (int b = 0; b < nb; ++b) {
      const BehindRow& r = rows[which[b]];
      block_end(h, r.ps[i], r.W + d0, r.M + d0, r.V + d0, n, cs[b]);
    }
  }
}

// Advance a group of rows piece-major: piece i of every row, then piece i+1. A row's pieces form
// one long dependency chain (sqrt, divide, exp, ...); the rows of a group are independent, so the
// CPU overlaps their chains instead of waiting on one (13.6 -> 11.8 ms for the 24K rows behind of a
// steady-state step in tools/bench/catchup.py, measured). The blocks of one size among piece i
// run together (advance_blocks_together); rows are distinct, so the order changes no bit.
// Compiled for AVX-512, AVX2 and baseline x86-64, picked at load time (target_clones): the
// extension is otherwise built for baseline x86-64.
template <bool KERAS>
inline __attribute__((always_inline)) void advance_group_impl(const CatchHyper& h, const BehindRow* rows, int g,
                                                              int64_t D) {
  int64_t most = 0;
  for (int r = 0; r < g; ++r) most = std::max(most, rows[r].n);
  for (int64_t i = 0; i < most; ++i) {
    int which[kCatchGroup];
    int nb = 0;
    int64_t k = 0;
    for (int r = 0; r < g; ++r) {
      if (i >= rows[r].n) continue;
      const Piece& p = rows[r].ps[i];
      if (p.k >= 2 && (nb == 0 || p.k == k)) {
        which[nb++] = r;
        k = p.k;
      } else {
        advance_piece<KERAS>(h, p, rows[r].W, rows[r].M, rows[r].V, D);
      }
    }
    if (nb) advance_blocks_together<KERAS>(h, rows, which, nb, i, D);
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RECSYS_CATCH_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define RECSYS_CATCH_CLONES
#endif

RECSYS_CATCH_CLONES void advance_group_torch(const CatchHyper& h, const BehindRow* rows, int g, int64_t D) {
  advance_group_impl<false>(h, rows, g, D);
}

RECSYS_CATCH_CLONES void advance_group_keras(const CatchHyper& h, const BehindRow* rows, int g, int64_t D) {
  advance_group_impl<true>(h, rows, g, D);
}

inline void advance_group(const CatchHyper& h, const BehindRow* rows, int g, int64_t D) {
  if (h.keras)
    advance_group_keras(h, rows, g, D);
  else
    advance_group_torch(h, rows, g, D);
}

// Per-thread schedule cache: slot[gap] -> (first piece, pieces) for gaps seen in this call.
struct CatchScratch {
  std::vector<int64_t> slot_start;  // -1: not computed
  std::vector<int32_t> slot_count;
  std::vector<int64_t> touched;
  std::vector<Piece> pieces;
  std::vector<Piece> tmp;
};

CatchScratch& catch_scratch() {
  thread_local CatchScratch s;
  return s;
}

constexpr int64_t kMaxCachedGap = int64_t(1) << 22;

// Denormals off while rows are advanced (restored on scope exit, exceptions included): moments
// decayed over long gaps reach 1e-38 and below, where every float op takes a microcode assist
// (+40% op time measured in the steady state of tools/bench/catchup.py). Below 1.2e-38 they count
// as 0: no weight moves by them.
struct NoDenormals {
#if defined(__SSE__)
  unsigned csr = _mm_getcsr();
  NoDenormals() { _mm_setcsr(csr | 0x8040); }  // flush-to-zero | denormals-are-zero
  ~NoDenormals() { _mm_setcsr(csr); }
#endif
};

template <typename index_t>
int64_t catch_up_table(const CatchHyper& h, int64_t step, float* W, float* M, float* V, int64_t* RS, int64_t N,
                       int64_t D, const index_t* idx, int64_t lo, int64_t hi) {
  CatchScratch& cs = catch_scratch();
  int64_t advanced = 0;
  // a group holds schedule offsets until it runs: new schedules may move cs.pieces
  BehindRow group[kCatchGroup];
  int64_t group_start[kCatchGroup];
  int g = 0;
  auto flush = [&]() {
    for (int r = 0; r < g; ++r) group[r].ps = cs.pieces.data() + group_start[r];
    advance_group(h, group, g, D);
    g = 0;
  };
  for (int64_t i = lo; i < hi; ++i) {
    if (i + kCatchPrefetchRowStep < hi) {
      const int64_t a = static_cast<int64_t>(idx[i + kCatchPrefetchRowStep]);
      if (a >= 0 && a < N) prefetch(RS + a);
    }
    if (i + kCatchPrefetchRows < hi) {
      const int64_t a = static_cast<int64_t>(idx[i + kCatchPrefetchRows]);
      if (a >= 0 && a < N && RS[a] < step) {
        prefetch(W + a * D);
        prefetch(M + a * D);
        prefetch(V + a * D);
      }
    }
    const int64_t k = static_cast<int64_t>(idx[i]);
    RECSYS_CHECK(k >= 0 && k < N, "catch-up: index ", k, " outside a table of ", N, " rows");
    const int64_t rs = RS[k];
    if (rs >= step) continue;  // current, or already in this call's work (a repeated id)
    RS[k] = step;
    ++advanced;
    const int64_t gap = step - rs;
    if (gap >= kMaxCachedGap) {  // not cached (a gap of millions of steps): alone, now
      if (g) flush();
      cs.tmp.clear();
      make_schedule(h, rs, gap, cs.tmp);
      const BehindRow one{W + k * D, M + k * D, V + k * D, cs.tmp.data(), static_cast<int64_t>(cs.tmp.size())};
      advance_group(h, &one, 1, D);
      continue;
    }
    if (static_cast<int64_t>(cs.slot_start.size()) <= gap) {
      cs.slot_start.resize(std::min(kMaxCachedGap, std::max<int64_t>(2 * gap, 1024)), -1);
      cs.slot_count.resize(cs.slot_start.size(), 0);
    }
    if (cs.slot_start[gap] < 0) {
      cs.slot_start[gap] = static_cast<int64_t>(cs.pieces.size());
      const size_t before = cs.pieces.size();
      make_schedule(h, rs, gap, cs.pieces);
      cs.slot_count[gap] = static_cast<int32_t>(cs.pieces.size() - before);
      cs.touched.push_back(gap);
    }
    group[g] = BehindRow{W + k * D, M + k * D, V + k * D, nullptr, cs.slot_count[gap]};
    group_start[g] = cs.slot_start[gap];
    if (++g == kCatchGroup) flush();
  }
  if (g) flush();
  return advanced;
}

void reset_catch_scratch() {
  CatchScratch& cs = catch_scratch();
  for (int64_t g : cs.touched) cs.slot_start[g] = -1;
  cs.touched.clear();
  cs.pieces.clear();
}

Tensor cowclip_catch_up_tables_cpu(
    Tensor weights, Tensor momentum1, Tensor momentum2, Tensor row_step,
    const Tensor& feature_meta, const Tensor& indices, const Tensor& offsets, int64_t step,
    double lr, double beta1, double beta2, double eps, double l2, bool keras_eps, double growth) {
  RECSYS_CHECK(weights.dim() == 1, "weights must be the flat 1-D buffer");
  check_state(weights, momentum1, momentum2, row_step);
  RECSYS_CHECK(feature_meta.dim() == 2 && feature_meta.size(1) == 6 && feature_meta.scalar_type() == ScalarType::Long &&
                  feature_meta.is_contiguous(),
              "feature_meta must be a contiguous int64 [F, 6]");
  RECSYS_CHECK(indices.dim() == 1 && offsets.dim() == 1 && indices.is_contiguous() && offsets.is_contiguous(),
              "indices and offsets must be contiguous 1-D");
  RECSYS_CHECK(indices.scalar_type() == offsets.scalar_type() &&
                  (indices.scalar_type() == ScalarType::Long || indices.scalar_type() == ScalarType::Int),
              "indices and offsets must both be int64 or both int32");
  RECSYS_CHECK(growth >= 1.0, "growth must be >= 1, got ", growth);
  RECSYS_CHECK(beta1 > 0.0 && beta1 < 1.0 && beta2 > 0.0 && beta2 < 1.0, "betas must be in (0, 1)");
  const int64_t F = feature_meta.size(0);
  RECSYS_CHECK(F > 0 && (offsets.numel() - 1) % F == 0, "offsets must have F*B+1 entries");
  const int64_t B = (offsets.numel() - 1) / F;
  const int64_t* meta = feature_meta.const_data_ptr<int64_t>();
  for (int64_t f = 0; f < F; ++f) {
    const int64_t* mf = meta + 6 * f;
    RECSYS_CHECK(mf[0] >= 0 && mf[1] >= 0 && mf[2] > 0 && mf[0] + mf[1] * mf[2] <= weights.numel(),
                "feature ", f, ": table outside the weights buffer");
    RECSYS_CHECK(mf[4] >= 0 && mf[4] + mf[1] <= row_step.numel(), "feature ", f, ": rows outside row_step");
  }
  auto out = zeros_long({F});
  if (indices.numel() == 0) return out;
  CatchHyper h{};
  h.lr = lr;
  h.b1 = beta1;
  h.b2 = beta2;
  h.eps = eps;
  h.c = 2.0 * l2;
  h.growth = growth;
  h.keras = keras_eps;
  h.b1f = static_cast<float>(beta1);
  h.b2f = static_cast<float>(beta2);
  h.epsf = static_cast<float>(eps);
  h.c_m = static_cast<float>((1.0 - beta1) * h.c);
  h.c_v = static_cast<float>((1.0 - beta2) * h.c * h.c);
  h.c2 = static_cast<float>(h.c * h.c);
  float* W = weights.mutable_data_ptr<float>();
  float* M1 = momentum1.mutable_data_ptr<float>();
  float* M2 = momentum2.mutable_data_ptr<float>();
  int64_t* RS = row_step.mutable_data_ptr<int64_t>();
  int64_t* res = out.mutable_data_ptr<int64_t>();
  auto run = [&](auto* idx, auto* off) {
    // features read distinct tables (checked by the update op's callers); one task per feature
    parallel_for_checked(0, F, 1, [&](int64_t f0, int64_t f1) {
      const NoDenormals no_denormals;
      for (int64_t f = f0; f < f1; ++f) {
        const int64_t* mf = meta + 6 * f;
        const int64_t D = mf[2];
        res[f] = catch_up_table(h, step, W + mf[0], M1 + mf[0], M2 + mf[0], RS + mf[4], mf[1], D, idx,
                                static_cast<int64_t>(off[f * B]), static_cast<int64_t>(off[(f + 1) * B]));
      }
      reset_catch_scratch();
    });
  };
  if (indices.scalar_type() == ScalarType::Long)
    run(indices.const_data_ptr<int64_t>(), offsets.const_data_ptr<int64_t>());
  else
    run(indices.const_data_ptr<int32_t>(), offsets.const_data_ptr<int32_t>());
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY(recsys, m) {
  m.def(
      "cowclip_adam_step_(Tensor(a!) weight, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!) row_step, Tensor indices, Tensor offsets, Tensor grad_output, "
      "Tensor? per_sample_weights, float lr, float beta1, float beta2, float eps, float r, "
      "float zeta, float l2, bool clip, bool keras_eps) -> Tensor");
  m.def(
      "cowclip_adam_tables_(Tensor(a!) weights, Tensor(b!) momentum1, Tensor(c!) momentum2, "
      "Tensor(d!) row_step, Tensor feature_meta, Tensor zeta, Tensor indices, Tensor offsets, "
      "Tensor grad_output, Tensor? per_sample_weights, float lr, float beta1, float beta2, "
      "float eps, float r, float l2, bool keras_eps) -> Tensor");
  m.def(
      "cowclip_catch_up_tables_(Tensor(a!) weights, Tensor(b!) momentum1, Tensor(c!) momentum2, "
      "Tensor(d!) row_step, Tensor feature_meta, Tensor indices, Tensor offsets, int step, float lr, "
      "float beta1, float beta2, float eps, float l2, bool keras_eps, float growth) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(recsys, CPU, m) {
  m.impl("cowclip_adam_step_", TORCH_BOX(&cowclip_adam_step_cpu));
  m.impl("cowclip_adam_tables_", TORCH_BOX(&cowclip_adam_tables_cpu));
  m.impl("cowclip_catch_up_tables_", TORCH_BOX(&cowclip_catch_up_tables_cpu));
}
