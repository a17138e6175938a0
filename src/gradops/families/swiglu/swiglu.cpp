// SwiGlu and SwiGluGrad (aclnnSwiGlu / aclnnSwiGluGrad, docs/semantics.md §7): x split in two halves A and B along
// one dim, y = silu(A)·B; float32 math for every storage dtype, on vec.h's 8 float32 lanes.
//
// The host hands every call over as rows x 2·cols items (x contiguous: the dims before the split dim are the rows,
// the split dim and the dims after it the columns), so row r's A is x[r, 0:cols] and its B x[r, cols:2·cols]; y is
// rows x cols, the gradient rows x 2·cols like x. Byte models: forward 3·rows·cols·s, backward 5·rows·cols·s.
//
// sigmoid(a) = 1 / (1 + e^-a) (exp_lanes: within 2 ulp); silu(a) = a·sigmoid(a). The backward is the derivative
//   dA = g·B·s·(1 + A·(1 - s)),  dB = g·A·s,  s = sigmoid(A)
// (CANN's document prints dA's factor as s + s·(1 - s·A), a misplaced parenthesis: the derivative of A·s(A) is
// s + A·s·(1 - s); see docs/semantics.md §7).

#include "kernels.h"
#include "nodes.h"
#include "vec.h"

#include <vector>

namespace gradops {
namespace {

using namespace vec;

inline Lanes sigmoid_lanes(Lanes a) { return 1.0f / (1.0f + exp_lanes(-a)); }

// y = (a·s)·b.
inline Lanes swiglu_lanes(Lanes a, Lanes b) { return (a * sigmoid_lanes(a)) * b; }

// dA and dB of one step, the formulas above in that operation order.
inline void swiglu_grad_lanes(Lanes g, Lanes a, Lanes b, Lanes& da, Lanes& db) {
  const Lanes s = sigmoid_lanes(a);
  da = g * b * (s * (1.0f + a * (1.0f - s)));
  db = g * (a * s);
}

// One row, 8 columns a step; the last < 8 go through zero-padded copies and the same vector code.
template <class T>
void forward_row(const T* a, const T* b, T* y, int64_t cols) {
  int64_t j = 0;
  for (; j + kLanes <= cols; j += kLanes) store(swiglu_lanes(load(a + j), load(b + j)), y + j);
  if (j < cols) {
    T as[kLanes] = {}, bs[kLanes] = {}, ys[kLanes];
    std::copy(a + j, a + cols, as);
    std::copy(b + j, b + cols, bs);
    store(swiglu_lanes(load(as), load(bs)), ys);
    std::copy(ys, ys + (cols - j), y + j);
  }
}

template <class T>
void backward_row(const T* g, const T* a, const T* b, T* da, T* db, int64_t cols) {
  int64_t j = 0;
  Lanes va, vb;
  for (; j + kLanes <= cols; j += kLanes) {
    swiglu_grad_lanes(load(g + j), load(a + j), load(b + j), va, vb);
    store(va, da + j);
    store(vb, db + j);
  }
  if (j < cols) {
    T gs[kLanes] = {}, as[kLanes] = {}, bs[kLanes] = {}, das[kLanes], dbs[kLanes];
    std::copy(g + j, g + cols, gs);
    std::copy(a + j, a + cols, as);
    std::copy(b + j, b + cols, bs);
    swiglu_grad_lanes(load(gs), load(as), load(bs), va, vb);
    store(va, das);
    store(vb, dbs);
    std::copy(das, das + (cols - j), da + j);
    std::copy(dbs, dbs + (cols - j), db + j);
  }
}

// rows and cols from ints, checked against the tensors: x and dx hold rows·2·cols items, y and g rows·cols, all of
// one float dtype, so that no loop reads or writes past a tensor's end.
void require_rows(const KernelArgs& a, const char* kernel, int64_t& rows, int64_t& cols) {
  TORCH_CHECK(a.ints.size() == 2, "gradops kernel ", kernel, ": takes ints {rows, cols}");
  rows = a.ints[0];
  cols = a.ints[1];
  TORCH_CHECK(rows >= 0 && cols >= 0, "gradops kernel ", kernel, ": rows and cols must be >= 0");
  int64_t half = 0, whole = 0;
  TORCH_CHECK(!__builtin_mul_overflow(rows, cols, &half) && !__builtin_mul_overflow(half, int64_t{2}, &whole),
              "gradops kernel ", kernel, ": rows x 2·cols overflows int64");
  const at::ScalarType s = a.in.back().scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kHalf || s == at::kBFloat16, "gradops kernel ", kernel,
              ": x must be float32, float16 or bfloat16, got ", s);
  for (const auto* list : {&a.in, &a.out}) {
    for (const at::Tensor& t : *list) {
      TORCH_CHECK(t.defined() && t.scalar_type() == s, "gradops kernel ", kernel, ": every tensor must have x's dtype");
    }
  }
}

// "swiglu": in {x (rows x 2·cols)}; out {y (rows x cols)}; ints {rows, cols}. Returns -1 (no value is refused).
int64_t swiglu_kernel(const KernelArgs& a) {
  TORCH_CHECK(a.in.size() == 1 && a.out.size() == 1, "gradops kernel swiglu: takes in {x}, out {y}");
  int64_t rows = 0, cols = 0;
  require_rows(a, "swiglu", rows, cols);
  TORCH_CHECK(a.in[0].numel() == rows * 2 * cols && a.out[0].numel() == rows * cols,
              "gradops kernel swiglu: x must hold rows·2·cols items and y rows·cols");
  GRADOPS_DISPATCH_FLOATS(a.in[0].scalar_type(), "swiglu", [&] {
    const auto* x = a.in[0].const_data_ptr<scalar_t>();
    auto* y = a.out[0].data_ptr<scalar_t>();
    parallel(0, rows, rows_grain(rows, 3 * cols), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) forward_row(x + r * 2 * cols, x + r * 2 * cols + cols, y + r * cols, cols);
    });
  });
  return -1;
}

// "swiglu_grad": in {y_grad (rows x cols), x (rows x 2·cols)}; out {dx (rows x 2·cols)}; ints {rows, cols}. Each
// row of dx is written after its row of every input was read, step by step, so dx may not be one of the inputs.
// Returns -1 (no value is refused).
int64_t swiglu_grad_kernel(const KernelArgs& a) {
  TORCH_CHECK(a.in.size() == 2 && a.out.size() == 1, "gradops kernel swiglu_grad: takes in {y_grad, x}, out {dx}");
  int64_t rows = 0, cols = 0;
  require_rows(a, "swiglu_grad", rows, cols);
  TORCH_CHECK(a.in[0].numel() == rows * cols && a.in[1].numel() == rows * 2 * cols &&
                  a.out[0].numel() == rows * 2 * cols,
              "gradops kernel swiglu_grad: y_grad must hold rows·cols items, x and dx rows·2·cols");
  GRADOPS_DISPATCH_FLOATS(a.in[1].scalar_type(), "swiglu_grad", [&] {
    const auto* g = a.in[0].const_data_ptr<scalar_t>();
    const auto* x = a.in[1].const_data_ptr<scalar_t>();
    auto* dx = a.out[0].data_ptr<scalar_t>();
    parallel(0, rows, rows_grain(rows, 5 * cols), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t at = r * 2 * cols;
        backward_row(g + r * cols, x + at, x + at + cols, dx + at, dx + at + cols, cols);
      }
    });
  });
  return -1;
}

GRADOPS_KERNEL("swiglu", swiglu_kernel);
GRADOPS_KERNEL("swiglu_grad", swiglu_grad_kernel);

// ---- the native node (nodes.h): gradops.swiglu's recorded call (the MoE experts' gate in gradops.transformers)
//
// Through the Python autograd.Function a small SwiGLU forward + backward cost more than eager torch's two ops
// (8 x 16 fp32: 68.7 µs against 56 on 2 cores); the node keeps the backward in C++.

const int64_t kFormula = formula_slot();

// x's view as the kernels take it: rows x 2·cols, split along ``dim`` (checked by gradops' call plan; again here,
// since rows and cols address memory), and y's sizes.
struct Split {
  int64_t rows = 1, cols = 1;
  std::vector<int64_t> out;
};

Split split_of(const at::Tensor& x, int64_t dim) {
  const int64_t rank = x.dim();
  TORCH_CHECK(rank >= 1 && dim >= -rank && dim < rank, "gradops.native: swiglu: dim ", dim, " out of range");
  const int64_t d = dim < 0 ? dim + rank : dim;
  TORCH_CHECK(x.size(d) % 2 == 0, "gradops.native: swiglu: an odd size along dim ", dim);
  Split s;
  s.out.assign(x.sizes().begin(), x.sizes().end());
  s.out[d] /= 2;
  for (int64_t i = 0; i < d; ++i) s.rows *= x.size(i);
  for (int64_t i = d; i < rank; ++i) s.cols *= s.out[i];
  return s;
}

struct SwiGluBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable x_;
  int64_t dim_ = -1, rows_ = 0, cols_ = 0;

  std::string name() const override { return "gradops_native::SwiGluBackward"; }
  void release_variables() override { x_.reset_data(); }

  variable_list apply(variable_list&& grads) override {
    at::Tensor x = x_.unpack(getptr());
    // A saved x whose storage was freed after the forward (see hollow): the formula's op refuses it.
    if (at::GradMode::is_enabled() || forked || !plain(grads[0]) || hollow(x)) {
      return {python_backward(kFormula, {grads[0], x}, dim_)[0]};
    }
    at::Tensor g = grads[0].contiguous();
    at::Tensor dx = output(x.sizes(), x.options());
    const std::array<at::Tensor, 2> in{g, x};
    const std::array<int64_t, 2> ints{rows_, cols_};
    swiglu_grad_kernel({in, dx, ints, {}});
    return {dx};
  }
};

// SwiGLU of a contiguous x, recorded when x requires grad (the caller checked grad mode: see recordable_handles).
at::Tensor swiglu_node(const at::Tensor& x, int64_t dim) {
  const Split s = split_of(x, dim);
  at::Tensor y = output(s.out, x.options());
  const std::array<int64_t, 2> ints{s.rows, s.cols};
  swiglu_kernel({x, y, ints, {}});
  if (at::GradMode::is_enabled() && x.requires_grad()) {
    NodeRef ref = make_node<SwiGluBackward>();
    auto* node = static_cast<SwiGluBackward*>(ref.get());
    node->x_ = torch::autograd::SavedVariable(x, /*is_output=*/false);
    node->dim_ = dim;
    node->rows_ = s.rows;
    node->cols_ = s.cols;
    record(ref, y, x);
  }
  return y;
}

at::Tensor swiglu_entry(const at::Tensor& x, int64_t dim) {
  require_whole(x, "x");
  return swiglu_node(x, dim);
}

// swiglu_planned(x, dim): the recorded SwiGLU on a remembered call's metadata (direct.cpp), or None; a dim that is
// not an int is the op's to refuse.
PyObject* swiglu_planned(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  static const int64_t call_id = direct_op("swiglu");
  if (!arity("swiglu_planned", nargs, 2)) return nullptr;
  if (!PyLong_CheckExact(args[1])) Py_RETURN_NONE;
  int overflow = 0;
  const long long dim = PyLong_AsLongLongAndOverflow(args[1], &overflow);
  if (overflow != 0) Py_RETURN_NONE;  // no remembered call has such a key
  if (!node_call(call_id, std::array<py::handle, 1>{args[0]}, args, 2)) Py_RETURN_NONE;
  return py::cast(swiglu_node(THPVariable_Unpack(args[0]), dim)).release().ptr();
  END_HANDLE_TH_ERRORS
}

PyMethodDef planned[] = {
    {"swiglu_planned", fastcall(swiglu_planned), METH_FASTCALL,
     "the recorded SwiGLU on a remembered call's metadata, or None"},
    {nullptr, nullptr, 0, nullptr}};

void module_part(py::module_& m) {
  m.attr("SWIGLU") = kFormula;
  m.def("swiglu", &swiglu_entry, "SwiGLU of a contiguous x split along dim; backward aclnnSwiGluGrad");
  if (PyModule_AddFunctions(m.ptr(), planned) != 0) throw py::error_already_set();
}

GRADOPS_MODULE_PART(module_part);

}  // namespace
}  // namespace gradops
