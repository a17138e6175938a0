// What a family's native autograd node is made of (the nodes themselves live with their kernels, in the family's
// .cpp; autograd.cpp defines what is declared here and builds the module).
//
// Why C++ nodes: a torch.autograd.Function is a Python object whose backward the engine calls through Python. Around
// ATen's own hardswish kernels such a Function costs 1.3-1.4x torch's native node at 64 x 128 (fwd + bwd, 2 cores:
// 106-116 µs against 78-88), so no Python autograd path can come within 1.25x of torch at small sizes. A node here is
// written as torch's generated ones are (a torch::autograd::Node subclass, saved tensors as SavedVariable, the
// history set on the output) rather than torch::autograd::Function: that one's CppNode keeps an AutogradContext
// (saved data in a string-keyed map of IValues), per-input and per-output metadata, wraps its outputs generically
// and builds its name by demangling the type on every backward - ~10 µs per forward + backward on 2 cores
// (Hardswish 8 x 8 fp32, `(m(x) * w).sum().backward()`: 50.5 µs against torch's 37.3 with CppNode, 39.8 against
// 36.2 with these). Saving through SavedVariable keeps what CppNode gave: saved-tensor hooks, the version check
// ("modified by an inplace operation"), and the error of a second backward through a freed graph.
//
// What stays in Python: validation (gradops' call plan, on the first call of each argument metadata; the plan's
// answer is then remembered in direct.cpp's table, so a repeated call is one C++ call after the tests only Python
// can make), and the backwards the kernels cannot run: create_graph=True (grad mode on inside the backward), a forked
// child, an upstream gradient that is not a plain tensor. Those call the op's Python formula (a slot, see
// formula_slot), which records its own differentiable graph; every other backward is C++ only.
//
// Every tensor a node hands to a kernel is contiguous (the caller checks the inputs; the upstream gradient is made
// contiguous by the node) and lives until the kernel returns.
#pragma once

#include "common.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <array>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace gradops {

using torch::autograd::variable_list;

// Whether the kernels may read ``t`` by address: a dense CPU tensor with storage and no key that changes what its
// memory means. An upstream gradient can be none of that: a legacy-vmap BatchedTensor (autograd.grad with
// is_grads_batched=True), a functorch wrapper, a tensor subclass, a lazy negation / conjugation. Those take the
// Python formula, whose op knows how to dispatch them. So does a hollow one (a freed storage: see hollow), whose op
// refuses it with its OpError.
bool plain(const at::Tensor& t);

// Whether a node may write its result into the gradient it was handed: a plain contiguous tensor of x's dtype and
// sizes that nothing else references - the engine moved its only reference into the node's arguments (a gradient
// the caller passed to backward(), one a hook kept or a retain_grad() stored, or a view sharing its memory, holds
// another) - so the write is seen by no one (the test by which torch's AccumulateGrad takes a gradient as .grad
// without a copy). The backward then reads two streams and writes one back where a new output costs a third (its
// read-for-ownership) and an allocation: Hardswish 4096 x 1024 fp32, 4 Mi elements on one thread, 1.05 ms against
// 1.75. Only for kernels that read each item of a row before they write it.
bool owned_like(const at::Tensor& g, const at::Tensor& x);

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

// Records ``ref`` as the grad_fn of ``output``, its edges to ``inputs``: what torch's generated autograd code does
// for its own ops.
template <class... Inputs>
void record(const NodeRef& ref, const at::Tensor& output, const Inputs&... inputs) {
  ref->set_next_edges(torch::autograd::collect_next_edges(inputs...));
  torch::autograd::set_history(output, ref);
}

// A slot for one op's Python formula, taken at static initialisation by the family's file and published to Python
// as a module constant; gradops.native.node fills it (set_differentiable) on first use. Thread rules: the slots'
// objects are written by set_differentiable and read by python_backward, both with the GIL held (the engine's threads
// take it first).
int64_t formula_slot();
py::object* formula(int64_t slot);

// The op's Python formula on ``args`` and ``extra`` (what it needs besides tensors, anything pybind11 casts). Every
// Python object is made and released inside, under the GIL, which the engine does not hold while it runs a backward.
template <class Extra>
variable_list python_backward(int64_t slot, const variable_list& args, const Extra& extra) {
  py::gil_scoped_acquire gil;
  py::object* fn = formula(slot);
  TORCH_CHECK(fn != nullptr, "gradops.native: no differentiable backward registered");
  py::list inputs;
  for (const at::Tensor& t : args) inputs.append(py::cast(t));
  py::sequence result = (*fn)(inputs, py::cast(extra));
  variable_list grads;
  for (py::handle item : result) grads.push_back(item.is_none() ? at::Tensor() : item.cast<at::Tensor>());
  return grads;
}

// Whether a call with ``args`` is an eager call that autograd records, on plain tensors: what
// gradops.ops._direct.eager_path answers FUNCTION for, less the two answers it reads in Python first
// (torch.compiler.is_compiling, which dynamo answers while it traces, and the direct path's switch). One C++ call
// where the Python test makes eight hook calls and four per tensor (~1.4 µs warm, ~8 µs inside a training step on
// 2 cores). False sends the caller to the Python test, which gives the full answer.
template <typename Handles>
bool recordable_handles(const Handles& args) {
  if (!at::GradMode::is_enabled() || !unwatched()) return false;
  bool grad = false;
  for (py::handle a : args) {
    PyTypeObject* type = Py_TYPE(a.ptr());
    if (type == plain_types[0] || type == plain_types[1]) {
      const at::Tensor& t = THPVariable_Unpack(a.ptr());
      if (foreign_tensor(t)) return false;
      grad = grad || t.requires_grad();
    } else if (THPVariable_Check(a.ptr())) {
      return false;  // a tensor subclass: its own __torch_function__ / __torch_dispatch__ comes first
    }
  }
  return grad;
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

// Whether a remembered call of op ``call_id`` (direct.cpp) on ``call[0:n]`` goes to the op's node: an eager recorded
// call on plain tensors, ``tensors`` of its arguments, whose metadata the call plan gave the node. The node entries'
// first test (see <op>_planned in the families' files: the recorded call, or None for gradops' Python path).
template <size_t N>
bool node_call(int64_t call_id, const std::array<py::handle, N>& tensors, PyObject* const* call, Py_ssize_t n) {
  return !forked && recordable_handles(tensors) && all_tensors(tensors) && node_known(call_id, call, n);
}

// The <op>_planned entries are CPython METH_FASTCALL functions: they run in front of every recorded module call,
// where pybind11's dispatcher (an argument vector, a conversion flag per argument, overload resolution) cost ~0.3 µs
// of a ~3 µs Hardswish forward at 8 x 8 on 2 cores. arity: whether ``given`` is ``expected``, else a TypeError set.
bool arity(const char* name, Py_ssize_t given, Py_ssize_t expected);

// The public entries run after gradops' call plan validated their tensors, which refuses a hollow one (see hollow);
// checked again because the kernels read them by address: a storage freed in between (by another thread, a hook)
// must not reach them.
void require_whole(const at::Tensor& t, const char* name);

// A family's part of the extension's module (its node entries and constants), added by GRADOPS_MODULE_PART in the
// family's file at static initialisation and run when the module is made, in no particular order.
using ModulePart = void (*)(py::module_& m);
bool register_module_part(ModulePart part);

#define GRADOPS_MODULE_PART(fn) \
  static const bool GRADOPS_CONCAT(gradops_module_part_, __LINE__) = ::gradops::register_module_part(fn)

// A METH_FASTCALL function as PyMethodDef wants it.
template <class F>
PyCFunction fastcall(F* f) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f));
}

}  // namespace gradops
