// What gradops' three CANN libraries share and host programs never see (not installed under DIR/include):
// libascendcl's thread's error message and its registry of allocations and streams, which libnnopbase reads, and
// the one entry libopapi's generated operator functions call. Nothing here names an operator.
#ifndef GRADOPS_CAPI_H_
#define GRADOPS_CAPI_H_

#include <stdint.h>

#include "aclnn/acl_meta.h"

extern "C" {

// libascendcl: the calling thread's message for aclGetRecentErrMsg (replaces the previous one).
ACL_FUNC_VISIBILITY void gradops_set_error(const char* message);
// libascendcl: the bytes from ptr to the end of the aclrtMalloc block that holds it; -1 when no block does (memory
// the caller got elsewhere: it cannot be checked).
ACL_FUNC_VISIBILITY int64_t gradops_block_room(const void* ptr);
// libascendcl: whether stream is nullptr (the default stream) or a live stream aclrtCreateStream made.
ACL_FUNC_VISIBILITY bool gradops_stream_known(aclrtStream stream);
}

namespace gradops_capi {

// How one phase-1 argument converts to Python: the kinds of gradops.aclnn._declare.KINDS.
enum class Kind : int32_t { Tensor, IntArray, BoolArray, FloatArray, Int64, Uint64, Double, Bool };

struct Arg {
  Kind kind;
  union {
    const void* object;
    int64_t i64;
    uint64_t u64;
    double f64;
    bool flag;
  };
};

inline Arg arg(const aclTensor* v) { Arg a{Kind::Tensor, {}}; a.object = v; return a; }
inline Arg arg(const aclIntArray* v) { Arg a{Kind::IntArray, {}}; a.object = v; return a; }
inline Arg arg(const aclBoolArray* v) { Arg a{Kind::BoolArray, {}}; a.object = v; return a; }
inline Arg arg(const aclFloatArray* v) { Arg a{Kind::FloatArray, {}}; a.object = v; return a; }
inline Arg arg(int64_t v) { Arg a{Kind::Int64, {}}; a.i64 = v; return a; }
inline Arg arg(uint64_t v) { Arg a{Kind::Uint64, {}}; a.u64 = v; return a; }
inline Arg arg(double v) { Arg a{Kind::Double, {}}; a.f64 = v; return a; }
inline Arg arg(bool v) { Arg a{Kind::Bool, {}}; a.flag = v; return a; }

// One operator as libopapi declares it: CANN's name, its C parameter list (matched against the installed gradops'
// declaration when first called: a tree written by another gradops refuses instead of converting wrongly), the
// parameter names (for messages), and the bridge's slot for it (filled on first use, under the GIL).
struct Op {
  const char* name;
  const char* signature;
  const char* const* params;
  int32_t count;
  void* slot;
};

}  // namespace gradops_capi

extern "C" {
// libnnopbase: phase 1 and phase 2 of any operator, through gradops.aclnn.
ACL_FUNC_VISIBILITY aclnnStatus gradops_phase1(gradops_capi::Op* op, const gradops_capi::Arg* args,
                                               uint64_t* workspaceSize, aclOpExecutor** executor);
ACL_FUNC_VISIBILITY aclnnStatus gradops_phase2(gradops_capi::Op* op, void* workspace, uint64_t workspaceSize,
                                               aclOpExecutor* executor, aclrtStream stream);
}

#endif  // GRADOPS_CAPI_H_
