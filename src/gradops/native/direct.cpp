// gradops' direct calls: an eager call of a public function that nothing records, replayed in one C++ call.
//
// Why: after the call plans (gradops.ops._plan) the Python path of a call at 8 x 8 fp32 still cost 8-15 µs on
// 2 cores (layer_norm_backward 15.4: the eager-path test 2.5, the plan lookup 2.5, three pooled
// outputs 3.8, the kernel call with its tensors by address 1.8, the layers between them the rest), against 2-11 µs
// for ATen's own kernels. Every part of that is a function of the arguments' metadata alone, so it is decided once.
//
// What Python hands over (gradops.cpu.programs), once gradops' call plan validated a call and chose the CPU kernels:
// the op's program for these argument metadata - the outputs to allocate (sizes, dtype) and the registered kernel
// (kernels.h) that fills them, with its inputs and outputs as slots and its ints and floats. The kernel is the one
// the Python path runs, so the results are the Python path's bits. A later call with the same metadata is this
// file: the eager test, the key, the allocations, the kernel.
//
// The same table says, for the ops with a native autograd node (nodes.h; each family's .cpp holds its own),
// whether the node takes recorded calls of these metadata: one remembered entry per (op, argument metadata), the
// extension's copy of gradops' call plan for them (gradops.ops._plan.CallPlan), dropped with it.
//
// A kernel that returns >= 0 found a value the op refuses (an index outside a table, a negative variance): the call
// returns None and the Python path runs, which raises the op's OpError. So does every call this file cannot take
// as it is: something watches calls (a mode, a transform, the profiler, a tracer), autograd would record it, an
// argument is not a plain contiguous CPU tensor or a simple scalar, a child of fork().

#include "common.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <array>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

namespace py = pybind11;
using at::Tensor;

// What a kernel argument is: the call's input i, output i, or an absent optional tensor (an undefined one).
enum Slot : int64_t { kInput = 0, kOutput = 1, kAbsent = 4 };
constexpr size_t kMaxArgs = 32;

struct Buffer {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
};

// One registered kernel (kernels.h) run on the call: it splits its own work over torch's threads.
struct Step {
  gradops::Kernel kernel = nullptr;
  std::vector<std::pair<int64_t, int64_t>> in, out;  // (Slot, index)
  std::vector<int64_t> ints;
  std::vector<double> floats;
};

struct Program {
  std::vector<int64_t> key;
  std::string backend, interpret;  // GRADOPS_BACKEND, TRITON_INTERPRET as read when remembered
  bool python = true;              // no program: the call takes gradops' Python path (another backend, empty tensors)
  bool node = false;               // the op's native autograd node takes recorded calls of these metadata
  std::vector<Buffer> outputs;
  std::vector<Step> steps;
  std::vector<int64_t> results;  // the outputs returned, in order
  bool tuple = false;            // returned as a tuple (else the one tensor)
};

// Thread rules: ``programs`` and ``op_ids`` are read and written with the GIL held, and only so. Every entry point
// here is called from Python (direct, direct_into, remember, forget_calls, direct_op), which holds the GIL; none
// releases it. A replayed program's kernels run with the GIL held too (unlike kernels.cpp's binding, which releases
// it): the Program they read lives in ``programs[op]``, which another thread's ``remember`` may grow and so move.
// The kernels split their own work over torch's intra-op threads, so holding the GIL serialises only the Python
// threads that call gradops, not the work.
std::vector<std::vector<Program>> programs;  // by op id (direct_op)
std::unordered_map<std::string, int64_t> op_ids;
constexpr size_t kProgramLimit = 64;  // a model has a handful of shapes per op; a shape sweep starts over

// Key tags of the scalar arguments; a tensor's entry starts with its dtype (>= 0), then its dim and sizes.
enum Tag : int64_t { kNone = -1, kBool = -2, kInt = -3, kFloat = -4, kInts = -5 };

// Appends the metadata of the call arguments args[0:n] to key and their tensors to tensors; false when a direct
// call cannot take them: a tensor that is not a plain contiguous CPU tensor (a subclass, meta, lazily negated or
// conjugated, legacy-vmap batched), one autograd would record (``record``: grad mode is on), a hollow one (its
// storage freed or shrunk: gradops::hollow, checked on every call since a program is remembered by metadata only),
// or an argument other than a tensor, None, bool, int, float or a list or tuple of ints (a shape). What
// gradops.contract._memo.key_of reads, and contiguity.
bool key_of(PyObject* const* args, Py_ssize_t n, bool record, std::vector<int64_t>& key,
            std::vector<const Tensor*>& tensors) {
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = args[i];
    PyTypeObject* type = Py_TYPE(a);
    if (type == gradops::plain_types[0] || type == gradops::plain_types[1]) {
      const Tensor& t = THPVariable_Unpack(a);
      if (gradops::foreign_tensor(t) || (record && t.requires_grad()) || t.layout() != at::kStrided ||
          !t.device().is_cpu() || !t.is_contiguous() || gradops::hollow(t)) {
        return false;
      }
      key.push_back(static_cast<int64_t>(t.scalar_type()));
      key.push_back(t.dim());
      for (int64_t size : t.sizes()) key.push_back(size);
      tensors.push_back(&t);
    } else if (a == Py_None) {
      key.push_back(kNone);
    } else if (type == &PyBool_Type) {
      key.push_back(kBool);
      key.push_back(a == Py_True);
    } else if (type == &PyLong_Type) {
      int overflow = 0;
      const long long value = PyLong_AsLongLongAndOverflow(a, &overflow);
      if (overflow != 0) return false;
      key.push_back(kInt);
      key.push_back(value);
    } else if (type == &PyFloat_Type) {
      key.push_back(kFloat);
      key.push_back(gradops::float_bits(PyFloat_AS_DOUBLE(a)));
    } else if (PyList_Check(a) || PyTuple_Check(a)) {  // a shape (restore_shape): ints only
      const Py_ssize_t len = PySequence_Fast_GET_SIZE(a);
      key.push_back(kInts);
      key.push_back(len);
      PyObject* const* values = PySequence_Fast_ITEMS(a);
      for (Py_ssize_t j = 0; j < len; ++j) {
        int overflow = 0;
        if (!PyLong_CheckExact(values[j])) return false;
        key.push_back(PyLong_AsLongLongAndOverflow(values[j], &overflow));
        if (overflow != 0) return false;
      }
    } else {
      return false;
    }
  }
  return true;
}

// A tuple's items, in place.
PyObject* const* items(PyObject* tuple) { return PySequence_Fast_ITEMS(tuple); }

const Program* find_program(int64_t op, const std::vector<int64_t>& key) {
  const char* backend = gradops::env_or_unset("GRADOPS_BACKEND");
  const char* interpret = gradops::env_or_unset("TRITON_INTERPRET");
  for (const Program& p : programs[op]) {
    if (p.key == key && p.backend == backend && p.interpret == interpret) return &p;
  }
  return nullptr;
}

// The program's outputs on the call's inputs, or None when a kernel refused a value. ``given``: the caller's
// tensors for the program's results (an ``out=`` call, see direct_into), written in place; then True, not the
// outputs. A kernel that refuses a value does so before it writes anything (kernels.h), so a refused call leaves
// the caller's tensors as they were.
py::object run(const Program& p, const std::vector<const Tensor*>& inputs,
               const std::vector<Tensor>* given = nullptr) {
  std::vector<Tensor> outs(p.outputs.size());
  if (given != nullptr) {
    for (size_t i = 0; i < p.results.size(); ++i) outs[p.results[i]] = (*given)[i];
  }
  // A buffer memory cannot hold (embedding_dense_backward's num_weights alone sizes its table: 2**40 rows of 4
  // floats are 16 TiB) takes the Python path, whose op raises its OpError naming the argument that sized it.
  try {
    for (size_t k = 0; k < outs.size(); ++k) {
      if (!outs[k].defined()) outs[k] = gradops::output(p.outputs[k].sizes, at::TensorOptions().dtype(p.outputs[k].dtype));
    }
  } catch (const c10::Error&) {
    return py::none();
  }
  auto tensor_at = [&](const std::pair<int64_t, int64_t>& slot) -> Tensor {
    return slot.first == kInput ? *inputs[slot.second] : slot.first == kOutput ? outs[slot.second] : Tensor();
  };
  for (const Step& s : p.steps) {
    std::array<Tensor, kMaxArgs> in, out;
    for (size_t i = 0; i < s.in.size(); ++i) in[i] = tensor_at(s.in[i]);
    for (size_t i = 0; i < s.out.size(); ++i) out[i] = tensor_at(s.out[i]);
    const gradops::KernelArgs a{c10::ArrayRef<Tensor>(in.data(), s.in.size()),
                                c10::ArrayRef<Tensor>(out.data(), s.out.size()), s.ints, s.floats};
    if (s.kernel(a) >= 0) return py::none();
  }
  if (given != nullptr) {
    for (const Tensor& t : *given) t.unsafeGetTensorImpl()->bump_version();  // written in place, as out= ops do
    return py::bool_(true);
  }
  // Wrapping the outputs allocates Python objects, which can run a garbage collection whose finalizers call
  // gradops again and remember a program, moving this one: nothing of it is read from here on.
  const std::vector<int64_t> results = p.results;
  if (!p.tuple) return py::cast(outs[results[0]]);
  py::tuple result(results.size());
  for (size_t i = 0; i < results.size(); ++i) result[i] = py::cast(outs[results[i]]);
  return result;
}

// The remembered program of op (the call's first argument) for the call arguments from ``first`` on, their tensors in
// ``tensors``; nullptr with ``answer`` set to what the entry returns instead: None where the call must take
// gradops' Python path (see the top of this file), MISS (Ellipsis) where it could run here but no program is
// remembered for these argument metadata (the caller plans it and calls remember).
const Program* program_for(PyObject* call, Py_ssize_t first, std::vector<const Tensor*>& tensors, py::object& answer) {
  answer = py::none();
  if (gradops::forked || !gradops::unwatched()) return nullptr;
  TORCH_CHECK(PyTuple_GET_SIZE(call) >= first, "gradops.native: a direct call without its op id or outs");
  const int64_t op = PyLong_AsLongLong(PyTuple_GET_ITEM(call, 0));
  TORCH_CHECK(op >= 0 && op < static_cast<int64_t>(programs.size()), "gradops.native: unknown direct op ", op);
  thread_local std::vector<int64_t> key;
  key.clear();
  tensors.clear();
  if (!key_of(items(call) + first, PyTuple_GET_SIZE(call) - first, at::GradMode::is_enabled(), key, tensors)) {
    return nullptr;
  }
  const Program* p = find_program(op, key);
  if (p == nullptr) {
    answer = py::ellipsis();
    return nullptr;
  }
  return p->python ? nullptr : p;
}

// direct(op, *args): op's result on args from a remembered program, or None / MISS (see program_for).
py::object direct(py::args args) {
  thread_local std::vector<const Tensor*> tensors;
  py::object answer;
  const Program* p = program_for(args.ptr(), 1, tensors, answer);
  return p == nullptr ? answer : run(*p, tensors);
}

// Whether the byte ranges of two contiguous tensors meet (an empty tensor meets nothing). By address, not by
// storage: two storages over the same memory (numpy arrays, from_blob) count as overlapping here, where
// gradops.ops._out.check_out compares storages; such a call takes the Python path, which decides.
bool meet(const Tensor& a, const Tensor& b) {
  const int64_t na = a.numel() * a.element_size(), nb = b.numel() * b.element_size();
  if (na == 0 || nb == 0) return false;
  const int64_t pa = gradops::addr(a), pb = gradops::addr(b);
  return pa < pb + nb && pb < pa + na;
}

// direct_into(op, out, *args): the op's out= call on its own arguments - direct() writing the results into
// ``out``, the one tensor of a one-result op or a tuple or list of one tensor per result. True when done; None
// wherever gradops.ops._out.check_out would refuse out or could accept it only on the Python path: out of another
// form or length, an out that is not a plain contiguous CPU tensor of exactly the result's sizes and dtype (a lazily
// negated one included: its memory holds the negated values), a hollow one (gradops::hollow), one that requires grad
// while grad mode is on, an inference tensor outside inference mode, or one whose bytes meet an input's or another
// out's. Python then runs
// check_out, which raises the op's OpError (or torch's RuntimeError) naming the out, or copies into an out of other
// strides. MISS as direct(). Every out check here is one check_out makes, so a call taken here is one check_out
// accepts: this is the common out= call without the Python checks (23.5 µs of layer_norm_backward at 8 x 8 fp32
// that way).
py::object direct_into(py::args args) {
  thread_local std::vector<const Tensor*> tensors;
  py::object answer;
  const Program* p = program_for(args.ptr(), 2, tensors, answer);
  if (p == nullptr) return answer;
  PyObject* given = PyTuple_GET_ITEM(args.ptr(), 1);
  const size_t n = p->results.size();
  const bool sequence = PyTuple_Check(given) || PyList_Check(given);
  if (sequence != p->tuple || (sequence && static_cast<size_t>(PySequence_Fast_GET_SIZE(given)) != n)) {
    return py::none();
  }
  const bool inference = c10::InferenceMode::is_enabled();
  const bool grad_mode = at::GradMode::is_enabled();
  std::vector<Tensor> outs;
  outs.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    PyObject* o = sequence ? PySequence_Fast_GET_ITEM(given, static_cast<Py_ssize_t>(i)) : given;
    PyTypeObject* type = Py_TYPE(o);
    if (type != gradops::plain_types[0] && type != gradops::plain_types[1]) return py::none();
    const Tensor& t = THPVariable_Unpack(o);
    const Buffer& b = p->outputs[p->results[i]];
    if (gradops::foreign_tensor(t) || t.layout() != at::kStrided || !t.device().is_cpu() || !t.is_contiguous() ||
        t.scalar_type() != b.dtype || t.sizes() != at::IntArrayRef(b.sizes) || (t.is_inference() && !inference) ||
        (grad_mode && t.requires_grad()) || gradops::hollow(t)) {
      return py::none();
    }
    for (const Tensor* input : tensors) {
      if (meet(t, *input)) return py::none();
    }
    for (const Tensor& other : outs) {
      if (meet(t, other)) return py::none();
    }
    outs.push_back(t);
  }
  return run(*p, tensors, &outs);
}

at::ScalarType dtype_of(py::handle dtype) {
  TORCH_CHECK(THPDtype_Check(dtype.ptr()), "gradops.native: expected a torch.dtype");
  return reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
}

std::vector<Buffer> buffers(const py::list& specs) {
  std::vector<Buffer> out;
  for (py::handle spec : specs) {
    auto item = spec.cast<py::tuple>();
    TORCH_CHECK(item.size() == 2, "gradops.native: an output is (sizes, dtype)");
    out.push_back({item[0].cast<std::vector<int64_t>>(), dtype_of(item[1])});
  }
  return out;
}

// Remembers gradops' call plan of op for calls with the metadata of ``call`` (the arguments as the op takes them).
// ``node``: the op's native autograd node takes recorded calls of these metadata. ``python``: no program, calls
// that nothing records take gradops' Python path. ``outputs``: (sizes, dtype) each; ``steps``: (kernel name,
// input slots, output slots, ints, floats) each, a slot (Slot, index); ``results``: output indexes.
void remember(int64_t op, py::tuple call, bool node, bool python, py::list outputs, py::list steps,
              std::vector<int64_t> results, bool tuple) {
  TORCH_CHECK(op >= 0 && op < static_cast<int64_t>(programs.size()), "gradops.native: unknown op ", op);
  Program p;
  std::vector<const Tensor*> tensors;
  if (!key_of(items(call.ptr()), PyTuple_GET_SIZE(call.ptr()), false, p.key, tensors)) return;  // not one we take
  p.backend = gradops::env_or_unset("GRADOPS_BACKEND");
  p.interpret = gradops::env_or_unset("TRITON_INTERPRET");
  p.node = node;
  p.python = python;
  if (!python) {
    p.outputs = buffers(outputs);
    auto slot_of = [&](py::handle arg) {
      auto [slot, v] = arg.cast<std::pair<int64_t, int64_t>>();
      const size_t limit = slot == kInput ? tensors.size() : slot == kOutput ? p.outputs.size() : 0;
      TORCH_CHECK(slot == kAbsent || ((slot == kInput || slot == kOutput) && v >= 0 && static_cast<size_t>(v) < limit),
                  "gradops.native: kernel argument (", slot, ", ", v, ") names no tensor");
      return std::make_pair(slot, v);
    };
    for (py::handle spec : steps) {
      auto item = spec.cast<py::tuple>();
      TORCH_CHECK(item.size() == 5, "gradops.native: a step is (kernel name, inputs, outputs, ints, floats)");
      Step s;
      const auto kernel_name = item[0].cast<std::string>();
      s.kernel = gradops::find_kernel(kernel_name);
      TORCH_CHECK(s.kernel != nullptr, "gradops.native: no kernel named ", kernel_name);
      for (py::handle arg : item[1]) s.in.push_back(slot_of(arg));
      for (py::handle arg : item[2]) s.out.push_back(slot_of(arg));
      TORCH_CHECK(s.in.size() <= kMaxArgs && s.out.size() <= kMaxArgs, "gradops.native: a kernel takes at most ",
                  kMaxArgs, " inputs and outputs");
      s.ints = item[3].cast<std::vector<int64_t>>();
      s.floats = item[4].cast<std::vector<double>>();
      p.steps.push_back(std::move(s));
    }
    for (int64_t r : results) {
      TORCH_CHECK(r >= 0 && static_cast<size_t>(r) < p.outputs.size(), "gradops.native: result ", r, " names no output");
    }
    TORCH_CHECK(!results.empty() && (tuple || results.size() == 1), "gradops.native: bad results");
    p.results = std::move(results);
    p.tuple = tuple;
  }
  std::vector<Program>& list = programs[op];
  for (Program& old : list) {
    if (old.key == p.key && old.backend == p.backend && old.interpret == p.interpret) {
      old = std::move(p);
      return;
    }
  }
  if (list.size() >= kProgramLimit) list.clear();
  list.push_back(std::move(p));
}

}  // namespace

// The id direct() and remember() take for the op called ``name`` (the same id for the same name).
int64_t gradops::direct_op(const std::string& name) {
  auto [it, fresh] = op_ids.emplace(name, static_cast<int64_t>(programs.size()));
  if (fresh) programs.emplace_back();
  return it->second;
}

bool gradops::node_known(int64_t op, PyObject* const* args, Py_ssize_t n) {
  thread_local std::vector<int64_t> key;
  thread_local std::vector<const Tensor*> tensors;
  key.clear();
  tensors.clear();
  if (!key_of(args, n, false, key, tensors)) return false;
  const Program* p = find_program(op, key);
  return p != nullptr && p->node;
}

void gradops::forget_calls() {
  for (auto& list : programs) list.clear();
}

void gradops::register_direct(py::module_& m) {
  m.attr("MISS") = py::ellipsis();
  m.attr("INPUT") = static_cast<int64_t>(kInput);
  m.attr("OUTPUT") = static_cast<int64_t>(kOutput);
  m.attr("ABSENT") = static_cast<int64_t>(kAbsent);
  m.attr("MAX_ARGS") = static_cast<int64_t>(kMaxArgs);
  m.def("direct", &direct, "direct(op, *args): the public function's eager call from a remembered program, None "
        "(take the Python path) or MISS (no program for these argument metadata)");
  m.def("direct_into", &direct_into, "direct_into(op, out, *args): direct() writing the results into out (a tensor, "
        "or a tuple or list of them) when it passes the out= checks; True, None (take the Python path) or MISS");
  m.def("remember", &remember, "the call plan of op for calls with these arguments' metadata: whether its native "
        "node takes recorded calls, its program for the others");
  m.def("direct_op", &gradops::direct_op, "the id of the op called name in direct(), remember()");
}
