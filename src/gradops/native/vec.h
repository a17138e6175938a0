// The CPU kernels' vector and dtype layer: 8 float32 lanes written as GCC / Clang vector types, their loads from
// and stores to each storage dtype (float32, float16, bfloat16) with c10's bits, and what elementwise kernels share
// (a chunked loop over torch's threads, exp). Why vector types rather than scalar loops, with the numbers: see
// families/hardswish/hardswish.cpp, the first kernel written on it.
#pragma once

#include "kernels.h"

#include <cstring>

#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace gradops {
namespace vec {

// Every helper here is forced inline: they run once per 8 items inside the kernels' loops, and GCC left some out of
// line where a kernel's loop body was large (a call per 8 items: +9% on the RmsNorm bfloat16 forward).
#define GRADOPS_VEC inline __attribute__((always_inline))

// 8 float32 lanes, their bits, and 8 16-bit items. A comparison of Lanes gives all-ones / zero lanes (as Bits once
// cast): the selects below are bit masks.
typedef float Lanes __attribute__((vector_size(32)));
typedef uint32_t Bits __attribute__((vector_size(32)));
typedef uint16_t Bits16 __attribute__((vector_size(16)));
constexpr int64_t kLanes = 8;

GRADOPS_VEC Lanes splat(float v) { return Lanes{} + v; }

// Lanes of ``a > b ? a : b`` and ``a < b ? a : b`` (x86's maxps / minps: b where either is NaN). GCC lowers the
// generic form to a compare and a blend, or two compares and two logic operations for the masks below: 26 µs against
// 17 for the fp16 forward at 128 Ki items on one thread.
GRADOPS_VEC Lanes max_lanes(Lanes a, Lanes b) {
#if defined(__AVX__)
  return _mm256_max_ps(a, b);
#else
  const Bits keep = reinterpret_cast<Bits>(a > b);
  return reinterpret_cast<Lanes>((reinterpret_cast<Bits>(a) & keep) | (reinterpret_cast<Bits>(b) & ~keep));
#endif
}

GRADOPS_VEC Lanes min_lanes(Lanes a, Lanes b) {
#if defined(__AVX__)
  return _mm256_min_ps(a, b);
#else
  const Bits keep = reinterpret_cast<Bits>(a < b);
  return reinterpret_cast<Lanes>((reinterpret_cast<Bits>(a) & keep) | (reinterpret_cast<Bits>(b) & ~keep));
#endif
}

// load(): 8 items as float32 lanes; store(): 8 lanes into the items' dtype. The bits are c10's: exact widening,
// round-to-nearest-even narrowing, a NaN as c10 makes it (bf16 0x7FC0, fp16 the hardware's quiet NaN).

// One item at a time, c10's conversions (float16 without F16C, float64). Plain overloads, not a template: a template
// load(const T*) ties with c10's own ``c10::load(const T*)``, which argument-dependent lookup finds for c10::Half
// (a CPU without F16C then failed to compile: "call of overloaded 'load(const c10::Half*)' is ambiguous").
template <class T>
GRADOPS_VEC Lanes widen_each(const T* p) {
  float f[kLanes];
  for (int64_t k = 0; k < kLanes; ++k) f[k] = static_cast<float>(p[k]);
  Lanes v;
  std::memcpy(&v, f, sizeof v);
  return v;
}

template <class T>
GRADOPS_VEC void narrow_each(Lanes v, T* p) {
  float f[kLanes];
  std::memcpy(f, &v, sizeof v);
  for (int64_t k = 0; k < kLanes; ++k) p[k] = static_cast<T>(f[k]);
}

GRADOPS_VEC Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

GRADOPS_VEC void store(Lanes v, float* p) { std::memcpy(p, &v, sizeof v); }

// bf16 loads: the bits shifted into the top half. With AVX2, one widening load and a shift where GCC's generic
// conversion takes five instructions (Hardswish's bf16 backward at 128 Ki items: 46 µs against 66 on one thread,
// with the store below).
GRADOPS_VEC Lanes load(const c10::BFloat16* p) {
#if defined(__AVX2__)
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#else
  Bits16 h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<Lanes>(__builtin_convertvector(h, Bits) << 16);
#endif
}

// c10's float32 -> bfloat16 rounding on 8 lanes (to nearest, ties to even; a NaN becomes 0x7FC0), each lane's
// bfloat16 in its high half, for kernels that lay out their own bfloat16 tiles (moe_permute.cpp's even / odd
// columns). The same bits as store().
GRADOPS_VEC Bits round_bf16(Lanes v) {
#if defined(__AVX2__)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return reinterpret_cast<Bits>(
      _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
#else
  const Bits b = reinterpret_cast<Bits>(v);
  const Bits rounded = b + ((b >> 16) & 1u) + 0x7FFFu;
  return (b & 0x7FFFFFFFu) > 0x7F800000u ? Bits{} + 0x7FC00000u : rounded;
#endif
}

// bfloat16 stores: the rounding with a select for the NaNs (one blend), narrowed by GCC's generic conversion. Against
// round_bf16's AVX2 form plus a saturating pack, in one process alternating builds: RmsNorm's bfloat16 forward
// 19.3-19.5 µs against 21.1 at 512 x 256, 947-952 against 1035-1045 at 4096 x 2048; LayerNorm's 32.4-32.7 against
// 34.1-34.3 at 512 x 256.
GRADOPS_VEC void store(Lanes v, c10::BFloat16* p) {
  const Bits u = reinterpret_cast<Bits>(v);
  const Bits rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const Bits bits = (u & 0x7FFFFFFFu) > 0x7F800000u ? Bits{} + 0x7FC0u : rounded;
  const Bits16 h = __builtin_convertvector(bits, Bits16);
  std::memcpy(p, &h, sizeof h);
}

#if defined(__F16C__)
GRADOPS_VEC Lanes load(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

GRADOPS_VEC void store(Lanes v, c10::Half* p) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
#else
GRADOPS_VEC Lanes load(const c10::Half* p) { return widen_each(p); }
GRADOPS_VEC void store(Lanes v, c10::Half* p) { narrow_each(v, p); }
#endif

// float64: GRADOPS_DISPATCH_FLOATS instantiates the kernels for it, which refuse it (float64 calls take the float64
// reference), so these only have to compile.
GRADOPS_VEC Lanes load(const double* p) { return widen_each(p); }
GRADOPS_VEC void store(Lanes v, double* p) { narrow_each(v, p); }

// ``f(lo, hi)`` over [0, n): on the calling thread below kParallelMin items (a parallel region costs ~1.6 µs to
// start, more than the threads save), else in ``chunk``-item chunks over torch's threads. Elementwise work: no split
// changes a bit.
template <class F>
void chunked(int64_t n, int64_t chunk, const F& f) {
  if (n < kParallelMin) {
    if (n > 0) f(0, n);
    return;
  }
  const int64_t chunks = (n + chunk - 1) / chunk;
  parallel(0, chunks, 1, [&](int64_t c0, int64_t c1) { f(c0 * chunk, std::min(n, c1 * chunk)); });
}

// e^v for every lane, within 2 ulp of the exact value over float32's range: v = n·ln2 + r with n = round(v·log2 e)
// and |r| <= ln2/2 (ln2 in two parts, so that n·ln2 is exact), e^r by Cephes' degree-7 polynomial, then 2^n applied
// in two halves so that results below 2^-126 come out subnormal, not zero, and above 2^128 infinite. v is clamped to
// [-104, 89], beyond which e^v rounds to 0 / inf anyway; a NaN lane stays NaN.
GRADOPS_VEC Lanes exp_lanes(Lanes v) {
  const Lanes x = min_lanes(max_lanes(v, splat(-104.0f)), splat(89.0f));
  Lanes n = x * 1.44269504088896341f;
#if defined(__AVX__)
  n = _mm256_round_ps(n, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  for (int64_t k = 0; k < kLanes; ++k) n[k] = __builtin_nearbyintf(n[k]);
#endif
  const Lanes r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  Lanes p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  typedef int32_t Ints __attribute__((vector_size(32)));
  const Ints e = __builtin_convertvector(n, Ints);
  const Ints half = e >> 1;
  const Lanes lo = reinterpret_cast<Lanes>((half + 127) << 23);
  const Lanes hi = reinterpret_cast<Lanes>((e - half + 127) << 23);
  const Lanes out = p * lo * hi;
  const Bits nan = reinterpret_cast<Bits>(v != v);
  return reinterpret_cast<Lanes>((reinterpret_cast<Bits>(out) & ~nan) | (reinterpret_cast<Bits>(v) & nan));
}

}  // namespace vec
}  // namespace gradops
