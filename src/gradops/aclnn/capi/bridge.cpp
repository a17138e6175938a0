// libnnopbase's bridge: every operator's two phases run in gradops.aclnn (one contract: the statuses, workspace
// sizes, messages and results are the Python surface's, from the same validation tables), and the executors.
//
// It embeds CPython (the interpreter `gradops cann-home` ran in, GRADOPS_PYTHON in gradops_home.h), started at the
// first operator call or by aclnnInit; in a process that is already Python (ctypes) it uses that one. Each call takes
// the GIL, so host threads may call at once: each has its own executors and error message, and their Python work
// runs one at a time (the kernels themselves use torch's thread pool).
//
// What the C layer checks itself, because C gives what Python cannot: that every object is live (objects.cpp), that a
// tensor's storage lies inside the aclrtMalloc block holding it, formats that name plain strided memory; executors
// are ids that are never reused, so a spent or destroyed one is refused instead of dereferenced.

#include "objects.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "gradops_home.h"

using gradops_capi::Arg;
using gradops_capi::dtype_name;
using gradops_capi::Kind;
using gradops_capi::live;
using gradops_capi::Object;
using gradops_capi::Op;
using gradops_capi::refuse;

namespace {

// The ND family: formats that name the dims of a plain strided layout. The others (NC1HWC0, FRACTAL_Z / NZ, ...)
// are Ascend's private tiled layouts, whose bytes are not the view's.
bool plain_format(aclFormat f) {
  switch (f) {
    case ACL_FORMAT_ND: case ACL_FORMAT_NCHW: case ACL_FORMAT_NHWC: case ACL_FORMAT_HWCN: case ACL_FORMAT_NDHWC:
    case ACL_FORMAT_NCDHW: case ACL_FORMAT_NC: case ACL_FORMAT_NCL: return true;
    default: return false;
  }
}

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

// A tuple of each value of v made a Python object by make.
template <class T, class Make>
PyObject* tuple_of(const std::vector<T>& v, Make make) {
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(v.size()));
  for (size_t i = 0; t != nullptr && i < v.size(); ++i) PyTuple_SET_ITEM(t, i, make(v[i]));
  return t;
}

PyObject* int_tuple(const std::vector<int64_t>& v) { return tuple_of(v, PyLong_FromLongLong); }

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
      return tuple_of(static_cast<const aclBoolArray*>(a.object)->values, [](uint8_t v) { return PyBool_FromLong(v); });
    }
    case Kind::FloatArray: {
      if (a.object == nullptr) Py_RETURN_NONE;
      if (!live(a.object, Object::FloatArray)) break;
      return tuple_of(static_cast<const aclFloatArray*>(a.object)->values, PyFloat_FromDouble);
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
      const int64_t elements = t->storage_elements;
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

void gradops_capi::release_python(PyObject* tensor) {
  if (!Py_IsInitialized()) return;
  Gil gil;
  Py_DECREF(tensor);
}

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
