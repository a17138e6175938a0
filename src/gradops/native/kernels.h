// gradops' CPU kernels: one calling convention, one registry, the numerics they share.
//
// Every CPU kernel of every op is a C++ function registered here by name (GRADOPS_KERNEL in the op family's file,
// e.g. rms_norm.cpp) and called three ways with the same bits: by gradops.cpu's host entries (the Python path,
// through the extension's ``kernel`` binding), by the direct calls' programs (direct.cpp) and by the autograd nodes
// (nodes.h, in the family's file). Compiled ahead of time with the extension, so no call ever waits for a compiler.
//
// The convention: ``int64_t kernel(const KernelArgs& a)``.
//  - ``a.in``: the op's tensor arguments in the op's order, each contiguous on the CPU (an undefined tensor for an
//    optional one that is absent); never written, unless the family's file says a result may alias one (an
//    upstream gradient nobody else holds, see owned_like in nodes.h).
//  - ``a.out``: the results, allocated by the caller, contiguous, of the op's result spec; the kernel writes every
//    element (zero-fill included) and nothing else.
//  - ``a.ints`` / ``a.floats``: the rest of the call (rows, columns, scalars), in the order the family's file
//    documents for the kernel.
//  - returns -1, or the position of the first value the op refuses (an index outside a table, a repeated index,
//    a negative variance where the op refuses one), found before the kernel writes any output (an out= call that
//    is refused leaves the caller's tensors as they were): the caller then takes the Python path, which raises the
//    op's OpError naming the argument. A kernel never addresses memory through a value it has not range-checked.
//
// Determinism: a kernel's result bits depend on the shape only, never on the thread count or the split. Row
// reductions accumulate in float32 in a fixed order; cross-row reductions (dgamma, dbeta) use row_blocks(rows, cols)
// fixed blocks, each with its own float32 partial row, folded in block order (fold_rows).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace gradops {

struct KernelArgs {
  c10::ArrayRef<at::Tensor> in;
  c10::ArrayRef<at::Tensor> out;
  c10::ArrayRef<int64_t> ints;
  c10::ArrayRef<double> floats;
};

using Kernel = int64_t (*)(const KernelArgs&);

// Registers ``kernel`` under ``name`` (at static initialisation; a name registered twice is a build error in spirit:
// the later one is refused and said on stderr). find_kernel: the kernel or nullptr.
bool register_kernel(const char* name, Kernel kernel);
Kernel find_kernel(const std::string& name);
std::vector<std::string> kernel_names();

#define GRADOPS_CONCAT_INNER(a, b) a##b
#define GRADOPS_CONCAT(a, b) GRADOPS_CONCAT_INNER(a, b)
#define GRADOPS_KERNEL(name, fn) \
  static const bool GRADOPS_CONCAT(gradops_kernel_registered_, __LINE__) = ::gradops::register_kernel(name, fn)

// Work (items of the main tensor) below which a kernel runs on the calling thread: a parallel region costs ~1.6 µs to
// start on 2 cores, which 32 Ki fp32 items (~128 KiB, ~10 µs of work) amortise.
constexpr int64_t kParallelMin = 1 << 15;
// Items per task of a parallel row loop: a 2048 x 512 input still gives 64 tasks for 64 threads.
constexpr int64_t kTaskItems = 1 << 14;
// Most row blocks of a cross-row reduction, and the least items per block below that many. The count is a
// function of the shape only (row_blocks), so the partial sums and their order never depend on the thread count.
// 64 blocks keep 64 threads busy while the fp32 partials stay small (64 x 4096 x 4 B = 1 MiB at N = 4096, 0.6% of
// the traffic of an 8192 x 4096 fp32 RMSNorm backward); blocks of 16 Ki items keep the partials a small share of the
// work at small sizes (LayerNorm 512 x 256: 8 blocks of 64 rows were 0.87-0.92x torch, 64 blocks of 8 rows 0.91-1.07x).
constexpr int64_t kRowBlocks = 64;
constexpr int64_t kBlockItems = 1 << 14;

// One block per kBlockItems items, rounded up to a power of two (an even split over 2, 4, 8 ... threads), at most
// kRowBlocks and ``rows``, at least 1.
inline int64_t row_blocks(int64_t rows, int64_t cols) {
  const int64_t want = (rows * cols + kBlockItems - 1) / kBlockItems;
  int64_t pow2 = 1;
  while (pow2 < want && pow2 < kRowBlocks) pow2 *= 2;
  return std::max<int64_t>(1, std::min<int64_t>({kRowBlocks, rows, pow2}));
}

// Set in a child of fork(). GNU OpenMP does not survive fork: there every kernel runs on the calling thread.
extern bool forked;

// f(lo, hi) over pieces of [begin, end) of at least ``grain`` items on torch's intra-op threads (the pool ATen's own
// kernels run on: gradops' kernels and torch's never compete for cores); one piece on the calling thread when the
// range fits one grain or in a child of fork().
template <class F>
void parallel(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  if (forked || end - begin <= grain) {
    f(begin, end);
  } else {
    at::parallel_for(begin, end, grain, f);
  }
}

// Rows per task of a per-row kernel over rows x cols items: all rows below kParallelMin items, else kTaskItems' worth.
inline int64_t rows_grain(int64_t rows, int64_t cols) {
  if (rows * cols < kParallelMin) return std::max<int64_t>(rows, 1);
  return std::max<int64_t>(1, kTaskItems / std::max<int64_t>(cols, 1));
}

// Storage <-> float32. c10's conversions: exact widening, round-to-nearest-even narrowing (torch's own).
inline float to_f32(float v) { return v; }
inline float to_f32(c10::Half v) { return static_cast<float>(v); }
inline float to_f32(c10::BFloat16 v) { return static_cast<float>(v); }
template <class T>
inline T from_f32(float v) { return static_cast<T>(v); }

// dst[j] = sum over b in [0, blocks) of partial[b * n + j], added in block order: the fold of row-block partials.
inline void fold_rows(const float* partial, int64_t blocks, int64_t n, float* dst) {
  for (int64_t j = 0; j < n; ++j) dst[j] = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* p = partial + b * n;
    for (int64_t j = 0; j < n; ++j) dst[j] += p[j];
  }
}

// Streaming (non-temporal) stores of float32 results larger than the caches: an ordinary store first reads each line
// it writes, a third stream of traffic beside a kernel's reads and its write, which copy_ (glibc's memcpy streams
// at these sizes) does not pay. Past L3 (32 MiB on the machines gradops is measured on) a result cannot stay cached
// for its consumer anyway. float32 only: the half dtypes' kernels are bound by their conversions, and 16-byte
// streams ran 2-7% slower than stores there. A kernel that streams calls stream_fence() at the end of each parallel
// task, so that its results are visible once the call returns.
constexpr int64_t kStreamBytes = int64_t{32} << 20;

#if defined(__AVX2__)
constexpr bool kCanStream = true;
// 8 float32 lanes (any 32-byte vector type) to p, 32-byte aligned, bypassing the caches.
template <class V>
inline void stream8(float* p, const V& v) {
  static_assert(sizeof(V) == 32, "8 float32 lanes");
  __m256 m;
  std::memcpy(&m, &v, sizeof m);
  _mm256_stream_ps(p, m);
}
inline void stream_fence() { _mm_sfence(); }
#else
constexpr bool kCanStream = false;
template <class V>
inline void stream8(float* p, const V& v) {
  std::memcpy(p, &v, sizeof v);
}
inline void stream_fence() {}
#endif

// Whether a rows x n result of T at p is streamed: float32, at least kStreamBytes, every row's 8-element groups
// 32-byte aligned, and the result in gradops' output pool, whose blocks of 4 MiB and more are 2 MiB-aligned mappings
// advised for transparent huge pages (pool.cpp: map_block). Streamed into 4 KiB pages (a caller's out= from
// torch.empty where THP is "madvise") the 8192 x 4096 fp32 LayerNorm backward took 19.4 ms against 15.0-16.6 with
// ordinary stores; into the pool's blocks 12.8-14.3 against 13.9-15.1. 2 MiB alignment is how the pool's blocks are
// told apart by address alone.
constexpr uintptr_t kHugeAlign = uintptr_t{2} << 20;

template <class T>
inline bool streams(const T* p, int64_t rows, int64_t n) {
  return kCanStream && std::is_same_v<T, float> && rows * n * 4 >= kStreamBytes &&
         reinterpret_cast<uintptr_t>(p) % kHugeAlign == 0 && n % 8 == 0;
}

// The dtype dispatch of gradops' CPU kernels: float32, float16, bfloat16 (float64 calls never reach a kernel: they
// take the float64 reference).
#define GRADOPS_DISPATCH_FLOATS(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

}  // namespace gradops
