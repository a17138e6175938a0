// RmsNorm forward and aclnnRmsNormGrad: the CPU kernels (calling convention and shared numerics: kernels.h).
//
//   rstd[r]   = 1 / sqrt(sum_j x[r,j]^2 * (1/N) + eps)                 (float32)
//   y[r,j]    = x[r,j] * rstd[r] * gamma[j]
//   c[r]      = sum_j(dy[r,j] * gamma[j] * x[r,j]) * rstd[r] * (1/N)   (= mean_j(dy * gamma * xh), xh = x * rstd)
//   dx[r,j]   = (dy[r,j] * gamma[j] - xh[r,j] * c[r]) * rstd[r]
//   dgamma[j] = sum_r dy[r,j] * xh[r,j]                                 (float32)
//
// All math and accumulation in float32 (products in the order written), rounded once to the output dtype. Row sums
// go into 16 lanes (column j into lane j % 16), added in a fixed tree order at the end of the row, so the bits
// depend on N only. dgamma: row_blocks(M, N) fixed row blocks, each with a float32 partial row, folded by fold_rows.
//
// The loops run on 8 float32 at a time (F8: vec.h's lanes, GCC / Clang vector extensions lowered to AVX, SSE or
// NEON, or to scalars), loaded from and stored to each storage dtype by vec.h's load / store; the last N % 8
// columns of a row take the same formulas one at a time. Element-wise, so no reassociation: every column's
// value is the same whichever width computed it.

#include "kernels.h"
#include "vec.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>

namespace gradops {
namespace {

// ---------------------------------------------------------------- 8 float32 at a time
using F8 = vec::Lanes;
using vec::load;
using vec::store;

// The row helpers below are called once or twice per row: inlined, so that a short row pays no call (GCC left
// sum_of_squares<float> out of line, +14% on the 64 x 128 float32 forward).
#define GRADOPS_RMS_INLINE inline __attribute__((always_inline))

// Lanes of a row sum: two F8 (two independent add chains hide the add latency). A column keeps its lane wherever
// its row is cut: the loops step by kLanes, and the last N % kLanes columns go into lanes 0, 1, ... in order.
constexpr int64_t kLanes = 16;

// The 16 lanes' sum in a fixed tree order: lane k absorbs lane k + w for w = 8, 4, 2, 1. The first step on the
// whole F8s; the rest written out, in registers (the same steps as a loop over an array went through the stack,
// and the narrow reloads of the wide stores stalled store forwarding, ~20 ns a row: 512 x 256 float32 forward
// 36 -> 26 µs).
inline float lane_sum(F8 a0, F8 a1) {
  const F8 t = a0 + a1;
  return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

// The last n % kLanes columns' terms term(j) into lanes 0, 1, ... of (a0, a1), one at a time.
template <class Term>
GRADOPS_RMS_INLINE void add_tail(F8& a0, F8& a1, int64_t from, int64_t n, const Term& term) {
  if (from == n) return;
  float lanes[kLanes];
  std::memcpy(lanes, &a0, sizeof a0);
  std::memcpy(lanes + 8, &a1, sizeof a1);
  for (int64_t k = 0; from + k < n; ++k) lanes[k] += term(from + k);
  std::memcpy(&a0, lanes, sizeof a0);
  std::memcpy(&a1, lanes + 8, sizeof a1);
}

// The family's storage dtypes (the seed's table: x in float32 / float16 / bfloat16, gamma in x's dtype or
// float32): f(T{}) with T the C++ type of ``type``. float64 never reaches a kernel (see kernels.h).
template <class F>
void dispatch_storage(at::ScalarType type, const char* what, const F& f) {
  switch (type) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(c10::Half{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "gradops.native: rms_norm kernels take no ", what, " of dtype ", type);
  }
}

// A row sum in blocks of kBlock columns: each block's terms in the 16 float32 lanes, the blocks' lane sums added in
// float64. In-order float32 lanes lose accuracy with the row's length (N = 2^20: rstd's relative error ~5e-6, where
// ATen's cascade sum keeps ~3e-8); the blocks keep the error of one 256-element float32 sum at every length, for
// one float64 add per 256 columns. A row of at most kBlock columns gives the bits of the lanes alone.
// body(j, a0, a1) adds the terms of columns [j, j + 16) to the lanes; tail(i) is the term of column i.
constexpr int64_t kBlock = 256;

template <class Body, class Term>
GRADOPS_RMS_INLINE float blocked_sum(int64_t n, const Body& body, const Term& tail) {
  double total = 0.0;
  int64_t j = 0;
  F8 a0 = {}, a1 = {};
  for (;;) {
    const int64_t end = std::min(n - n % kLanes, j + kBlock);
    for (; j < end; j += kLanes) body(j, a0, a1);
    if (j + kLanes > n) break;  // the whole groups are done: the tail joins the last block's lanes
    total += static_cast<double>(lane_sum(a0, a1));
    a0 = F8{};
    a1 = F8{};
  }
  add_tail(a0, a1, j, n, tail);
  return static_cast<float>(total + static_cast<double>(lane_sum(a0, a1)));
}

// ---------------------------------------------------------------- forward
// sum_j x[j]^2 of one row.
template <class T>
GRADOPS_RMS_INLINE float sum_of_squares(const T* x, int64_t n) {
  return blocked_sum(
      n,
      [&](int64_t j, F8& a0, F8& a1) {
        const F8 v0 = load(x + j), v1 = load(x + j + 8);
        a0 += v0 * v0;
        a1 += v1 * v1;
      },
      [&](int64_t i) {
        const float v = to_f32(x[i]);
        return v * v;
      });
}

// The same for two rows in one pass (each row with its own lanes, as above).
template <class T>
GRADOPS_RMS_INLINE void sums_of_squares(const T* xa, const T* xb, int64_t n, float& sa, float& sb) {
  F8 a0 = {}, a1 = {}, b0 = {}, b1 = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const F8 v0 = load(xa + j), v1 = load(xa + j + 8), w0 = load(xb + j), w1 = load(xb + j + 8);
    a0 += v0 * v0;
    a1 += v1 * v1;
    b0 += w0 * w0;
    b1 += w1 * w1;
  }
  add_tail(a0, a1, j, n, [&](int64_t i) {
    const float v = to_f32(xa[i]);
    return v * v;
  });
  add_tail(b0, b1, j, n, [&](int64_t i) {
    const float v = to_f32(xb[i]);
    return v * v;
  });
  sa = lane_sum(a0, a1);
  sb = lane_sum(b0, b1);
}

// y[j] = x[j] * s * gamma[j] over one row (a second pass over it, from L1 / L2). gamma is read in its own dtype:
// widened to a float32 copy it took twice the cache, and a 4096-column bfloat16 row with its gamma and y no longer
// fit L1 (8192 x 4096 forward +5%).
template <class T, class G>
GRADOPS_RMS_INLINE void scale_row(const T* x, const G* g, float s, T* y, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) store(load(x + j) * s * load(g + j), y + j);
  for (; j < n; ++j) y[j] = from_f32<T>(to_f32(x[j]) * s * to_f32(g[j]));
}

// Rows lo..hi-1: rstd[r], then y[r, :]. Short float16 / bfloat16 rows go two at a time through their first pass:
// their conversions make it compute-bound, and the second row's independent adds fill the first's latency (float16
// 512 x 256: 25 -> 20 µs, 64 x 128: 2.1 -> 1.5 µs; bfloat16 -9% / -15%; 32768 x 128 float16 -15%). Only rows of
// at most kPairItems items: a pair of longer rows is two interleaved streams the prefetchers serve worse (4096 x 1024
// and 2048 x 2048 float16 from memory: 1.2 -> 1.7 ms). float32 rows, bound by memory, ran 5% slower paired at
// 64 x 128 and no faster at 512 x 256: one at a time. Either way a row's bits are the same.
constexpr int64_t kPairItems = 256;
static_assert(kPairItems <= kBlock, "paired rows are one block: sums_of_squares keeps no float64 total");

template <class T, class G>
void rms_norm_rows(const T* x, const G* g, float eps, T* y, float* rstd, int64_t n, int64_t lo, int64_t hi) {
  const float inv_n = 1.0f / static_cast<float>(n);
  int64_t r = lo;
  if constexpr (!std::is_same_v<T, float>) {
    for (; n <= kPairItems && r + 2 <= hi; r += 2) {
      float sa, sb;
      sums_of_squares(x + r * n, x + (r + 1) * n, n, sa, sb);
      const float s = 1.0f / std::sqrt(sa * inv_n + eps), t = 1.0f / std::sqrt(sb * inv_n + eps);
      rstd[r] = s;
      rstd[r + 1] = t;
      scale_row(x + r * n, g, s, y + r * n, n);
      scale_row(x + (r + 1) * n, g, t, y + (r + 1) * n, n);
    }
  }
  for (; r < hi; ++r) {
    const float s = 1.0f / std::sqrt(sum_of_squares(x + r * n, n) * inv_n + eps);
    rstd[r] = s;
    scale_row(x + r * n, g, s, y + r * n, n);
  }
}

// "rms_norm": the forward.
//   in:     x (rows x cols, float32 / float16 / bfloat16), gamma (cols, x's dtype or float32)
//   out:    y (rows x cols, x's dtype), rstd (rows, float32)
//   ints:   rows, cols
//   floats: epsilon (rounded to float32, as the math is)
// A row of no columns has mean(x^2) = 0: rstd = 1/sqrt(eps) (inf when eps = 0). Refuses nothing: returns -1.
int64_t rms_norm_kernel(const KernelArgs& a) {
  TORCH_CHECK(a.in.size() == 2 && a.out.size() == 2 && a.ints.size() == 2 && a.floats.size() == 1,
              "gradops.native: rms_norm takes (x, gamma) -> (y, rstd), ints (rows, cols), floats (epsilon)");
  const int64_t m = a.ints[0], n = a.ints[1];
  const at::Tensor &x = a.in[0], &gamma = a.in[1], &y = a.out[0], &rstd = a.out[1];
  TORCH_CHECK(m >= 0 && n >= 0 && x.numel() == m * n && y.numel() == m * n && gamma.numel() == n &&
                  rstd.numel() == m && y.scalar_type() == x.scalar_type() && rstd.scalar_type() == at::kFloat,
              "gradops.native: rms_norm's tensors do not match rows x cols = ", m, " x ", n);
  const float eps = static_cast<float>(a.floats[0]);
  if (m == 0) return -1;
  float* rs = rstd.data_ptr<float>();
  if (n == 0) {
    std::fill(rs, rs + m, 1.0f / std::sqrt(eps));
    return -1;
  }
  dispatch_storage(x.scalar_type(), "x", [&](auto xtag) {
    using T = decltype(xtag);
    dispatch_storage(gamma.scalar_type(), "gamma", [&](auto gtag) {
      using G = decltype(gtag);
      const T* xp = x.data_ptr<T>();
      const G* g = gamma.data_ptr<G>();
      T* yp = y.data_ptr<T>();
      // No cross-row state: any split over threads gives the same bits.
      parallel(0, m, rows_grain(m, n),
               [&](int64_t lo, int64_t hi) { rms_norm_rows<T, G>(xp, g, eps, yp, rs, n, lo, hi); });
    });
  });
  return -1;
}

// ---------------------------------------------------------------- backward
// c[r] of one row (see the top of the file).
template <class T, class G>
GRADOPS_RMS_INLINE float row_coef(const T* dy, const T* x, const G* g, float s, float inv_n, int64_t n) {
  const float sum = blocked_sum(
      n,
      [&](int64_t j, F8& a0, F8& a1) {
        a0 += load(dy + j) * load(g + j) * load(x + j);
        a1 += load(dy + j + 8) * load(g + j + 8) * load(x + j + 8);
      },
      [&](int64_t i) { return to_f32(dy[i]) * to_f32(g[i]) * to_f32(x[i]); });
  return sum * s * inv_n;
}

// dx's 8 columns at p: streamed past the caches (kStream, float32 only: see kernels.h), else stored.
template <bool kStream, class T>
GRADOPS_RMS_INLINE void put8(F8 v, T* p) {
  if constexpr (kStream && std::is_same_v<T, float>) {
    stream8(p, v);
  } else {
    store(v, p);
  }
}

// Row block b of ``blocks`` (ceil(m / blocks) rows each; the last blocks may have fewer or none): dx of its rows and
// its dgamma partial row part[0, n), which it zeroes first. Rows go four at a time: c of each (a pass over the four
// rows), then dx and partial[j] += dy0*xh0 + dy1*xh1 + dy2*xh2 + dy3*xh3 (a second pass, from L2: four rows of 4096
// float32 dy and x are 128 KiB), one load and store of the partial per four rows (numba's version of this loop
// measured 72% -> 89% of copy_'s bandwidth at 8192 x 4096 float32 against one row per update).
template <bool kStream, class T, class G>
void rms_norm_grad_block(const T* dy, const T* x, const float* rstd, const G* g, T* dx, float* part, int64_t m,
                         int64_t n, int64_t blocks, int64_t b) {
  const int64_t per = (m + blocks - 1) / blocks;
  const float inv_n = 1.0f / static_cast<float>(n);
  std::fill(part, part + n, 0.0f);
  int64_t r = std::min(m, b * per);
  const int64_t end = std::min(m, r + per);
  for (; r + 4 <= end; r += 4) {
    const T *d0 = dy + r * n, *d1 = d0 + n, *d2 = d1 + n, *d3 = d2 + n;
    const T *x0 = x + r * n, *x1 = x0 + n, *x2 = x1 + n, *x3 = x2 + n;
    T *o0 = dx + r * n, *o1 = o0 + n, *o2 = o1 + n, *o3 = o2 + n;
    const float s0 = rstd[r], s1 = rstd[r + 1], s2 = rstd[r + 2], s3 = rstd[r + 3];
    const float c0 = row_coef(d0, x0, g, s0, inv_n, n), c1 = row_coef(d1, x1, g, s1, inv_n, n);
    const float c2 = row_coef(d2, x2, g, s2, inv_n, n), c3 = row_coef(d3, x3, g, s3, inv_n, n);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const F8 gj = load(g + j);
      const F8 e0 = load(d0 + j), e1 = load(d1 + j), e2 = load(d2 + j), e3 = load(d3 + j);
      const F8 h0 = load(x0 + j) * s0, h1 = load(x1 + j) * s1, h2 = load(x2 + j) * s2, h3 = load(x3 + j) * s3;
      put8<kStream>((e0 * gj - h0 * c0) * s0, o0 + j);
      put8<kStream>((e1 * gj - h1 * c1) * s1, o1 + j);
      put8<kStream>((e2 * gj - h2 * c2) * s2, o2 + j);
      put8<kStream>((e3 * gj - h3 * c3) * s3, o3 + j);
      store(load(part + j) + (e0 * h0 + e1 * h1 + e2 * h2 + e3 * h3), part + j);
    }
    for (; j < n; ++j) {
      const float gj = to_f32(g[j]);
      const float e0 = to_f32(d0[j]), e1 = to_f32(d1[j]), e2 = to_f32(d2[j]), e3 = to_f32(d3[j]);
      const float h0 = to_f32(x0[j]) * s0, h1 = to_f32(x1[j]) * s1, h2 = to_f32(x2[j]) * s2, h3 = to_f32(x3[j]) * s3;
      o0[j] = from_f32<T>((e0 * gj - h0 * c0) * s0);
      o1[j] = from_f32<T>((e1 * gj - h1 * c1) * s1);
      o2[j] = from_f32<T>((e2 * gj - h2 * c2) * s2);
      o3[j] = from_f32<T>((e3 * gj - h3 * c3) * s3);
      part[j] += e0 * h0 + e1 * h1 + e2 * h2 + e3 * h3;
    }
  }
  for (; r < end; ++r) {  // the block's last rows, fewer than four
    const T* d = dy + r * n;
    const T* xr = x + r * n;
    T* o = dx + r * n;
    const float s = rstd[r];
    const float c = row_coef(d, xr, g, s, inv_n, n);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const F8 e = load(d + j), h = load(xr + j) * s;
      put8<kStream>((e * load(g + j) - h * c) * s, o + j);
      store(load(part + j) + e * h, part + j);
    }
    for (; j < n; ++j) {
      const float e = to_f32(d[j]), h = to_f32(xr[j]) * s;
      o[j] = from_f32<T>((e * to_f32(g[j]) - h * c) * s);
      part[j] += e * h;
    }
  }
}

// "rms_norm_grad": aclnnRmsNormGrad.
//   in:   dy (rows x cols, float32 / float16 / bfloat16), x (rows x cols, dy's dtype), rstd (rows, float32),
//         gamma (cols, dy's dtype or float32), and optionally workspace (uint8, at least row_blocks(rows, cols) x
//         cols x 4 bytes, 4-byte aligned: the float32 dgamma partials go there; absent, too small or misaligned,
//         the kernel allocates them)
//   out:  dx (rows x cols, dy's dtype), dgamma (cols, float32)
//   ints: rows, cols
// No rows or no columns: dgamma = 0 (dx is empty). Refuses nothing: returns -1.
int64_t rms_norm_grad_kernel(const KernelArgs& a) {
  TORCH_CHECK((a.in.size() == 4 || a.in.size() == 5) && a.out.size() == 2 && a.ints.size() == 2,
              "gradops.native: rms_norm_grad takes (dy, x, rstd, gamma[, workspace]) -> (dx, dgamma), "
              "ints (rows, cols)");
  const int64_t m = a.ints[0], n = a.ints[1];
  const at::Tensor &dy = a.in[0], &x = a.in[1], &rstd = a.in[2], &gamma = a.in[3];
  const at::Tensor &dx = a.out[0], &dgamma = a.out[1];
  TORCH_CHECK(m >= 0 && n >= 0 && dy.numel() == m * n && x.numel() == m * n && dx.numel() == m * n &&
                  rstd.numel() == m && gamma.numel() == n && dgamma.numel() == n &&
                  x.scalar_type() == dy.scalar_type() && dx.scalar_type() == dy.scalar_type() &&
                  rstd.scalar_type() == at::kFloat && dgamma.scalar_type() == at::kFloat,
              "gradops.native: rms_norm_grad's tensors do not match rows x cols = ", m, " x ", n);
  float* dg = dgamma.data_ptr<float>();
  if (m == 0 || n == 0) {
    std::fill(dg, dg + n, 0.0f);
    return -1;
  }
  const int64_t blocks = row_blocks(m, n);
  const int64_t need = blocks * n;  // float32 partials
  float* part = nullptr;
  std::unique_ptr<float[]> owned;
  if (a.in.size() == 5 && a.in[4].defined()) {
    const at::Tensor& ws = a.in[4];
    void* p = ws.data_ptr();
    if (ws.scalar_type() == at::kByte && ws.numel() >= need * static_cast<int64_t>(sizeof(float)) &&
        reinterpret_cast<uintptr_t>(p) % alignof(float) == 0) {
      part = static_cast<float*>(p);
    }
  }
  if (part == nullptr) {
    owned.reset(new float[static_cast<size_t>(need)]);
    part = owned.get();
  }
  dispatch_storage(dy.scalar_type(), "dy", [&](auto ttag) {
    using T = decltype(ttag);
    dispatch_storage(gamma.scalar_type(), "gamma", [&](auto gtag) {
      using G = decltype(gtag);
      const G* g = gamma.data_ptr<G>();
      const T* dyp = dy.data_ptr<T>();
      const T* xp = x.data_ptr<T>();
      T* dxp = dx.data_ptr<T>();
      const float* rs = rstd.data_ptr<float>();
      // Blocks, not rows, are the parallel items: a block's partial is its own, so the split changes no bits.
      const int64_t grain = m * n < kParallelMin ? blocks : 1;
      const bool stream = streams(dxp, m, n);
      parallel(0, blocks, grain, [&](int64_t lo, int64_t hi) {
        for (int64_t b = lo; b < hi; ++b) {
          if (stream) {
            rms_norm_grad_block<true, T, G>(dyp, xp, rs, g, dxp, part + b * n, m, n, blocks, b);
          } else {
            rms_norm_grad_block<false, T, G>(dyp, xp, rs, g, dxp, part + b * n, m, n, blocks, b);
          }
        }
        if (stream) stream_fence();  // this task's streamed rows are visible before the call returns
      });
    });
  });
  fold_rows(part, blocks, n, dg);
  return -1;
}

GRADOPS_KERNEL("rms_norm", rms_norm_kernel);
GRADOPS_KERNEL("rms_norm_grad", rms_norm_grad_kernel);

#undef GRADOPS_RMS_INLINE

}  // namespace
}  // namespace gradops
