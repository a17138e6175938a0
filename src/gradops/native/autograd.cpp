// The extension's module and what every family's native autograd node shares (nodes.h): the plain-tensor and
// ownership tests, the Python formulas' slots, the eager-call test, the module parts. The nodes themselves live with
// their kernels in the families' files (GRADOPS_MODULE_PART); nothing here names an op.

#include "nodes.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <cstdlib>
#include <vector>

namespace py = pybind11;
using at::Tensor;

PyTypeObject* gradops::plain_types[2] = {nullptr, nullptr};

bool gradops::plain(const Tensor& t) {
  static const c10::DispatchKeySet foreign({c10::DispatchKey::Batched, c10::DispatchKey::FuncTorchBatched,
                                            c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::Python,
                                            c10::DispatchKey::PythonTLSSnapshot, c10::DispatchKey::Functionalize,
                                            c10::DispatchKey::Conjugate, c10::DispatchKey::Negative});
  return t.layout() == at::kStrided && t.device().is_cpu() && t.has_storage() && !t.key_set().has_any(foreign) &&
         !hollow(t);
}

bool gradops::owned_like(const Tensor& g, const Tensor& x) {
  return g.defined() && g.use_count() == 1 && plain(g) && !g.is_view() && g.has_storage() &&
         g.storage().use_count() == 1 && g.is_contiguous() && g.scalar_type() == x.scalar_type() &&
         g.sizes() == x.sizes() && !g.requires_grad() && !g.is_inference();
}

namespace {

// The formulas' slots. The vector grows only at static initialisation (formula_slot); its objects are leaked on
// purpose: a static py::object would be released after the interpreter is gone.
std::vector<py::object*>& formulas() {
  static auto* slots = new std::vector<py::object*>();  // leaked: used by static initialisers of other files
  return *slots;
}

std::vector<gradops::ModulePart>& module_parts() {
  static auto* parts = new std::vector<gradops::ModulePart>();
  return *parts;
}

}  // namespace

int64_t gradops::formula_slot() {
  formulas().push_back(nullptr);
  return static_cast<int64_t>(formulas().size()) - 1;
}

py::object* gradops::formula(int64_t slot) {
  return slot >= 0 && slot < static_cast<int64_t>(formulas().size()) ? formulas()[slot] : nullptr;
}

bool gradops::register_module_part(ModulePart part) {
  module_parts().push_back(part);
  return true;
}

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

bool gradops::arity(const char* name, Py_ssize_t given, Py_ssize_t expected) {
  if (given == expected) return true;
  PyErr_Format(PyExc_TypeError, "gradops.native.%s takes %zd arguments, got %zd", name, expected, given);
  return false;
}

void gradops::require_whole(const Tensor& t, const char* name) {
  TORCH_CHECK(!hollow(t), "gradops.native: ", name, " has ", t.numel(), " elements but its storage holds ",
              t.has_storage() ? t.storage().nbytes() : 0, " bytes (freed or shrunk: untyped_storage().resize_())");
}

namespace {

using gradops::plain_types;

bool recordable(py::args args) { return gradops::recordable_handles(args); }

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

std::vector<int64_t> int_tuple(PyObject* seq, const char* what) {
  TORCH_CHECK(PyTuple_Check(seq), "gradops.native.from_address: ", what, " must be a tuple of ints");
  std::vector<int64_t> out(PyTuple_GET_SIZE(seq));
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i));
    if (out[i] == -1 && PyErr_Occurred()) throw python_error();
  }
  return out;
}

// A tensor over memory the caller owns (the C surface's aclTensor: gradops/aclnn/capi): address, dtype, sizes,
// strides, offset in elements. The caller (aclnn/capi/bridge.cpp) has checked that the view lies inside the memory it was
// given; nothing is copied or freed here. ~0.4 µs where torch.frombuffer + as_strided cost ~6.
PyObject* from_address(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!gradops::arity("from_address", nargs, 5)) return nullptr;
  auto* data = static_cast<char*>(PyLong_AsVoidPtr(args[0]));
  if (data == nullptr && PyErr_Occurred()) return nullptr;
  TORCH_CHECK(THPDtype_Check(args[1]), "gradops.native.from_address: dtype must be a torch.dtype");
  const at::ScalarType dtype = reinterpret_cast<THPDtype*>(args[1])->scalar_type;
  const std::vector<int64_t> sizes = int_tuple(args[2], "sizes"), strides = int_tuple(args[3], "strides");
  TORCH_CHECK(sizes.size() == strides.size(), "gradops.native.from_address: sizes and strides differ in length");
  const int64_t offset = PyLong_AsLongLong(args[4]);
  if (offset == -1 && PyErr_Occurred()) return nullptr;
  TORCH_CHECK(offset >= 0, "gradops.native.from_address: offset must be >= 0, got ", offset);
  char* first = data == nullptr ? nullptr : data + offset * static_cast<int64_t>(c10::elementSize(dtype));
  return THPVariable_Wrap(at::from_blob(first, sizes, strides, at::TensorOptions().dtype(dtype)));
  END_HANDLE_TH_ERRORS
}

// gradops.aclnn._executor._layout's C form: (data_ptr, shape, strides, storage offset, dtype, device, storage bytes),
// what an aclnn executor compares between its two phases (~0.3 µs where the seven Python reads cost ~0.7).
PyObject* layout_fast(PyObject*, PyObject* arg) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(THPVariable_Check(arg), "gradops.native.layout: expected a tensor");
  const at::Tensor& t = THPVariable_Unpack(arg);
  const auto sizes = t.sizes(), strides = t.strides();
  PyObject* shape = PyTuple_New(static_cast<Py_ssize_t>(sizes.size()));
  PyObject* steps = PyTuple_New(static_cast<Py_ssize_t>(strides.size()));
  if (shape == nullptr || steps == nullptr) throw python_error();
  for (size_t i = 0; i < sizes.size(); ++i) PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(sizes[i]));
  for (size_t i = 0; i < strides.size(); ++i) PyTuple_SET_ITEM(steps, i, PyLong_FromLongLong(strides[i]));
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
  Py_INCREF(dtype);
  const int64_t nbytes = t.has_storage() ? static_cast<int64_t>(t.storage().nbytes()) : 0;
  return PyTuple_Pack(7, py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(t.data_ptr())).ptr(),
                      py::reinterpret_steal<py::object>(shape).ptr(), py::reinterpret_steal<py::object>(steps).ptr(),
                      py::reinterpret_steal<py::object>(PyLong_FromLongLong(t.storage_offset())).ptr(),
                      py::reinterpret_steal<py::object>(dtype).ptr(),
                      py::reinterpret_steal<py::object>(THPDevice_New(t.device())).ptr(),
                      py::reinterpret_steal<py::object>(PyLong_FromLongLong(nbytes)).ptr());
  END_HANDLE_TH_ERRORS
}

PyMethodDef shared_functions[] = {
    {"layout", layout_fast, METH_O, "(data_ptr, shape, strides, storage offset, dtype, device, storage bytes)"},
    {"hollow", hollow_fast, METH_O, "whether a plain tensor's storage does not hold its elements (freed, shrunk)"},
    {"from_address", gradops::fastcall(from_address), METH_FASTCALL,
     "a tensor over memory the caller owns: (address, dtype, sizes, strides, offset)"},
    {nullptr, nullptr, 0, nullptr}};

void set_plain_types(py::handle tensor, py::handle parameter) {
  plain_types[0] = reinterpret_cast<PyTypeObject*>(tensor.ptr());
  plain_types[1] = reinterpret_cast<PyTypeObject*>(parameter.ptr());
}

// Called with the GIL held (from Python), which also guards the slots: the one writer, and the readers
// (python_backward) take the GIL first. A second registration (after gradops.native.reset) replaces the object in
// place, releasing the old function.
void set_differentiable(int64_t slot, py::object fn) {
  auto& slots = formulas();
  TORCH_CHECK(slot >= 0 && slot < static_cast<int64_t>(slots.size()), "gradops.native: unknown op ", slot);
  if (slots[slot] == nullptr) {
    slots[slot] = new py::object(std::move(fn));
  } else {
    *slots[slot] = std::move(fn);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gradops' CPU kernels, native autograd nodes and direct calls (see gradops/native)";
  m.def("set_differentiable", &set_differentiable, "the Python backward of op for create_graph=True");
  m.def("recordable", &recordable, "whether a call on these arguments is eager, recorded, on plain tensors");
  m.def("set_plain_types", &set_plain_types, "torch.Tensor and torch.nn.Parameter (kept alive by torch)");
  m.def("forget", &gradops::forget_calls, "drop every remembered call");
  if (PyModule_AddFunctions(m.ptr(), shared_functions) != 0) throw py::error_already_set();
  gradops::register_pool(m);
  gradops::register_direct(m);
  gradops::register_kernels(m);
  for (gradops::ModulePart part : module_parts()) part(m);
}
