// What libnnopbase's two parts share: the aclnn objects (objects.cpp makes, checks and destroys them) and what the
// bridge into gradops.aclnn (bridge.cpp) reads of them. Not installed: host programs see the opaque types of
// aclnn/acl_meta.h only.
#ifndef GRADOPS_CAPI_OBJECTS_H_
#define GRADOPS_CAPI_OBJECTS_H_

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gradops_capi.h"

struct aclTensor {
  std::vector<int64_t> view, strides, storage;
  int64_t offset;
  aclDataType dtype;
  aclFormat format;
  void* data;
  int64_t storage_elements;  // the product of storage (checked to fit in int64 when the tensor was made)
  // The torch tensor over the same memory, made at the first operator call that reads it and kept (under the GIL)
  // until aclDestroyTensor: an aclTensor never changes, and making one costs ~1 µs of a call's budget.
  PyObject* python = nullptr;
};
struct aclIntArray {
  std::vector<int64_t> values;
};
struct aclBoolArray {
  std::vector<uint8_t> values;
};
struct aclFloatArray {
  std::vector<float> values;
};
struct aclScalar {
  aclDataType dtype;
  unsigned char bytes[16];
};
struct aclTensorList {
  std::vector<const aclTensor*> items;
};

namespace gradops_capi {

enum class Object { Tensor, IntArray, BoolArray, FloatArray, Scalar, TensorList };

// Whether p is a live object of this kind that this library made (a registry lookup, never a dereference).
bool live(const void* p, Object kind);

// Set this thread's aclGetRecentErrMsg to message and the status' name; returns status.
aclnnStatus refuse(aclnnStatus status, const std::string& message);

const char* dtype_name(aclDataType t);

// Drop an aclTensor's cached torch tensor (bridge.cpp: takes the GIL).
void release_python(PyObject* tensor);

}  // namespace gradops_capi

#endif  // GRADOPS_CAPI_OBJECTS_H_
