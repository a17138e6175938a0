// LayerNorm's CPU kernels: the forward (y, mean, variance), AscendC's LayerNormGrad and LayerNormGradBeta, and the
// fused backward (aclnnLayerNormBackward), in the calling convention of kernels.h.
//
// Formulas (see gradops.families.layer_norm.reference and docs/semantics.md), all in float32 with float32 accumulation
// whatever the storage dtype, x - mean written xmu, dy·gamma written pd_xl:
//  - forward: mean = sum(x)/N (64-element float32 trees summed in float64), var = sum(xmu^2)/N (biased, two passes),
//    y = xmu·rsqrt(var + eps)·gamma + beta;
//  - LayerNormGrad (AscendC, term by term, its sum(xmu) term included): rstd = (var + eps)^-0.5,
//    pd_var = sum(-0.5·pd_xl·xmu)·rstd^3, pd_mean = sum(-pd_xl)·rstd + pd_var·sum(-2·xmu)/N,
//    pd_x = pd_xl·rstd + pd_var·2/N·xmu + pd_mean/N, res_for_gamma = xmu·rstd;
//  - LayerNormGradBeta: pd_gamma = sum_rows(dy·res_for_gamma), pd_beta = sum_rows(dy);
//  - fused backward (ATen's native_layer_norm_backward, rstd given): a = -sum(pd_xl·xmu)·rstd^3/N,
//    c = -sum(pd_xl)·rstd/N, dx = pd_xl·rstd + a·xmu + c, dgamma = sum_rows(dy·xmu·rstd), dbeta = sum_rows(dy).
//
// Row sums accumulate in kLanes float32 lanes (element j into lane j % kLanes, lanes added in a fixed pairwise
// order, each 256 elements' lanes added into a float64 total: Lanes): the loops vectorize without reassociation,
// so the bits depend on N only. Column sums over rows use
// row_blocks(M, N) fixed blocks of ceil(M / blocks) rows, each with its own float32 partial row, folded in block
// order (fold_rows): the bits depend on the shape only, never on the thread count. Elementwise results are the
// same expression in a vector body and its scalar tail, so they depend on nothing but their operands.
//
// float16 / bfloat16 elements are widened to float32 as they are loaded (exact) and results narrowed once as they
// are stored (round to nearest even, torch's conversion); gamma and beta of another dtype than float32 are widened
// once per call.

#include "kernels.h"
#include "nodes.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

#if defined(__F16C__) || defined(__FMA__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace gradops {
namespace {

// Accumulator lanes of a row sum: two 8-float vectors, enough independent adds to hide the add latency at L1
// speed. Written with explicit vectors (GCC/Clang vector extensions): GCC's loop vectorizer turns a lane array
// indexed j % 16 into in-order ("fold-left") reductions across j, scalar adds behind transposing shuffles - right
// bits at scalar speed (the fused backward ran at 0.4x numba's speed at 512 x 256, one thread).
constexpr int64_t kLanes = 16;
// Squares per float32 partial of the forward's variance, the partials added in float64: the variance is an output
// of its own (LayerNormGrad's input), so its error must not grow with N. Max relative error against float64 over
// 512 x N rows: one float32 sum 1.3-2.9e-7, these blocks 0.7-1.5e-7 (PyTorch's: 1.3e-7), at the cost of one float64
// add per block.
constexpr int64_t kVarBlock = 128;

using F8 = vec::Lanes;
typedef float F4 __attribute__((vector_size(16)));
using U8 = vec::Bits;
typedef int32_t I8 __attribute__((vector_size(32)));

template <class To, class From>
inline To bits_as(const From& v) {
  static_assert(sizeof(To) == sizeof(From));
  To out;
  std::memcpy(&out, &v, sizeof out);
  return out;
}

// a·b + c with one rounding per lane (vfmadd where the target has it; std::fma, the same bits, elsewhere).
inline F8 fma8(F8 a, F8 b, F8 c) {
#if defined(__FMA__)
  return bits_as<F8>(_mm256_fmadd_ps(bits_as<__m256>(a), bits_as<__m256>(b), bits_as<__m256>(c)));
#else
  F8 r;
  for (int k = 0; k < 8; ++k) r[k] = std::fma(a[k], b[k], c[k]);
  return r;
#endif
}

// A row sum: element j of the row in float32 lane j % 16 for kFlush steps (kFlush * 16 = 256 elements), then the
// 16 lanes added in a fixed pairwise order into a float64 total, the lanes cleared, and on. In-order float32 lanes
// lose accuracy with the row's length (16 lanes at N = 2^20: a relative error of ~5e-6 in rms_norm's rstd, ~5e-7 in
// layer_norm's mean, where ATen's cascade sum keeps ~3e-8); blocks of 256 added in float64 keep the error of one
// 256-element float32 sum at every length, for one float64 add per 256 elements. A row of at most 256 elements
// sums to the bits the lanes alone gave (its total is one float32 sum, exact in float64).
constexpr int kFlush = 16;

struct Lanes {
  F8 lo = {}, hi = {};
  double total = 0.0;
  int steps = 0;

  void add(F8 a, F8 b) {
    lo += a;
    hi += b;
    if (++steps == kFlush) {
      total += static_cast<double>(fold());
      lo = F8{};
      hi = F8{};
      steps = 0;
    }
  }
  // The lanes' sum in a fixed pairwise order.
  float fold() const {
    const F8 v = lo + hi;
    F4 a, b;
    std::memcpy(&a, &v, sizeof a);
    std::memcpy(&b, reinterpret_cast<const char*>(&v) + sizeof a, sizeof b);
    const F4 c = a + b;  // lanes k, k + 4, k + 8, k + 12
    return (c[0] + c[2]) + (c[1] + c[3]);
  }
  double exact() const { return total + static_cast<double>(fold()); }
  float sum() const { return static_cast<float>(exact()); }
};

// A row's sum in float64, exact for any N copies of one float32 value (24 significant bits times N < 2^29 fit 53):
// each 64 elements are added in float32 as a pairwise tree of their eight 8-lane vectors (so each lane holds 8
// copies' sum, 8·c, exactly), that vector is widened into two 4-double accumulators; the last n % 64 elements are
// widened one vector, then one element, at a time. One widening per 64 elements where a float64 lane per element
// cost 1.2-1.5x the whole forward on one thread (2048 x 1024 bf16: 723 -> 1053 µs).
typedef double D4 __attribute__((vector_size(32)));

inline void add_wide(F8 v, D4& lo, D4& hi) {
  F4 h[2];
  std::memcpy(h, &v, sizeof v);
  lo += __builtin_convertvector(h[0], D4);
  hi += __builtin_convertvector(h[1], D4);
}

template <class T>
double row_sum(const T* x, int64_t n) {
  D4 lo = {}, hi = {};
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    const F8 a = (vec::load(x + j) + vec::load(x + j + 8)) + (vec::load(x + j + 16) + vec::load(x + j + 24));
    const F8 b = (vec::load(x + j + 32) + vec::load(x + j + 40)) + (vec::load(x + j + 48) + vec::load(x + j + 56));
    add_wide(a + b, lo, hi);
  }
  for (; j + 8 <= n; j += 8) add_wide(vec::load(x + j), lo, hi);
  double tail = 0.0;
  for (; j < n; ++j) tail += static_cast<double>(to_f32(x[j]));
  const D4 v = lo + hi;
  return ((v[0] + v[2]) + (v[1] + v[3])) + tail;
}

// The last len < 16 elements of a row as float32 lanes, zero-padded: the tail of a row sum takes one more step of
// the loop's own vector expression, its padding lanes masked out of the terms (keep), so the lanes a row's tail
// fills add as the lanes of the whole groups before it.
struct Tail {
  U8 mlo, mhi;
  explicit Tail(int64_t len) {
    for (int k = 0; k < 8; ++k) {
      mlo[k] = k < len ? ~0u : 0u;
      mhi[k] = k + 8 < len ? ~0u : 0u;
    }
  }
  template <class T>
  static void load(const T* p, int64_t len, F8& lo, F8& hi) {
    float buf[16] = {};
    for (int64_t k = 0; k < len; ++k) buf[k] = to_f32(p[k]);
    lo = vec::load(buf);
    hi = vec::load(buf + 8);
  }
  static F8 keep(F8 v, U8 mask) { return bits_as<F8>(bits_as<U8>(v) & mask); }
};

// The storage dtype's row of n elements narrowed from float32 (round to nearest even).
template <class T>
void narrow_row(const float* src, int64_t n, T* dst) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) vec::store(vec::load(src + j), dst + j);
  for (; j < n; ++j) dst[j] = from_f32<T>(src[j]);
}

// fn.template operator()<T>() for the storage dtype T of ``type`` (float32, float16, bfloat16).
template <class F>
void dispatch(at::ScalarType type, const char* kernel, const F& fn) {
  switch (type) {
    case at::kFloat: fn(float{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "gradops.native: kernel ", kernel, " takes float32, float16 or bfloat16, not ", type);
  }
}

// A parameter vector (gamma, beta) as float32: the tensor's own data, or a widened copy held by ``copy``.
const float* params_f32(const at::Tensor& t, int64_t n, std::unique_ptr<float[]>& copy) {
  if (t.scalar_type() == at::kFloat) return t.data_ptr<float>();
  copy.reset(new float[static_cast<size_t>(std::max<int64_t>(n, 1))]);
  float* dst = copy.get();
  dispatch(t.scalar_type(), "layer_norm (parameter)", [&](auto tag) {
    using T = decltype(tag);
    const T* src = reinterpret_cast<const T*>(t.data_ptr());
    for (int64_t j = 0; j < n; ++j) dst[j] = to_f32(src[j]);
  });
  return dst;
}

// The convention's promise, checked where a kernel reads by address: a defined contiguous tensor of ``numel``
// elements (at least, with ``at_least``) and, when given, of ``dtype``.
void require(const at::Tensor& t, int64_t numel, const char* kernel, const char* what, bool at_least = false,
             std::optional<at::ScalarType> dtype = std::nullopt) {
  TORCH_CHECK(t.defined() && t.is_contiguous() && (at_least ? t.numel() >= numel : t.numel() == numel),
              "gradops.native: kernel ", kernel, ": ", what, " must be a contiguous tensor of ", numel,
              " elements");
  TORCH_CHECK(!dtype || t.scalar_type() == *dtype, "gradops.native: kernel ", kernel, ": ", what, " must be ",
              *dtype, ", not ", t.scalar_type());
}

// The first of ``m`` statistics with ``value + floor < 0`` in float64 (the host check's arithmetic), or -1; NaN
// passes.
int64_t first_below(const float* values, int64_t m, double floor) {
  for (int64_t r = 0; r < m; ++r) {
    if (static_cast<double>(values[r]) + floor < 0.0) return r;
  }
  return -1;
}

// Row-block partials: the caller's workspace (uint8, 2·blocks·N floats: gamma's then beta's) when it is given and
// float-aligned, else memory of the call's own. Where they live changes no bit.
struct Partials {
  std::unique_ptr<float[]> own;
  float* pg = nullptr;
  float* pb = nullptr;

  Partials(const at::Tensor& workspace, int64_t blocks, int64_t n, const char* kernel) {
    const int64_t count = blocks * n;
    if (workspace.defined()) {
      require(workspace, 2 * count * 4, kernel, "workspace", true, at::kByte);
      auto* base = static_cast<uint8_t*>(workspace.data_ptr());
      if (reinterpret_cast<uintptr_t>(base) % alignof(float) == 0) {
        pg = reinterpret_cast<float*>(base);
        pb = pg + count;
        return;
      }
    }
    own.reset(new float[static_cast<size_t>(std::max<int64_t>(2 * count, 1))]);
    pg = own.get();
    pb = pg + count;
  }
};

// ================================================================ forward

// mean, variance and y of one row of n > 0 elements; returns (mean, variance). y never overlaps x, gamma or beta
// (the ops refuse an out= that overlaps an input).
template <class T>
std::pair<float, float> forward_row(const T* __restrict__ x, const float* __restrict__ gamma,
                                    const float* __restrict__ beta, float eps, int64_t n, T* __restrict__ y) {
  // The mean from a float64 row sum (row_sum): exact for a constant row (N copies of a float32 value), so its mean
  // is that value and xmu = 0, y = beta for any eps (a float32 sum(x) * (1/N) missed N copies of 0.1 by an ulp,
  // which rstd ~ 1e6 at eps = 1e-12 turned into |y - beta| of 1e-2..1e+1). (A corrected two-pass mean,
  // m1 + sum(x - m1)/N, is exact on constant rows too but adds the float32 roundings of x - m1: 2.5e-7 relative on
  // the check's 64 x 520 rows, where ATen has 1.3e-7.)
  const float mu = static_cast<float>(row_sum(x, n) / static_cast<double>(n));
  double q = 0.0;
  // Two blocks at a time (the same partials, added to q in block order): four independent chains where one block
  // has two, and half the loop overhead per block (fp32, one thread: 1.09 -> 0.98x numba's time at 4096 x 1024,
  // 1.08 -> 1.03x at 8192 x 4096).
  int64_t b0 = 0;
  for (; b0 + 2 * kVarBlock <= n; b0 += 2 * kVarBlock) {
    Lanes s0, s1;
    for (int64_t j = b0; j < b0 + kVarBlock; j += kLanes) {
      const F8 d0 = vec::load(x + j) - mu, d1 = vec::load(x + j + 8) - mu;
      const F8 e0 = vec::load(x + j + kVarBlock) - mu, e1 = vec::load(x + j + kVarBlock + 8) - mu;
      s0.add(d0 * d0, d1 * d1);
      s1.add(e0 * e0, e1 * e1);
    }
    q += static_cast<double>(s0.sum());
    q += static_cast<double>(s1.sum());
  }
  for (; b0 < n; b0 += kVarBlock) {
    const int64_t end = std::min(n, b0 + kVarBlock);
    const int64_t end_full = end - (end - b0) % kLanes;
    Lanes sq;
    for (int64_t j = b0; j < end_full; j += kLanes) {
      const F8 d0 = vec::load(x + j) - mu, d1 = vec::load(x + j + 8) - mu;
      sq.add(d0 * d0, d1 * d1);
    }
    if (end_full < end) {
      const Tail t(end - end_full);
      F8 x0, x1;
      Tail::load(x + end_full, end - end_full, x0, x1);
      const F8 d0 = x0 - mu, d1 = x1 - mu;
      sq.add(Tail::keep(d0 * d0, t.mlo), Tail::keep(d1 * d1, t.mhi));
    }
    q += static_cast<double>(sq.sum());
  }
  const float var = static_cast<float>(q * (1.0 / static_cast<double>(n)));
  const float s = 1.0f / std::sqrt(var + eps);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {  // two vectors loaded before either is stored (see grad_row)
    const F8 y0 = (vec::load(x + j) - mu) * s * vec::load(gamma + j) + vec::load(beta + j);
    const F8 y1 = (vec::load(x + j + 8) - mu) * s * vec::load(gamma + j + 8) + vec::load(beta + j + 8);
    vec::store(y0, y + j);
    vec::store(y1, y + j + 8);
  }
  for (; j + 8 <= n; j += 8) {
    vec::store((vec::load(x + j) - mu) * s * vec::load(gamma + j) + vec::load(beta + j), y + j);
  }
  for (; j < n; ++j) y[j] = from_f32<T>((to_f32(x[j]) - mu) * s * gamma[j] + beta[j]);
  return {mu, var};
}

// "layer_norm": the forward.
//   in:  x (M·N, T), gamma (N, T or float32), beta (N, T or float32)      T: float32, float16 or bfloat16
//   out: y (M·N, T), mean (M, float32), variance (M, float32)
//   ints: M, N;  floats: epsilon
// Rows split over threads (rows_grain). An empty row (N = 0) has mean and variance 0. Never refuses: -1.
int64_t layer_norm_kernel(const KernelArgs& a) {
  static const char* name = "layer_norm";
  TORCH_CHECK(a.in.size() == 3 && a.out.size() == 3 && a.ints.size() == 2 && a.floats.size() == 1,
              "gradops.native: kernel layer_norm takes 3 inputs, 3 outputs, 2 ints, 1 float");
  const int64_t m = a.ints[0], n = a.ints[1];
  TORCH_CHECK(m >= 0 && n >= 0, "gradops.native: kernel layer_norm: negative shape");
  const at::Tensor &x = a.in[0], &gamma = a.in[1], &beta = a.in[2], &y = a.out[0];
  require(x, m * n, name, "x");
  require(y, m * n, name, "y", false, x.scalar_type());
  require(gamma, n, name, "gamma");
  require(beta, n, name, "beta");
  require(a.out[1], m, name, "mean", false, at::kFloat);
  require(a.out[2], m, name, "variance", false, at::kFloat);
  float* mean = a.out[1].data_ptr<float>();
  float* var = a.out[2].data_ptr<float>();
  if (n == 0) {
    std::fill(mean, mean + m, 0.0f);
    std::fill(var, var + m, 0.0f);
    return -1;
  }
  std::unique_ptr<float[]> gamma_copy, beta_copy;
  const float* g = params_f32(gamma, n, gamma_copy);
  const float* b = params_f32(beta, n, beta_copy);
  const float eps = static_cast<float>(a.floats[0]);
  dispatch(x.scalar_type(), name, [&](auto tag) {
    using T = decltype(tag);
    const T* xs = reinterpret_cast<const T*>(x.data_ptr());
    T* ys = reinterpret_cast<T*>(y.data_ptr());
    parallel(0, m, rows_grain(m, n), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const auto [mu, v] = forward_row(xs + r * n, g, b, eps, n, ys + r * n);
        mean[r] = mu;
        var[r] = v;
      }
    });
  });
  return -1;
}

// ================================================================ LayerNormGrad (AscendC)

// step(x0, x1, dy0, dy1, g0, g1, m0, m1) over one row's kLanes-column tiles of x, dy and gamma, the last one
// partial (masks m0, m1 mark its columns): the walk both backward row sums take.
template <class T, class Step>
inline void over_tiles(const T* x, const T* dy, const float* gamma, int64_t n, const Step& step) {
  const int64_t full = n - n % kLanes;
  const U8 all = ~U8{};
  for (int64_t j = 0; j < full; j += kLanes) {
    step(vec::load(x + j), vec::load(x + j + 8), vec::load(dy + j), vec::load(dy + j + 8), vec::load(gamma + j), vec::load(gamma + j + 8),
         all, all);
  }
  if (full < n) {
    const Tail t(n - full);
    F8 x0, x1, dy0, dy1, g0, g1;
    Tail::load(x + full, n - full, x0, x1);
    Tail::load(dy + full, n - full, dy0, dy1);
    Tail::load(gamma + full, n - full, g0, g1);
    step(x0, x1, dy0, dy1, g0, g1, t.mlo, t.mhi);
  }
}

// pd_x and res_for_gamma of one row of n > 0 elements (outputs apart from the inputs, as forward_row's).
template <bool kStream, class T>
void grad_row(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ gamma, float mu, float s,
              int64_t n, T* __restrict__ pdx, T* __restrict__ res) {
  const float inv_n = 1.0f / static_cast<float>(n);
  Lanes s1, s2, s3;  // sum(-0.5·pd_xl·xmu), sum(-pd_xl), sum(-2·xmu)
  auto step = [&](F8 x0, F8 x1, F8 dy0, F8 dy1, F8 g0, F8 g1, U8 m0, U8 m1) {
    const F8 xmu0 = x0 - mu, xmu1 = x1 - mu;
    const F8 p0 = dy0 * g0, p1 = dy1 * g1;
    s1.add(Tail::keep(-0.5f * p0 * xmu0, m0), Tail::keep(-0.5f * p1 * xmu1, m1));
    s2.add(Tail::keep(-p0, m0), Tail::keep(-p1, m1));
    s3.add(Tail::keep(-2.0f * xmu0, m0), Tail::keep(-2.0f * xmu1, m1));
  };
  over_tiles(x, dy, gamma, n, step);
  const float pd_var = s1.sum() * s * s * s;
  const float pd_mean = s2.sum() * s + pd_var * s3.sum() * inv_n;
  const float a = pd_var * 2.0f * inv_n;
  const float b = pd_mean * inv_n;
  int64_t j = 0;
  // 16 items a step, every load before the stores, and no overlap test: 8 a step with GCC's runtime alias check ran
  // 1.12-1.18x numba's time at 8192 x 4096 fp32 (one thread), this 0.98-1.00x.
  for (; j + 16 <= n; j += 16) {
    const F8 xmu0 = vec::load(x + j) - mu, xmu1 = vec::load(x + j + 8) - mu;
    const F8 p0 = vec::load(dy + j) * vec::load(gamma + j) * s + a * xmu0 + b;
    const F8 p1 = vec::load(dy + j + 8) * vec::load(gamma + j + 8) * s + a * xmu1 + b;
    if constexpr (kStream && std::is_same_v<T, float>) {  // both results past the caches (kernels.h: streams)
      stream8(pdx + j, p0);
      stream8(pdx + j + 8, p1);
      stream8(res + j, xmu0 * s);
      stream8(res + j + 8, xmu1 * s);
    } else {
      vec::store(p0, pdx + j);
      vec::store(p1, pdx + j + 8);
      vec::store(xmu0 * s, res + j);
      vec::store(xmu1 * s, res + j + 8);
    }
  }
  for (; j + 8 <= n; j += 8) {
    const F8 xmu = vec::load(x + j) - mu;
    vec::store(vec::load(dy + j) * vec::load(gamma + j) * s + a * xmu + b, pdx + j);
    vec::store(xmu * s, res + j);
  }
  for (; j < n; ++j) {
    const float xmu = to_f32(x[j]) - mu;
    pdx[j] = from_f32<T>(to_f32(dy[j]) * gamma[j] * s + a * xmu + b);
    res[j] = from_f32<T>(xmu * s);
  }
}

// "layer_norm_grad": AscendC LayerNormGrad.
//   in:  dy (M·N, T), x (M·N, T), variance (M, float32), mean (M, float32), gamma (N, T or float32)
//   out: pd_x (M·N, T), res_for_gamma (M·N, T)
//   ints: M, N, check;  floats: epsilon
// With check != 0, first the row of a variance below -epsilon (variance + epsilon < 0 in float64; NaN passes):
// its position is returned and nothing is written (the op's check_statistics refusal). Else -1; rows split over
// threads (rows_grain). A variance below -epsilon without check gives NaN rows, as in AscendC.
int64_t layer_norm_grad_kernel(const KernelArgs& a) {
  static const char* name = "layer_norm_grad";
  TORCH_CHECK(a.in.size() == 5 && a.out.size() == 2 && a.ints.size() == 3 && a.floats.size() == 1,
              "gradops.native: kernel layer_norm_grad takes 5 inputs, 2 outputs, 3 ints, 1 float");
  const int64_t m = a.ints[0], n = a.ints[1];
  const bool check = a.ints[2] != 0;
  TORCH_CHECK(m >= 0 && n >= 0, "gradops.native: kernel layer_norm_grad: negative shape");
  const at::Tensor &dy = a.in[0], &x = a.in[1], &gamma = a.in[4], &pdx = a.out[0], &res = a.out[1];
  require(a.in[2], m, name, "variance", false, at::kFloat);
  const float* var = a.in[2].data_ptr<float>();
  const double eps = a.floats[0];
  if (check) {
    const int64_t bad = first_below(var, m, eps);
    if (bad >= 0) return bad;
  }
  if (m == 0 || n == 0) return -1;
  require(a.in[3], m, name, "mean", false, at::kFloat);
  require(x, m * n, name, "x");
  require(dy, m * n, name, "dy", false, x.scalar_type());
  require(gamma, n, name, "gamma");
  require(pdx, m * n, name, "pd_x", false, x.scalar_type());
  require(res, m * n, name, "res_for_gamma", false, x.scalar_type());
  const float* mean = a.in[3].data_ptr<float>();
  std::unique_ptr<float[]> gamma_copy;
  const float* g = params_f32(gamma, n, gamma_copy);
  const float eps32 = static_cast<float>(eps);
  dispatch(x.scalar_type(), name, [&](auto tag) {
    using T = decltype(tag);
    const T* dys = reinterpret_cast<const T*>(dy.data_ptr());
    const T* xs = reinterpret_cast<const T*>(x.data_ptr());
    T* pdxs = reinterpret_cast<T*>(pdx.data_ptr());
    T* ress = reinterpret_cast<T*>(res.data_ptr());
    const bool stream = streams(pdxs, m, n) && streams(ress, m, n);
    parallel(0, m, rows_grain(m, n), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const float s = 1.0f / std::sqrt(var[r] + eps32);
        if (stream) {
          grad_row<true>(dys + r * n, xs + r * n, g, mean[r], s, n, pdxs + r * n, ress + r * n);
        } else {
          grad_row<false>(dys + r * n, xs + r * n, g, mean[r], s, n, pdxs + r * n, ress + r * n);
        }
      }
      if (stream) stream_fence();
    });
  });
  return -1;
}

// ================================================================ LayerNormGradBeta (AscendC)

// Row block b's partial rows: pg[j] = sum_r dy·res, pb[j] = sum_r dy, four rows per update of the partials (79%
// -> 98% of copy_'s bandwidth at 8192 x 4096 fp32: a quarter of the partial-row traffic).
template <class T>
void grad_beta_block(const T* res, const T* dy, int64_t m, int64_t n, int64_t per, int64_t b, float* pg,
                     float* pb) {
  std::fill(pg, pg + n, 0.0f);
  std::fill(pb, pb + n, 0.0f);
  const int64_t begin = std::min(m, b * per), end = std::min(m, begin + per);
  int64_t r = begin;
  for (; r + 4 <= end; r += 4) {
    const T *g0 = dy + r * n, *g1 = g0 + n, *g2 = g1 + n, *g3 = g2 + n;
    const T *q0 = res + r * n, *q1 = q0 + n, *q2 = q1 + n, *q3 = q2 + n;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const F8 a0 = vec::load(g0 + j), a1 = vec::load(g1 + j), a2 = vec::load(g2 + j), a3 = vec::load(g3 + j);
      vec::store(vec::load(pg + j) + (a0 * vec::load(q0 + j) + a1 * vec::load(q1 + j) + a2 * vec::load(q2 + j) +
                                      a3 * vec::load(q3 + j)), pg + j);
      vec::store(vec::load(pb + j) + (a0 + a1 + a2 + a3), pb + j);
    }
    for (; j < n; ++j) {
      const float a0 = to_f32(g0[j]), a1 = to_f32(g1[j]), a2 = to_f32(g2[j]), a3 = to_f32(g3[j]);
      pg[j] += a0 * to_f32(q0[j]) + a1 * to_f32(q1[j]) + a2 * to_f32(q2[j]) + a3 * to_f32(q3[j]);
      pb[j] += a0 + a1 + a2 + a3;
    }
  }
  for (; r < end; ++r) {
    const T *g = dy + r * n, *q = res + r * n;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const F8 a0 = vec::load(g + j);
      vec::store(vec::load(pg + j) + a0 * vec::load(q + j), pg + j);
      vec::store(vec::load(pb + j) + a0, pb + j);
    }
    for (; j < n; ++j) {
      pg[j] += to_f32(g[j]) * to_f32(q[j]);
      pb[j] += to_f32(g[j]);
    }
  }
}

// "layer_norm_grad_beta": AscendC LayerNormGradBeta.
//   in:  res_for_gamma (M·N, T), dy (M·N, T), workspace (optional: uint8 of at least 2·row_blocks(M, N)·N·4
//        bytes, the float32 partials; written, never read before written)
//   out: pd_gamma (N, T), pd_beta (N, T)
//   ints: M, N
// Row blocks split over threads (one task below kParallelMin items), their partials folded in block order and
// rounded once to T. M = 0 gives zeros. Never refuses: -1.
int64_t layer_norm_grad_beta_kernel(const KernelArgs& a) {
  static const char* name = "layer_norm_grad_beta";
  TORCH_CHECK(a.in.size() == 3 && a.out.size() == 2 && a.ints.size() == 2 && a.floats.empty(),
              "gradops.native: kernel layer_norm_grad_beta takes 3 inputs, 2 outputs, 2 ints");
  const int64_t m = a.ints[0], n = a.ints[1];
  TORCH_CHECK(m >= 0 && n >= 0, "gradops.native: kernel layer_norm_grad_beta: negative shape");
  const at::Tensor &res = a.in[0], &dy = a.in[1], &pd_gamma = a.out[0], &pd_beta = a.out[1];
  require(dy, m * n, name, "dy");
  require(res, m * n, name, "res_for_gamma", false, dy.scalar_type());
  require(pd_gamma, n, name, "pd_gamma", false, dy.scalar_type());
  require(pd_beta, n, name, "pd_beta", false, dy.scalar_type());
  if (n == 0) return -1;
  const int64_t blocks = row_blocks(m, n);
  const int64_t per = (m + blocks - 1) / blocks;
  Partials p(a.in[2], blocks, n, name);
  dispatch(dy.scalar_type(), name, [&](auto tag) {
    using T = decltype(tag);
    const T* rs = reinterpret_cast<const T*>(res.data_ptr());
    const T* dys = reinterpret_cast<const T*>(dy.data_ptr());
    parallel(0, blocks, m * n < kParallelMin ? blocks : 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) grad_beta_block(rs, dys, m, n, per, b, p.pg + b * n, p.pb + b * n);
    });
    T* gamma_out = reinterpret_cast<T*>(pd_gamma.data_ptr());
    T* beta_out = reinterpret_cast<T*>(pd_beta.data_ptr());
    if constexpr (std::is_same_v<T, float>) {
      fold_rows(p.pg, blocks, n, gamma_out);
      fold_rows(p.pb, blocks, n, beta_out);
    } else {
      std::unique_ptr<float[]> sum(new float[static_cast<size_t>(n)]);
      fold_rows(p.pg, blocks, n, sum.get());
      narrow_row(sum.get(), n, gamma_out);
      fold_rows(p.pb, blocks, n, sum.get());
      narrow_row(sum.get(), n, beta_out);
    }
  });
  return -1;
}

// ================================================================ fused backward (aclnnLayerNormBackward)

// dx of one row of n > 0 elements and its share of the partial rows. dx may be dy itself: each element of the row
// is read by the sums before the second loop writes any, and that loop reads each group of 8 before writing it.
template <class T>
void backward_row(const T* dy, const T* x, const float* gamma, float mu, float s, float inv_n, int64_t n, T* dx,
                  float* ag, float* ab) {
  Lanes s1, s2;  // sum(pd_xl·xmu), sum(pd_xl)
  auto step = [&](F8 x0, F8 x1, F8 dy0, F8 dy1, F8 g0, F8 g1, U8 m0, U8 m1) {
    const F8 p0 = dy0 * g0, p1 = dy1 * g1;
    s1.add(Tail::keep(p0 * (x0 - mu), m0), Tail::keep(p1 * (x1 - mu), m1));
    s2.add(Tail::keep(p0, m0), Tail::keep(p1, m1));
  };
  over_tiles(x, dy, gamma, n, step);
  const float a = -s1.sum() * s * s * s * inv_n;
  const float c = -s2.sum() * s * inv_n;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const F8 g = vec::load(dy + j);
    const F8 xmu = vec::load(x + j) - mu;
    vec::store(g * vec::load(gamma + j) * s + a * xmu + c, dx + j);
    vec::store(fma8(g, xmu * s, vec::load(ag + j)), ag + j);  // one rounding per row, as ATen's vectorized fmadd
    vec::store(vec::load(ab + j) + g, ab + j);
  }
  for (; j < n; ++j) {
    const float g = to_f32(dy[j]);
    const float xmu = to_f32(x[j]) - mu;
    dx[j] = from_f32<T>(g * gamma[j] * s + a * xmu + c);
    ag[j] = std::fma(g, xmu * s, ag[j]);
    ab[j] += g;
  }
}

// backward_row on kBackwardRows consecutive rows at once: each row's sums, then one pass over the columns that
// writes the rows' dx and adds their terms to the partial rows in row order - the same operations in the same order
// as backward_row row by row, so the same bits, with the partial rows loaded and stored once per four rows instead
// of once per row. Only for rows of at least kBackwardRowsMinN columns, whose second pass reads from L2 either way
// (one row's x and dy at N = 4096 fp32 are 32 KiB, L1's size): 8192 x 4096 fp32 went from 72-77% to 85-92% of
// copy_'s bandwidth (2 threads); at N = 1024 the four rows no longer fit L1 beside the partials and 4096 x 1024 ran
// 1.1-1.3x slower (bf16 and fp32), as two rows at a time did too.
constexpr int64_t kBackwardRows = 4;
constexpr int64_t kBackwardRowsMinN = 2048;

template <bool kStream, class T>
void backward_rows(const T* dy, const T* x, const float* gamma, const float* mu, const float* rstd, float inv_n,
                   int64_t n, T* dx, float* ag, float* ab) {
  constexpr int64_t R = kBackwardRows;
  float a[R], c[R], s[R], m[R];
  for (int64_t q = 0; q < R; ++q) {
    Lanes s1, s2;  // sum(pd_xl·xmu), sum(pd_xl)
    m[q] = mu[q];
    s[q] = rstd[q];
    const float mq = m[q];
    auto step = [&](F8 x0, F8 x1, F8 dy0, F8 dy1, F8 g0, F8 g1, U8 m0, U8 m1) {
      const F8 p0 = dy0 * g0, p1 = dy1 * g1;
      s1.add(Tail::keep(p0 * (x0 - mq), m0), Tail::keep(p1 * (x1 - mq), m1));
      s2.add(Tail::keep(p0, m0), Tail::keep(p1, m1));
    };
    over_tiles(x + q * n, dy + q * n, gamma, n, step);
    a[q] = -s1.sum() * s[q] * s[q] * s[q] * inv_n;
    c[q] = -s2.sum() * s[q] * inv_n;
  }
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const F8 gm = vec::load(gamma + j);
    F8 agv = vec::load(ag + j), abv = vec::load(ab + j);
    for (int64_t q = 0; q < R; ++q) {
      const F8 g = vec::load(dy + q * n + j);
      const F8 xmu = vec::load(x + q * n + j) - m[q];
      const F8 d = g * gm * s[q] + a[q] * xmu + c[q];
      if constexpr (kStream && std::is_same_v<T, float>) {
        stream8(dx + q * n + j, d);
      } else {
        vec::store(d, dx + q * n + j);
      }
      agv = fma8(g, xmu * s[q], agv);
      abv = abv + g;
    }
    vec::store(agv, ag + j);
    vec::store(abv, ab + j);
  }
  for (; j < n; ++j) {
    for (int64_t q = 0; q < R; ++q) {
      const float g = to_f32(dy[q * n + j]);
      const float xmu = to_f32(x[q * n + j]) - m[q];
      dx[q * n + j] = from_f32<T>(g * gamma[j] * s[q] + a[q] * xmu + c[q]);
      ag[j] = std::fma(g, xmu * s[q], ag[j]);
      ab[j] += g;
    }
  }
}

// "layer_norm_backward": the fused LayerNorm backward (LayerNormGrad + LayerNormGradBeta in one pass over dy, x).
//   in:  dy (M·N, T), x (M·N, T), mean (M, float32), rstd (M, float32), gamma (N, T or float32),
//        workspace (optional: uint8 of at least 2·row_blocks(M, N)·N·4 bytes, the float32 partials)
//   out: dx (M·N, T; may be dy itself: an upstream gradient nobody else holds, see owned_like in nodes.h),
//        dgamma (N, float32), dbeta (N, float32)
//   ints: M, N, check
// With check != 0, first the row of a negative rstd (NaN passes): its position is returned and nothing is written.
// Else -1; row blocks split over threads (one task below kParallelMin items), partials folded in block order. M = 0
// or N = 0 gives zero dgamma and dbeta.
int64_t layer_norm_backward_kernel(const KernelArgs& a) {
  static const char* name = "layer_norm_backward";
  TORCH_CHECK(a.in.size() >= 5 && a.in.size() <= 6 && a.out.size() == 3 && a.ints.size() == 3 && a.floats.empty(),
              "gradops.native: kernel layer_norm_backward takes 5 or 6 inputs, 3 outputs, 3 ints");
  const int64_t m = a.ints[0], n = a.ints[1];
  const bool check = a.ints[2] != 0;
  TORCH_CHECK(m >= 0 && n >= 0, "gradops.native: kernel layer_norm_backward: negative shape");
  const at::Tensor &dy = a.in[0], &x = a.in[1], &gamma = a.in[4], &dx = a.out[0];
  require(a.in[3], m, name, "rstd", false, at::kFloat);
  const float* rstd = a.in[3].data_ptr<float>();
  if (check) {
    const int64_t bad = first_below(rstd, m, 0.0);
    if (bad >= 0) return bad;
  }
  require(a.out[1], n, name, "dgamma", false, at::kFloat);
  require(a.out[2], n, name, "dbeta", false, at::kFloat);
  float* dgamma = a.out[1].data_ptr<float>();
  float* dbeta = a.out[2].data_ptr<float>();
  if (m == 0 || n == 0) {
    std::fill(dgamma, dgamma + n, 0.0f);
    std::fill(dbeta, dbeta + n, 0.0f);
    return -1;
  }
  require(a.in[2], m, name, "mean", false, at::kFloat);
  require(x, m * n, name, "x");
  require(dy, m * n, name, "dy", false, x.scalar_type());
  require(gamma, n, name, "gamma");
  require(dx, m * n, name, "dx", false, x.scalar_type());
  {
    // dx is dy itself or apart from it: a partial overlap would write rows before they are read.
    const auto* d0 = static_cast<const char*>(dx.data_ptr());
    const auto* g0 = static_cast<const char*>(dy.data_ptr());
    const int64_t bytes = m * n * static_cast<int64_t>(dx.element_size());
    TORCH_CHECK(d0 == g0 || d0 + bytes <= g0 || g0 + bytes <= d0,
                "gradops.native: kernel layer_norm_backward: dx overlaps dy without being dy");
  }
  const float* mean = a.in[2].data_ptr<float>();
  std::unique_ptr<float[]> gamma_copy;
  const float* g = params_f32(gamma, n, gamma_copy);
  const int64_t blocks = row_blocks(m, n);
  const int64_t per = (m + blocks - 1) / blocks;
  Partials p(a.in.size() == 6 ? a.in[5] : at::Tensor(), blocks, n, name);
  const float inv_n = 1.0f / static_cast<float>(n);
  dispatch(x.scalar_type(), name, [&](auto tag) {
    using T = decltype(tag);
    const T* dys = reinterpret_cast<const T*>(dy.data_ptr());
    const T* xs = reinterpret_cast<const T*>(x.data_ptr());
    T* dxs = reinterpret_cast<T*>(dx.data_ptr());
    // Not in place: a streamed half line of dx would be read back as dy by the next group of 8.
    const bool stream = streams(dxs, m, n) && static_cast<const void*>(dxs) != static_cast<const void*>(dys);
    parallel(0, blocks, m * n < kParallelMin ? blocks : 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        float* ag = p.pg + b * n;
        float* ab = p.pb + b * n;
        std::fill(ag, ag + n, 0.0f);
        std::fill(ab, ab + n, 0.0f);
        const int64_t begin = std::min(m, b * per), end = std::min(m, begin + per);
        int64_t r = begin;
        for (; n >= kBackwardRowsMinN && r + kBackwardRows <= end; r += kBackwardRows) {
          if (stream) {
            backward_rows<true>(dys + r * n, xs + r * n, g, mean + r, rstd + r, inv_n, n, dxs + r * n, ag, ab);
          } else {
            backward_rows<false>(dys + r * n, xs + r * n, g, mean + r, rstd + r, inv_n, n, dxs + r * n, ag, ab);
          }
        }
        for (; r < end; ++r) {
          backward_row(dys + r * n, xs + r * n, g, mean[r], rstd[r], inv_n, n, dxs + r * n, ag, ab);
        }
      }
      if (stream) stream_fence();  // this task's streamed rows are visible before the call returns
    });
  });
  fold_rows(p.pg, blocks, n, dgamma);
  fold_rows(p.pb, blocks, n, dbeta);
  return -1;
}

GRADOPS_KERNEL("layer_norm", layer_norm_kernel);
GRADOPS_KERNEL("layer_norm_grad", layer_norm_grad_kernel);
GRADOPS_KERNEL("layer_norm_grad_beta", layer_norm_grad_beta_kernel);
GRADOPS_KERNEL("layer_norm_backward", layer_norm_backward_kernel);

// ---- the native node (nodes.h): gradops.nn.LayerNorm's recorded call
//
// LayerNorm over the last dim, y only (what torch.nn.LayerNorm returns): mean and variance stay inside the node.
// Its second derivative (the Python formula, create_graph=True) sums its two parts, through y and through the
// statistics, in another order than the Python path: equal to float32 rounding (tests/test_native.py).

const int64_t kFormula = formula_slot();

struct LayerNormBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable x_, gamma_, mean_, var_;
  double eps_ = 0.0;
  at::ScalarType beta_dtype_ = at::kFloat;

  std::string name() const override { return "gradops_native::LayerNormBackward"; }
  void release_variables() override {
    x_.reset_data();
    gamma_.reset_data();
    mean_.reset_data();
    var_.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    auto self = getptr();
    at::Tensor x = x_.unpack(self), gamma = gamma_.unpack(self), mean = mean_.unpack(self), var = var_.unpack(self);
    // x or gamma (the caller's tensors; mean and var are the node's own) freed after the forward, as FSDP frees a
    // parameter's storage between uses (see hollow): the formula's op refuses it with its OpError.
    if (at::GradMode::is_enabled() || forked || !plain(grads[0]) || hollow(x) || hollow(gamma)) {
      // The Python formula needs beta's dtype: an empty tensor carries it.
      at::Tensor beta_like = at::empty({0}, x.options().dtype(beta_dtype_));
      variable_list g = python_backward(kFormula, {grads[0], x, gamma, mean, var, beta_like}, eps_);
      return {g[0], g[1], g[2]};
    }
    const int64_t n = x.size(-1);
    const int64_t m = x.numel() / n;
    // rstd as the Python path computes it, torch.rsqrt(var + eps): ATen adds the wrapped double scalar in float32
    // and takes 1 / sqrt (IEEE division and square root, vectorized or not), so this loop gives the same bits
    // without two ATen calls (~3 µs of a small backward on 2 cores).
    at::Tensor rstd = at::empty(var.sizes(), var.options());
    {
      const float e = static_cast<float>(eps_);
      const float* v = var.data_ptr<float>();
      float* out = rstd.data_ptr<float>();
      for (int64_t i = 0, rows = var.numel(); i < rows; ++i) out[i] = 1.0f / std::sqrt(v[i] + e);
    }
    at::TensorOptions f32 = x.options().dtype(at::kFloat);
    at::Tensor dgamma = at::empty(gamma.sizes(), f32);
    at::Tensor dbeta = at::empty(gamma.sizes(), f32);
    at::Tensor dy, dx;
    if (owned_like(grads[0], x)) {
      // dx over the gradient nobody else holds, as Hardswish's (the kernel reads each element of a row before it
      // writes it): at 512 x 256 fp32 the row blocks took 36.4 µs against 41.7 into a new dx (one thread, one
      // process), and forward + backward 0.93x torch against 0.94-0.95 (three alternating runs each, 2 cores).
      dx = std::move(grads[0]);
      dy = dx;
    } else {
      dy = grads[0].contiguous();
      dx = output(x.sizes(), x.options());
    }
    const std::array<at::Tensor, 5> in{dy, x, mean, rstd, gamma};
    const std::array<at::Tensor, 3> out{dx, dgamma, dbeta};
    const std::array<int64_t, 3> ints{m, n, 0};  // rstd from the node's own variance: never negative, unchecked
    layer_norm_backward_kernel({in, out, ints, {}});
    return {dx, dgamma.to(gamma.scalar_type()), dbeta.to(beta_dtype_)};
  }
};

// LayerNorm y of a contiguous x (..., N) with contiguous gamma, beta (N,); recorded when one of them requires grad.
at::Tensor layer_norm_node(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta, double eps) {
  const int64_t n = x.size(-1);
  const int64_t m = x.numel() / n;
  at::Tensor y = output(x.sizes(), x.options());
  at::TensorOptions f32 = x.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({m}, f32);
  at::Tensor var = at::empty({m}, f32);
  const std::array<at::Tensor, 3> in{x, gamma, beta};
  const std::array<at::Tensor, 3> out{y, mean, var};
  const std::array<int64_t, 2> ints{m, n};
  const std::array<double, 1> floats{eps};
  layer_norm_kernel({in, out, ints, floats});
  if (at::GradMode::is_enabled() && (x.requires_grad() || gamma.requires_grad() || beta.requires_grad())) {
    NodeRef ref = make_node<LayerNormBackward>();
    auto* node = static_cast<LayerNormBackward*>(ref.get());
    node->x_ = torch::autograd::SavedVariable(x, false);
    node->gamma_ = torch::autograd::SavedVariable(gamma, false);
    node->mean_ = torch::autograd::SavedVariable(mean, false);
    node->var_ = torch::autograd::SavedVariable(var, false);
    node->eps_ = eps;
    node->beta_dtype_ = beta.scalar_type();
    record(ref, y, x, gamma, beta);
  }
  return y;
}

at::Tensor layer_norm_entry(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta, double eps) {
  require_whole(x, "x");
  require_whole(gamma, "gamma");
  require_whole(beta, "beta");
  return layer_norm_node(x, gamma, beta, eps);
}

// layer_norm_planned(x, gamma, beta, eps): the recorded LayerNorm y on a remembered call's metadata (direct.cpp), or
// None; an eps that is not a float or an int is the op's to refuse.
PyObject* layer_norm_planned(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  static const int64_t call_id = direct_op("layer_norm");
  if (!arity("layer_norm_planned", nargs, 4)) return nullptr;
  if (!PyFloat_Check(args[3]) && !PyLong_CheckExact(args[3])) Py_RETURN_NONE;
  const double eps = PyFloat_AsDouble(args[3]);
  if (eps == -1.0 && PyErr_Occurred()) return nullptr;
  if (!node_call(call_id, std::array<py::handle, 3>{args[0], args[1], args[2]}, args, 4)) Py_RETURN_NONE;
  return py::cast(layer_norm_node(THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]),
                                  THPVariable_Unpack(args[2]), eps))
      .release()
      .ptr();
  END_HANDLE_TH_ERRORS
}

PyMethodDef planned[] = {
    {"layer_norm_planned", fastcall(layer_norm_planned), METH_FASTCALL,
     "the recorded LayerNorm y on a remembered call's metadata, or None"},
    {nullptr, nullptr, 0, nullptr}};

void module_part(py::module_& m) {
  m.attr("LAYER_NORM") = kFormula;
  m.def("layer_norm", &layer_norm_entry,
        "LayerNorm y of a contiguous x (..., N); backward the fused LayerNorm backward");
  if (PyModule_AddFunctions(m.ptr(), planned) != 0) throw py::error_already_set();
}

GRADOPS_MODULE_PART(module_part);

}  // namespace
}  // namespace gradops
