// libnnopbase's objects: aclTensor over the caller's memory, the int / bool / float arrays, scalars and tensor lists
// of aclnn/acl_meta.h, made, queried and destroyed here. Every object is registered when made, so that a pointer this
// library did not make (or already destroyed) is refused by a lookup instead of being dereferenced. Made and
// destroyed without the GIL: the registry has its own mutex.

#include "objects.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <unordered_map>

using gradops_capi::dtype_name;
using gradops_capi::live;
using gradops_capi::Object;
using gradops_capi::refuse;
using gradops_capi::release_python;

namespace {

bool mul_ok(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

std::mutex objects_mutex;
std::unordered_map<const void*, Object>& objects() {
  static auto* o = new std::unordered_map<const void*, Object>();
  return *o;
}

template <class T>
T* adopt(T* made, Object kind) {
  std::lock_guard<std::mutex> lock(objects_mutex);
  objects()[made] = kind;
  return made;
}

}  // namespace

bool gradops_capi::live(const void* p, Object kind) {
  std::lock_guard<std::mutex> lock(objects_mutex);
  auto it = objects().find(p);
  return it != objects().end() && it->second == kind;
}

namespace {

template <class T>
aclnnStatus destroy(const T* p, Object kind, const char* api) {
  if (p == nullptr) return ACLNN_SUCCESS;  // CANN's destroy functions accept nullptr
  {
    std::lock_guard<std::mutex> lock(objects_mutex);
    auto it = objects().find(p);
    if (it == objects().end() || it->second != kind) {
      return refuse(ACLNN_ERR_PARAM_INVALID, std::string(api) + ": the pointer is not one this library made, or "
                    "it was destroyed");
    }
    objects().erase(it);
  }
  delete p;
  return ACLNN_SUCCESS;
}

}  // namespace

aclnnStatus gradops_capi::refuse(aclnnStatus status, const std::string& message) {
  static const std::unordered_map<int, const char*> names = {
      {ACLNN_ERR_PARAM_NULLPTR, "ACLNN_ERR_PARAM_NULLPTR"}, {ACLNN_ERR_PARAM_INVALID, "ACLNN_ERR_PARAM_INVALID"},
      {ACLNN_ERR_INNER, "ACLNN_ERR_INNER"}, {ACLNN_ERR_INNER_OP_NOT_REGISTERED, "ACLNN_ERR_INNER_OP_NOT_REGISTERED"}};
  auto it = names.find(status);
  gradops_set_error((message + " [" + (it != names.end() ? it->second : "ACLNN") + " " + std::to_string(status) +
                     "]").c_str());
  return status;
}

const char* gradops_capi::dtype_name(aclDataType t) {
  switch (t) {
    case ACL_FLOAT: return "ACL_FLOAT";
    case ACL_FLOAT16: return "ACL_FLOAT16";
    case ACL_INT8: return "ACL_INT8";
    case ACL_INT32: return "ACL_INT32";
    case ACL_UINT8: return "ACL_UINT8";
    case ACL_INT16: return "ACL_INT16";
    case ACL_UINT16: return "ACL_UINT16";
    case ACL_UINT32: return "ACL_UINT32";
    case ACL_INT64: return "ACL_INT64";
    case ACL_UINT64: return "ACL_UINT64";
    case ACL_DOUBLE: return "ACL_DOUBLE";
    case ACL_BOOL: return "ACL_BOOL";
    case ACL_STRING: return "ACL_STRING";
    case ACL_COMPLEX64: return "ACL_COMPLEX64";
    case ACL_COMPLEX128: return "ACL_COMPLEX128";
    case ACL_BF16: return "ACL_BF16";
    case ACL_INT4: return "ACL_INT4";
    case ACL_UINT1: return "ACL_UINT1";
    case ACL_COMPLEX32: return "ACL_COMPLEX32";
    default: return "an unknown aclDataType";
  }
}

// The ND family: formats that name the dims of a plain strided layout. The others (NC1HWC0, FRACTAL_Z / NZ, ...)

extern "C" {

aclTensor* aclCreateTensor(const int64_t* viewDims, uint64_t viewDimsNum, aclDataType dataType, const int64_t* stride,
                           int64_t offset, aclFormat format, const int64_t* storageDims, uint64_t storageDimsNum,
                           void* tensorData) {
  auto no = [](const std::string& why) -> aclTensor* {
    refuse(ACLNN_ERR_PARAM_INVALID, "aclCreateTensor: " + why);
    return nullptr;
  };
  if (viewDimsNum > 64 || storageDimsNum > 64) return no("at most 64 dims");
  if ((viewDims == nullptr && viewDimsNum > 0) || (storageDims == nullptr && storageDimsNum > 0)) {
    return no("viewDims / storageDims is nullptr with a nonzero count");
  }
  if (aclDataTypeSize(dataType) == 0) return no(std::string("dataType ") + dtype_name(dataType) + " has no size");
  if (offset < 0) return no("offset must be >= 0, got " + std::to_string(offset));
  auto* t = new aclTensor{std::vector<int64_t>(viewDims, viewDims + viewDimsNum), {}, {}, offset, dataType, format,
                          tensorData, 0};
  if (stride != nullptr) {
    t->strides.assign(stride, stride + viewDimsNum);
  } else {  // contiguous
    t->strides.assign(viewDimsNum, 1);
    for (int64_t i = static_cast<int64_t>(viewDimsNum) - 2; i >= 0; --i) {
      t->strides[i] = t->strides[i + 1] * t->view[i + 1];
    }
  }
  // The view's last element, offset + sum((size - 1) * stride), must lie inside the storage.
  int64_t last = offset, elements = 1;
  bool empty = false, ok = true;
  for (uint64_t i = 0; i < viewDimsNum; ++i) {
    if (t->view[i] < 0 || t->strides[i] < 0) ok = false;
    if (t->view[i] == 0) empty = true;
    int64_t step = 0;
    if (t->view[i] > 0 &&
        (!mul_ok(t->view[i] - 1, t->strides[i], &step) || __builtin_add_overflow(last, step, &last))) {
      ok = false;
    }
  }
  if (!ok) {
    delete t;
    return no("view dims and strides must be >= 0 (and their extent must fit in int64)");
  }
  if (storageDims != nullptr) {
    t->storage.assign(storageDims, storageDims + storageDimsNum);
  } else {
    t->storage = {empty ? 0 : last + 1};
  }
  for (int64_t d : t->storage) {
    if (d < 0 || !mul_ok(elements, d, &elements)) {
      delete t;
      return no("storage dims must be >= 0 (and their product must fit in int64)");
    }
  }
  t->storage_elements = elements;
  if (!empty && last >= elements) {
    delete t;
    return no("the view (offset " + std::to_string(offset) + ", last element at " + std::to_string(last) +
              ") runs past its storage of " + std::to_string(elements) + " elements");
  }
  return adopt(t, Object::Tensor);
}

aclScalar* aclCreateScalar(void* value, aclDataType dataType) {
  const size_t size = aclDataTypeSize(dataType);
  if (value == nullptr || size == 0 || size > 16) {
    refuse(ACLNN_ERR_PARAM_INVALID, "aclCreateScalar: value is nullptr or dataType has no size");
    return nullptr;
  }
  auto* s = new aclScalar{dataType, {}};
  std::memcpy(s->bytes, value, size);
  return adopt(s, Object::Scalar);
}

aclIntArray* aclCreateIntArray(const int64_t* value, uint64_t size) {
  if (value == nullptr && size > 0) return nullptr;
  return adopt(new aclIntArray{std::vector<int64_t>(value, value + size)}, Object::IntArray);
}

aclFloatArray* aclCreateFloatArray(const float* value, uint64_t size) {
  if (value == nullptr && size > 0) return nullptr;
  return adopt(new aclFloatArray{std::vector<float>(value, value + size)}, Object::FloatArray);
}

aclBoolArray* aclCreateBoolArray(const bool* value, uint64_t size) {
  if (value == nullptr && size > 0) return nullptr;
  auto* a = new aclBoolArray{};
  for (uint64_t i = 0; i < size; ++i) a->values.push_back(value[i] ? 1 : 0);
  return adopt(a, Object::BoolArray);
}

aclTensorList* aclCreateTensorList(const aclTensor* const* value, uint64_t size) {
  if (value == nullptr && size > 0) return nullptr;
  return adopt(new aclTensorList{std::vector<const aclTensor*>(value, value + size)}, Object::TensorList);
}

aclnnStatus aclDestroyTensor(const aclTensor* tensor) {
  PyObject* python = tensor != nullptr && live(tensor, Object::Tensor) ? tensor->python : nullptr;
  const aclnnStatus status = destroy(tensor, Object::Tensor, "aclDestroyTensor");
  if (status == ACLNN_SUCCESS && python != nullptr) release_python(python);  // an executor may still hold it
  return status;
}
aclnnStatus aclDestroyScalar(const aclScalar* scalar) { return destroy(scalar, Object::Scalar, "aclDestroyScalar"); }
aclnnStatus aclDestroyIntArray(const aclIntArray* array) {
  return destroy(array, Object::IntArray, "aclDestroyIntArray");
}
aclnnStatus aclDestroyFloatArray(const aclFloatArray* array) {
  return destroy(array, Object::FloatArray, "aclDestroyFloatArray");
}
aclnnStatus aclDestroyBoolArray(const aclBoolArray* array) {
  return destroy(array, Object::BoolArray, "aclDestroyBoolArray");
}
aclnnStatus aclDestroyTensorList(const aclTensorList* array) {
  return destroy(array, Object::TensorList, "aclDestroyTensorList");
}

}  // extern "C"

namespace {
aclnnStatus give_dims(const aclTensor* tensor, const std::vector<int64_t> aclTensor::*field, int64_t** out,
                      uint64_t* count, const char* api) {
  if (out == nullptr || count == nullptr) return refuse(ACLNN_ERR_PARAM_NULLPTR, std::string(api) + ": nullptr out");
  if (!live(tensor, Object::Tensor)) return refuse(ACLNN_ERR_PARAM_INVALID, std::string(api) + ": unknown tensor");
  const auto& v = tensor->*field;
  *out = new int64_t[v.empty() ? 1 : v.size()];
  std::copy(v.begin(), v.end(), *out);
  *count = v.size();
  return ACLNN_SUCCESS;
}

template <class A>
aclnnStatus give_size(const A* array, Object kind, uint64_t* size, const char* api) {
  if (size == nullptr) return refuse(ACLNN_ERR_PARAM_NULLPTR, std::string(api) + ": size is nullptr");
  if (!live(array, kind)) return refuse(ACLNN_ERR_PARAM_INVALID, std::string(api) + ": unknown array");
  if constexpr (std::is_same_v<A, aclTensorList>) {
    *size = array->items.size();
  } else {
    *size = array->values.size();
  }
  return ACLNN_SUCCESS;
}
}  // namespace

extern "C" {

aclnnStatus aclGetViewShape(const aclTensor* tensor, int64_t** viewDims, uint64_t* viewDimsNum) {
  return give_dims(tensor, &aclTensor::view, viewDims, viewDimsNum, "aclGetViewShape");
}
aclnnStatus aclGetStorageShape(const aclTensor* tensor, int64_t** storageDims, uint64_t* storageDimsNum) {
  return give_dims(tensor, &aclTensor::storage, storageDims, storageDimsNum, "aclGetStorageShape");
}
aclnnStatus aclGetViewStrides(const aclTensor* tensor, int64_t** stridesValue, uint64_t* stridesNum) {
  return give_dims(tensor, &aclTensor::strides, stridesValue, stridesNum, "aclGetViewStrides");
}
aclnnStatus aclGetViewOffset(const aclTensor* tensor, int64_t* offset) {
  if (offset == nullptr) return refuse(ACLNN_ERR_PARAM_NULLPTR, "aclGetViewOffset: offset is nullptr");
  if (!live(tensor, Object::Tensor)) return refuse(ACLNN_ERR_PARAM_INVALID, "aclGetViewOffset: unknown tensor");
  *offset = tensor->offset;
  return ACLNN_SUCCESS;
}
aclnnStatus aclGetFormat(const aclTensor* tensor, aclFormat* format) {
  if (format == nullptr) return refuse(ACLNN_ERR_PARAM_NULLPTR, "aclGetFormat: format is nullptr");
  if (!live(tensor, Object::Tensor)) return refuse(ACLNN_ERR_PARAM_INVALID, "aclGetFormat: unknown tensor");
  *format = tensor->format;
  return ACLNN_SUCCESS;
}
aclnnStatus aclGetDataType(const aclTensor* tensor, aclDataType* dataType) {
  if (dataType == nullptr) return refuse(ACLNN_ERR_PARAM_NULLPTR, "aclGetDataType: dataType is nullptr");
  if (!live(tensor, Object::Tensor)) return refuse(ACLNN_ERR_PARAM_INVALID, "aclGetDataType: unknown tensor");
  *dataType = tensor->dtype;
  return ACLNN_SUCCESS;
}
aclnnStatus aclGetIntArraySize(const aclIntArray* array, uint64_t* size) {
  return give_size(array, Object::IntArray, size, "aclGetIntArraySize");
}
aclnnStatus aclGetBoolArraySize(const aclBoolArray* array, uint64_t* size) {
  return give_size(array, Object::BoolArray, size, "aclGetBoolArraySize");
}
aclnnStatus aclGetFloatArraySize(const aclFloatArray* array, uint64_t* size) {
  return give_size(array, Object::FloatArray, size, "aclGetFloatArraySize");
}
aclnnStatus aclGetTensorListSize(const aclTensorList* tensorList, uint64_t* size) {
  return give_size(tensorList, Object::TensorList, size, "aclGetTensorListSize");
}

}  // extern "C"
