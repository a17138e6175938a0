// The embedding family's CPU kernels: the lookup ``weight[indices]`` and aclnnEmbeddingDenseBackward.
//
// The backward writes every table row exactly once - the float32 sum of its gradient rows in increasing position,
// rounded once to the table's dtype, or zeros - so no atomics and no zero-fill pass under the sums: the bits depend
// on the shape only, whatever the thread count. Two ways to find each row's gradient rows, chosen by the shape:
//  - T >= V (T indices, V table rows): a counting sort over the V rows (serial, O(T + V), also the range test),
//    then the table in fixed blocks of kTableRows rows split over the threads.
//  - T < V (few indices in a large table): a stable LSD radix sort of the T positions by index (O(T) per 8 bits of
//    V - 1, no pass over V offsets), then the table in fixed chunks of rows: the runs of equal indices in a chunk
//    summed, the untouched rows between them zeroed in spans. T = 8, V = 32000, E = 8 fp32 was 181 µs with the
//    counting sort against 81 with a sort of the positions on 2 cores (the table's fill is most of it). Each
//    touched row is written once, not zeroed first and then written.
// Both sum a row's terms in the same order (increasing position), so the two paths give the same bits.
//
// Byte model of the backward: T·E·s (grad) + V·E·s (the table, written once) + T·s_idx + scratch of (V + 1 + T)·8
// bytes (counting sort) or 2·T·8 (radix sort).

#include "kernels.h"
#include "nodes.h"

#include <cstring>
#include <memory>
#include <utility>
#include <vector>

namespace gradops {
namespace {

// Table rows per task of the counting-sort path: 64 rows x 1024 x 4 B = 256 KiB written per task.
constexpr int64_t kTableRows = 64;
// Table items per task of the sorting path (256 KiB of fp32 written).
constexpr int64_t kChunkItems = 1 << 16;
// Bits per pass of the radix sort: 256 counters stay in L1, and V < 65536 takes two passes.
constexpr int kRadixBits = 8;
constexpr int64_t kRadix = int64_t{1} << kRadixBits;

// The first position whose index lies outside [0, v), or -1. Every kernel runs it (or the counting sort, which is
// the same test) before it addresses anything through an index: indices saved for a backward can change in place
// behind autograd's back (numpy, .data), so not even an index the caller checked is trusted.
template <class I>
int64_t first_outside(const I* idx, int64_t n, int64_t v) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = static_cast<int64_t>(idx[i]);
    if (k < 0 || k >= v) return i;
  }
  return -1;
}

// Scratch of ``count`` int64: carved from the caller's workspace (a uint8 tensor, see
// gradops.cpu.embedding_dense_backward_workspace) at item ``offset`` when one was given, else owned by ``own``.
int64_t* scratch(const at::Tensor& workspace, int64_t offset, int64_t count, std::unique_ptr<int64_t[]>& own) {
  if (workspace.defined()) {
    TORCH_CHECK(workspace.scalar_type() == at::kByte && workspace.numel() >= (offset + count) * 8,
                "gradops.native: embedding_dense_backward's workspace must be uint8 of at least ",
                (offset + count) * 8, " bytes, got ", workspace.numel(), " ", workspace.scalar_type());
    // A workspace that is a view at an odd byte offset cannot hold int64s: the kernel's own scratch then.
    auto* base = static_cast<unsigned char*>(workspace.data_ptr());
    if (reinterpret_cast<uintptr_t>(base) % alignof(int64_t) == 0) return reinterpret_cast<int64_t*>(base) + offset;
  }
  own.reset(new int64_t[std::max<int64_t>(count, 1)]);
  return own.get();
}

// A gradient item's term in its table row's sum: divided by the row's count when Scale.
template <class T, bool Scale>
inline float term(T v, float cnt) {
  if constexpr (Scale) {
    return to_f32(v) / cnt;
  } else {
    return to_f32(v);
  }
}

// The float32 table streamed past the caches (kernels.h: streams) takes the same sums eight columns at a time in
// explicit vectors: the same operations per element, so the same bits.
typedef float V8 __attribute__((vector_size(32)));

inline V8 load_v8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <bool Scale, int R, bool First>
void streamed_pass(const float* g0, const float* g1, const float* g2, const float* g3, int64_t e, float cnt,
                   const float* acc, float* out) {
  for (int64_t j = 0; j < e; j += 8) {  // e % 8 == 0 where the table streams
    V8 s = Scale ? load_v8(g0 + j) / cnt : load_v8(g0 + j);
    if constexpr (!First) s = load_v8(acc + j) + s;
    if constexpr (R > 1) s = s + (Scale ? load_v8(g1 + j) / cnt : load_v8(g1 + j));
    if constexpr (R > 2) s = s + (Scale ? load_v8(g2 + j) / cnt : load_v8(g2 + j));
    if constexpr (R > 3) s = s + (Scale ? load_v8(g3 + j) / cnt : load_v8(g3 + j));
    stream8(out + j, s);
  }
}

// One pass of a table row's sum over R (1 to 4) gradient rows ``g``: ``s = (First ? 0 : acc) + g[0] + ... +
// g[R-1]`` added left to right, into the float32 row sum ``acc``, or rounded into ``out`` by the Last pass. A
// contiguous j loop of R + 1 streams, vectorized as written (no reassociation needed); a
// streamed table's Last pass is streamed_pass.
template <class T, bool Scale, int R, bool First, bool Last>
void row_pass(const T* const* g, int64_t e, float cnt, float* __restrict acc, T* __restrict out, bool stream) {
  const T* __restrict g0 = g[0];
  const T* __restrict g1 = g[R > 1 ? 1 : 0];
  const T* __restrict g2 = g[R > 2 ? 2 : 0];
  const T* __restrict g3 = g[R > 3 ? 3 : 0];
  if constexpr (Last && std::is_same_v<T, float>) {
    if (stream) return streamed_pass<Scale, R, First>(g0, g1, g2, g3, e, cnt, acc, out);
  } else {
    (void)stream;
  }
  for (int64_t j = 0; j < e; ++j) {
    float s = term<T, Scale>(g0[j], cnt);
    if constexpr (!First) s = acc[j] + s;
    if constexpr (R > 1) s = s + term<T, Scale>(g1[j], cnt);
    if constexpr (R > 2) s = s + term<T, Scale>(g2[j], cnt);
    if constexpr (R > 3) s = s + term<T, Scale>(g3[j], cnt);
    if constexpr (Last) {
      out[j] = from_f32<T>(s);
    } else {
      acc[j] = s;
    }
  }
}

template <class T, bool Scale, bool First, bool Last>
void row_pass(int r, const T* const* g, int64_t e, float cnt, float* acc, T* out, bool stream) {
  switch (r) {
    case 1: return row_pass<T, Scale, 1, First, Last>(g, e, cnt, acc, out, stream);
    case 2: return row_pass<T, Scale, 2, First, Last>(g, e, cnt, acc, out, stream);
    case 3: return row_pass<T, Scale, 3, First, Last>(g, e, cnt, acc, out, stream);
    default: return row_pass<T, Scale, 4, First, Last>(g, e, cnt, acc, out, stream);
  }
}

// One table row: ``out[j] = sum over p in [lo, hi) of term(grad[order[p], j])`` in float32, every element summed
// left to right in the order of ``order`` (increasing position), rounded once. Passes over whole rows of four
// gradient rows each, the first one without a row sum to read and the last one writing ``out`` instead of ``acc``
// (E floats): a row of at most four terms is one pass, with no row sum at all. Whole rows, not column chunks: a
// chunk of a gradient row is a short stream for the prefetcher (4096 x 1024 fp32, 16 rows of 256 terms: 2 KiB
// chunks took 3.0 ms on one core, whole rows 0.8).
template <class T, bool Scale>
void write_row(const T* grad, int64_t e, const int64_t* order, int64_t lo, int64_t hi, T* out, float* acc,
               bool stream) {
  const float cnt = static_cast<float>(hi - lo);
  const T* g[4];
  for (int64_t p = lo; p < hi; p += 4) {
    const int r = static_cast<int>(std::min<int64_t>(4, hi - p));
    for (int q = 0; q < r; ++q) g[q] = grad + order[p + q] * e;
    const bool first = p == lo, last = p + r == hi;
    if (first && last) {
      row_pass<T, Scale, true, true>(r, g, e, cnt, acc, out, stream);
    } else if (first) {
      row_pass<T, Scale, true, false>(r, g, e, cnt, acc, out, stream);
    } else if (last) {
      row_pass<T, Scale, false, true>(r, g, e, cnt, acc, out, stream);
    } else {
      row_pass<T, Scale, false, false>(r, g, e, cnt, acc, out, stream);
    }
  }
}

template <class T>
void zero_rows(T* out, int64_t e, int64_t k0, int64_t k1, bool stream) {
  if (k1 <= k0) return;
  if constexpr (std::is_same_v<T, float>) {
    if (stream) {
      const V8 zero = {};
      for (float *p = out + k0 * e, *end = out + k1 * e; p < end; p += 8) stream8(p, zero);
      return;
    }
  }
  std::memset(out + k0 * e, 0, static_cast<size_t>((k1 - k0) * e) * sizeof(T));  // 0 bits = +0.0
}

// T >= V: the counting sort of the positions by index, serial (at T = 16k, V = 256k ~1% of the table's write).
// Afterwards row k's positions are order[start(k) .. ends[k]) in increasing position, start(k) = k ? ends[k-1] : 0.
// The counting pass is also the range test: the first position outside [0, v), before anything is written, or -1.
template <class I>
int64_t counting_sort(const I* idx, int64_t n, int64_t v, int64_t* ends, int64_t* order) {
  std::fill(ends, ends + v + 1, int64_t{0});
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = static_cast<int64_t>(idx[i]);
    if (k < 0 || k >= v) return i;
    ++ends[k + 1];
  }
  for (int64_t k = 0; k < v; ++k) ends[k + 1] += ends[k];  // ends[k]: row k's first slot
  for (int64_t i = 0; i < n; ++i) order[ends[idx[i]]++] = i;  // ... then one past its last
  return -1;
}

template <class T, class I, bool Scale>
void table_by_rows(const T* grad, int64_t e, int64_t v, int64_t pad, const int64_t* ends, const int64_t* order,
                   T* out) {
  const int64_t blocks = (v + kTableRows - 1) / kTableRows;
  const bool stream = streams(out, v, e);
  parallel(0, blocks, v * e < kParallelMin ? blocks : 1, [&](int64_t c0, int64_t c1) {
    std::unique_ptr<float[]> acc(new float[e]);
    for (int64_t k = c0 * kTableRows, k1 = std::min(v, c1 * kTableRows); k < k1; ++k) {
      const int64_t lo = k ? ends[k - 1] : 0, hi = ends[k];
      if (hi == lo || k == pad) {
        zero_rows(out, e, k, k + 1, stream);
      } else {
        write_row<T, Scale>(grad, e, order, lo, hi, out + k * e, acc.get(), stream);
      }
    }
    if (stream) stream_fence();
  });
}

// T < V: ``order`` the positions [0, n) sorted by index, stably (so each run of one index lists its positions in
// increasing order, the counting sort's order), by least-significant-digit radix passes of kRadixBits over the bits
// of v - 1; ``spare``: n more int64. The indices passed first_outside.
template <class I>
void radix_sort(const I* idx, int64_t n, int64_t v, int64_t* order, int64_t* spare) {
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  int bits = 0;
  while (bits < 63 && (int64_t{1} << bits) < v) ++bits;  // indices < v < 2**bits
  int64_t count[kRadix];
  for (int shift = 0; shift < bits; shift += kRadixBits) {
    std::fill(count, count + kRadix, int64_t{0});
    for (int64_t i = 0; i < n; ++i) ++count[(static_cast<int64_t>(idx[i]) >> shift) & (kRadix - 1)];
    int64_t sum = 0;
    for (int64_t d = 0; d < kRadix; ++d) {
      const int64_t c = count[d];
      count[d] = sum;
      sum += c;
    }
    for (int64_t p = 0; p < n; ++p) {
      const int64_t i = order[p];
      spare[count[(static_cast<int64_t>(idx[i]) >> shift) & (kRadix - 1)]++] = i;
    }
    std::swap(order, spare);
  }
  // An odd number of passes left the result in the caller's ``spare``.
  if (((bits + kRadixBits - 1) / kRadixBits) % 2 == 1) std::memcpy(spare, order, static_cast<size_t>(n) * 8);
}

template <class T, class I, bool Scale>
void table_by_runs(const T* grad, const I* idx, int64_t n, int64_t e, int64_t v, int64_t pad, const int64_t* order,
                   T* out) {
  auto key = [&](int64_t p) { return static_cast<int64_t>(idx[order[p]]); };
  // Fixed chunks of table rows, each written whole by one task: its untouched rows zeroed in spans between the
  // touched ones, each touched row the sum of its run of equal indices in ``order`` (a run is one row, so it lies
  // in one chunk). One parallel region, not a zero fill and then the runs: on 2 busy cores a region waits for
  // whichever thread the OS took away, and two regions waited twice (512 x 256 fp32, V = 1024: 42 ms median with
  // two regions where numba's one took 20).
  const int64_t rows = std::max<int64_t>(1, kChunkItems / std::max<int64_t>(e, 1));
  const int64_t chunks = (v + rows - 1) / rows;
  const bool stream = streams(out, v, e);
  parallel(0, chunks, v * e < kParallelMin ? chunks : 1, [&](int64_t c0, int64_t c1) {
    std::unique_ptr<float[]> acc(new float[e]);
    const int64_t r0 = c0 * rows, r1 = std::min(v, c1 * rows);
    int64_t lo = 0, hi = n;  // the first sorted position whose index is >= r0
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (key(mid) < r0) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    int64_t r = r0;  // the first row of the chunk not written yet
    for (int64_t p = lo; p < n && key(p) < r1;) {
      const int64_t k = key(p);
      int64_t end = p + 1;
      while (end < n && key(end) == k) ++end;
      zero_rows(out, e, r, k, stream);
      if (k == pad) {
        zero_rows(out, e, k, k + 1, stream);
      } else {
        write_row<T, Scale>(grad, e, order, p, end, out + k * e, acc.get(), stream);
      }
      r = k + 1;
      p = end;
    }
    zero_rows(out, e, r, r1, stream);
    if (stream) stream_fence();
  });
}

template <class T, class I>
int64_t dense_backward(const at::Tensor& grad_t, const at::Tensor& idx_t, const at::Tensor& workspace,
                       const at::Tensor& out_t, int64_t v, int64_t e, int64_t pad, bool scale) {
  const T* grad = grad_t.data_ptr<T>();
  const I* idx = idx_t.data_ptr<I>();
  T* out = out_t.data_ptr<T>();
  const int64_t n = idx_t.numel();
  std::unique_ptr<int64_t[]> own_order, own_ends;
  if (n < v) {
    const int64_t bad = first_outside(idx, n, v);
    if (bad >= 0 || e == 0) return bad;
    int64_t* order = scratch(workspace, 0, 2 * n, own_order);  // the sorted positions and the radix sort's spare
    radix_sort(idx, n, v, order, order + n);
    if (scale) {
      table_by_runs<T, I, true>(grad, idx, n, e, v, pad, order, out);
    } else {
      table_by_runs<T, I, false>(grad, idx, n, e, v, pad, order, out);
    }
    return -1;
  }
  int64_t* ends = scratch(workspace, 0, v + 1, own_ends);
  int64_t* order = scratch(workspace, v + 1, n, own_order);
  const int64_t bad = counting_sort(idx, n, v, ends, order);
  if (bad >= 0 || v == 0 || e == 0) return bad;
  if (scale) {
    table_by_rows<T, I, true>(grad, e, v, pad, ends, order, out);
  } else {
    table_by_rows<T, I, false>(grad, e, v, pad, ends, order, out);
  }
  return -1;
}

// "embedding_dense_backward": aclnnEmbeddingDenseBackward.
//   in:     grad (T·E items of any shape, float32 / float16 / bfloat16), indices (T items, int32 / int64),
//           optional workspace (uint8, at least (V + 1 + T)·8 bytes: gradops.cpu.embedding_dense_backward_workspace;
//           undefined: the kernel allocates its scratch)
//   out:    table (V, E), grad's dtype
//   ints:   num_weights V, padding_idx (a row left at zero; outside [0, V): none), scale_grad_by_freq (0 / 1:
//           divide every term by its row's count, every occurrence counted, padding included)
//   floats: none
//   returns the first position whose index lies outside [0, V), nothing written; else -1.
int64_t embedding_dense_backward(const KernelArgs& a) {
  TORCH_CHECK((a.in.size() == 2 || a.in.size() == 3) && a.out.size() == 1 && a.ints.size() == 3,
              "gradops.native: embedding_dense_backward takes (grad, indices[, workspace]), (table), 3 ints");
  const at::Tensor& grad = a.in[0];
  const at::Tensor& idx = a.in[1];
  const at::Tensor workspace = a.in.size() > 2 ? a.in[2] : at::Tensor();
  const at::Tensor& table = a.out[0];
  const int64_t v = a.ints[0];
  TORCH_CHECK(table.dim() == 2 && table.size(0) == v && table.scalar_type() == grad.scalar_type(),
              "gradops.native: embedding_dense_backward's table must be (num_weights, E) in grad's dtype");
  const int64_t e = table.size(1), n = idx.numel();
  int64_t items = 0;
  TORCH_CHECK(!__builtin_mul_overflow(n, e, &items) && grad.numel() == items,
              "gradops.native: embedding_dense_backward's grad must hold T x E items");
  const int64_t pad = 0 <= a.ints[1] && a.ints[1] < v ? a.ints[1] : -1;
  const bool scale = a.ints[2] != 0;
  int64_t bad = -1;
  GRADOPS_DISPATCH_FLOATS(grad.scalar_type(), "embedding_dense_backward", [&] {
    if (idx.scalar_type() == at::kLong) {
      bad = dense_backward<scalar_t, int64_t>(grad, idx, workspace, table, v, e, pad, scale);
    } else {
      TORCH_CHECK(idx.scalar_type() == at::kInt, "gradops.native: embedding indices must be int32 or int64");
      bad = dense_backward<scalar_t, int32_t>(grad, idx, workspace, table, v, e, pad, scale);
    }
  });
  return bad;
}

template <class I>
int64_t lookup(const at::Tensor& weight, const at::Tensor& idx_t, const at::Tensor& y) {
  const int64_t v = weight.size(0), n = idx_t.numel();
  const I* idx = idx_t.data_ptr<I>();
  const int64_t bad = first_outside(idx, n, v);
  if (bad >= 0) return bad;
  const int64_t row = weight.size(1) * static_cast<int64_t>(weight.element_size());  // bytes
  const auto* w = static_cast<const char*>(weight.data_ptr());
  auto* out = static_cast<char*>(y.data_ptr());
  parallel(0, n, rows_grain(n, weight.size(1)), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      std::memcpy(out + i * row, w + static_cast<int64_t>(idx[i]) * row, static_cast<size_t>(row));
    }
  });
  return -1;
}

// "embedding": the lookup ``y[i] = weight[indices[i]]``, a copy of storage items (the bits of ATen's index_select).
//   in:     weight (V, E) of any dtype, indices (T items, int32 / int64)
//   out:    y (T·E items, e.g. indices.shape + (E,)), weight's dtype
//   ints:   none
//   floats: none
//   returns the first position whose index lies outside [0, V), nothing written; else -1.
int64_t embedding(const KernelArgs& a) {
  TORCH_CHECK(a.in.size() == 2 && a.out.size() == 1, "gradops.native: embedding takes (weight, indices), (y)");
  const at::Tensor& weight = a.in[0];
  const at::Tensor& idx = a.in[1];
  const at::Tensor& y = a.out[0];
  int64_t items = 0;
  TORCH_CHECK(weight.dim() == 2 && y.scalar_type() == weight.scalar_type() &&
                  !__builtin_mul_overflow(idx.numel(), weight.size(1), &items) && y.numel() == items,
              "gradops.native: embedding's y must hold T x E items of weight's dtype");
  if (idx.scalar_type() == at::kLong) return lookup<int64_t>(weight, idx, y);
  TORCH_CHECK(idx.scalar_type() == at::kInt, "gradops.native: embedding indices must be int32 or int64");
  return lookup<int32_t>(weight, idx, y);
}

GRADOPS_KERNEL("embedding", embedding);
GRADOPS_KERNEL("embedding_dense_backward", embedding_dense_backward);

// ---- the native node (nodes.h): gradops.nn.Embedding's recorded call
//
// The lookup, weight (V, E) rows at the indices; backward aclnnEmbeddingDenseBackward into a new table.

const int64_t kFormula = formula_slot();

struct EmbeddingBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable indices_;
  int64_t num_weights_ = 0, padding_ = -1;
  bool scale_ = false;

  std::string name() const override { return "gradops_native::EmbeddingBackward"; }
  void release_variables() override { indices_.reset_data(); }

  variable_list python(const at::Tensor& grad, const at::Tensor& idx) {
    return {python_backward(kFormula, {grad, idx}, std::make_tuple(num_weights_, padding_, scale_))[0]};
  }

  variable_list apply(variable_list&& grads) override {
    at::Tensor idx = indices_.unpack(getptr());
    // Indices freed after the forward (see hollow): the op refuses them with its OpError.
    if (at::GradMode::is_enabled() || forked || !plain(grads[0]) || hollow(idx)) return python(grads[0], idx);
    at::Tensor grad = grads[0].contiguous();
    at::Tensor table = output({num_weights_, grad.size(-1)}, grad.options());
    const std::array<at::Tensor, 2> in{grad, idx};
    const std::array<int64_t, 3> ints{num_weights_, padding_, scale_};
    // An index outside the table: the saved indices were changed behind autograd's back (.data, numpy). The op
    // raises its OpError for them.
    if (embedding_dense_backward({in, table, ints, {}}) >= 0) return python(grads[0], idx);
    return {table};
  }
};

// weight[indices] for contiguous weight (V, E) and int32 / int64 indices, recorded when weight requires grad; an
// undefined tensor when an index lies outside the table (the caller's Python path raises the OpError).
at::Tensor embedding_node(const at::Tensor& weight, const at::Tensor& indices, int64_t padding, bool scale) {
  std::vector<int64_t> shape(indices.sizes().begin(), indices.sizes().end());
  shape.push_back(weight.size(1));
  at::Tensor y = output(shape, weight.options());
  // The rows: a copy of storage items, the bits of the Python path's index_select, after the range test. ATen's
  // index_select_out here cost ~1.5 µs of dispatch at 8 x 8.
  const std::array<at::Tensor, 2> in{weight, indices};
  if (embedding({in, y, {}, {}}) >= 0) return at::Tensor();
  if (at::GradMode::is_enabled() && weight.requires_grad()) {
    NodeRef ref = make_node<EmbeddingBackward>();
    auto* node = static_cast<EmbeddingBackward*>(ref.get());
    node->indices_ = torch::autograd::SavedVariable(indices, false);
    node->num_weights_ = weight.size(0);
    node->padding_ = padding;
    node->scale_ = scale;
    record(ref, y, weight);
  }
  return y;
}

py::object embedding_entry(const at::Tensor& weight, const at::Tensor& indices, int64_t padding, bool scale) {
  require_whole(weight, "weight");
  require_whole(indices, "indices");
  at::Tensor y = embedding_node(weight, indices, padding, scale);
  return y.defined() ? py::cast(y) : py::none();
}

// embedding_planned(weight, indices, padding_idx, scale_grad_by_freq): the recorded lookup on a remembered call's
// metadata (direct.cpp), or None; a padding row that is not an int or a scaling that is not a bool is the op's to
// refuse.
PyObject* embedding_planned(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  static const int64_t call_id = direct_op("embedding");
  if (!arity("embedding_planned", nargs, 4)) return nullptr;
  if (!PyLong_CheckExact(args[2]) || !PyBool_Check(args[3])) Py_RETURN_NONE;
  int overflow = 0;
  const long long padding = PyLong_AsLongLongAndOverflow(args[2], &overflow);
  if (overflow != 0) Py_RETURN_NONE;  // no remembered call has such a key
  if (!node_call(call_id, std::array<py::handle, 2>{args[0], args[1]}, args, 4)) Py_RETURN_NONE;
  at::Tensor y = embedding_node(THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]), padding, args[3] == Py_True);
  if (!y.defined()) Py_RETURN_NONE;
  return py::cast(y).release().ptr();
  END_HANDLE_TH_ERRORS
}

PyMethodDef planned[] = {
    {"embedding_planned", fastcall(embedding_planned), METH_FASTCALL,
     "the recorded embedding lookup on a remembered call's metadata, or None"},
    {nullptr, nullptr, 0, nullptr}};

void module_part(py::module_& m) {
  m.attr("EMBEDDING") = kFormula;
  m.def("embedding", &embedding_entry,
        "weight[indices], contiguous; backward aclnnEmbeddingDenseBackward; None for an index outside the table");
  if (PyModule_AddFunctions(m.ptr(), planned) != 0) throw py::error_already_set();
}

GRADOPS_MODULE_PART(module_part);

}  // namespace
}  // namespace gradops
