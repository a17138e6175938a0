// The MoE token permute family's CPU kernels: aclnnMoeTokenPermute (the stable counting sort of the expert ids and
// the row gather), aclnnMoeTokenPermuteGrad and aclnnMoeTokenUnpermute (gather-sums of each token's K rows, the
// second weighted by probs) and aclnnMoeTokenUnpermuteGrad (the scatter of each token's gradient row to its K
// rows, and the probs' dot products). No zero-fill, no atomics: sorted_indices is a permutation, so each output
// row has exactly one writer, and the result bits depend on the shape only.
//
// Conventions shared by the four kernels (see docs/semantics.md §5 for the formulas):
//  - sorted_indices (T·K,), int32 or int64, CANN's: entry t·K + k is the permuted row of token t's copy k. A row
//    >= A (the permuted rows present) is one the forward dropped: it adds nothing, and its probs gradient is 0.
//  - float tensors are float32, float16 or bfloat16, each independently where the op allows it; all arithmetic is
//    float32, k in order, each product rounded to float32 before it is added (no FMA: -ffp-contract=off).
//  - refusals return the first position of the index tensor the op refuses, before anything is written: a
//    negative expert id (permute), an entry outside [0, T·K) or a repeated one (the other three). A kernel reads or
//    writes a row only through an entry it has range-checked.
//
// Byte models (s: a float element's size): permute T·K·H·s + T·K·(s_idx + 4); permute grad and unpermute
// T·K·H·s_in + T·H·s_out + T·K·(s_idx + 1) (+ T·K·s_p for probs); unpermute grad
// T·H·s_g + A·H·(s_x + s_dx) + T·K·(s_idx + 1 + s_p + s_dp). Every pass but the gathers is over T·K indices.

#include "kernels.h"
#include "vec.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <utility>

namespace gradops {
namespace {

// Entries of an int32 or int64 index tensor, read as int64 (one predictable branch per entry; the loops that read
// entries do a row's worth of work per entry, so this costs nothing measurable).
struct Entries {
  const int32_t* narrow = nullptr;
  const int64_t* wide = nullptr;
  int64_t operator[](int64_t i) const { return wide != nullptr ? wide[i] : static_cast<int64_t>(narrow[i]); }
};

Entries entries_of(const at::Tensor& t, const char* kernel) {
  Entries e;
  if (t.scalar_type() == at::kLong) {
    e.wide = t.const_data_ptr<int64_t>();
  } else {
    TORCH_CHECK(t.scalar_type() == at::kInt, "gradops.native: ", kernel, ": index tensor of dtype ", t.scalar_type(),
                " (int32 or int64 expected)");
    e.narrow = t.const_data_ptr<int32_t>();
  }
  return e;
}

// f(T{}) for the float dtype ``s``: float32, float16, bfloat16 (one instantiation each; float64 calls never reach a
// kernel).
template <class F>
void with_float(at::ScalarType s, const char* kernel, const F& f) {
  switch (s) {
    case at::kFloat:
      f(float{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    default:
      TORCH_CHECK(false, "gradops.native: ", kernel, ": float tensor of dtype ", s,
                  " (float32, float16 or bfloat16 expected)");
  }
}

// The items of a float tensor (probs, its gradient) read and written one at a time as float32: the address and
// dtype resolved once (Tensor::data_ptr checks the dtype and the storage on every call: ~2 µs of a 15 µs
// 512 x 256 unpermute, one call per copy), a switch per item, never per element of a row.
struct Items {
  void* p = nullptr;
  at::ScalarType type = at::kFloat;
  float operator[](int64_t i) const {
    switch (type) {
      case at::kHalf:
        return to_f32(static_cast<const c10::Half*>(p)[i]);
      case at::kBFloat16:
        return to_f32(static_cast<const c10::BFloat16*>(p)[i]);
      default:
        return static_cast<const float*>(p)[i];
    }
  }
  void store(int64_t i, float v) const {
    switch (type) {
      case at::kHalf:
        static_cast<c10::Half*>(p)[i] = from_f32<c10::Half>(v);
        break;
      case at::kBFloat16:
        static_cast<c10::BFloat16*>(p)[i] = from_f32<c10::BFloat16>(v);
        break;
      default:
        static_cast<float*>(p)[i] = v;
    }
  }
};

// ``t``'s items (float32, float16 or bfloat16; refused otherwise); an undefined tensor gives no items.
Items items_of(const at::Tensor& t, const char* kernel) {
  Items items;
  if (!t.defined()) return items;
  with_float(t.scalar_type(), kernel, [](auto) {});
  items.type = t.scalar_type();
  items.p = t.numel() != 0 ? t.data_ptr() : nullptr;
  return items;
}

// The call's arity and the 2-D tensors the kernel indexes as (rows, H): with the shape checks of each kernel, what
// keeps a malformed call (a caller's bug, never a user's values) from addressing memory outside its tensors.
void require_args(const KernelArgs& a, const char* kernel, size_t in_min, size_t in_max, size_t outs, size_t ints) {
  TORCH_CHECK(a.in.size() >= in_min && a.in.size() <= in_max && a.out.size() == outs && a.ints.size() == ints,
              "gradops.native: ", kernel, ": called with ", a.in.size(), " inputs, ", a.out.size(), " outputs and ",
              a.ints.size(), " ints");
}

void require_2d(const char* kernel, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(!t->defined() || t->dim() == 2, "gradops.native: ", kernel, ": a 2-D tensor has ", t->dim(),
                " dimensions");
  }
}

// The first position whose entry lies outside [0, n) or repeats an earlier one, or -1 (the entries are then a
// permutation of [0, n)). One serial pass with an n-byte map: n·(s_idx + 1) bytes, against the gathers' n·H·s.
template <class I>
int64_t first_not_permutation(const I* idx, int64_t n) {
  std::vector<uint8_t> seen(static_cast<size_t>(n), 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = static_cast<int64_t>(idx[i]);
    if (v < 0 || v >= n || seen[v] != 0) return i;
    seen[v] = 1;
  }
  return -1;
}

int64_t first_not_permutation(const at::Tensor& idx, const char* kernel) {
  const Entries e = entries_of(idx, kernel);
  return e.wide != nullptr ? first_not_permutation(e.wide, idx.numel()) : first_not_permutation(e.narrow, idx.numel());
}

// Columns of a row kept in one float32 tile (2 KiB): a token's K rows are added tile by tile, so the sum stays in
// L1 beside the up to 8 source tiles one pass reads (16 KiB as float32), and is stored once.
constexpr int64_t kTile = 512;

// float16 <-> float32 over a tile, 8 lanes at a time (vec.h: F16C's conversions where the CPU has them): GCC does
// not vectorize c10::Half's scalar conversions (_cvtsh_ss), which made the float16 kernels 1.5-5x slower than the
// float32 and bfloat16 ones at T·K x H = 64 x 128 to 8192 x 4096. The same IEEE round-to-nearest-even conversions
// as c10's, so the same bits.
void widen(const c10::Half* src, int64_t n, float* dst) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) vec::store(vec::load(src + j), dst + j);
  for (; j < n; ++j) dst[j] = to_f32(src[j]);
}

void narrow(const float* src, int64_t n, c10::Half* dst) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) vec::store(vec::load(src + j), dst + j);
  for (; j < n; ++j) dst[j] = from_f32<c10::Half>(src[j]);
}

template <class T>
constexpr bool kIsHalf = std::is_same_v<T, c10::Half>;

// The n items at p as the kernels' loops read them: float16 widened into ``buf`` (kTile floats), the other dtypes
// in place (their conversions vectorize inline).
template <class T>
inline auto tile_in(const T* p, int64_t n, float* buf) {
  if constexpr (kIsHalf<T>) {
    widen(p, n, buf);
    return static_cast<const float*>(buf);
  } else {
    (void)n;
    (void)buf;
    return p;
  }
}

// Where the loops write a tile bound for p: ``buf`` for float16 (narrowed by tile_out_done), else p itself.
template <class T>
inline auto tile_out(T* p, float* buf) {
  if constexpr (kIsHalf<T>) {
    (void)p;
    return buf;
  } else {
    (void)buf;
    return p;
  }
}

template <class T>
inline void tile_out_done(T* p, int64_t n, const float* buf) {
  if constexpr (kIsHalf<T>) narrow(buf, n, p);
}

// acc[j] (+)= sum over q < kRows of w[q] · p[q][j] (weight 1 without kWeighted), j < n, added left to right after
// acc[j] (kFirst: the first term is the sum's start, no 0 + x). kRows row streams in flight at once: one row per
// pass reads at a fraction of the memory's bandwidth (T=8192 K=8 H=2048 fp32: 37% of copy_'s with one row per
// pass, 70% with eight).
template <class U, bool kWeighted, int kRows, bool kFirst>
inline void add_rows(float* __restrict__ acc, const U* const* rows_at, const float* w, int64_t n) {
  const U* p[kRows];
  float wq[kRows];
  for (int q = 0; q < kRows; ++q) {
    p[q] = rows_at[q];
    wq[q] = kWeighted ? w[q] : 1.0f;
  }
  for (int64_t j = 0; j < n; ++j) {
    float v = kWeighted ? wq[0] * to_f32(p[0][j]) : to_f32(p[0][j]);
    if (!kFirst) v = acc[j] + v;
    for (int q = 1; q < kRows; ++q) v = v + (kWeighted ? wq[q] * to_f32(p[q][j]) : to_f32(p[q][j]));
    acc[j] = v;
  }
}

#if defined(__F16C__)
// add_rows for float16 rows with F16C's conversions inside the loop (staging each row's tile through widen() reads
// the rows one after the other, a single stream, and took 1.3-2.8x this loop's time): the same products and
// additions in the same order, eight columns at a time.
template <bool kWeighted, int kRows, bool kFirst>
inline void add_rows_f16(float* __restrict__ acc, const c10::Half* const* rows_at, const float* w, int64_t n) {
  const c10::Half* p[kRows];
  float wq[kRows];
  __m256 wv[kRows];
  for (int q = 0; q < kRows; ++q) {
    p[q] = rows_at[q];
    wq[q] = kWeighted ? w[q] : 1.0f;
    wv[q] = _mm256_set1_ps(wq[q]);
  }
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 v = kWeighted ? _mm256_mul_ps(wv[0], vec::load(p[0] + j)) : vec::load(p[0] + j);
    if (!kFirst) v = _mm256_add_ps(_mm256_loadu_ps(acc + j), v);
    for (int q = 1; q < kRows; ++q) {
      v = _mm256_add_ps(v, kWeighted ? _mm256_mul_ps(wv[q], vec::load(p[q] + j)) : vec::load(p[q] + j));
    }
    _mm256_storeu_ps(acc + j, v);
  }
  for (; j < n; ++j) {
    float v = kWeighted ? wq[0] * to_f32(p[0][j]) : to_f32(p[0][j]);
    if (!kFirst) v = acc[j] + v;
    for (int q = 1; q < kRows; ++q) v = v + (kWeighted ? wq[q] * to_f32(p[q][j]) : to_f32(p[q][j]));
    acc[j] = v;
  }
}
#endif

#if defined(__AVX2__)
// bfloat16 rows, 16 columns a step: one 256-bit load gives the even columns (each 32-bit lane's low half, shifted
// up) and the odd ones (its high half, masked): 3 instructions per 16 columns where the widening GCC generates
// (vpmovzxwd, vpslld) takes 6, which left the 512 x 256 bfloat16 sums 15% behind the float32 ones. The sum tile
// holds a step's 16 columns as [8 even | 8 odd] (narrow_bf16 puts them back in order); the same products and
// additions, so the same bits.
inline void load16(const c10::BFloat16* p, __m256& even, __m256& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

template <bool kWeighted, int kRows, bool kFirst>
inline void add_rows_bf16(float* __restrict__ acc, const c10::BFloat16* const* rows_at, const float* w, int64_t n) {
  const c10::BFloat16* p[kRows];
  float wq[kRows];
  __m256 wv[kRows];
  for (int q = 0; q < kRows; ++q) {
    p[q] = rows_at[q];
    wq[q] = kWeighted ? w[q] : 1.0f;
    wv[q] = _mm256_set1_ps(wq[q]);
  }
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m256 e, o;
    load16(p[0] + j, e, o);
    if (kWeighted) {
      e = _mm256_mul_ps(wv[0], e);
      o = _mm256_mul_ps(wv[0], o);
    }
    if (!kFirst) {
      e = _mm256_add_ps(_mm256_loadu_ps(acc + j), e);
      o = _mm256_add_ps(_mm256_loadu_ps(acc + j + 8), o);
    }
    for (int q = 1; q < kRows; ++q) {
      __m256 eq, oq;
      load16(p[q] + j, eq, oq);
      e = _mm256_add_ps(e, kWeighted ? _mm256_mul_ps(wv[q], eq) : eq);
      o = _mm256_add_ps(o, kWeighted ? _mm256_mul_ps(wv[q], oq) : oq);
    }
    _mm256_storeu_ps(acc + j, e);
    _mm256_storeu_ps(acc + j + 8, o);
  }
  for (; j < n; ++j) {
    float v = kWeighted ? wq[0] * to_f32(p[0][j]) : to_f32(p[0][j]);
    if (!kFirst) v = acc[j] + v;
    for (int q = 1; q < kRows; ++q) v = v + (kWeighted ? wq[q] * to_f32(p[q][j]) : to_f32(p[q][j]));
    acc[j] = v;
  }
}

// c10's float32 -> bfloat16 rounding on 8 lanes (vec.h), each result in its lane's high half.
inline __m256i round_bf16(__m256 x) { return reinterpret_cast<__m256i>(vec::round_bf16(x)); }

// The n sums of a tile laid out by add_rows_bf16 ([8 even | 8 odd] per 16 columns, the tail in order) to bfloat16.
inline void narrow_bf16(const float* acc, int64_t n, c10::BFloat16* dst) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256i e = round_bf16(_mm256_loadu_ps(acc + j)), o = round_bf16(_mm256_loadu_ps(acc + j + 8));
    const __m256i packed = _mm256_or_si256(_mm256_srli_epi32(e, 16),
                                           _mm256_and_si256(o, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), packed);
  }
  for (; j < n; ++j) dst[j] = from_f32<c10::BFloat16>(acc[j]);
}
#endif

template <class T>
constexpr bool kIsBFloat16 = std::is_same_v<T, c10::BFloat16>;

// One pass of gather_sum over the tile [j0, j0 + n): kRows rows from ``rows``, added to acc.
template <class T, bool kWeighted, int kRows>
inline void sum_pass(float* acc, const T* src, int64_t h, int64_t j0, int64_t n, const int64_t* rows, const float* w,
                     bool first) {
  const T* at[kRows];
  for (int q = 0; q < kRows; ++q) at[q] = src + rows[q] * h + j0;
#if defined(__F16C__)
  if constexpr (kIsHalf<T>) {
    if (first) {
      add_rows_f16<kWeighted, kRows, true>(acc, at, w, n);
    } else {
      add_rows_f16<kWeighted, kRows, false>(acc, at, w, n);
    }
    return;
  }
#endif
#if defined(__AVX2__)
  if constexpr (kIsBFloat16<T>) {
    if (first) {
      add_rows_bf16<kWeighted, kRows, true>(acc, at, w, n);
    } else {
      add_rows_bf16<kWeighted, kRows, false>(acc, at, w, n);
    }
    return;
  }
#endif
  if (first) {
    add_rows<T, kWeighted, kRows, true>(acc, at, w, n);
  } else {
    add_rows<T, kWeighted, kRows, false>(acc, at, w, n);
  }
}

// dst[j] = sum over c < nv of w[c] · src[rows[c]][j] (of src[rows[c]][j] without kWeighted) in float32, strictly in
// c order: the first term is the sum's start, each later one added to it; eight rows per pass while eight remain,
// then two, then one (the order is the same whatever the grouping). nv = 0: a zero row.
template <class T, bool kWeighted>
void gather_sum(const T* src, int64_t h, const int64_t* rows, const float* w, int64_t nv, T* dst,
                bool stream = false) {
  if (nv == 0) {
    for (int64_t j = 0; j < h; ++j) dst[j] = from_f32<T>(0.0f);
    return;
  }
  float acc[kTile];
  for (int64_t j0 = 0; j0 < h; j0 += kTile) {
    const int64_t n = std::min(kTile, h - j0);
    for (int64_t c = 0; c < nv;) {
      const bool first = c == 0;
      if (nv - c >= 8) {
        sum_pass<T, kWeighted, 8>(acc, src, h, j0, n, rows + c, w + c, first);
        c += 8;
      } else if (nv - c >= 2) {
        sum_pass<T, kWeighted, 2>(acc, src, h, j0, n, rows + c, w + c, first);
        c += 2;
      } else {
        sum_pass<T, kWeighted, 1>(acc, src, h, j0, n, rows + c, w + c, first);
        c += 1;
      }
    }
    if constexpr (kIsHalf<T>) {
      narrow(acc, n, dst + j0);
#if defined(__AVX2__)
    } else if constexpr (kIsBFloat16<T>) {
      narrow_bf16(acc, n, dst + j0);
#endif
    } else if constexpr (std::is_same_v<T, float>) {
      if (stream) {  // dst 32-byte aligned, h % 8 == 0 (streams() in the caller)
        for (int64_t j = 0; j < n; j += 8) {
          float v[8];
          std::memcpy(v, acc + j, sizeof v);
          stream8(dst + j0 + j, v);
        }
      } else {
        std::memcpy(dst + j0, acc, static_cast<size_t>(n) * sizeof(float));
      }
    } else {
      T* d = dst + j0;
      for (int64_t j = 0; j < n; ++j) d[j] = from_f32<T>(acc[j]);
    }
  }
}

// The gather-sums of moe_token_permute_grad, moe_token_unpermute and the routing-map ops: out[t] = sum_{k<K}
// weight(t, k) · src[idx[t·K + k]] over the slots naming a row present (0 <= row < A), k in order (kWeighted false:
// the plain sum, no products). The caller checked idx (a permutation, or the routing-map slot rules). Tokens split
// over threads by rows_grain over the H items a token writes: serial below kParallelMin written items (a 512 x 256
// fp32 gradient's T = 64, H = 256 sums run on the calling thread).
template <bool kWeighted, class W>
void token_sums(const at::Tensor& src, const Entries& idx, int64_t topk, const W& weight, const at::Tensor& out,
                const char* kernel) {
  const int64_t a = src.size(0), h = src.size(1), tokens = out.size(0);
  if (tokens == 0 || h == 0) return;
  with_float(src.scalar_type(), kernel, [&](auto tag) {
    using T = decltype(tag);
    const T* x = src.const_data_ptr<T>();
    T* y = out.data_ptr<T>();
    const bool stream = streams(y, tokens, h);
    parallel(0, tokens, rows_grain(tokens, h), [&](int64_t lo, int64_t hi) {
      std::vector<int64_t> rows(static_cast<size_t>(topk));
      std::vector<float> w(static_cast<size_t>(topk));
      for (int64_t t = lo; t < hi; ++t) {
        int64_t nv = 0;
        for (int64_t k = 0; k < topk; ++k) {
          const int64_t r = idx[t * topk + k];
          if (r >= 0 && r < a) {
            rows[nv] = r;
            if constexpr (kWeighted) w[nv] = weight(t, k);
            ++nv;
          }
        }
        gather_sum<T, kWeighted>(x, h, rows.data(), w.data(), nv, y + t * h, stream);
      }
      if (stream) stream_fence();
    });
  });
}

// Weight 1 (a plain sum where kWeighted is false; the routing-map ops' unit weights where it is true).
inline float unit_weight(int64_t, int64_t) { return 1.0f; }

// ---------------------------------------------------------------- moe_token_permute
// The destination row of each copy: inverse[i] = the rank of copy i in the stable order of the flattened expert
// ids (CANN's sorted_indices). A counting sort when the ids span fewer than 2·n + 4096 values (every router: ids
// in [0, E)), else a sort of (id, position) pairs - unique keys, so the stable order exactly. Serial: n·(s_idx + 4)
// bytes and an array of the span's counts, small beside the gather's n·H·s. Returns -1, or the first position of a
// negative id, found by the pass that takes the ids' span, before anything is written.
template <class I>
int64_t destinations(const I* ids, int64_t n, int32_t* inverse) {
  if (n == 0) return -1;
  int64_t lo = static_cast<int64_t>(ids[0]), hi = lo;
  for (int64_t i = 1; i < n; ++i) {
    const int64_t v = static_cast<int64_t>(ids[i]);
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  if (lo < 0) {
    for (int64_t i = 0; i < n; ++i) {
      if (ids[i] < 0) return i;
    }
  }
  // 0 <= lo <= hi: hi - lo cannot overflow; the bound in double keeps 2·n + 4096 from overflowing.
  if (static_cast<double>(hi - lo) < 2.0 * static_cast<double>(n) + 4096.0) {
    const int64_t span = hi - lo + 1;
    std::vector<int64_t> starts(static_cast<size_t>(span), 0);
    for (int64_t i = 0; i < n; ++i) ++starts[static_cast<int64_t>(ids[i]) - lo];
    int64_t total = 0;
    for (int64_t v = 0; v < span; ++v) {
      const int64_t c = starts[v];
      starts[v] = total;
      total += c;
    }
    for (int64_t i = 0; i < n; ++i) inverse[i] = static_cast<int32_t>(starts[static_cast<int64_t>(ids[i]) - lo]++);
  } else {
    std::vector<std::pair<int64_t, int64_t>> order(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) order[i] = {static_cast<int64_t>(ids[i]), i};
    std::sort(order.begin(), order.end());
    for (int64_t j = 0; j < n; ++j) inverse[order[j].second] = static_cast<int32_t>(j);
  }
  return -1;
}

// moe_token_permute: permuted[sorted_indices[i]] = tokens[i // K] for the first ``rows`` permuted rows.
//  in:  tokens (T, H) float; indices (T, K) or (T,), int32 / int64 expert ids >= 0.
//  out: permuted (rows, H) in tokens' dtype, rows <= T·K; sorted_indices (T·K,) int32.
//  ints: K. floats: none.
//  Returns -1, or the first flat position of a negative id (nothing written).
// The gather copies bits (no conversion), copy by copy: each token's row is read K times in a row (from cache) and
// each kept row of permuted written once. Serial below kParallelMin written items (rows · H), else kTaskItems'
// worth of copies per task.
int64_t moe_token_permute(const KernelArgs& a) {
  const char* name = "moe_token_permute";
  require_args(a, name, 2, 2, 2, 1);
  const at::Tensor &tokens = a.in[0], &indices = a.in[1], &permuted = a.out[0], &inverse = a.out[1];
  require_2d(name, {&tokens, &permuted});
  const int64_t topk = a.ints[0];
  const int64_t t_count = tokens.size(0), h = tokens.size(1), total = indices.numel(), rows = permuted.size(0);
  TORCH_CHECK(topk >= 1 && total == t_count * topk && inverse.numel() == total && inverse.scalar_type() == at::kInt &&
                  rows <= total && permuted.size(1) == h && permuted.scalar_type() == tokens.scalar_type(),
              "gradops.native: ", name, ": arguments of mismatched shapes or dtypes");
  TORCH_CHECK(total <= std::numeric_limits<int32_t>::max(), "gradops.native: ", name,
              ": more copies than int32 sorted_indices can number");
  int32_t* dest = inverse.data_ptr<int32_t>();
  const Entries ids = entries_of(indices, name);
  const int64_t bad = ids.wide != nullptr ? destinations(ids.wide, total, dest) : destinations(ids.narrow, total, dest);
  if (bad >= 0 || rows == 0 || h == 0) return bad;
  const int64_t bytes = h * static_cast<int64_t>(tokens.element_size());
  const char* src = static_cast<const char*>(tokens.const_data_ptr());
  char* dst = static_cast<char*>(permuted.data_ptr());
  const int64_t grain = rows * h < kParallelMin ? total : std::max<int64_t>(1, kTaskItems / h);
  parallel(0, total, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t d = dest[i];
      if (d < rows) std::memcpy(dst + d * bytes, src + (i / topk) * bytes, static_cast<size_t>(bytes));
    }
  });
  return -1;
}

// ---------------------------------------------------------------- moe_token_permute_grad
// moe_token_permute_grad: out[t] = sum_{k<K} grad[sorted_indices[t·K + k]] over the rows present, k in order.
//  in:  grad (A, H) float, A <= T·K; sorted_indices (T·K,) int32 / int64.
//  out: out (T, H) in grad's dtype (a zero row for a token whose copies were all dropped).
//  ints: K. floats: none.
//  Returns -1, or the first position of sorted_indices outside [0, T·K) or repeated (nothing written): the test
//  runs whatever the caller checked, since the sums read rows with the entries.
int64_t moe_token_permute_grad(const KernelArgs& a) {
  const char* name = "moe_token_permute_grad";
  require_args(a, name, 2, 2, 1, 1);
  const at::Tensor &grad = a.in[0], &idx = a.in[1], &out = a.out[0];
  require_2d(name, {&grad, &out});
  const int64_t topk = a.ints[0], total = idx.numel();
  TORCH_CHECK(topk >= 1 && total % topk == 0 && out.size(0) == total / topk && out.size(1) == grad.size(1) &&
                  grad.size(0) <= total && out.scalar_type() == grad.scalar_type(),
              "gradops.native: ", name, ": arguments of mismatched shapes or dtypes");
  const int64_t bad = first_not_permutation(idx, name);
  if (bad >= 0) return bad;
  token_sums<false>(grad, entries_of(idx, name), topk, unit_weight, out, name);
  return -1;
}

// ---------------------------------------------------------------- moe_token_unpermute
// moe_token_unpermute: out[t] = sum_{k<K} probs[t, k] · permuted[sorted_indices[t·K + k]] over the rows present,
// k in order, each product rounded to float32 before it is added (probs absent: K = 1, weight 1, the sum of one row:
// the permute gradient's gather).
//  in:  permuted (A, H) float, A <= T·K; sorted_indices (T·K,) int32 / int64; probs (T, K) float or absent.
//  out: out (T, H) in permuted's dtype.
//  ints: none. floats: none.
//  Returns -1, or the first position of sorted_indices outside [0, T·K) or repeated (nothing written).
int64_t moe_token_unpermute(const KernelArgs& a) {
  const char* name = "moe_token_unpermute";
  require_args(a, name, 2, 3, 1, 0);
  const at::Tensor &x = a.in[0], &idx = a.in[1], &out = a.out[0];
  const at::Tensor probs = a.in.size() > 2 ? a.in[2] : at::Tensor();
  require_2d(name, {&x, &out, &probs});
  const int64_t total = idx.numel();
  const int64_t topk = probs.defined() ? probs.size(1) : 1;
  TORCH_CHECK(topk >= 1 && (!probs.defined() || probs.numel() == total) && total % topk == 0 &&
                  out.size(0) == total / topk && out.size(1) == x.size(1) && x.size(0) <= total &&
                  out.scalar_type() == x.scalar_type(),
              "gradops.native: ", name, ": arguments of mismatched shapes or dtypes");
  const int64_t bad = first_not_permutation(idx, name);
  if (bad >= 0) return bad;
  const Entries e = entries_of(idx, name);
  if (probs.defined()) {
    const Items p = items_of(probs, name);
    token_sums<true>(x, e, topk, [&](int64_t t, int64_t k) { return p[t * topk + k]; }, out, name);
  } else {
    token_sums<false>(x, e, topk, unit_weight, out, name);
  }
  return -1;
}

// ---------------------------------------------------------------- moe_token_unpermute_grad
// Lanes of the probs gradient's float32 dot products: lane q adds the products of columns q, q + 16, ..., in
// column order, then the lanes fold pairwise (8, 4, 2, 1). A fixed order, so the same bits on every run and thread
// count, that vectorizes without reassociation: each step adds two 16-wide vectors.
constexpr int64_t kLanes = 16;

static_assert(kTile % kLanes == 0, "a tile starts on lane 0");

// One tile of scatter_and_dot: dx[j] = g[j] · w, lanes[j % kLanes] += g[j] · x[j] for j < n.
template <class UG, class UX, class UD>
inline void scatter_dot_tile(const UG* __restrict__ g, const UX* __restrict__ x, UD* __restrict__ dx, float w,
                             int64_t n, float* __restrict__ lanes) {
  const int64_t full = n - n % kLanes;
  for (int64_t j0 = 0; j0 < full; j0 += kLanes) {
    for (int64_t q = 0; q < kLanes; ++q) {
      const float gv = to_f32(g[j0 + q]);
      dx[j0 + q] = from_f32<UD>(gv * w);
      lanes[q] += gv * to_f32(x[j0 + q]);
    }
  }
  for (int64_t j = full; j < n; ++j) {
    const float gv = to_f32(g[j]);
    dx[j] = from_f32<UD>(gv * w);
    lanes[j - full] += gv * to_f32(x[j]);
  }
}

#if defined(__AVX2__)
// scatter_dot_tile for bfloat16 g, x and dx, 16 columns a step: load16's even / odd halves, the products and lane
// sums of the scalar loop (lane q of a step holds column q: the even columns are lanes 0, 2, ..., the odd ones
// 1, 3, ...), dx rounded by round_bf16 and packed back in column order. The same products and additions in the same
// order, so the same bits; the scalar loop's c10 rounding of each dx element did not vectorize (T = 8192, K = 8,
// H = 2048 bf16 took 74% of the fp32 time for half its bytes).
inline void scatter_dot_tile_bf16(const c10::BFloat16* __restrict__ g, const c10::BFloat16* __restrict__ x,
                                  c10::BFloat16* __restrict__ dx, float w, int64_t n, float* __restrict__ lanes) {
  const int64_t full = n - n % kLanes;
  const __m256 wv = _mm256_set1_ps(w);
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t j0 = 0; j0 < full; j0 += kLanes) {
    __m256 ge, go, xe, xo;
    load16(g + j0, ge, go);
    load16(x + j0, xe, xo);
    const __m256i de = round_bf16(_mm256_mul_ps(ge, wv)), dodd = round_bf16(_mm256_mul_ps(go, wv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dx + j0),
                        _mm256_or_si256(_mm256_srli_epi32(de, 16), _mm256_and_si256(dodd, high)));
    even = _mm256_add_ps(even, _mm256_mul_ps(ge, xe));
    odd = _mm256_add_ps(odd, _mm256_mul_ps(go, xo));
  }
  float e[8], o[8];
  _mm256_storeu_ps(e, even);
  _mm256_storeu_ps(o, odd);
  for (int q = 0; q < 8; ++q) {
    lanes[2 * q] += e[q];
    lanes[2 * q + 1] += o[q];
  }
  for (int64_t j = full; j < n; ++j) {
    const float gv = to_f32(g[j]);
    dx[j] = from_f32<c10::BFloat16>(gv * w);
    lanes[j - full] += gv * to_f32(x[j]);
  }
}
#endif

#if defined(__AVX2__)
// scatter_dot_tile for float32 g, x and dx with explicit 8-lane vectors, so that dx can be streamed past the caches
// (stream: see kernels.h; dx 32-byte aligned): lanes 0-7 and 8-15 of a step are two vectors, the same products and
// additions in the same order as the scalar loop.
inline void scatter_dot_tile_f32(const float* __restrict__ g, const float* __restrict__ x, float* __restrict__ dx,
                                 float w, int64_t n, float* __restrict__ lanes, bool stream) {
  const int64_t full = n - n % kLanes;
  const __m256 wv = _mm256_set1_ps(w);
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t j0 = 0; j0 < full; j0 += kLanes) {
    const __m256 g0 = _mm256_loadu_ps(g + j0), g1 = _mm256_loadu_ps(g + j0 + 8);
    const __m256 d0 = _mm256_mul_ps(g0, wv), d1 = _mm256_mul_ps(g1, wv);
    if (stream) {
      _mm256_stream_ps(dx + j0, d0);
      _mm256_stream_ps(dx + j0 + 8, d1);
    } else {
      _mm256_storeu_ps(dx + j0, d0);
      _mm256_storeu_ps(dx + j0 + 8, d1);
    }
    lo = _mm256_add_ps(lo, _mm256_mul_ps(g0, _mm256_loadu_ps(x + j0)));
    hi = _mm256_add_ps(hi, _mm256_mul_ps(g1, _mm256_loadu_ps(x + j0 + 8)));
  }
  float l[8], h[8];
  _mm256_storeu_ps(l, lo);
  _mm256_storeu_ps(h, hi);
  for (int q = 0; q < 8; ++q) {
    lanes[q] += l[q];
    lanes[q + 8] += h[q];
  }
  for (int64_t j = full; j < n; ++j) {
    dx[j] = g[j] * w;
    lanes[j - full] += g[j] * x[j];
  }
}
#endif

// dx[j] = g[j] · w (float32 product, rounded once to dx's dtype); returns sum_j g[j] · x[j]: each tile's products in
// the lane order of kLanes, folded, and the tiles' sums added in float64 (in-order float32 lanes lose accuracy with
// H; a tile's float32 sum keeps the error of a kTile-element sum at every H, and H <= kTile gives the lanes' bits).
// One pass over g, x and dx, tile by tile.
template <class TX, class TG>
float scatter_and_dot(const TG* g, const TX* x, TX* dx, float w, int64_t h, bool stream = false) {
  float gbuf[kIsHalf<TG> ? kTile : 1], xbuf[kIsHalf<TX> ? kTile : 1], dbuf[kIsHalf<TX> ? kTile : 1];
  double total = 0.0;
  for (int64_t j0 = 0; j0 < h; j0 += kTile) {
    const int64_t n = std::min(kTile, h - j0);
    float lanes[kLanes] = {};
#if defined(__AVX2__)
    if constexpr (kIsBFloat16<TX> && kIsBFloat16<TG>) {
      scatter_dot_tile_bf16(g + j0, x + j0, dx + j0, w, n, lanes);
    } else if constexpr (std::is_same_v<TX, float> && std::is_same_v<TG, float>) {
      scatter_dot_tile_f32(g + j0, x + j0, dx + j0, w, n, lanes, stream);
    } else {
      scatter_dot_tile(tile_in(g + j0, n, gbuf), tile_in(x + j0, n, xbuf), tile_out(dx + j0, dbuf), w, n, lanes);
    }
#else
    scatter_dot_tile(tile_in(g + j0, n, gbuf), tile_in(x + j0, n, xbuf), tile_out(dx + j0, dbuf), w, n, lanes);
#endif
    tile_out_done(dx + j0, n, dbuf);
    for (int64_t step = kLanes / 2; step > 0; step /= 2) {
      for (int64_t q = 0; q < step; ++q) lanes[q] += lanes[q + step];
    }
    total += static_cast<double>(lanes[0]);
  }
  return static_cast<float>(total);
}

// dx[j] = g[j] converted to dx's dtype through float32 (grad_unpermuted's row scattered without probs).
template <class TX, class TG>
void convert_row(const TG* g, TX* dx, int64_t h) {
  float gbuf[kIsHalf<TG> ? kTile : 1], dbuf[kIsHalf<TX> ? kTile : 1];
  for (int64_t j0 = 0; j0 < h; j0 += kTile) {
    const int64_t n = std::min(kTile, h - j0);
    const auto* gi = tile_in(g + j0, n, gbuf);
    auto* o = tile_out(dx + j0, dbuf);
    using UD = std::remove_pointer_t<decltype(o)>;
    for (int64_t j = 0; j < n; ++j) o[j] = from_f32<UD>(to_f32(gi[j]));
    tile_out_done(dx + j0, n, dbuf);
  }
}

// moe_token_unpermute_grad: for each copy k of token t whose row r = sorted_indices[t·K + k] is present (< A):
//     grad_permuted[r] = grad_unpermuted[t] · probs[t, k]     (float32 product; grad_unpermuted[t] without probs)
//     grad_probs[t, k] = dot(grad_unpermuted[t], permuted[r]) (float32 per tile, tiles in float64; 0 if dropped)
//  in:  permuted (A, H) float, A <= T·K; grad_unpermuted (T, H) float (any of the three dtypes);
//       sorted_indices (T·K,) int32 / int64; probs (T, K) float or absent (K = 1).
//  out: grad_permuted (A, H) in permuted's dtype; grad_probs (T, K) in probs' dtype, or an empty tensor without
//       probs (not written).
//  ints: check (1: test that sorted_indices is a permutation first; 0: the caller's own forward made it one - an
//        entry outside [0, A) is still never read or written with). floats: none.
//  Returns -1, or (check only) the first position of sorted_indices outside [0, T·K) or repeated (nothing written).
// sorted_indices being a permutation, every row of grad_permuted has exactly one writer: tokens split over threads
// by rows_grain over the K·H items a token touches, no zero-fill, no atomics.
int64_t moe_token_unpermute_grad(const KernelArgs& a) {
  const char* name = "moe_token_unpermute_grad";
  require_args(a, name, 3, 4, 2, 1);
  const at::Tensor &x = a.in[0], &g = a.in[1], &idx = a.in[2], &dx = a.out[0], &dp = a.out[1];
  const at::Tensor probs = a.in.size() > 3 ? a.in[3] : at::Tensor();
  require_2d(name, {&x, &g, &dx, &probs});
  const bool check = a.ints[0] != 0;
  const int64_t rows_a = x.size(0), h = x.size(1), tokens = g.size(0), total = idx.numel();
  const bool has_probs = probs.defined();
  const int64_t topk = has_probs ? probs.size(1) : 1;
  TORCH_CHECK(topk >= 1 && tokens * topk == total && g.size(1) == h && dx.sizes() == x.sizes() &&
                  dx.scalar_type() == x.scalar_type() && rows_a <= total &&
                  (!has_probs || (probs.size(0) == tokens && dp.numel() == total)),
              "gradops.native: ", name, ": arguments of mismatched shapes or dtypes");
  const Items p = items_of(probs, name), dpi = items_of(has_probs ? dp : at::Tensor(), name);
  TORCH_CHECK(!has_probs || dp.scalar_type() == probs.scalar_type(), "gradops.native: ", name,
              ": grad_probs not in probs' dtype");
  if (check) {
    const int64_t bad = first_not_permutation(idx, name);
    if (bad >= 0) return bad;
  }
  if (tokens == 0) return -1;
  const Entries e = entries_of(idx, name);
  with_float(x.scalar_type(), name, [&](auto xtag) {
    using TX = decltype(xtag);
    with_float(g.scalar_type(), name, [&](auto gtag) {
      using TG = decltype(gtag);
      const TX* xp = x.const_data_ptr<TX>();
      const TG* gp = g.const_data_ptr<TG>();
      TX* dxp = dx.data_ptr<TX>();
      const bool stream = streams(dxp, rows_a, h);
      parallel(0, tokens, rows_grain(tokens, topk * h), [&](int64_t lo, int64_t hi) {
        for (int64_t t = lo; t < hi; ++t) {
          const TG* gt = gp + t * h;
          for (int64_t k = 0; k < topk; ++k) {
            const int64_t r = e[t * topk + k];
            const bool present = r >= 0 && r < rows_a;
            if (has_probs) {
              const int64_t i = t * topk + k;
              dpi.store(i, present ? scatter_and_dot(gt, xp + r * h, dxp + r * h, p[i], h, stream) : 0.0f);
            } else if (present) {
              convert_row(gt, dxp + r * h, h);
            }
          }
        }
        if (stream) stream_fence();
      });
    });
  });
  return -1;
}

// ---------------------------------------------------------------- the routing-map ops
// aclnnMoeTokenPermuteWithRoutingMap, aclnnMoeTokenUnpermuteWithRoutingMap and their gradients: the slot tables of
// gradops.families.moe.routing_reference (docs/semantics.md §5b) built here in integer passes over the (T, E) map and the
// sorted indices, then the gather-sums and scatters above on them. One kernel per op, so that a remembered call is
// one C++ call (the Python slot tables cost 50-110 µs at 8 x 8, a dozen torch ops and a host read of the live count
// each) and the same kernel runs on gradops' Python path: the sums are gather_sum / scatter_and_dot on the rows in
// the order the tables give them, so the bits are those of the family kernels on the Python tables.
//
// Two layouts (the ops' drop_and_pad):
//  - without dropping, K slots per token: slot (t, k) is token t's k-th routed expert (ascending) and its permuted
//    row; rows are expert-major, tokens ascending within an expert (the stable sort by expert id). sorted_indices
//    (T·K,) holds each slot's row, -1 for a slot past the token's last routed expert. What a gradient or unpermute
//    accepts: entries >= -1 whose non-negative ones are the rows [0, live) once each, live <= A.
//  - drop_and_pad, C rows per expert: expert e's rows [e·C, (e+1)·C) hold its routed tokens ascending, then its
//    unrouted ones ascending, the first C of them; sorted_indices (C·E,) holds each row's token. What a gradient or
//    unpermute accepts: tokens in [0, T), each on at most kMaxRowsPerToken rows; a token's rows are summed in
//    ascending order.
// routing_map is bool or int8, read as bytes (nonzero: routed). Every refusal is found by a read-only pass before
// any output is written.

// The permute family's top-k limit (gradops.families.moe.contract.MAX_TOPK): the most rows one token may gather.
constexpr int64_t kMaxRowsPerToken = 512;

const uint8_t* map_bytes(const at::Tensor& m, const char* kernel) {
  TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == at::kChar, "gradops.native: ", kernel,
              ": routing_map of dtype ", m.scalar_type(), " (bool or int8 expected)");
  return static_cast<const uint8_t*>(m.const_data_ptr());
}

// dst's item j = src's item i, bits copied (a probs value moved, not computed; the two share a dtype).
inline void copy_item(const at::Tensor& src, int64_t i, const at::Tensor& dst, int64_t j) {
  const int64_t size = dst.element_size();
  std::memcpy(static_cast<char*>(dst.data_ptr()) + j * size, static_cast<const char*>(src.const_data_ptr()) + i * size,
              static_cast<size_t>(size));
}

void zero_all(const at::Tensor& t) {
  if (t.numel() != 0) std::memset(t.data_ptr(), 0, static_cast<size_t>(t.numel() * t.element_size()));
}

// Zeroes rows [from, rows) of a (rows, H) tensor (a zero's bits are all zero in the three float dtypes).
void zero_rows(const at::Tensor& t, int64_t from) {
  const int64_t rows = t.size(0), bytes = t.size(1) * t.element_size();
  if (from < rows && bytes != 0) {
    std::memset(static_cast<char*>(t.data_ptr()) + from * bytes, 0, static_cast<size_t>((rows - from) * bytes));
  }
}

// The slots of sorted indices without dropping: ``live`` rows named, or the first position refused (an entry
// below -1 or outside [0, live), a row named twice, more rows named than A). One pass and a T·K-byte map.
struct Live {
  int64_t live = 0;
  int64_t bad = -1;
};

Live live_rows(const Entries& idx, int64_t n, int64_t rows_a) {
  Live out;
  for (int64_t i = 0; i < n; ++i) out.live += idx[i] >= 0 ? 1 : 0;
  std::vector<uint8_t> seen(static_cast<size_t>(out.live), 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = idx[i];
    if (v < -1 || v >= out.live || (v >= 0 && seen[v] != 0)) {
      out.bad = i;
      return out;
    }
    if (v >= 0) seen[v] = 1;
  }
  if (out.live > rows_a) out.bad = 0;
  return out;
}

// Each token's rows (drop_and_pad: row r holds token idx[r]), ascending, as offsets into one list: the first
// position refused (a token outside [0, T), a token on more than kMaxRowsPerToken rows) or -1.
struct TokenRows {
  std::vector<int64_t> start;  // T + 1 offsets
  std::vector<int64_t> rows;
};

int64_t rows_by_token(const Entries& idx, int64_t n, int64_t tokens, TokenRows& out) {
  out.start.assign(static_cast<size_t>(tokens + 1), 0);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = idx[r];
    if (t < 0 || t >= tokens) return r;
    if (++out.start[t + 1] > kMaxRowsPerToken) return r;
  }
  for (int64_t t = 0; t < tokens; ++t) out.start[t + 1] += out.start[t];
  out.rows.resize(static_cast<size_t>(n));
  std::vector<int64_t> cursor(out.start.begin(), out.start.end() - 1);
  for (int64_t r = 0; r < n; ++r) out.rows[cursor[idx[r]]++] = r;
  return -1;
}

// Token t's k-th routed expert (ascending) for k < K, -1 past its last: one row of the map.
void experts_by_rank(const uint8_t* map_row, int64_t e_count, int64_t topk, int64_t* out) {
  int64_t k = 0;
  for (int64_t e = 0; e < e_count && k < topk; ++e) {
    if (map_row[e] != 0) out[k++] = e;
  }
  for (; k < topk; ++k) out[k] = -1;
}

// out[t] = sum over token t's rows ``rows[start[t] .. start[t+1])`` (ascending) of w · src[row], in float32, the
// first row the sum's start; weights from ``weight(t, row)``. A token without rows: a zero row.
template <class W>
void token_row_sums(const at::Tensor& src, const TokenRows& by, const W& weight, const at::Tensor& out,
                    const char* kernel) {
  const int64_t h = src.size(1), tokens = out.size(0);
  if (tokens == 0 || h == 0) return;
  with_float(src.scalar_type(), kernel, [&](auto tag) {
    using T = decltype(tag);
    const T* x = src.const_data_ptr<T>();
    T* y = out.data_ptr<T>();
    const bool stream = streams(y, tokens, h);
    parallel(0, tokens, rows_grain(tokens, h), [&](int64_t lo, int64_t hi) {
      std::vector<float> w(static_cast<size_t>(kMaxRowsPerToken));
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t first = by.start[t], nv = by.start[t + 1] - first;
        for (int64_t c = 0; c < nv; ++c) w[c] = weight(t, by.rows[first + c]);
        gather_sum<T, true>(x, h, by.rows.data() + first, w.data(), nv, y + t * h, stream);
      }
      if (stream) stream_fence();
    });
  });
}

// moe_token_permute_with_routing_map: the rows of each (token, expert) pair, grouped by expert.
//  in:  tokens (T, H) float; routing_map (T, E) bool / int8; probs (T, E) float or absent.
//  out: permuted (A, H) in tokens' dtype; permuted_probs (A,) in probs' dtype, or an empty tensor without probs;
//       sorted_indices (S,) int32 (S = T·K, or C·E with drop_and_pad; A = S).
//  ints: per (K, or C with drop_and_pad), drop_and_pad.
//  Returns -1, or (without dropping) the map position of the first token routed to more than K experts.
// Without dropping, rows [live, A) of permuted and permuted_probs are zeros (CANN leaves them unwritten).
int64_t moe_token_permute_with_routing_map(const KernelArgs& a) {
  const char* name = "moe_token_permute_with_routing_map";
  require_args(a, name, 2, 3, 3, 2);
  const at::Tensor &tokens = a.in[0], &map = a.in[1], &permuted = a.out[0], &pprobs = a.out[1], &sorted = a.out[2];
  const at::Tensor probs = a.in.size() > 2 ? a.in[2] : at::Tensor();
  require_2d(name, {&tokens, &map, &permuted, &probs});
  const int64_t per = a.ints[0], t_count = tokens.size(0), h = tokens.size(1), e_count = map.size(1);
  const bool drop = a.ints[1] != 0;
  const int64_t slots = drop ? per * e_count : per * t_count;
  TORCH_CHECK(per >= 1 && map.size(0) == t_count && permuted.size(0) == slots && permuted.size(1) == h &&
                  permuted.scalar_type() == tokens.scalar_type() && sorted.numel() == slots &&
                  sorted.scalar_type() == at::kInt && (!probs.defined() || (probs.sizes() == map.sizes() &&
                  pprobs.numel() == slots && pprobs.scalar_type() == probs.scalar_type())) &&
                  (!drop || per <= t_count) && slots <= std::numeric_limits<int32_t>::max(),
              "gradops.native: ", name, ": arguments of mismatched shapes or dtypes");
  const uint8_t* m = map_bytes(map, name);
  int32_t* si = sorted.data_ptr<int32_t>();
  // token_of[r]: the token each row copies (-1: a zero row).
  std::vector<int64_t> token_of(static_cast<size_t>(slots), -1);
  std::vector<int64_t> expert_of(probs.defined() ? static_cast<size_t>(slots) : 0);
  std::vector<int64_t> count(static_cast<size_t>(e_count), 0);
  if (drop) {
    for (int64_t t = 0; t < t_count; ++t) {
      for (int64_t e = 0; e < e_count; ++e) count[e] += m[t * e_count + e] != 0 ? 1 : 0;
    }
    std::vector<int64_t> routed(static_cast<size_t>(e_count), 0), other(static_cast<size_t>(e_count), 0);
    for (int64_t t = 0; t < t_count; ++t) {
      for (int64_t e = 0; e < e_count; ++e) {
        const int64_t place = m[t * e_count + e] != 0 ? routed[e]++ : count[e] + other[e]++;
        if (place < per) {
          token_of[e * per + place] = t;
          if (probs.defined()) expert_of[e * per + place] = e;
        }
      }
    }
    for (int64_t r = 0; r < slots; ++r) si[r] = static_cast<int32_t>(token_of[r]);
  } else {
    for (int64_t t = 0; t < t_count; ++t) {
      int64_t routed = 0;
      for (int64_t e = 0; e < e_count; ++e) {
        if (m[t * e_count + e] != 0) {
          ++count[e];
          if (++routed > per) return t * e_count + e;
        }
      }
    }
    std::vector<int64_t> cursor(static_cast<size_t>(e_count), 0);
    for (int64_t e = 1; e < e_count; ++e) cursor[e] = cursor[e - 1] + count[e - 1];
    for (int64_t t = 0; t < t_count; ++t) {
      int64_t k = 0;
      for (int64_t e = 0; e < e_count; ++e) {
        if (m[t * e_count + e] == 0) continue;
        const int64_t r = cursor[e]++;
        si[t * per + k++] = static_cast<int32_t>(r);
        token_of[r] = t;
        if (probs.defined()) expert_of[r] = e;
      }
      for (; k < per; ++k) si[t * per + k] = -1;
    }
  }
  const int64_t bytes = h * static_cast<int64_t>(tokens.element_size());
  const char* src = static_cast<const char*>(tokens.const_data_ptr());
  char* dst = static_cast<char*>(permuted.data_ptr());
  parallel(0, slots, rows_grain(slots, h), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      if (bytes == 0) break;
      if (token_of[r] >= 0) {
        std::memcpy(dst + r * bytes, src + token_of[r] * bytes, static_cast<size_t>(bytes));
      } else {
        std::memset(dst + r * bytes, 0, static_cast<size_t>(bytes));
      }
    }
  });
  if (probs.defined()) {
    const int64_t size = pprobs.element_size();
    char* pp = static_cast<char*>(pprobs.data_ptr());
    for (int64_t r = 0; r < slots; ++r) {
      if (token_of[r] >= 0) {
        copy_item(probs, token_of[r] * e_count + expert_of[r], pprobs, r);
      } else {
        std::memset(pp + r * size, 0, static_cast<size_t>(size));
      }
    }
  }
  return -1;
}

// moe_token_permute_with_routing_map_grad: each token's gradient (the sum of its rows' gradients) and each row's
// probs gradient at its (token, expert) pair.
//  in:  grad (A, H) float; permuted_probs_grad (A,) float or absent; sorted_indices (S,) int32 / int64;
//       routing_map (T, E) bool / int8 or absent (needed for the probs' gradient without dropping).
//  out: tokens_grad (T, H) in grad's dtype; probs_grad (T, E) in permuted_probs_grad's dtype, or an empty tensor
//       without it.
//  ints: E, T, drop_and_pad.
//  Returns -1, or the first position of sorted_indices refused (see the layouts above).
int64_t moe_token_permute_with_routing_map_grad(const KernelArgs& a) {
  const char* name = "moe_token_permute_with_routing_map_grad";
  require_args(a, name, 4, 4, 2, 3);
  const at::Tensor &grad = a.in[0], &gprobs = a.in[1], &idx = a.in[2], &map = a.in[3];
  const at::Tensor &dtokens = a.out[0], &dprobs = a.out[1];
  require_2d(name, {&grad, &map, &dtokens});
  const int64_t e_count = a.ints[0], t_count = a.ints[1], rows_a = grad.size(0), n = idx.numel();
  const bool drop = a.ints[2] != 0, with_probs = gprobs.defined();
  TORCH_CHECK(e_count >= 1 && t_count >= 1 && dtokens.size(0) == t_count && dtokens.size(1) == grad.size(1) &&
                  dtokens.scalar_type() == grad.scalar_type() &&
                  (drop ? n == rows_a && n % e_count == 0 : n % t_count == 0 && n / t_count >= 1) &&
                  (!with_probs || (gprobs.numel() == rows_a && dprobs.dim() == 2 && dprobs.size(0) == t_count &&
                                   dprobs.size(1) == e_count && dprobs.scalar_type() == gprobs.scalar_type() &&
                                   (drop || (map.defined() && map.size(0) == t_count && map.size(1) == e_count)))),
              "gradops.native: ", name, ": arguments of mismatched shapes or dtypes");
  const Entries e = entries_of(idx, name);
  if (drop) {
    TokenRows by;
    const int64_t bad = rows_by_token(e, n, t_count, by);
    if (bad >= 0) return bad;
    token_row_sums(grad, by, unit_weight, dtokens, name);
    if (with_probs) {
      zero_all(dprobs);
      const int64_t per = n / e_count;
      for (int64_t r = 0; r < n; ++r) copy_item(gprobs, r, dprobs, e[r] * e_count + r / per);
    }
    return -1;
  }
  const int64_t topk = n / t_count;
  const Live live = live_rows(e, n, rows_a);
  if (live.bad >= 0) return live.bad;
  token_sums<true>(grad, e, topk, unit_weight, dtokens, name);
  if (with_probs) {
    zero_all(dprobs);
    const uint8_t* m = map_bytes(map, name);
    std::vector<int64_t> ranked(static_cast<size_t>(topk));
    for (int64_t t = 0; t < t_count; ++t) {
      experts_by_rank(m + t * e_count, e_count, topk, ranked.data());
      for (int64_t k = 0; k < topk; ++k) {
        const int64_t r = e[t * topk + k];
        if (r >= 0 && ranked[k] >= 0) copy_item(gprobs, r, dprobs, t * e_count + ranked[k]);
      }
    }
  }
  return -1;
}

// The weight of each slot of an unpermute (pair): its (token, expert) prob, 0 for a slot naming a row whose token
// has no k-th routed expert, 1 without probs.
struct SlotWeights {
  Items probs;
  const uint8_t* map = nullptr;
  int64_t experts = 0, topk = 0;
  std::vector<int64_t> ranked;  // without dropping: (T, K) experts by rank, -1 past the last
};

SlotWeights slot_weights(const at::Tensor& probs, const at::Tensor& map, int64_t tokens, int64_t topk,
                         const char* kernel) {
  SlotWeights w;
  w.probs = items_of(probs, kernel);
  w.topk = topk;
  if (!probs.defined()) return w;
  w.experts = probs.size(1);
  w.map = map_bytes(map, kernel);
  w.ranked.resize(static_cast<size_t>(tokens * topk));
  for (int64_t t = 0; t < tokens; ++t) experts_by_rank(w.map + t * w.experts, w.experts, topk, &w.ranked[t * topk]);
  return w;
}

// moe_token_unpermute_with_routing_map: out[t] = sum over token t's rows of w · permuted[row] (w: the row's
// (token, expert) prob, 1 without probs), in float32: without dropping in k order, with drop_and_pad in row order.
//  in:  permuted (A, H) float; sorted_indices (S,) int32 / int64; probs (T, E) float or absent; routing_map (T, E)
//       bool / int8 or absent (required with probs without dropping).
//  out: out (T, H) in permuted's dtype.
//  ints: drop_and_pad, C (drop_and_pad: rows per expert; 0 where neither probs nor the map says E).
//  Returns -1, or the first position of sorted_indices refused.
int64_t moe_token_unpermute_with_routing_map(const KernelArgs& a) {
  const char* name = "moe_token_unpermute_with_routing_map";
  require_args(a, name, 4, 4, 1, 2);
  const at::Tensor &x = a.in[0], &idx = a.in[1], &probs = a.in[2], &map = a.in[3], &out = a.out[0];
  require_2d(name, {&x, &probs, &map, &out});
  const bool drop = a.ints[0] != 0;
  const int64_t per = a.ints[1], t_count = out.size(0), rows_a = x.size(0), n = idx.numel();
  TORCH_CHECK(t_count >= 1 && out.size(1) == x.size(1) && out.scalar_type() == x.scalar_type() &&
                  (!probs.defined() || probs.size(0) == t_count) &&
                  (drop ? n == rows_a && (!probs.defined() || (per >= 1 && per * probs.size(1) == n))
                        : n % t_count == 0 && (!probs.defined() || (map.defined() && map.sizes() == probs.sizes()))),
              "gradops.native: ", name, ": arguments of mismatched shapes or dtypes");
  const Entries e = entries_of(idx, name);
  if (drop) {
    TokenRows by;
    const int64_t bad = rows_by_token(e, n, t_count, by);
    if (bad >= 0) return bad;
    const Items p = items_of(probs, name);
    const int64_t experts = probs.defined() ? probs.size(1) : 0;
    if (probs.defined()) {
      token_row_sums(x, by, [&](int64_t t, int64_t r) { return p[t * experts + r / per]; }, out, name);
    } else {
      token_row_sums(x, by, unit_weight, out, name);
    }
    return -1;
  }
  const int64_t topk = n / t_count;
  const Live live = live_rows(e, n, rows_a);
  if (live.bad >= 0) return live.bad;
  const SlotWeights w = slot_weights(probs, map, t_count, topk, name);
  if (probs.defined()) {
    token_sums<true>(x, e, topk, [&](int64_t t, int64_t k) {
      const int64_t ex = w.ranked[t * topk + k];
      return ex >= 0 ? w.probs[t * w.experts + ex] : 0.0f;
    }, out, name);
  } else {
    token_sums<true>(x, e, topk, unit_weight, out, name);
  }
  return -1;
}

// moe_token_unpermute_with_routing_map_grad: for each row some slot names (token t, weight w as the unpermute's):
//     grad_permuted[row] = grad_unpermuted[t] · w            (grad_unpermuted[t] in permuted's dtype without probs)
//     grad_probs[t, expert] = dot(grad_unpermuted[t], permuted[row])   (scatter_and_dot's; with probs only)
// rows no slot names are zeros, and so is grad_probs where no row has the pair.
//  in:  permuted (A, H) float; grad_unpermuted (T, H) float; sorted_indices (S,) int32 / int64; probs (T, E) float
//       or absent; routing_map (T, E) bool / int8 or absent (required with probs without dropping).
//  out: grad_permuted (A, H) in permuted's dtype; grad_probs (T, E) in probs' dtype, or an empty tensor without.
//  ints: drop_and_pad, C (as the unpermute's).
//  Returns -1, or the first position of sorted_indices refused.
int64_t moe_token_unpermute_with_routing_map_grad(const KernelArgs& a) {
  const char* name = "moe_token_unpermute_with_routing_map_grad";
  require_args(a, name, 5, 5, 2, 2);
  const at::Tensor &x = a.in[0], &g = a.in[1], &idx = a.in[2], &probs = a.in[3], &map = a.in[4];
  const at::Tensor &dx = a.out[0], &dp = a.out[1];
  require_2d(name, {&x, &g, &probs, &map, &dx});
  const bool drop = a.ints[0] != 0, with_probs = probs.defined();
  const int64_t per = a.ints[1], t_count = g.size(0), rows_a = x.size(0), h = x.size(1), n = idx.numel();
  TORCH_CHECK(t_count >= 1 && g.size(1) == h && dx.sizes() == x.sizes() && dx.scalar_type() == x.scalar_type() &&
                  (!with_probs || (probs.size(0) == t_count && dp.sizes() == probs.sizes() &&
                                   dp.scalar_type() == probs.scalar_type())) &&
                  (drop ? n == rows_a && (!with_probs || (per >= 1 && per * probs.size(1) == n))
                        : n % t_count == 0 && (!with_probs || (map.defined() && map.sizes() == probs.sizes()))),
              "gradops.native: ", name, ": arguments of mismatched shapes or dtypes");
  const Entries e = entries_of(idx, name);
  // row_token[r] / row_weight[r]: the token (-1: no slot names the row) and weight of each row; row_pair[r]: the
  // flat (token, expert) of its probs gradient (-1: none).
  std::vector<int64_t> row_token(static_cast<size_t>(rows_a), -1), row_pair;
  std::vector<float> row_weight;
  const int64_t experts = with_probs ? probs.size(1) : 0;
  if (with_probs) {
    row_pair.assign(static_cast<size_t>(rows_a), -1);
    row_weight.assign(static_cast<size_t>(rows_a), 0.0f);
  }
  const Items p = items_of(probs, name);
  if (drop) {
    TokenRows by;
    const int64_t bad = rows_by_token(e, n, t_count, by);
    if (bad >= 0) return bad;
    for (int64_t r = 0; r < n; ++r) {
      row_token[r] = e[r];
      if (with_probs) {
        row_pair[r] = e[r] * experts + r / per;
        row_weight[r] = p[row_pair[r]];
      }
    }
  } else {
    const int64_t topk = n / t_count;
    const Live live = live_rows(e, n, rows_a);
    if (live.bad >= 0) return live.bad;
    const SlotWeights w = slot_weights(probs, map, t_count, topk, name);
    for (int64_t s = 0; s < n; ++s) {
      const int64_t r = e[s];
      if (r < 0) continue;
      const int64_t t = s / topk;
      row_token[r] = t;
      if (with_probs) {
        const int64_t ex = w.ranked[s];
        row_pair[r] = ex >= 0 ? t * experts + ex : -1;
        row_weight[r] = ex >= 0 ? p[t * experts + ex] : 0.0f;
      }
    }
  }
  std::vector<float> dots(with_probs ? static_cast<size_t>(rows_a) : 0);
  with_float(x.scalar_type(), name, [&](auto xtag) {
    using TX = decltype(xtag);
    with_float(g.scalar_type(), name, [&](auto gtag) {
      using TG = decltype(gtag);
      const TX* xp = x.const_data_ptr<TX>();
      const TG* gp = g.const_data_ptr<TG>();
      TX* dxp = dx.data_ptr<TX>();
      const bool stream = streams(dxp, rows_a, h);
      parallel(0, rows_a, rows_grain(rows_a, h), [&](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; ++r) {
          const int64_t t = row_token[r];
          if (t < 0) {
            std::memset(dxp + r * h, 0, static_cast<size_t>(h) * sizeof(TX));
          } else if (with_probs) {
            dots[r] = scatter_and_dot(gp + t * h, xp + r * h, dxp + r * h, row_weight[r], h, stream);
          } else if constexpr (std::is_same_v<TX, TG>) {
            std::memcpy(dxp + r * h, gp + t * h, static_cast<size_t>(h) * sizeof(TX));
          } else {
            convert_row(gp + t * h, dxp + r * h, h);
          }
        }
        if (stream) stream_fence();
      });
    });
  });
  if (with_probs) {
    // In the slot order of the Python tables (token-major, a token's rows ascending), so that a pair two rows name
    // (possible only in caller-made drop_and_pad indices) keeps the later row's value there too.
    zero_all(dp);
    const Items out = items_of(dp, name);
    if (drop) {
      for (int64_t r = 0; r < n; ++r) out.store(row_pair[r], dots[r]);
    } else {
      for (int64_t s = 0; s < n; ++s) {
        const int64_t r = e[s];
        if (r >= 0 && row_pair[r] >= 0) out.store(row_pair[r], dots[r]);
      }
    }
  }
  return -1;
}

GRADOPS_KERNEL("moe_token_permute", moe_token_permute);
GRADOPS_KERNEL("moe_token_permute_grad", moe_token_permute_grad);
GRADOPS_KERNEL("moe_token_unpermute", moe_token_unpermute);
GRADOPS_KERNEL("moe_token_unpermute_grad", moe_token_unpermute_grad);
GRADOPS_KERNEL("moe_token_permute_with_routing_map", moe_token_permute_with_routing_map);
GRADOPS_KERNEL("moe_token_permute_with_routing_map_grad", moe_token_permute_with_routing_map_grad);
GRADOPS_KERNEL("moe_token_unpermute_with_routing_map", moe_token_unpermute_with_routing_map);
GRADOPS_KERNEL("moe_token_unpermute_with_routing_map_grad", moe_token_unpermute_with_routing_map_grad);

}  // namespace
}  // namespace gradops
