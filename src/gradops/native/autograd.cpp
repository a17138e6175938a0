// gradops' native autograd nodes: the eager training path of gradops.nn without Python in the backward.
//
// Why: a torch.autograd.Function is a Python object whose backward the engine calls through Python. Around
// ATen's own hardswish kernels such a Function costs 1.3-1.4x torch's native node at 64 x 128 (fwd + bwd, 2
// cores: 106-116 µs against 78-88), so no Python autograd path can come within 1.25x of torch at
// small sizes. These nodes are C++ autograd nodes written as torch's generated ones are (see HardswishBackward for
// why not torch::autograd::Function) whose forward and backward call gradops' registered CPU kernels (kernels.h),
// which split their work over torch's own intra-op threads (at::parallel_for: one thread pool for gradops' kernels
// and ATen's). The same kernels as the Python path and the direct calls: the same bits.
//
// What stays in Python: validation (gradops' call plan, on the first call of each argument metadata; the plan's
// answer is then remembered here, so a repeated call is one C++ call after the tests only Python can make), and
// the backwards the kernels cannot run: create_graph=True (grad mode on inside the backward), a forked child, an
// upstream gradient that is not a plain tensor. Those call the Python formula registered for the op, which
// records its own differentiable graph; every other backward is C++ only. (LayerNorm's second derivative then
// sums its two parts, through y and through the statistics, in another order than the Python path: equal to
// float32 rounding, tests/test_native.py.)
//
// Every tensor handed to a kernel is contiguous (the caller checks the inputs; the upstream gradient is made
// contiguous here) and lives until the kernel returns.

#include "common.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <torch/csrc/utils/pybind.h>

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using at::Tensor;
using gradops::forked;
using gradops::output;
using torch::autograd::variable_list;

PyTypeObject* gradops::plain_types[2] = {nullptr, nullptr};

namespace {

enum Op { kHardswish = 0, kLayerNorm = 1, kEmbedding = 2, kOps = 3 };

// Whether the kernels may read ``t`` by address: a dense CPU tensor with storage and no key that changes what its
// memory means. An upstream gradient can be none of that: a legacy-vmap BatchedTensor (autograd.grad with
// is_grads_batched=True), a functorch wrapper, a tensor subclass, a lazy negation / conjugation. Those take the
// Python formula, whose op knows how to dispatch them. So does a hollow one (a freed storage: see gradops::hollow),
// whose op refuses it with its OpError.
bool plain(const Tensor& t) {
  static const c10::DispatchKeySet foreign({c10::DispatchKey::Batched, c10::DispatchKey::FuncTorchBatched,
                                            c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::Python,
                                            c10::DispatchKey::PythonTLSSnapshot, c10::DispatchKey::Functionalize,
                                            c10::DispatchKey::Conjugate, c10::DispatchKey::Negative});
  return t.layout() == at::kStrided && t.device().is_cpu() && t.has_storage() && !t.key_set().has_any(foreign) &&
         !gradops::hollow(t);
}

// The Python formula of each op's backward (create_graph=True, a forked child, a gradient that is not plain); set
// once by gradops.native. Thread rules: written by set_differentiable and read by python_backward, both with the GIL
// held (the engine's threads take it first). Leaked on purpose: a static py::object would be released after the
// interpreter is gone.
py::object* differentiable[kOps] = {nullptr, nullptr, nullptr};

// ``extra``: what the formula needs besides tensors (LayerNorm's eps; the embedding's table rows, padding row and
// scaling), anything pybind11 casts. Every Python object is made and released inside, under the GIL, which the
// engine does not hold while it runs a backward.
template <class Extra>
variable_list python_backward(Op op, const variable_list& args, const Extra& extra) {
  py::gil_scoped_acquire gil;
  TORCH_CHECK(differentiable[op] != nullptr, "gradops.native: no differentiable backward registered");
  py::list inputs;
  for (const Tensor& t : args) inputs.append(py::cast(t));
  py::sequence result = (*differentiable[op])(inputs, py::cast(extra));
  variable_list grads;
  for (py::handle item : result) grads.push_back(item.is_none() ? Tensor() : item.cast<Tensor>());
  return grads;
}

// ---- the output pool: gradops.cpu._pool's recycled blocks, kept here once the extension is loaded
//
// Every fresh CPU tensor of more than glibc's mmap threshold (up to 32 MiB) is a new mapping whose first write takes
// a page fault per 4 KiB (a fresh 64 MiB embedding table: ~15 ms of faults on 2 cores, more than the backward).
// The pool keeps the memory of outputs that died and hands it out again for the same size. In Python (numpy blocks,
// a weakref finalizer per tensor) a pooled output costs ~10 µs; here a block is a mapping whose tensor's deleter
// returns it to the free list: ~1 µs, and no GIL in a backward. Same rules as the Python pool: blocks of at
// least kPoolMin bytes, at most GRADOPS_CPU_POOL_MB MiB of free blocks (default 2048; read whenever a block dies or
// is asked for; 0 turns the pool off), exact sizes only.
//
// Why not from 128 KiB, glibc's default mmap threshold, where a malloc'ed output can already be fresh pages again
// every step (as free() trims the heap's top)? Measured on 2 cores: with that floor, LayerNorm
// 512 x 256 fp32 forward + backward took no page faults where malloc had given it 0 to 72 per step; but `gradops
// demo` (1024 x 96 activations: 384 KiB outputs) gained nothing - 1.02, 1.01, 0.96x torch against 1.00, 0.99,
// 1.00x with the pool off, alternating - since the rest of a model's tensors still come from malloc's heap,
// and the pool would hold more blocks for it.
constexpr int64_t kPoolMin = 1 << 20;  // gradops.cpu._pool.MIN_BYTES
constexpr int64_t kPage = 4096;
constexpr int64_t kHuge = 2 << 20;     // a transparent huge page
constexpr int64_t kHugeMin = 4 << 20;  // numpy's threshold for advising them

// Thread rules: ``free`` and ``free_bytes`` are touched only under ``lock`` (a tensor's deleter runs on whichever
// thread drops it, the GIL held or not); no critical section takes the GIL or calls into Python, so the two locks
// never nest. fork(): see the pthread_atfork handlers in the module's init.
struct BlockPool {
  std::mutex lock;
  std::unordered_map<int64_t, std::vector<void*>> free;
  int64_t free_bytes = 0;
};

// Leaked on purpose: a tensor's deleter may run after static destructors at exit.
BlockPool& block_pool() {
  static BlockPool* pool = new BlockPool();
  return *pool;
}

// GRADOPS_CPU_POOL_MB in bytes, as gradops.cpu._pool.limit_bytes reads it (not a number: 0).
int64_t pool_limit() {
  const char* text = std::getenv("GRADOPS_CPU_POOL_MB");
  if (text == nullptr) return int64_t{2048} << 20;
  char* end = nullptr;
  const double mib = std::strtod(text, &end);
  while (end != nullptr && std::isspace(static_cast<unsigned char>(*end))) ++end;
  if (end == text || end == nullptr || *end != '\0' || !(mib > 0)) return 0;
  return static_cast<int64_t>(mib * (1 << 20));
}

// A block's length: whole pages, whole huge pages from kHugeMin on.
size_t block_length(int64_t bytes) {
  const int64_t unit = bytes >= kHugeMin ? kHuge : kPage;
  return static_cast<size_t>((bytes + unit - 1) / unit * unit);
}

// A block is an anonymous mapping of its own, outside malloc's heap. From malloc, a block below glibc's dynamic
// mmap threshold (up to 32 MiB) would sit in the heap for as long as the pool keeps it: it would decide where the
// heap's top is, and so when free() trims memory that the rest of the program's tensors then fault in again (in
// the sweep, torch's own twin ran 0.9 or 2.9 ms at 2048 x 512 depending on it), and pool_clear could not give its
// memory back to the OS. From kHugeMin on, 2 MiB-aligned and advised for transparent huge pages, as numpy (whose
// blocks the Python pool hands out) does: a streaming kernel over 16 MiB tensors takes a TLB miss per 4 KiB page
// otherwise.
void* map_block(int64_t bytes) {
  const size_t length = block_length(bytes);
  const bool huge = bytes >= kHugeMin;
  const size_t span = huge ? length + kHuge : length;  // room to cut a 2 MiB-aligned start out of
  void* mapped = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) return nullptr;
  if (!huge) return mapped;
  char* start = static_cast<char*>(mapped);
  char* aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(start) + kHuge - 1) / kHuge * kHuge);
  if (aligned > start) munmap(start, aligned - start);
  const size_t tail = static_cast<size_t>(start + span - (aligned + length));
  if (tail > 0) munmap(aligned + length, tail);
#ifdef MADV_HUGEPAGE
  madvise(aligned, length, MADV_HUGEPAGE);
#endif
  return aligned;
}

void unmap_block(void* block, int64_t bytes) {
  munmap(block, block_length(bytes));
}

void release_block(void* block, int64_t bytes) {
  BlockPool& pool = block_pool();
  {
    std::lock_guard<std::mutex> guard(pool.lock);
    if (pool.free_bytes + bytes <= pool_limit()) {
      pool.free[bytes].push_back(block);
      pool.free_bytes += bytes;
      return;
    }
  }
  unmap_block(block, bytes);
}

}  // namespace

// A contiguous CPU tensor: from the pool from kPoolMin on (a recycled block of the exact size, else a new one), else
// at::empty. Its storage cannot be resized (as the Python pool's).
Tensor gradops::output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  // Checked: a product that wrapped around (an embedding table of 2**62 + 2**18 rows of 4 floats is 2**20 bytes
  // modulo 2**64) would hand out a block smaller than the tensor over it.
  int64_t bytes = static_cast<int64_t>(options.dtype().itemsize());
  for (int64_t size : sizes) {
    TORCH_CHECK(size >= 0 && !__builtin_mul_overflow(bytes, size, &bytes), "gradops.native: could not allocate ",
                sizes, " elements of ", options.dtype().itemsize(), " bytes (more than int64 bytes)");
  }
  if (bytes < kPoolMin || pool_limit() <= 0) return at::empty(sizes, options);
  void* block = nullptr;
  {
    BlockPool& pool = block_pool();
    std::lock_guard<std::mutex> guard(pool.lock);
    auto hit = pool.free.find(bytes);
    if (hit != pool.free.end() && !hit->second.empty()) {
      block = hit->second.back();
      hit->second.pop_back();
      pool.free_bytes -= bytes;
    }
  }
  if (block == nullptr) {
    block = map_block(bytes);
    TORCH_CHECK(block != nullptr, "gradops.native: could not allocate ", bytes, " bytes");
  }
  return at::from_blob(block, sizes, [bytes](void* data) { release_block(data, bytes); }, options);
}

namespace {

// gradops.cpu._pool.empty's body once the extension is loaded.
Tensor pool_empty(std::vector<int64_t> sizes, py::handle dtype) {
  TORCH_CHECK(THPDtype_Check(dtype.ptr()), "gradops.native: pool_empty takes a torch.dtype");
  return output(sizes, at::TensorOptions().dtype(reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type));
}

// Frees every free block; returns their bytes (gradops.empty_cache).
int64_t pool_clear() {
  BlockPool& pool = block_pool();
  std::lock_guard<std::mutex> guard(pool.lock);
  const int64_t released = pool.free_bytes;
  for (auto& [bytes, list] : pool.free) {
    for (void* block : list) unmap_block(block, bytes);
  }
  pool.free.clear();
  pool.free_bytes = 0;
  return released;
}

int64_t pool_free_bytes() {
  BlockPool& pool = block_pool();
  std::lock_guard<std::mutex> guard(pool.lock);
  return pool.free_bytes;
}

}  // namespace

// How the engine holds a node: c10::intrusive_ptr in recent torch, std::shared_ptr before.
using NodeRef = decltype(torch::autograd::Edge::function);

template <class N>
NodeRef make_node() {
  if constexpr (std::is_same_v<NodeRef, std::shared_ptr<torch::autograd::Node>>) {
    return std::shared_ptr<N>(new N());
  } else {
    return c10::make_intrusive<N>();
  }
}

// Records ``node`` as the grad_fn of ``output``, its edges to ``inputs``: what torch's generated autograd code does
// for its own ops.
template <class... Inputs>
void record(const NodeRef& ref, const Tensor& output, const Inputs&... inputs) {
  ref->set_next_edges(torch::autograd::collect_next_edges(inputs...));
  torch::autograd::set_history(output, ref);
}

// Nodes written like torch's generated ones (a torch::autograd::Node subclass, saved tensors as SavedVariable, the
// history set on the output) rather than torch::autograd::Function: that one's CppNode keeps an AutogradContext
// (saved data in a string-keyed map of IValues), per-input and per-output metadata, wraps its outputs generically
// and builds its name by demangling the type on every backward - ~10 µs per forward + backward on 2 cores
// (Hardswish 8 x 8 fp32, `(m(x) * w).sum().backward()`: 50.5 µs against torch's 37.3 with CppNode,
// 39.8 against 36.2 with these). Saving through SavedVariable keeps what CppNode gave: saved-tensor hooks, the
// version check ("modified by an inplace operation"), and the error of a second backward through a freed graph.
// Named (not anonymous) so that grad_fn.name() reads gradops_native::..., as torch's read HardswishBackward0.
namespace gradops_native {

// Hardswish and its backward on contiguous tensors: the nodes' kernels, and the public functions' (gradops.hardswish,
// gradops.hardswish_backward when nothing records them), the registered hardswish / hardswish_backward
// (hardswish.cpp) that the Python path and the direct calls run, on torch's threads. ``dx`` may be ``g`` itself
// (see owned_like): the kernel reads each item before it writes it.
Tensor hardswish_values(const Tensor& x) {
  static const gradops::Kernel forward = gradops::find_kernel("hardswish");
  TORCH_CHECK(forward != nullptr, "gradops.native: no kernel hardswish");
  Tensor y = output(x.sizes(), x.options());
  forward({x, y, {}, {}});
  return y;
}

Tensor hardswish_grad(const Tensor& g, const Tensor& x, const Tensor& dx) {
  static const gradops::Kernel backward = gradops::find_kernel("hardswish_backward");
  TORCH_CHECK(backward != nullptr, "gradops.native: no kernel hardswish_backward");
  const std::array<Tensor, 2> in{g, x};
  backward({in, dx, {}, {}});
  return dx;
}

// Whether a node may write its result into the gradient it was handed: a plain contiguous tensor of x's dtype and
// sizes that nothing else references - the engine moved its only reference into the node's arguments (a gradient
// the caller passed to backward(), one a hook kept or a retain_grad() stored, or a view sharing its memory, holds
// another) - so the write is seen by no one (the test by which torch's AccumulateGrad takes a gradient as .grad
// without a copy, and then accumulates into it). The backward then reads two streams and writes one back where a new
// output costs a third (its read-for-ownership) and an allocation: Hardswish 4096 x 1024 fp32, 4 Mi elements on
// one thread, 1.05 ms against 1.75.
bool owned_like(const Tensor& g, const Tensor& x) {
  return g.defined() && g.use_count() == 1 && plain(g) && !g.is_view() && g.has_storage() &&
         g.storage().use_count() == 1 && g.is_contiguous() && g.scalar_type() == x.scalar_type() &&
         g.sizes() == x.sizes() && !g.requires_grad() && !g.is_inference();
}

struct HardswishBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable self_;

  std::string name() const override { return "gradops_native::HardswishBackward"; }
  void release_variables() override { self_.reset_data(); }

  variable_list apply(variable_list&& grads) override {
    Tensor x = self_.unpack(getptr());
    // A saved x whose storage was freed after the forward (see gradops::hollow): the formula's op refuses it.
    if (at::GradMode::is_enabled() || forked || !plain(grads[0]) || gradops::hollow(x)) {
      return {python_backward(kHardswish, {grads[0], x}, 0.0)[0]};
    }
    if (owned_like(grads[0], x)) {
      Tensor g = std::move(grads[0]);
      return {hardswish_grad(g, x, g)};
    }
    return {hardswish_grad(grads[0].contiguous(), x, output(x.sizes(), x.options()))};
  }
};

// Hardswish of a contiguous x, recorded when x requires grad (the caller checked grad mode: see recordable).
Tensor hardswish_node(const Tensor& x) {
  Tensor y = hardswish_values(x);
  if (at::GradMode::is_enabled() && x.requires_grad()) {
    NodeRef ref = make_node<HardswishBackward>();
    auto* node = static_cast<HardswishBackward*>(ref.get());
    node->self_ = torch::autograd::SavedVariable(x, /*is_output=*/false);
    record(ref, y, x);
  }
  return y;
}


// LayerNorm over the last dim, y only (what torch.nn.LayerNorm returns): mean and variance stay inside the node.
// Forward and backward run the family's registered kernels (layer_norm.cpp), the ones the Python path and the
// direct calls run.
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
    static const gradops::Kernel backward = gradops::find_kernel("layer_norm_backward");
    TORCH_CHECK(backward != nullptr, "gradops.native: no kernel layer_norm_backward");
    auto self = getptr();
    Tensor x = x_.unpack(self), gamma = gamma_.unpack(self), mean = mean_.unpack(self), var = var_.unpack(self);
    // x or gamma (the caller's tensors; mean and var are the node's own) freed after the forward, as FSDP frees a
    // parameter's storage between uses (see gradops::hollow): the formula's op refuses it with its OpError.
    if (at::GradMode::is_enabled() || forked || !plain(grads[0]) || gradops::hollow(x) || gradops::hollow(gamma)) {
      // The Python formula needs beta's dtype: an empty tensor carries it.
      Tensor beta_like = at::empty({0}, x.options().dtype(beta_dtype_));
      variable_list g = python_backward(kLayerNorm, {grads[0], x, gamma, mean, var, beta_like}, eps_);
      return {g[0], g[1], g[2]};
    }
    const int64_t n = x.size(-1);
    const int64_t m = x.numel() / n;
    // rstd as the Python path computes it, torch.rsqrt(var + eps): ATen adds the wrapped double scalar in float32
    // and takes 1 / sqrt (IEEE division and square root, vectorized or not), so this loop gives the same bits
    // without two ATen calls (~3 µs of a small backward on 2 cores).
    Tensor rstd = at::empty(var.sizes(), var.options());
    {
      const float e = static_cast<float>(eps_);
      const float* v = var.data_ptr<float>();
      float* out = rstd.data_ptr<float>();
      for (int64_t i = 0, rows = var.numel(); i < rows; ++i) out[i] = 1.0f / std::sqrt(v[i] + e);
    }
    at::TensorOptions f32 = x.options().dtype(at::kFloat);
    Tensor dgamma = at::empty(gamma.sizes(), f32);
    Tensor dbeta = at::empty(gamma.sizes(), f32);
    Tensor dy, dx;
    if (owned_like(grads[0], x)) {
      // dx over the gradient nobody else holds, as Hardswish's (the kernel reads each element of a row before it
      // writes it): at 512 x 256 fp32 the row blocks took 36.4 µs against 41.7 into a new dx (one thread, one
      // process), and forward + backward 0.93x torch against 0.94-0.95 (three alternating runs each, 2
      // cores).
      dx = std::move(grads[0]);
      dy = dx;
    } else {
      dy = grads[0].contiguous();
      dx = output(x.sizes(), x.options());
    }
    const std::array<Tensor, 5> in{dy, x, mean, rstd, gamma};
    const std::array<Tensor, 3> out{dx, dgamma, dbeta};
    const std::array<int64_t, 3> ints{m, n, 0};  // rstd from the node's own variance: never negative, unchecked
    backward({in, out, ints, {}});
    return {dx, dgamma.to(gamma.scalar_type()), dbeta.to(beta_dtype_)};
  }
};

// LayerNorm y of a contiguous x (..., N) with contiguous gamma, beta (N,); recorded when one of them requires grad.
Tensor layer_norm_node(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps) {
  static const gradops::Kernel forward = gradops::find_kernel("layer_norm");
  TORCH_CHECK(forward != nullptr, "gradops.native: no kernel layer_norm");
  const int64_t n = x.size(-1);
  const int64_t m = x.numel() / n;
  Tensor y = output(x.sizes(), x.options());
  at::TensorOptions f32 = x.options().dtype(at::kFloat);
  Tensor mean = at::empty({m}, f32);
  Tensor var = at::empty({m}, f32);
  const std::array<Tensor, 3> in{x, gamma, beta};
  const std::array<Tensor, 3> out{y, mean, var};
  const std::array<int64_t, 2> ints{m, n};
  const std::array<double, 1> floats{eps};
  forward({in, out, ints, floats});
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

// The embedding lookup, weight (V, E) rows at the indices; backward aclnnEmbeddingDenseBackward into a new table.
// Both run the family's registered kernels (embedding.cpp), the ones the Python path and the direct calls run.
struct EmbeddingBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable indices_;
  int64_t num_weights_ = 0, padding_ = -1;
  bool scale_ = false;

  std::string name() const override { return "gradops_native::EmbeddingBackward"; }
  void release_variables() override { indices_.reset_data(); }

  variable_list python(const Tensor& grad, const Tensor& idx) {
    return {python_backward(kEmbedding, {grad, idx}, std::make_tuple(num_weights_, padding_, scale_))[0]};
  }

  variable_list apply(variable_list&& grads) override {
    static const gradops::Kernel backward = gradops::find_kernel("embedding_dense_backward");
    TORCH_CHECK(backward != nullptr, "gradops.native: no kernel embedding_dense_backward");
    Tensor idx = indices_.unpack(getptr());
    // Indices freed after the forward (see gradops::hollow): the op refuses them with its OpError.
    if (at::GradMode::is_enabled() || forked || !plain(grads[0]) || gradops::hollow(idx)) return python(grads[0], idx);
    Tensor grad = grads[0].contiguous();
    Tensor table = output({num_weights_, grad.size(-1)}, grad.options());
    const std::array<Tensor, 2> in{grad, idx};
    const std::array<int64_t, 3> ints{num_weights_, padding_, scale_};
    // An index outside the table: the saved indices were changed behind autograd's back (.data, numpy). The op
    // raises its OpError for them.
    if (backward({in, table, ints, {}}) >= 0) return python(grads[0], idx);
    return {table};
  }
};

// weight[indices] for contiguous weight (V, E) and int32 / int64 indices, recorded when weight requires grad; an
// undefined tensor when an index lies outside the table (the caller's Python path raises the OpError).
Tensor embedding_node(const Tensor& weight, const Tensor& indices, int64_t padding, bool scale) {
  static const gradops::Kernel lookup = gradops::find_kernel("embedding");
  TORCH_CHECK(lookup != nullptr, "gradops.native: no kernel embedding");
  std::vector<int64_t> shape(indices.sizes().begin(), indices.sizes().end());
  shape.push_back(weight.size(1));
  Tensor y = output(shape, weight.options());
  // The rows: a copy of storage items, the bits of the Python path's index_select, after the range test. ATen's
  // index_select_out here cost ~1.5 µs of dispatch at 8 x 8.
  const std::array<Tensor, 2> in{weight, indices};
  if (lookup({in, y, {}, {}}) >= 0) return Tensor();
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

}  // namespace gradops_native

// Whether a torch.func transform is active: pushing one onto functorch's stack includes its front-mode key in this
// thread's dispatch keys (functorch's own headers need nlohmann/json, which torch does not ship).
static bool functorch_active() {
  return c10::impl::tls_local_dispatch_key_set().included_.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode);
}

bool gradops::unwatched() {
  return !c10::impl::TorchDispatchModeTLS::any_modes_set(/*skip_infra_modes=*/false) &&
         !at::impl::torch_function_mode_enabled() && !functorch_active() &&
         !torch::profiler::impl::profilerEnabled() && !torch::jit::tracer::isTracing();
}

bool gradops::foreign_tensor(const Tensor& t) {
  return t.is_meta() || t.is_neg() || t.is_conj() || t.key_set().has(c10::DispatchKey::Batched);
}

const char* gradops::env_or_unset(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "\x01";
}

namespace {

using gradops::plain_types;

// Whether a call with ``args`` is an eager call that autograd records, on plain tensors: what
// gradops.ops._direct.eager_path answers FUNCTION for, less the two answers it reads in Python first
// (torch.compiler.is_compiling, which dynamo answers while it traces, and the direct path's switch). One C++ call
// where the Python test makes eight hook calls and four per tensor (~1.4 µs warm, ~8 µs inside a training step on
// 2 cores). False sends the caller to the Python test, which gives the full answer.
template <typename Handles>
bool recordable_handles(const Handles& args) {
  if (!at::GradMode::is_enabled() || !gradops::unwatched()) return false;
  bool grad = false;
  for (py::handle a : args) {
    PyTypeObject* type = Py_TYPE(a.ptr());
    if (type == plain_types[0] || type == plain_types[1]) {
      const Tensor& t = THPVariable_Unpack(a.ptr());
      if (gradops::foreign_tensor(t)) return false;
      grad = grad || t.requires_grad();
    } else if (THPVariable_Check(a.ptr())) {
      return false;  // a tensor subclass: its own __torch_function__ / __torch_dispatch__ comes first
    }
  }
  return grad;
}

bool recordable(py::args args) { return recordable_handles(args); }

// ---- recorded calls on the nodes: the remembered call plans (direct.cpp's table)
//
// After gradops.ops validated a call and found a native node for it (the call plan), it remembers the plan with
// the arguments' metadata (gradops.native's ``remember``, the entry the direct calls use); later calls with the same
// metadata skip the Python plan lookup (~8 µs of a small training step on 2 cores). The entry's key is what the
// plan depends on: each tensor's dtype and sizes (all contiguous CPU tensors, checked per call), the scalars, and
// the two environment variables the backend decision reads. gradops forgets them with its own plans
// (gradops._runtime.invalidate: a fork, the native switch), and a child of fork() never uses them.

// The op's id in the remembered calls (direct.cpp), by the name gradops gives the op.
int64_t call_id(Op op) {
  static const int64_t ids[kOps] = {gradops::direct_op("hardswish"), gradops::direct_op("layer_norm"),
                                    gradops::direct_op("embedding")};
  return ids[op];
}

// Whether every handle is a tensor. recordable_handles skips what is not one (a gradient could flow through the
// others), so a call with None, a number, a list or a str for a tensor argument can pass it: such a call takes the
// Python path, whose plan refuses it with the op's OpError. After recordable_handles a tensor here is a plain one.
template <size_t N>
bool all_tensors(const std::array<py::handle, N>& args) {
  for (py::handle a : args) {
    if (!THPVariable_Check(a.ptr())) return false;
  }
  return true;
}

// The recorded call on the node for a remembered call's metadata, or None (then gradops' Python path decides).
// ``call``: the op's positional arguments as gradops passes them (the key of the remembered call).
py::object hardswish_planned(PyObject* const* call) {
  const std::array<py::handle, 1> args{call[0]};
  if (forked || !recordable_handles(args) || !all_tensors(args) || !gradops::node_known(call_id(kHardswish), call, 1)) {
    return py::none();
  }
  return py::cast(gradops_native::hardswish_node(THPVariable_Unpack(call[0])));
}

py::object layer_norm_planned(PyObject* const* call, double eps) {
  const std::array<py::handle, 3> args{call[0], call[1], call[2]};
  if (forked || !recordable_handles(args) || !all_tensors(args) || !gradops::node_known(call_id(kLayerNorm), call, 4)) {
    return py::none();
  }
  return py::cast(gradops_native::layer_norm_node(THPVariable_Unpack(call[0]), THPVariable_Unpack(call[1]),
                                                  THPVariable_Unpack(call[2]), eps));
}

py::object embedding_planned(PyObject* const* call, int64_t padding, bool scale) {
  const std::array<py::handle, 2> args{call[0], call[1]};
  if (forked || !recordable_handles(args) || !all_tensors(args) || !gradops::node_known(call_id(kEmbedding), call, 4)) {
    return py::none();
  }
  Tensor y = gradops_native::embedding_node(THPVariable_Unpack(call[0]), THPVariable_Unpack(call[1]), padding, scale);
  return y.defined() ? py::cast(y) : py::none();
}

// The *_planned functions as CPython METH_FASTCALL functions: they run in front of every recorded module call,
// where pybind11's dispatcher (an argument vector, a conversion flag per argument, overload resolution) cost ~0.3 µs
// of a ~3 µs Hardswish forward at 8 x 8 on 2 cores. Arguments: the op's positional arguments as gradops passes
// them, tensors then a float or int (layer_norm's eps) or an int and a bool (embedding's padding row and scaling);
// a scalar of another type is the op's to refuse: None.
bool arity(const char* name, Py_ssize_t given, Py_ssize_t expected) {
  if (given == expected) return true;
  PyErr_Format(PyExc_TypeError, "gradops.native.%s takes %zd arguments, got %zd", name, expected, given);
  return false;
}

PyObject* hardswish_planned_fast(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!arity("hardswish_planned", nargs, 1)) return nullptr;
  return hardswish_planned(args).release().ptr();
  END_HANDLE_TH_ERRORS
}

PyObject* layer_norm_planned_fast(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!arity("layer_norm_planned", nargs, 4)) return nullptr;
  if (!PyFloat_Check(args[3]) && !PyLong_CheckExact(args[3])) Py_RETURN_NONE;  // the op's to refuse
  const double eps = PyFloat_AsDouble(args[3]);
  if (eps == -1.0 && PyErr_Occurred()) return nullptr;
  return layer_norm_planned(args, eps).release().ptr();
  END_HANDLE_TH_ERRORS
}

PyObject* embedding_planned_fast(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!arity("embedding_planned", nargs, 4)) return nullptr;
  if (!PyLong_CheckExact(args[2]) || !PyBool_Check(args[3])) Py_RETURN_NONE;  // the op's to refuse
  int overflow = 0;
  const long long padding = PyLong_AsLongLongAndOverflow(args[2], &overflow);
  if (overflow != 0) Py_RETURN_NONE;  // no remembered call has such a key
  return embedding_planned(args, padding, args[3] == Py_True).release().ptr();
  END_HANDLE_TH_ERRORS
}

// gradops.contract._common.hollow's C form (the same rule, gradops::hollow), which gradops.contract._memo.key_of asks
// of every tensor of every planned call: METH_O, ~0.1 µs where the Python form reads four attributes (~1 µs).
// False for what is not a plain tensor (a subclass, a fake tensor: their data is their own to check).
PyObject* hollow_fast(PyObject*, PyObject* arg) {
  HANDLE_TH_ERRORS
  PyTypeObject* type = Py_TYPE(arg);
  const bool plain_tensor = type == plain_types[0] || type == plain_types[1];
  if (plain_tensor && gradops::hollow(THPVariable_Unpack(arg))) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef planned_functions[] = {
    {"hollow", hollow_fast, METH_O, "whether a plain tensor's storage does not hold its elements (freed, shrunk)"},
    {"hardswish_planned", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(hardswish_planned_fast)),
     METH_FASTCALL, "the recorded Hardswish on a remembered call's metadata, or None"},
    {"layer_norm_planned", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(layer_norm_planned_fast)),
     METH_FASTCALL, "the recorded LayerNorm y on a remembered call's metadata, or None"},
    {"embedding_planned", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(embedding_planned_fast)),
     METH_FASTCALL, "the recorded embedding lookup on a remembered call's metadata, or None"},
    {nullptr, nullptr, 0, nullptr}};

void set_plain_types(py::handle tensor, py::handle parameter) {
  plain_types[0] = reinterpret_cast<PyTypeObject*>(tensor.ptr());
  plain_types[1] = reinterpret_cast<PyTypeObject*>(parameter.ptr());
}

// The entries below run after gradops' call plan validated their tensors, which refuses a hollow one (see
// gradops::hollow); checked again here because the kernels read them by address: a storage freed in between (by
// another thread, a hook) must not reach them.
void require_whole(const Tensor& t, const char* name) {
  TORCH_CHECK(!gradops::hollow(t), "gradops.native: ", name, " has ", t.numel(), " elements but its storage holds ",
              t.has_storage() ? t.storage().nbytes() : 0, " bytes (freed or shrunk: untyped_storage().resize_())");
}

Tensor hardswish(const Tensor& x) {
  require_whole(x, "x");
  return gradops_native::hardswish_node(x);
}

Tensor layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps) {
  require_whole(x, "x");
  require_whole(gamma, "gamma");
  require_whole(beta, "beta");
  return gradops_native::layer_norm_node(x, gamma, beta, eps);
}

py::object embedding(const Tensor& weight, const Tensor& indices, int64_t padding, bool scale) {
  require_whole(weight, "weight");
  require_whole(indices, "indices");
  Tensor y = gradops_native::embedding_node(weight, indices, padding, scale);
  return y.defined() ? py::cast(y) : py::none();
}

Tensor hardswish_backward_function(const Tensor& g, const Tensor& x) {
  require_whole(g, "grad_output");
  require_whole(x, "x");
  TORCH_CHECK(g.sizes() == x.sizes() && g.scalar_type() == x.scalar_type(), "gradops.native: mismatched tensors");
  return gradops_native::hardswish_grad(g, x, output(x.sizes(), x.options()));
}

// Called with the GIL held (from Python), which also guards ``differentiable``: the one writer, and the readers
// (python_backward) take the GIL first. A second registration (after gradops.native.reset) replaces the object in
// place, releasing the old function.
void set_differentiable(int64_t op, py::object fn) {
  TORCH_CHECK(op >= 0 && op < kOps, "gradops.native: unknown op ", op);
  if (differentiable[op] == nullptr) {
    differentiable[op] = new py::object(std::move(fn));
  } else {
    *differentiable[op] = std::move(fn);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gradops' native autograd nodes (see autograd.cpp)";
  // The pool's lock is held across fork() (taken before, released in the parent and in the child): another thread
  // holding it at the fork would leave the child a copy that never opens, over a free list caught mid-change.
  pthread_atfork([] { block_pool().lock.lock(); }, [] { block_pool().lock.unlock(); },
                 [] {
                   forked = true;
                   block_pool().lock.unlock();
                 });
  m.attr("HARDSWISH") = static_cast<int64_t>(kHardswish);
  m.attr("LAYER_NORM") = static_cast<int64_t>(kLayerNorm);
  m.attr("POOL_MIN") = kPoolMin;
  m.attr("EMBEDDING") = static_cast<int64_t>(kEmbedding);
  m.def("hardswish", &hardswish, "Hardswish on a contiguous x; backward aclnnHardswishBackward");
  m.def("layer_norm", &layer_norm, "LayerNorm y of a contiguous x (..., N); backward the fused LayerNorm backward");
  m.def("embedding", &embedding, "weight[indices], contiguous; backward aclnnEmbeddingDenseBackward; None for an index "
        "outside the table");
  m.def("hardswish_backward", &hardswish_backward_function,
        "aclnnHardswishBackward on contiguous g, x of one shape and dtype, not recorded");
  m.def("set_differentiable", &set_differentiable, "the Python backward of op for create_graph=True");
  m.def("recordable", &recordable, "whether a call on these arguments is eager, recorded, on plain tensors");
  m.def("set_plain_types", &set_plain_types, "torch.Tensor and torch.nn.Parameter (kept alive by torch)");
  m.def("pool_empty", &pool_empty, "a contiguous CPU tensor from the output pool (1 MiB and more)");
  m.def("pool_clear", &pool_clear, "free the pool's free blocks; their bytes");
  m.def("pool_free_bytes", &pool_free_bytes, "bytes in the pool's free blocks");
  m.def("forget", &gradops::forget_calls, "drop every remembered call");
  if (PyModule_AddFunctions(m.ptr(), planned_functions) != 0) throw py::error_already_set();
  gradops::register_direct(m);
  gradops::register_kernels(m);
}
