// gradops' native autograd nodes: the eager training path of gradops.nn without Python in the backward.
//
// Why: a torch.autograd.Function is a Python object whose backward the engine calls through Python. Around
// ATen's own hardswish kernels such a Function costs 1.3-1.4x torch's native node at 64 x 128 (fwd + bwd, 2-core
// CI VM, 2026-11-23: 106-116 µs against 78-88), so no Python autograd path can come within 1.25x of torch at
// small sizes. These nodes are torch::autograd::Function in C++ (torch's own CppNode, as cheap as ATen's nodes)
// whose forward and backward call gradops' compiled CPU kernels: numba cfuncs, handed over as addresses
// (gradops.cpu.c_abi, whose signatures are the function-pointer types below). The same kernels as the Python
// path, the same operation order: the same bits.
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
// contiguous here) and lives until the kernel returns; addresses travel as int64.

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <torch/csrc/utils/pybind.h>

#include <pthread.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace py = pybind11;
using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

inline int64_t addr(const Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr()); }

// The kernels' C entry points (numba cfuncs), by signature.
using ElementwiseFn = void (*)(int64_t x, int64_t y, int64_t n);
using ElementwiseGradFn = void (*)(int64_t g, int64_t x, int64_t out, int64_t n);
using LayerNormFn = void (*)(int64_t x, int64_t gamma, int64_t beta, double eps, int64_t y, int64_t mean,
                             int64_t var, int64_t m, int64_t n);
using LayerNormGradFn = void (*)(int64_t dy, int64_t x, int64_t mean, int64_t rstd, int64_t gamma, int64_t dx,
                                 int64_t dgamma, int64_t dbeta, int64_t m, int64_t n);

enum Op { kHardswish = 0, kLayerNorm = 1, kOps = 2 };

// Set in a child of fork(). A graph recorded before the fork may run its backward there, and the kernels' thread
// pool may not survive the fork (GNU OpenMP: numba terminates the process at its next parallel launch), which only
// the Python path's guards know: a forked child's backwards take the Python formula (gradops.cpu._host).
bool forked = false;

// Whether the kernels may read ``t`` by address: a dense CPU tensor with storage and no key that changes what its
// memory means. An upstream gradient can be none of that: a legacy-vmap BatchedTensor (autograd.grad with
// is_grads_batched=True), a functorch wrapper, a tensor subclass, a lazy negation / conjugation. Those take the
// Python formula, whose op knows how to dispatch them.
bool plain(const Tensor& t) {
  static const c10::DispatchKeySet foreign({c10::DispatchKey::Batched, c10::DispatchKey::FuncTorchBatched,
                                            c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::Python,
                                            c10::DispatchKey::PythonTLSSnapshot, c10::DispatchKey::Functionalize,
                                            c10::DispatchKey::Conjugate, c10::DispatchKey::Negative});
  return t.layout() == at::kStrided && t.device().is_cpu() && t.has_storage() && !t.key_set().has_any(foreign);
}

// The Python formula of each op's backward (create_graph=True, a forked child, a gradient that is not plain); set
// once by gradops.native.
// Leaked on purpose: a static py::object would be released after the interpreter is gone.
py::object* differentiable[kOps] = {nullptr, nullptr};

// ``extra``: a number the formula needs besides tensors (LayerNorm's eps). Every Python object is made and released
// inside, under the GIL, which the engine does not hold while it runs a backward.
variable_list python_backward(Op op, const variable_list& args, double extra) {
  py::gil_scoped_acquire gil;
  TORCH_CHECK(differentiable[op] != nullptr, "gradops.native: no differentiable backward registered");
  py::list inputs;
  for (const Tensor& t : args) inputs.append(py::cast(t));
  py::sequence result = (*differentiable[op])(inputs, py::float_(extra));
  variable_list grads;
  for (py::handle item : result) grads.push_back(item.is_none() ? Tensor() : item.cast<Tensor>());
  return grads;
}

}  // namespace

// Named (not anonymous): a node's name() is its type's, so grad_fn.name() reads gradops_native::HardswishNode.
namespace gradops_native {

struct HardswishNode : public torch::autograd::Function<HardswishNode> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, int64_t fwd, int64_t bwd) {
    Tensor y = at::empty_like(x);
    reinterpret_cast<ElementwiseFn>(fwd)(addr(x), addr(y), x.numel());
    ctx->save_for_backward({x});
    ctx->saved_data["bwd"] = bwd;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Tensor x = ctx->get_saved_variables()[0];
    Tensor dx;
    if (at::GradMode::is_enabled() || forked || !plain(grads[0])) {
      dx = python_backward(kHardswish, {grads[0], x}, 0.0)[0];
    } else {
      Tensor g = grads[0].contiguous();
      dx = at::empty_like(x);
      reinterpret_cast<ElementwiseGradFn>(ctx->saved_data["bwd"].toInt())(addr(g), addr(x), addr(dx), x.numel());
    }
    return {dx, Tensor(), Tensor()};
  }
};

// LayerNorm over the last dim, y only (what torch.nn.LayerNorm returns): mean and variance stay inside the node.
struct LayerNormNode : public torch::autograd::Function<LayerNormNode> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps,
                        int64_t fwd, int64_t bwd) {
    const int64_t n = x.size(-1);
    const int64_t m = x.numel() / n;
    Tensor y = at::empty_like(x);
    at::TensorOptions f32 = x.options().dtype(at::kFloat);
    Tensor mean = at::empty({m}, f32);
    Tensor var = at::empty({m}, f32);
    reinterpret_cast<LayerNormFn>(fwd)(addr(x), addr(gamma), addr(beta), eps, addr(y), addr(mean), addr(var), m, n);
    ctx->save_for_backward({x, gamma, mean, var});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["bwd"] = bwd;
    ctx->saved_data["beta_dtype"] = static_cast<int64_t>(beta.scalar_type());
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];
    const Tensor& gamma = saved[1];
    const Tensor& mean = saved[2];
    const Tensor& var = saved[3];
    const double eps = ctx->saved_data["eps"].toDouble();
    const auto beta_dtype = static_cast<at::ScalarType>(ctx->saved_data["beta_dtype"].toInt());
    if (at::GradMode::is_enabled() || forked || !plain(grads[0])) {
      // The Python formula needs beta's dtype: an empty tensor carries it.
      Tensor beta_like = at::empty({0}, x.options().dtype(beta_dtype));
      variable_list g = python_backward(kLayerNorm, {grads[0], x, gamma, mean, var, beta_like}, eps);
      return {g[0], g[1], g[2], Tensor(), Tensor(), Tensor()};
    }
    const int64_t n = x.size(-1);
    const int64_t m = x.numel() / n;
    // rstd as the Python path computes it (float32 var + a wrapped double scalar, then rsqrt): the same bits.
    Tensor rstd = at::rsqrt(var + eps);
    Tensor dy = grads[0].contiguous();
    Tensor dx = at::empty_like(x);
    at::TensorOptions f32 = x.options().dtype(at::kFloat);
    Tensor dgamma = at::empty(gamma.sizes(), f32);
    Tensor dbeta = at::empty(gamma.sizes(), f32);
    reinterpret_cast<LayerNormGradFn>(ctx->saved_data["bwd"].toInt())(
        addr(dy), addr(x), addr(mean), addr(rstd), addr(gamma), addr(dx), addr(dgamma), addr(dbeta), m, n);
    return {dx, dgamma.to(gamma.scalar_type()), dbeta.to(beta_dtype), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace gradops_native

namespace {

// Whether a torch.func transform is active: pushing one onto functorch's stack includes its front-mode key in this
// thread's dispatch keys (functorch's own headers need nlohmann/json, which torch does not ship).
bool functorch_active() {
  return c10::impl::tls_local_dispatch_key_set().included_.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode);
}

// torch.Tensor and torch.nn.Parameter, set once by gradops.native: the exact types the eager path takes.
PyTypeObject* plain_types[2] = {nullptr, nullptr};

// Whether a call with ``args`` is an eager call that autograd records, on plain tensors: what
// gradops.ops._direct.eager_path answers FUNCTION for, less the two answers it reads in Python first
// (torch.compiler.is_compiling, which dynamo answers while it traces, and the direct path's switch). One C++ call
// where the Python test makes eight hook calls and four per tensor (~1.4 µs warm, ~8 µs inside a training step on
// the CI VM, 2026-11-24). False sends the caller to the Python test, which gives the full answer.
template <typename Handles>
bool recordable_handles(const Handles& args) {
  if (!at::GradMode::is_enabled() || c10::impl::TorchDispatchModeTLS::any_modes_set(/*skip_infra_modes=*/false) ||
      at::impl::torch_function_mode_enabled() || functorch_active() ||
      torch::profiler::impl::profilerEnabled() || torch::jit::tracer::isTracing()) {
    return false;
  }
  bool grad = false;
  for (py::handle a : args) {
    PyTypeObject* type = Py_TYPE(a.ptr());
    if (type == plain_types[0] || type == plain_types[1]) {
      const Tensor& t = THPVariable_Unpack(a.ptr());
      if (t.is_meta() || t.is_neg() || t.is_conj() || t.key_set().has(c10::DispatchKey::Batched)) return false;
      grad = grad || t.requires_grad();
    } else if (THPVariable_Check(a.ptr())) {
      return false;  // a tensor subclass: its own __torch_function__ / __torch_dispatch__ comes first
    }
  }
  return grad;
}

bool recordable(py::args args) { return recordable_handles(args); }

// ---- remembered plans: the Python call plan's answer for the native node, per argument metadata
//
// After gradops.ops validated a call and found a native node for it (the call plan), it hands the node's kernels
// here with the arguments' metadata; later calls with the same metadata skip the Python plan lookup (~8 µs of a
// small training step on the CI VM, 2026-11-24). The key is what the plan depends on: each tensor's dtype and
// sizes (all contiguous CPU tensors, checked per call), the scalar, and the two environment variables the
// backend decision reads. gradops forgets them with its own plans (gradops.ops._plan.forget_all: a fork, the
// native switch), and a child of fork() never uses them.
struct Plan {
  std::vector<int64_t> key;
  double scalar;
  std::string backend, interpret;  // GRADOPS_BACKEND, TRITON_INTERPRET as read when remembered ("\x01": unset)
  int64_t fwd, bwd;
};
std::vector<Plan> plans[kOps];
constexpr size_t kPlanLimit = 64;  // a model has a handful of shapes per op; a shape sweep starts over

const char* env_or_unset(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "\x01";
}

// Appends t's metadata to key; false when t cannot go to a kernel as it is (not a contiguous CPU tensor).
bool add_key(std::vector<int64_t>& key, const Tensor& t) {
  if (!t.is_contiguous() || !t.device().is_cpu() || t.layout() != at::kStrided) return false;
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(t.dim());
  for (int64_t size : t.sizes()) key.push_back(size);
  return true;
}

const Plan* find_plan(Op op, const std::vector<int64_t>& key, double scalar) {
  const char* backend = env_or_unset("GRADOPS_BACKEND");
  const char* interpret = env_or_unset("TRITON_INTERPRET");
  for (const Plan& plan : plans[op]) {
    if (plan.key == key && plan.scalar == scalar && plan.backend == backend && plan.interpret == interpret) {
      return &plan;
    }
  }
  return nullptr;
}

void remember(int64_t op, std::vector<Tensor> tensors, double scalar, int64_t fwd, int64_t bwd) {
  TORCH_CHECK(op >= 0 && op < kOps, "gradops.native: unknown op ", op);
  Plan plan{{}, scalar, env_or_unset("GRADOPS_BACKEND"), env_or_unset("TRITON_INTERPRET"), fwd, bwd};
  for (const Tensor& t : tensors) {
    if (!add_key(plan.key, t)) return;
  }
  if (find_plan(static_cast<Op>(op), plan.key, scalar) != nullptr) return;
  if (plans[op].size() >= kPlanLimit) plans[op].clear();
  plans[op].push_back(std::move(plan));
}

void forget() {
  for (auto& list : plans) list.clear();
}

// The recorded call on the node from a remembered plan, or None (then gradops' Python path decides).
py::object hardswish_planned(py::handle x) {
  if (forked || !recordable_handles(std::array<py::handle, 1>{x})) return py::none();
  const Tensor& t = THPVariable_Unpack(x.ptr());
  std::vector<int64_t> key;
  const Plan* plan = add_key(key, t) ? find_plan(kHardswish, key, 0.0) : nullptr;
  if (plan == nullptr) return py::none();
  return py::cast(gradops_native::HardswishNode::apply(t, plan->fwd, plan->bwd));
}

py::object layer_norm_planned(py::handle x, py::handle gamma, py::handle beta, double eps) {
  if (forked || !recordable_handles(std::array<py::handle, 3>{x, gamma, beta})) return py::none();
  if (!THPVariable_Check(gamma.ptr()) || !THPVariable_Check(beta.ptr())) return py::none();
  const Tensor& tx = THPVariable_Unpack(x.ptr());
  const Tensor& tg = THPVariable_Unpack(gamma.ptr());
  const Tensor& tb = THPVariable_Unpack(beta.ptr());
  std::vector<int64_t> key;
  const Plan* plan =
      add_key(key, tx) && add_key(key, tg) && add_key(key, tb) ? find_plan(kLayerNorm, key, eps) : nullptr;
  if (plan == nullptr) return py::none();
  return py::cast(gradops_native::LayerNormNode::apply(tx, tg, tb, eps, plan->fwd, plan->bwd));
}

void set_plain_types(py::handle tensor, py::handle parameter) {
  plain_types[0] = reinterpret_cast<PyTypeObject*>(tensor.ptr());
  plain_types[1] = reinterpret_cast<PyTypeObject*>(parameter.ptr());
}

Tensor hardswish(const Tensor& x, int64_t fwd, int64_t bwd) { return gradops_native::HardswishNode::apply(x, fwd, bwd); }

Tensor layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, int64_t fwd, int64_t bwd) {
  return gradops_native::LayerNormNode::apply(x, gamma, beta, eps, fwd, bwd);
}

void set_differentiable(int64_t op, py::object fn) {
  TORCH_CHECK(op >= 0 && op < kOps, "gradops.native: unknown op ", op);
  differentiable[op] = new py::object(std::move(fn));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gradops' native autograd nodes (see autograd.cpp)";
  pthread_atfork(nullptr, nullptr, [] { forked = true; });
  m.attr("HARDSWISH") = static_cast<int64_t>(kHardswish);
  m.attr("LAYER_NORM") = static_cast<int64_t>(kLayerNorm);
  m.def("hardswish", &hardswish, "Hardswish on a contiguous x; backward aclnnHardswishBackward");
  m.def("layer_norm", &layer_norm, "LayerNorm y of a contiguous x (..., N); backward the fused LayerNorm backward");
  m.def("set_differentiable", &set_differentiable, "the Python backward of op for create_graph=True");
  m.def("recordable", &recordable, "whether a call on these arguments is eager, recorded, on plain tensors");
  m.def("set_plain_types", &set_plain_types, "torch.Tensor and torch.nn.Parameter (kept alive by torch)");
  m.def("remember", &remember, "the native node's kernels for calls with these tensors' metadata and scalar");
  m.def("forget", &forget, "drop every remembered plan");
  m.def("hardswish_planned", &hardswish_planned, "the recorded Hardswish on a remembered plan, or None");
  m.def("layer_norm_planned", &layer_norm_planned, "the recorded LayerNorm y on a remembered plan, or None");
}
