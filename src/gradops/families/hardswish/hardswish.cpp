// Hardswish and aclnnHardswishBackward (docs/semantics.md §3): elementwise, float32 math for every storage dtype.
//
// Byte models: forward 2·n·s, backward 3·n·s; memory-bound once the tensors leave the L2 cache. The math runs on
// 8 float32 lanes of vec.h (GCC / Clang vector types), so the vector code does not depend on the auto-vectorizer:
// written as scalar loops, GCC kept a step's lanes in registers or not, and lowered the selects to blends or to a
// branch per item, by dtype and by call site - one instantiation ran 10-20x slower on random data (fp16 forward,
// 128 Ki items, branch mispredictions), another 2-3x (fp32 items copied to the stack as 16-byte moves and read back
// as 32-byte vectors, a failed store-to-load forwarding each). Where GCC lowers the generic vector code poorly, x86
// instructions replace it with the same bits (see max_lanes and the conversions).
//
// Each step loads its 8 items of every input before it stores its 8 results, so an output that is one of the
// inputs gives the bits of a separate one: the native node's backward writes dx into the upstream gradient nobody
// else holds (owned_like, nodes.h), reading two streams and writing one back where a new output costs a
// third stream's read-for-ownership and an allocation. (An auto-vectorized loop given its output among its inputs
// takes its scalar version at the runtime overlap test: 2.7 ms for 4 Mi fp32 items on one thread against 1.05.)

#include "kernels.h"
#include "nodes.h"
#include "vec.h"

#include <cstring>

namespace gradops {
namespace {

using namespace vec;

// Items per parallel task: 16 Ki x 4 B = 64 KiB per fp32 input stream (kTaskItems); 32 Mi items give 2048 tasks.
// Tasks are whole chunks from index 0; the op is elementwise, so no split changes a bit.
constexpr int64_t kChunk = kTaskItems;

// float32(1/3) = 0.33333334f, CANN's constant (docs/semantics.md §3).
constexpr float kThird = 0.3333333432674408f;

// y = x·clamp(x + 3, 0, 6) / 6, the reference's operation order. x + 3 is never -0 (x = -3 gives +0 under
// round-to-nearest), so the clamp is exactly min(max(x + 3, 0), 6); a NaN x gives NaN.
inline Lanes hardswish_lanes(Lanes v) {
  const Lanes t = min_lanes(max_lanes(v + 3.0f, splat(0.0f)), splat(6.0f));
  return v * t / 6.0f;
}

// out = 0 if x < -3; g·(x·0.33333334 + 0.5) if -3 <= x <= 3; g otherwise (a NaN x passes g through). x·(1/3) is
// rounded before the + 0.5, as CANN's kernel does it with two vector instructions and as the reference computes
// it (the extension builds with -ffp-contract=off): an FMA gives -1.49e-8 at x = -1.5 where every other backend
// and the float64 golden give 0.
inline Lanes grad_lanes(Lanes g, Lanes v) {
  const Lanes linear = g * (v * kThird + 0.5f);
  const Bits inside = reinterpret_cast<Bits>(v <= 3.0f);   // -inf <= x <= 3
  const Bits kept = ~reinterpret_cast<Bits>(v < -3.0f);    // all but x < -3 (a NaN x is kept)
  return reinterpret_cast<Lanes>(((reinterpret_cast<Bits>(linear) & inside) | (reinterpret_cast<Bits>(g) & ~inside)) &
                                 kept);
}

// Over [lo, hi), 8 items a step; the last < 8 items go through zero-padded copies and the same vector code, so
// they get the bits they would get inside a step.
template <class T>
void forward_range(const T* x, T* y, int64_t lo, int64_t hi) {
  int64_t i = lo;
  for (; i + kLanes <= hi; i += kLanes) store(hardswish_lanes(load(x + i)), y + i);
  if (i < hi) {
    T xs[kLanes] = {}, ys[kLanes];
    std::copy(x + i, x + hi, xs);
    store(hardswish_lanes(load(xs)), ys);
    std::copy(ys, ys + (hi - i), y + i);
  }
}

template <class T>
void backward_range(const T* g, const T* x, T* out, int64_t lo, int64_t hi) {
  int64_t i = lo;
  for (; i + kLanes <= hi; i += kLanes) store(grad_lanes(load(g + i), load(x + i)), out + i);
  if (i < hi) {
    T gs[kLanes] = {}, xs[kLanes] = {}, outs[kLanes];
    std::copy(g + i, g + hi, gs);
    std::copy(x + i, x + hi, xs);
    store(grad_lanes(load(gs), load(xs)), outs);
    std::copy(outs, outs + (hi - i), out + i);
  }
}

// What the binding's checks (contiguous CPU tensors holding their items) leave to the kernel: a kernel dtype, and
// ``t`` of x's dtype and item count, so that no loop reads or writes past a tensor's end.
void require_like(const at::Tensor& t, const at::Tensor& x, const char* kernel, const char* what) {
  TORCH_CHECK(t.defined() && x.defined(), "gradops kernel ", kernel, ": ", what, " is missing");
  const at::ScalarType s = x.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kHalf || s == at::kBFloat16, "gradops kernel ", kernel,
              ": x must be float32, float16 or bfloat16, got ", s);
  TORCH_CHECK(t.scalar_type() == s && t.numel() == x.numel(), "gradops kernel ", kernel, ": ", what,
              " must have x's dtype and item count");
}

// "hardswish": in {x}; out {y}, x's dtype and item count (may be x itself); no ints, no floats. Returns -1 (no
// value is refused).
int64_t hardswish_kernel(const KernelArgs& a) {
  TORCH_CHECK(a.in.size() == 1 && a.out.size() == 1, "gradops kernel hardswish: takes in {x}, out {y}");
  const at::Tensor& x = a.in[0];
  require_like(x, x, "hardswish", "x");
  require_like(a.out[0], x, "hardswish", "y");
  GRADOPS_DISPATCH_FLOATS(x.scalar_type(), "hardswish", [&] {
    const auto* xp = x.const_data_ptr<scalar_t>();
    auto* yp = a.out[0].data_ptr<scalar_t>();
    chunked(x.numel(), kChunk, [&](int64_t lo, int64_t hi) { forward_range(xp, yp, lo, hi); });
  });
  return -1;
}

// "hardswish_backward" (aclnnHardswishBackward, the closed interval [-3, 3]): in {grad_output, x}; out {dx}, x's
// dtype and item count (may be grad_output or x itself); no ints, no floats. Returns -1 (no value is refused).
int64_t hardswish_backward_kernel(const KernelArgs& a) {
  TORCH_CHECK(a.in.size() == 2 && a.out.size() == 1,
              "gradops kernel hardswish_backward: takes in {grad_output, x}, out {dx}");
  const at::Tensor& x = a.in[1];
  require_like(x, x, "hardswish_backward", "x");
  require_like(a.in[0], x, "hardswish_backward", "grad_output");
  require_like(a.out[0], x, "hardswish_backward", "dx");
  GRADOPS_DISPATCH_FLOATS(x.scalar_type(), "hardswish_backward", [&] {
    const auto* gp = a.in[0].const_data_ptr<scalar_t>();
    const auto* xp = x.const_data_ptr<scalar_t>();
    auto* dp = a.out[0].data_ptr<scalar_t>();
    chunked(x.numel(), kChunk, [&](int64_t lo, int64_t hi) { backward_range(gp, xp, dp, lo, hi); });
  });
  return -1;
}

GRADOPS_KERNEL("hardswish", hardswish_kernel);
GRADOPS_KERNEL("hardswish_backward", hardswish_backward_kernel);

// ---- the native node (nodes.h): gradops.nn.Hardswish's recorded call, and the public functions' eager calls

const int64_t kFormula = formula_slot();

// Hardswish and its backward on contiguous tensors, for the node and for the public functions (gradops.hardswish,
// gradops.hardswish_backward when nothing records them). ``dx`` may be ``g`` itself (see owned_like): the kernel
// reads each item before it writes it.
at::Tensor hardswish_values(const at::Tensor& x) {
  at::Tensor y = output(x.sizes(), x.options());
  hardswish_kernel({x, y, {}, {}});
  return y;
}

at::Tensor hardswish_grad(const at::Tensor& g, const at::Tensor& x, const at::Tensor& dx) {
  const std::array<at::Tensor, 2> in{g, x};
  hardswish_backward_kernel({in, dx, {}, {}});
  return dx;
}

struct HardswishBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable self_;

  std::string name() const override { return "gradops_native::HardswishBackward"; }
  void release_variables() override { self_.reset_data(); }

  variable_list apply(variable_list&& grads) override {
    at::Tensor x = self_.unpack(getptr());
    // A saved x whose storage was freed after the forward (see hollow): the formula's op refuses it.
    if (at::GradMode::is_enabled() || forked || !plain(grads[0]) || hollow(x)) {
      return {python_backward(kFormula, {grads[0], x}, 0.0)[0]};
    }
    if (owned_like(grads[0], x)) {
      at::Tensor g = std::move(grads[0]);
      return {hardswish_grad(g, x, g)};
    }
    return {hardswish_grad(grads[0].contiguous(), x, output(x.sizes(), x.options()))};
  }
};

// Hardswish of a contiguous x, recorded when x requires grad (the caller checked grad mode: see recordable_handles).
at::Tensor hardswish_node(const at::Tensor& x) {
  at::Tensor y = hardswish_values(x);
  if (at::GradMode::is_enabled() && x.requires_grad()) {
    NodeRef ref = make_node<HardswishBackward>();
    static_cast<HardswishBackward*>(ref.get())->self_ = torch::autograd::SavedVariable(x, /*is_output=*/false);
    record(ref, y, x);
  }
  return y;
}

at::Tensor hardswish_entry(const at::Tensor& x) {
  require_whole(x, "x");
  return hardswish_node(x);
}

at::Tensor hardswish_backward_entry(const at::Tensor& g, const at::Tensor& x) {
  require_whole(g, "grad_output");
  require_whole(x, "x");
  TORCH_CHECK(g.sizes() == x.sizes() && g.scalar_type() == x.scalar_type(), "gradops.native: mismatched tensors");
  return hardswish_grad(g, x, output(x.sizes(), x.options()));
}

// hardswish_planned(x): the recorded Hardswish on a remembered call's metadata (direct.cpp), or None.
PyObject* hardswish_planned(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  static const int64_t call_id = direct_op("hardswish");
  if (!arity("hardswish_planned", nargs, 1)) return nullptr;
  if (!node_call(call_id, std::array<py::handle, 1>{args[0]}, args, 1)) Py_RETURN_NONE;
  return py::cast(hardswish_node(THPVariable_Unpack(args[0]))).release().ptr();
  END_HANDLE_TH_ERRORS
}

PyMethodDef planned[] = {
    {"hardswish_planned", fastcall(hardswish_planned), METH_FASTCALL,
     "the recorded Hardswish on a remembered call's metadata, or None"},
    {nullptr, nullptr, 0, nullptr}};

void module_part(py::module_& m) {
  m.attr("HARDSWISH") = kFormula;
  m.def("hardswish", &hardswish_entry, "Hardswish on a contiguous x; backward aclnnHardswishBackward");
  m.def("hardswish_backward", &hardswish_backward_entry,
        "aclnnHardswishBackward on contiguous g, x of one shape and dtype, not recorded");
  if (PyModule_AddFunctions(m.ptr(), planned) != 0) throw py::error_already_set();
}

GRADOPS_MODULE_PART(module_part);

}  // namespace
}  // namespace gradops
