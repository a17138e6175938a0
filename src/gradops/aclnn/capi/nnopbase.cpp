// libnnopbase.so: the aclnn objects (tensors over the caller's memory, arrays, scalars, executors) and the bridge
// that runs every operator's two phases in gradops.aclnn (one contract: the statuses, workspace sizes, messages and
// results are the Python surface's, from the same validation tables).
//
// The bridge embeds CPython (the interpreter `gradops cann-home` ran in, GRADOPS_PYTHON in gradops_home.h), started
// at the first operator call or by aclnnInit; in a process that is already Python (ctypes) it uses that one. Each
// call takes the GIL, so host threads may call at once: each has its own executors and error message, and their
// Python work runs one at a time (the kernels themselves use torch's thread pool).
//
// What the C layer checks itself, because C gives what Python cannot: that every object pointer is one this library
// made and has not destroyed (a registry, not a dereference), that a tensor's view lies inside its storage, and,
// where the storage is an aclrtMalloc block, inside that block; executors are ids that are never reused, so a spent
// or destroyed one is refused instead of dereferenced.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "gradops_capi.h"
#include "gradops_home.h"

using gradops_capi::Arg;
using gradops_capi::Kind;
using gradops_capi::Op;

struct aclTensor {
  std::vector<int64_t> view, strides, storage;
  int64_t offset;
  aclDataType dtype;
  aclFormat format;
  void* data;
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

namespace {

// ---- the registry of live objects (created and destroyed without the GIL: its own mutex) ----

enum class Object { Tensor, IntArray, BoolArray, FloatArray, Scalar, TensorList };

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

bool live(const void* p, Object kind) {
  std::lock_guard<std::mutex> lock(objects_mutex);
  auto it = objects().find(p);
  return it != objects().end() && it->second == kind;
}

template <class T>
aclnnStatus destroy(const T* p, Object kind, const char* api) {
  if (p == nullptr) return ACLNN_SUCCESS;  // CANN's destroy functions accept nullptr
  {
    std::lock_guard<std::mutex> lock(objects_mutex);
    auto it = objects().find(p);
    if (it == objects().end() || it->second != kind) {
      gradops_set_error((std::string(api) + ": the pointer is not one this library made, or it was destroyed [" +
                         std::to_string(ACLNN_ERR_PARAM_INVALID) + "]").c_str());
      return ACLNN_ERR_PARAM_INVALID;
    }
    objects().erase(it);
  }
  delete p;
  return ACLNN_SUCCESS;
}

aclnnStatus refuse(aclnnStatus status, const std::string& message) {
  static const std::unordered_map<int, const char*> names = {
      {ACLNN_ERR_PARAM_NULLPTR, "ACLNN_ERR_PARAM_NULLPTR"}, {ACLNN_ERR_PARAM_INVALID, "ACLNN_ERR_PARAM_INVALID"},
      {ACLNN_ERR_INNER, "ACLNN_ERR_INNER"}, {ACLNN_ERR_INNER_OP_NOT_REGISTERED, "ACLNN_ERR_INNER_OP_NOT_REGISTERED"}};
  auto it = names.find(status);
  gradops_set_error((message + " [" + (it != names.end() ? it->second : "ACLNN") + " " + std::to_string(status) +
                     "]").c_str());
  return status;
}

const char* dtype_name(aclDataType t) {
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
// are Ascend's private tiled layouts, whose bytes are not the view's.
bool plain_format(aclFormat f) {
  switch (f) {
    case ACL_FORMAT_ND: case ACL_FORMAT_NCHW: case ACL_FORMAT_NHWC: case ACL_FORMAT_HWCN: case ACL_FORMAT_NDHWC:
    case ACL_FORMAT_NCDHW: case ACL_FORMAT_NC: case ACL_FORMAT_NCL: return true;
    default: return false;
  }
}

bool mul_ok(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

// ---- the Python side (every member below is used with the GIL held) ----

struct Bridge {
  PyObject* entries = nullptr;       // {name: (phase1, phase2, signature)}
  PyObject* dtypes = nullptr;        // tuple: aclDataType code -> torch.dtype or None
  PyObject* from_address = nullptr;  // (address, dtype, sizes, strides, offset) -> tensor over that memory
  PyObject* byte = nullptr;          // torch.uint8 (the workspace)
  PyObject* message = nullptr;       // gradops.aclnn.aclGetRecentErrMsg
  PyObject* destroy = nullptr;       // gradops.aclnn.aclDestroyAclOpExecutor
  PyObject* repeatable = nullptr;    // gradops.aclnn.aclSetAclOpExecutorRepeatable
  PyObject* spent = nullptr;         // "spent", "destroyed": the executor's state
  PyObject* destroyed = nullptr;
};
Bridge bridge;
std::once_flag started;
std::string start_error;  // empty: started

struct Entry {
  PyObject* phase1;
  PyObject* phase2;
};

// Executors: id -> the Python executor. An id is never reused, so a handle that ran or was destroyed is unknown,
// never another call's executor.
std::unordered_map<uintptr_t, PyObject*> executors;
uintptr_t last_id = 0;

aclOpExecutor* handle_of(uintptr_t id) { return reinterpret_cast<aclOpExecutor*>(id << 4); }
uintptr_t id_of(const aclOpExecutor* h) { return reinterpret_cast<uintptr_t>(h) >> 4; }

class Gil {
 public:
  Gil() : state_(PyGILState_Ensure()) {}
  ~Gil() { PyGILState_Release(state_); }
  Gil(const Gil&) = delete;
  Gil& operator=(const Gil&) = delete;

 private:
  PyGILState_STATE state_;
};

// The pending Python exception as text (and cleared).
std::string python_error() {
  PyObject *type, *value, *trace;
  PyErr_Fetch(&type, &value, &trace);
  std::string text = "unknown Python error";
  if (value != nullptr || type != nullptr) {
    PyObject* s = PyObject_Str(value != nullptr ? value : type);
    const char* c = s != nullptr ? PyUnicode_AsUTF8(s) : nullptr;
    PyObject* tn = type != nullptr ? PyObject_GetAttrString(type, "__name__") : nullptr;
    const char* n = tn != nullptr ? PyUnicode_AsUTF8(tn) : nullptr;
    text = std::string(n ? n : "Error") + ": " + (c ? c : "");
    Py_XDECREF(s);
    Py_XDECREF(tn);
  }
  PyErr_Clear();
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(trace);
  return text;
}

bool fetch(PyObject* module, const char* name, PyObject** slot) {
  *slot = PyObject_GetAttrString(module, name);
  return *slot != nullptr;
}

void start_python() {
  const bool own = !Py_IsInitialized();
  if (own) {
    setenv("GRADOPS_CACHE_DIR", GRADOPS_CACHE, /*overwrite=*/0);  // the native extension `cann-home` built
    PyConfig config;
    PyConfig_InitIsolatedConfig(&config);  // PYTHON* variables and the user's site do not change what runs
    config.install_signal_handlers = 0;     // the host program's signals stay its own
    PyStatus status = PyConfig_SetBytesString(&config, &config.program_name, GRADOPS_PYTHON);
    if (!PyStatus_Exception(status)) status = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status)) {
      start_error = std::string("cannot start Python (") + GRADOPS_PYTHON + "): " +
                    (status.err_msg ? status.err_msg : "unknown error");
      return;
    }
  }
  {
    Gil gil;
    // The module path of the process that wrote the tree, in front: the gradops it generated the entry points from
    // is the one imported, whatever else the interpreter's own path holds.
    PyObject* path = PySys_GetObject("path");  // borrowed
    Py_ssize_t front = 0;
    for (const char* entry : GRADOPS_PATHS) {
      PyObject* item = PyUnicode_DecodeFSDefault(entry);
      if (item != nullptr && path != nullptr && PySequence_Contains(path, item) == 0) {
        PyList_Insert(path, front++, item);
      }
      Py_XDECREF(item);
    }
    PyObject* module = PyImport_ImportModule("gradops.aclnn.capi.bridge");
    bool ok = module != nullptr && fetch(module, "ENTRIES", &bridge.entries) &&
              fetch(module, "DTYPES", &bridge.dtypes) && fetch(module, "from_address", &bridge.from_address) &&
              fetch(module, "BYTE", &bridge.byte) && fetch(module, "message", &bridge.message) &&
              fetch(module, "destroy", &bridge.destroy) && fetch(module, "repeatable", &bridge.repeatable);
    if (ok) {
      bridge.spent = PyUnicode_InternFromString("spent");
      bridge.destroyed = PyUnicode_InternFromString("destroyed");
      ok = PyTuple_Check(bridge.dtypes) && PyDict_Check(bridge.entries);
      if (!ok) start_error = "gradops.aclnn.capi.bridge has the wrong shape";
    } else {
      start_error = "cannot load gradops (" + std::string(GRADOPS_PYTHON) + "): " + python_error();
    }
    Py_XDECREF(module);
  }
  if (own) PyEval_SaveThread();  // the interpreter is ours: let every host thread take the GIL
}

aclnnStatus ensure_started(const char* api) {
  std::call_once(started, start_python);
  if (start_error.empty()) return ACLNN_SUCCESS;
  return refuse(ACLNN_ERR_INNER, std::string(api) + ": " + start_error);
}

// The operator's Python phases, found once per Op (under the GIL) and held to the C declaration it was built from.
Entry* entry_of(Op* op, aclnnStatus* status) {
  if (op->slot != nullptr) return static_cast<Entry*>(op->slot);
  PyObject* found = PyDict_GetItemString(bridge.entries, op->name);  // borrowed
  if (found == nullptr || !PyTuple_Check(found) || PyTuple_GET_SIZE(found) != 3) {
    *status = refuse(ACLNN_ERR_INNER_OP_NOT_REGISTERED, std::string(op->name) + ": the installed gradops has no "
                     "such operator; run `gradops cann-home` again for the libraries of this gradops");
    return nullptr;
  }
  const char* signature = PyUnicode_AsUTF8(PyTuple_GET_ITEM(found, 2));
  if (signature == nullptr || std::strcmp(signature, op->signature) != 0) {
    PyErr_Clear();
    *status = refuse(ACLNN_ERR_INNER_OP_NOT_REGISTERED, std::string(op->name) + ": declared here as (" +
                     op->signature + ") but the installed gradops takes (" + (signature ? signature : "?") +
                     "); run `gradops cann-home` again");
    return nullptr;
  }
  auto* entry = new Entry{PyTuple_GET_ITEM(found, 0), PyTuple_GET_ITEM(found, 1)};
  Py_INCREF(entry->phase1);
  Py_INCREF(entry->phase2);
  op->slot = entry;
  return entry;
}

PyObject* int_tuple(const std::vector<int64_t>& v) {
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(v.size()));
  if (t == nullptr) return nullptr;
  for (size_t i = 0; i < v.size(); ++i) PyTuple_SET_ITEM(t, i, PyLong_FromLongLong(v[i]));
  return t;
}

PyObject* tensor_over(void* data, PyObject* dtype, PyObject* sizes, PyObject* strides, int64_t offset) {
  PyObject* address = PyLong_FromVoidPtr(data);
  PyObject* off = PyLong_FromLongLong(offset);
  PyObject* result = nullptr;
  if (address != nullptr && off != nullptr && sizes != nullptr && strides != nullptr) {
    PyObject* argv[] = {address, dtype, sizes, strides, off};
    result = PyObject_Vectorcall(bridge.from_address, argv, 5, nullptr);
  }
  Py_XDECREF(address);
  Py_XDECREF(off);
  Py_XDECREF(sizes);
  Py_XDECREF(strides);
  return result;
}

// One phase-1 argument as the Python phase takes it; nullptr with *status set when the C layer refuses it.
PyObject* convert(const Op* op, int32_t index, const Arg& a, aclnnStatus* status) {
  const std::string where = std::string(op->name) + "GetWorkspaceSize: " + op->params[index];
  switch (a.kind) {
    case Kind::Int64: return PyLong_FromLongLong(a.i64);
    case Kind::Uint64: return PyLong_FromUnsignedLongLong(a.u64);
    case Kind::Double: return PyFloat_FromDouble(a.f64);
    case Kind::Bool: return PyBool_FromLong(a.flag);
    case Kind::IntArray: {
      if (a.object == nullptr) Py_RETURN_NONE;
      if (!live(a.object, Object::IntArray)) break;
      return int_tuple(static_cast<const aclIntArray*>(a.object)->values);
    }
    case Kind::BoolArray: {
      if (a.object == nullptr) Py_RETURN_NONE;
      if (!live(a.object, Object::BoolArray)) break;
      const auto& v = static_cast<const aclBoolArray*>(a.object)->values;
      PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(v.size()));
      for (size_t i = 0; t != nullptr && i < v.size(); ++i) PyTuple_SET_ITEM(t, i, PyBool_FromLong(v[i]));
      return t;
    }
    case Kind::FloatArray: {
      if (a.object == nullptr) Py_RETURN_NONE;
      if (!live(a.object, Object::FloatArray)) break;
      const auto& v = static_cast<const aclFloatArray*>(a.object)->values;
      PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(v.size()));
      for (size_t i = 0; t != nullptr && i < v.size(); ++i) PyTuple_SET_ITEM(t, i, PyFloat_FromDouble(v[i]));
      return t;
    }
    case Kind::Tensor: {
      if (a.object == nullptr) Py_RETURN_NONE;
      if (!live(a.object, Object::Tensor)) break;
      auto* t = const_cast<aclTensor*>(static_cast<const aclTensor*>(a.object));  // only its cache is written
      const int code = static_cast<int>(t->dtype);
      PyObject* dtype = code >= 0 && code < PyTuple_GET_SIZE(bridge.dtypes) ? PyTuple_GET_ITEM(bridge.dtypes, code)
                                                                              : Py_None;
      if (dtype == Py_None) {
        *status = refuse(ACLNN_ERR_PARAM_INVALID, where + " has data type " + dtype_name(t->dtype) + " (" +
                         std::to_string(code) + "), which no gradops operator reads");
        return nullptr;
      }
      if (!plain_format(t->format)) {
        *status = refuse(ACLNN_ERR_PARAM_INVALID, where + " has format " + std::to_string(t->format) +
                         ", a private Ascend layout; gradops reads the ND family (ND, NCHW, NHWC, NCDHW, ...)");
        return nullptr;
      }
      int64_t elements = 1;
      for (int64_t d : t->storage) mul_ok(elements, d, &elements);
      const int64_t bytes = elements * static_cast<int64_t>(aclDataTypeSize(t->dtype));
      if (t->data == nullptr && bytes > 0) {
        *status = refuse(ACLNN_ERR_PARAM_NULLPTR, where + " has no memory (tensorData is nullptr) for its " +
                         std::to_string(elements) + " storage elements");
        return nullptr;
      }
      const int64_t room = t->data == nullptr ? -1 : gradops_block_room(t->data);
      if (room >= 0 && room < bytes) {
        *status = refuse(ACLNN_ERR_PARAM_INVALID, where + ": its storage (" + std::to_string(bytes) +
                         " bytes) runs past the end of the aclrtMalloc block holding tensorData (" +
                         std::to_string(room) + " bytes from it)");
        return nullptr;
      }
      if (t->python == nullptr) {
        t->python = tensor_over(t->data, dtype, int_tuple(t->view), int_tuple(t->strides), t->offset);
        if (t->python == nullptr) return nullptr;
      }
      Py_INCREF(t->python);
      return t->python;
    }
  }
  *status = refuse(ACLNN_ERR_PARAM_INVALID, where + " is not an object this library made (or it was destroyed)");
  return nullptr;
}

// Copy the Python surface's message of the last refusal into this thread's aclGetRecentErrMsg.
void take_message() {
  PyObject* text = PyObject_CallNoArgs(bridge.message);
  const char* c = text != nullptr ? PyUnicode_AsUTF8(text) : nullptr;
  gradops_set_error(c != nullptr ? c : "");
  if (c == nullptr) PyErr_Clear();
  Py_XDECREF(text);
}

aclnnStatus status_of(PyObject* result, const char* api) {
  long v = result != nullptr ? PyLong_AsLong(result) : -1;
  if (result == nullptr || (v == -1 && PyErr_Occurred())) {
    return refuse(ACLNN_ERR_INNER, std::string(api) + ": " + python_error());
  }
  if (v != ACLNN_SUCCESS) take_message();
  return static_cast<aclnnStatus>(v);
}

// The executor behind a handle (borrowed), or nullptr with *status set.
PyObject* executor_of(const aclOpExecutor* h, const std::string& api, aclnnStatus* status) {
  if (h == nullptr) {
    *status = refuse(ACLNN_ERR_PARAM_NULLPTR, api + ": executor is nullptr");
    return nullptr;
  }
  auto it = executors.find(id_of(h));
  if (it == executors.end() || handle_of(it->first) != h) {
    *status = refuse(ACLNN_ERR_PARAM_INVALID, api + ": the executor is not one phase 1 returned, or it ran already "
                     "(executors are single-use unless aclSetAclOpExecutorRepeatable was called), or it was "
                     "destroyed");
    return nullptr;
  }
  return it->second;
}

// Forget an executor that can no longer run (spent or destroyed): its tensors over the caller's memory go with it.
void settle(uintptr_t id, PyObject* executor) {
  bool gone = true;  // an executor whose state cannot be read is not run again
  for (PyObject* name : {bridge.spent, bridge.destroyed}) {
    PyObject* flag = PyObject_GetAttr(executor, name);
    const int set = flag != nullptr ? PyObject_IsTrue(flag) : -1;
    Py_XDECREF(flag);
    gone = set != 0;
    if (gone) break;
  }
  PyErr_Clear();
  if (!gone) return;
  executors.erase(id);
  Py_DECREF(executor);
}

}  // namespace

extern "C" {

aclnnStatus gradops_phase1(Op* op, const Arg* args, uint64_t* workspaceSize, aclOpExecutor** executor) {
  const std::string api = std::string(op->name) + "GetWorkspaceSize";
  if (workspaceSize == nullptr || executor == nullptr) {
    return refuse(ACLNN_ERR_PARAM_NULLPTR, api + ": " + (workspaceSize == nullptr ? "workspaceSize" : "executor") +
                  " is nullptr");
  }
  *workspaceSize = 0;
  *executor = nullptr;
  aclnnStatus status = ensure_started(api.c_str());
  if (status != ACLNN_SUCCESS) return status;
  Gil gil;
  Entry* entry = entry_of(op, &status);
  if (entry == nullptr) return status;
  std::vector<PyObject*> argv(op->count, nullptr);
  for (int32_t i = 0; i < op->count; ++i) {
    argv[i] = convert(op, i, args[i], &status);
    if (argv[i] == nullptr) {
      if (status == ACLNN_SUCCESS) status = refuse(ACLNN_ERR_INNER, api + ": " + python_error());
      for (PyObject* o : argv) Py_XDECREF(o);
      return status;
    }
  }
  PyObject* result = PyObject_Vectorcall(entry->phase1, argv.data(), op->count, nullptr);
  for (PyObject* o : argv) Py_DECREF(o);
  if (result == nullptr || !PyTuple_Check(result) || PyTuple_GET_SIZE(result) != 3) {
    status = refuse(ACLNN_ERR_INNER, api + ": " + (result == nullptr ? python_error() : "phase 1 returned no triple"));
    Py_XDECREF(result);
    return status;
  }
  status = status_of(PyTuple_GET_ITEM(result, 0), api.c_str());
  if (status == ACLNN_SUCCESS) {
    const unsigned long long size = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(result, 1));
    if (PyErr_Occurred()) {
      status = refuse(ACLNN_ERR_INNER, api + ": " + python_error());
    } else {
      PyObject* made = PyTuple_GET_ITEM(result, 2);
      Py_INCREF(made);
      executors[++last_id] = made;
      *workspaceSize = size;
      *executor = handle_of(last_id);
    }
  }
  Py_DECREF(result);
  return status;
}

aclnnStatus gradops_phase2(Op* op, void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                           aclrtStream stream) {
  const std::string api = op->name;
  aclnnStatus status = ensure_started(api.c_str());
  if (status != ACLNN_SUCCESS) return status;
  if (!gradops_stream_known(stream)) {
    return refuse(ACLNN_ERR_PARAM_INVALID, api + ": stream is not one aclrtCreateStream made (or it was destroyed)");
  }
  if (workspace != nullptr) {
    const int64_t room = gradops_block_room(workspace);
    if (room >= 0 && static_cast<uint64_t>(room) < workspaceSize) {
      return refuse(ACLNN_ERR_PARAM_INVALID, api + ": workspaceSize (" + std::to_string(workspaceSize) +
                    ") runs past the end of the aclrtMalloc block at workspace (" + std::to_string(room) + " bytes)");
    }
  }
  Gil gil;
  Entry* entry = entry_of(op, &status);
  if (entry == nullptr) return status;
  PyObject* made = Py_None;
  if (executor != nullptr) {
    made = executor_of(executor, api, &status);
    if (made == nullptr) return status;
  }
  Py_INCREF(made);
  PyObject* ws = Py_None;
  Py_INCREF(ws);
  if (workspace != nullptr) {
    Py_DECREF(ws);
    ws = tensor_over(workspace, bridge.byte, int_tuple({static_cast<int64_t>(workspaceSize)}), int_tuple({1}), 0);
  }
  PyObject* size = PyLong_FromUnsignedLongLong(workspaceSize);
  PyObject* result = nullptr;
  if (ws != nullptr && size != nullptr) {
    PyObject* argv[] = {ws, size, made, Py_None};
    result = PyObject_Vectorcall(entry->phase2, argv, 4, nullptr);
  }
  status = status_of(result, api.c_str());
  Py_XDECREF(result);
  Py_XDECREF(ws);
  Py_XDECREF(size);
  if (made != Py_None) settle(id_of(executor), made);
  Py_DECREF(made);
  return status;
}

aclnnStatus aclnnInit(const char* /*configPath*/) { return ensure_started("aclnnInit"); }
aclnnStatus aclnnFinalize(void) { return ACLNN_SUCCESS; }

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
                          tensorData};
  if (stride != nullptr) {
    t->strides.assign(stride, stride + viewDimsNum);
  } else {  // contiguous
    t->strides.assign(viewDimsNum, 1);
    for (int64_t i = static_cast<int64_t>(viewDimsNum) - 2; i >= 0; --i) t->strides[i] = t->strides[i + 1] * t->view[i + 1];
  }
  // The view's last element, offset + sum((size - 1) * stride), must lie inside the storage.
  int64_t last = offset, elements = 1;
  bool empty = false, ok = true;
  for (uint64_t i = 0; i < viewDimsNum; ++i) {
    if (t->view[i] < 0 || t->strides[i] < 0) ok = false;
    if (t->view[i] == 0) empty = true;
    int64_t step = 0;
    if (t->view[i] > 0 && (!mul_ok(t->view[i] - 1, t->strides[i], &step) || __builtin_add_overflow(last, step, &last))) {
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
  if (status == ACLNN_SUCCESS && python != nullptr && Py_IsInitialized()) {  // an executor may still hold it
    Gil gil;
    Py_DECREF(python);
  }
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

aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor* executor) {
  aclnnStatus status = ensure_started("aclSetAclOpExecutorRepeatable");
  if (status != ACLNN_SUCCESS) return status;
  Gil gil;
  PyObject* made = executor_of(executor, "aclSetAclOpExecutorRepeatable", &status);
  if (made == nullptr) return status;
  PyObject* result = PyObject_CallOneArg(bridge.repeatable, made);
  status = status_of(result, "aclSetAclOpExecutorRepeatable");
  Py_XDECREF(result);
  return status;
}

aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor* executor) {
  aclnnStatus status = ensure_started("aclDestroyAclOpExecutor");
  if (status != ACLNN_SUCCESS) return status;
  Gil gil;
  PyObject* made = executor_of(executor, "aclDestroyAclOpExecutor", &status);
  if (made == nullptr) return status;
  PyObject* result = PyObject_CallOneArg(bridge.destroy, made);
  status = status_of(result, "aclDestroyAclOpExecutor");
  Py_XDECREF(result);
  settle(id_of(executor), made);
  return status;
}

aclnnStatus aclSetInputTensorAddr(aclOpExecutor* /*executor*/, const size_t /*index*/, aclTensor* /*tensor*/,
                                  void* /*addr*/) {
  return refuse(ACLNN_ERR_PARAM_INVALID, "aclSetInputTensorAddr is not supported by gradops: run phase 1 again on "
                "tensors over the new memory");
}

aclnnStatus aclSetOutputTensorAddr(aclOpExecutor* /*executor*/, const size_t /*index*/, aclTensor* /*tensor*/,
                                   void* /*addr*/) {
  return refuse(ACLNN_ERR_PARAM_INVALID, "aclSetOutputTensorAddr is not supported by gradops: run phase 1 again on "
                "tensors over the new memory");
}

}  // extern "C"
