// What gradops' native parts share: the autograd nodes (nodes.h; the families' files), the direct calls of the
// public functions (direct.cpp) and the output pool (pool.cpp). One extension, one module, made by autograd.cpp.
#pragma once

#include "kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <string>

namespace gradops {

namespace py = pybind11;

inline int64_t addr(const at::Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr()); }

// Whether t has elements its storage does not hold: the storage was freed (``untyped_storage().resize_(0)``, as FSDP
// does to parameters between uses and any code may do to a saved tensor: data_ptr() is then 0) or shrunk below what
// the view addresses. A kernel handed such a tensor by address reads or writes memory that is not there, so every
// entry of the extension declines it (the Python path then raises the op's OpError naming it, see
// gradops.contract._common.hollow, whose rule this is). A tensor without storage of its own (a functorch wrapper)
// or on the meta device holds no data to check. Cost: a few loads per tensor.
inline bool hollow(const at::Tensor& t) {
  if (!t.has_storage() || t.is_meta()) return false;
  const int64_t n = t.numel();
  if (n == 0) return false;
  int64_t reach = t.storage_offset() + 1;  // one past the last element addressed, in elements (strides are >= 0)
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] > 1) reach += (sizes[d] - 1) * strides[d];
  }
  const c10::Storage& storage = t.storage();
  return storage.data() == nullptr || storage.nbytes() < static_cast<size_t>(reach) * t.element_size();
}

// A float64 as int64 bits (a float argument's entry in a direct call's key).
inline int64_t float_bits(double value) {
  int64_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

// A contiguous CPU tensor from the output pool (see pool.cpp): recycled blocks from 1 MiB on.
at::Tensor output(at::IntArrayRef sizes, const at::TensorOptions& options);

// torch.Tensor and torch.nn.Parameter, set once by gradops.native: the exact types the eager paths take.
extern PyTypeObject* plain_types[2];

// Whether nothing watches or transforms calls on this thread: no dispatch or torch-function mode, no torch.func
// transform, no profiler, no tracer (the thread-wide half of gradops.ops._direct.eager_path; the per-tensor half is
// the caller's).
bool unwatched();

// Whether a tensor carries a key that makes its data mean something other than its memory, or has none (meta, lazy
// negation / conjugation, legacy vmap batching): such a tensor takes the op's dispatch.
bool foreign_tensor(const at::Tensor& t);

// std::getenv(name), or "\x01" when unset (a plan remembers both variables the backend decision reads).
const char* env_or_unset(const char* name);

// direct.cpp's, kernels.cpp's and pool.cpp's parts of the module.
void register_direct(py::module_& m);
void register_kernels(py::module_& m);
void register_pool(py::module_& m);

// The remembered calls (direct.cpp): one entry per (op, argument metadata), gradops' call plan as the extension
// replays it. direct_op: the op's id by its name (the same id for the same name). node_known: whether the op's
// native node takes a recorded call on args[0:n], the op's positional arguments (their tensors may require grad).
// forget_calls: drop every entry (gradops._runtime.invalidate).
int64_t direct_op(const std::string& name);
bool node_known(int64_t op, PyObject* const* args, Py_ssize_t n);
void forget_calls();

}  // namespace gradops
