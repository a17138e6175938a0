// libascendcl.so: the AscendCL runtime subset CANN's host programs use, on the CPU (see include/acl/acl_rt.h).
//
// The device is the host. Every handle and allocation this library makes is registered, so that a handle it did not
// make (or one already destroyed) is answered with a status and a message instead of a crash, and so that the
// aclnn surface (libnnopbase) can check a tensor's view against the block aclrtMalloc gave. Thread-safe: one mutex
// guards the registries (a call holds it for a map lookup, never while copying).

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "acl/acl.h"
#include "gradops_capi.h"

namespace {

std::mutex registry_mutex;
std::map<uintptr_t, size_t>& blocks() {  // start -> bytes, of every live aclrtMalloc / aclrtMallocHost block
  static auto* b = new std::map<uintptr_t, size_t>();
  return *b;
}
std::set<const void*>& handles() {  // live streams, events and contexts
  static auto* h = new std::set<const void*>();
  return *h;
}

thread_local std::string pending;   // the message of this thread's latest failure, until read
thread_local std::string returned;  // what the last aclGetRecentErrMsg handed out (valid until the next one)
bool initialised = false;
std::mutex init_mutex;

aclError fail(aclError status, const std::string& message) {
  pending = message + " [" + std::to_string(status) + "]";
  return status;
}

// A handle made by this library: the address of a heap byte that is never read, unique while it lives.
void* make_handle() {
  void* h = std::malloc(1);
  if (h == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(registry_mutex);
  handles().insert(h);
  return h;
}

bool drop_handle(const void* h) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  if (handles().erase(h) == 0) return false;
  std::free(const_cast<void*>(h));
  return true;
}

bool known(const void* h) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  return handles().count(h) != 0;
}

aclError allocate(void** ptr, size_t size, const char* api) {
  if (ptr == nullptr) return fail(ACL_ERROR_INVALID_PARAM, std::string(api) + ": the pointer to write to is nullptr");
  if (size == 0) return fail(ACL_ERROR_INVALID_PARAM, std::string(api) + ": size must be > 0, got 0");
  // CANN aligns device memory to 512 bytes and rounds sizes up to 32; the same here, so that the byte counts a
  // program relies on behave alike.
  const size_t rounded = (size + 31) / 32 * 32;
  void* p = nullptr;
  if (posix_memalign(&p, 512, rounded) != 0 || p == nullptr) {
    return fail(ACL_ERROR_BAD_ALLOC, std::string(api) + ": cannot allocate " + std::to_string(size) + " bytes");
  }
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    blocks()[reinterpret_cast<uintptr_t>(p)] = size;
  }
  *ptr = p;
  return ACL_SUCCESS;
}

aclError release(void* ptr, const char* api) {
  if (ptr == nullptr) return fail(ACL_ERROR_INVALID_PARAM, std::string(api) + ": the pointer is nullptr");
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    if (blocks().erase(reinterpret_cast<uintptr_t>(ptr)) == 0) {
      return fail(ACL_ERROR_INVALID_PARAM, std::string(api) + ": the pointer is not the start of a block "
                  "aclrtMalloc returned (or it was freed already)");
    }
  }
  std::free(ptr);
  return ACL_SUCCESS;
}

// Whether [ptr, ptr + count) lies inside its block, where ptr is in one (host memory from elsewhere: unchecked).
bool fits(const void* ptr, size_t count) {
  const int64_t room = gradops_block_room(ptr);
  return room < 0 || static_cast<uint64_t>(room) >= count;
}

aclError copy(void* dst, size_t destMax, const void* src, size_t count, int kind, const char* api) {
  if (count == 0) return ACL_SUCCESS;
  if (dst == nullptr || src == nullptr) {
    return fail(ACL_ERROR_INVALID_PARAM, std::string(api) + ": " + (dst == nullptr ? "dst" : "src") + " is nullptr");
  }
  if (count > destMax) {
    return fail(ACL_ERROR_INVALID_PARAM, std::string(api) + ": count (" + std::to_string(count) +
                ") must be <= destMax (" + std::to_string(destMax) + ")");
  }
  if (kind < ACL_MEMCPY_HOST_TO_HOST || kind > ACL_MEMCPY_DEFAULT) {
    return fail(ACL_ERROR_INVALID_PARAM, std::string(api) + ": kind must be an aclrtMemcpyKind (0-4), got " +
                std::to_string(kind));
  }
  if (!fits(dst, count) || !fits(src, count)) {
    return fail(ACL_ERROR_INVALID_PARAM, std::string(api) + ": " + std::to_string(count) + " bytes run past the end "
                "of the aclrtMalloc block at " + (fits(dst, count) ? "src" : "dst"));
  }
  std::memmove(dst, src, count);
  return ACL_SUCCESS;
}

aclError check_stream(aclrtStream stream, const char* api) {
  if (gradops_stream_known(stream)) return ACL_SUCCESS;
  return fail(ACL_ERROR_INVALID_RESOURCE_HANDLE, std::string(api) + ": stream is not one aclrtCreateStream made "
              "(or it was destroyed)");
}

aclError unsupported(const char* api) {
  return fail(ACL_ERROR_API_NOT_SUPPORT, std::string(api) + " is not supported by gradops' CPU runtime");
}

}  // namespace

extern "C" {

void gradops_set_error(const char* message) { pending = message == nullptr ? "" : message; }

int64_t gradops_block_room(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = blocks().upper_bound(address);
  if (it == blocks().begin()) return -1;
  --it;
  if (address >= it->first + it->second) return -1;
  return static_cast<int64_t>(it->first + it->second - address);
}

bool gradops_stream_known(aclrtStream stream) { return stream == nullptr || known(stream); }

const char* aclGetRecentErrMsg(void) {
  if (pending.empty()) return nullptr;
  returned.swap(pending);
  pending.clear();
  return returned.c_str();
}

size_t aclDataTypeSize(aclDataType dataType) {
  switch (dataType) {
    case ACL_BOOL: case ACL_INT8: case ACL_UINT8: return 1;
    case ACL_FLOAT16: case ACL_BF16: case ACL_INT16: case ACL_UINT16: return 2;
    case ACL_FLOAT: case ACL_INT32: case ACL_UINT32: case ACL_COMPLEX32: return 4;
    case ACL_INT64: case ACL_UINT64: case ACL_DOUBLE: case ACL_COMPLEX64: return 8;
    case ACL_COMPLEX128: return 16;
    default: return 0;
  }
}

float aclFloat16ToFloat(aclFloat16 value) {
  const uint32_t sign = (value & 0x8000u) << 16, exp = (value >> 10) & 0x1f, mant = value & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int shift = 0;
    uint32_t m = mant;
    while ((m & 0x400u) == 0) { m <<= 1; ++shift; }
    bits = sign | ((113 - shift) << 23) | ((m & 0x3ffu) << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

aclFloat16 aclFloatToFloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const int32_t exp = static_cast<int32_t>((bits >> 23) & 0xff) - 127 + 15;
  uint32_t mant = bits & 0x7fffffu;
  if (((bits >> 23) & 0xff) == 0xff) return static_cast<aclFloat16>(sign | 0x7c00u | (mant ? 0x200u : 0));
  if (exp >= 0x1f) return static_cast<aclFloat16>(sign | 0x7c00u);
  if (exp <= 0) {  // subnormal or zero, round to nearest even
    if (exp < -10) return static_cast<aclFloat16>(sign);
    mant |= 0x800000u;
    const uint32_t shift = static_cast<uint32_t>(14 - exp);
    uint32_t half = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1u))) ++half;
    return static_cast<aclFloat16>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // a carry into the exponent is right
  return static_cast<aclFloat16>(half);
}

aclError aclInit(const char* /*configPath*/) {
  std::lock_guard<std::mutex> lock(init_mutex);
  if (initialised) return fail(ACL_ERROR_REPEAT_INITIALIZE, "aclInit: already initialised (call aclFinalize first)");
  initialised = true;
  return ACL_SUCCESS;
}

aclError aclFinalize(void) {
  std::lock_guard<std::mutex> lock(init_mutex);
  if (!initialised) return fail(ACL_ERROR_REPEAT_FINALIZE, "aclFinalize: aclInit was not called (or finalised)");
  initialised = false;
  return ACL_SUCCESS;
}

aclError aclrtGetVersion(int32_t* majorVersion, int32_t* minorVersion, int32_t* patchVersion) {
  if (majorVersion == nullptr || minorVersion == nullptr || patchVersion == nullptr) {
    return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetVersion: an output pointer is nullptr");
  }
  *majorVersion = 1, *minorVersion = 0, *patchVersion = 0;
  return ACL_SUCCESS;
}

// One device: 0, the host.
aclError aclrtSetDevice(int32_t deviceId) {
  if (deviceId != 0) {
    return fail(ACL_ERROR_INVALID_DEVICE, "aclrtSetDevice: deviceId must be 0 (gradops runs on the host), got " +
                std::to_string(deviceId));
  }
  return ACL_SUCCESS;
}

aclError aclrtResetDevice(int32_t deviceId) {
  if (deviceId != 0) {
    return fail(ACL_ERROR_INVALID_DEVICE, "aclrtResetDevice: deviceId must be 0, got " + std::to_string(deviceId));
  }
  return ACL_SUCCESS;
}

aclError aclrtGetDevice(int32_t* deviceId) {
  if (deviceId == nullptr) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetDevice: deviceId is nullptr");
  *deviceId = 0;
  return ACL_SUCCESS;
}

aclError aclrtGetDeviceCount(uint32_t* count) {
  if (count == nullptr) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetDeviceCount: count is nullptr");
  *count = 1;
  return ACL_SUCCESS;
}

aclError aclrtGetRunMode(aclrtRunMode* runMode) {
  if (runMode == nullptr) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetRunMode: runMode is nullptr");
  *runMode = ACL_HOST;
  return ACL_SUCCESS;
}

aclError aclrtSynchronizeDevice(void) { return ACL_SUCCESS; }

aclError aclrtCreateContext(aclrtContext* context, int32_t deviceId) {
  if (context == nullptr) return fail(ACL_ERROR_INVALID_PARAM, "aclrtCreateContext: context is nullptr");
  if (deviceId != 0) return fail(ACL_ERROR_INVALID_DEVICE, "aclrtCreateContext: deviceId must be 0");
  *context = make_handle();
  return *context ? ACL_SUCCESS : fail(ACL_ERROR_BAD_ALLOC, "aclrtCreateContext: out of memory");
}

aclError aclrtDestroyContext(aclrtContext context) {
  return drop_handle(context) ? ACL_SUCCESS
                              : fail(ACL_ERROR_INVALID_RESOURCE_HANDLE, "aclrtDestroyContext: unknown context");
}

aclError aclrtSetCurrentContext(aclrtContext context) {
  return known(context) ? ACL_SUCCESS
                        : fail(ACL_ERROR_INVALID_RESOURCE_HANDLE, "aclrtSetCurrentContext: unknown context");
}

aclError aclrtGetCurrentContext(aclrtContext* /*context*/) { return unsupported("aclrtGetCurrentContext"); }

aclError aclrtCreateStream(aclrtStream* stream) {
  if (stream == nullptr) return fail(ACL_ERROR_INVALID_PARAM, "aclrtCreateStream: stream is nullptr");
  *stream = make_handle();
  return *stream ? ACL_SUCCESS : fail(ACL_ERROR_BAD_ALLOC, "aclrtCreateStream: out of memory");
}

aclError aclrtDestroyStream(aclrtStream stream) {
  if (stream == nullptr) return fail(ACL_ERROR_INVALID_PARAM, "aclrtDestroyStream: stream is nullptr");
  return drop_handle(stream) ? ACL_SUCCESS : check_stream(stream, "aclrtDestroyStream");
}

// Work runs when it is enqueued: a stream is always idle.
aclError aclrtSynchronizeStream(aclrtStream stream) { return check_stream(stream, "aclrtSynchronizeStream"); }

aclError aclrtCreateEvent(aclrtEvent* event) {
  if (event == nullptr) return fail(ACL_ERROR_INVALID_PARAM, "aclrtCreateEvent: event is nullptr");
  *event = make_handle();
  return *event ? ACL_SUCCESS : fail(ACL_ERROR_BAD_ALLOC, "aclrtCreateEvent: out of memory");
}

aclError aclrtDestroyEvent(aclrtEvent event) {
  return drop_handle(event) ? ACL_SUCCESS : fail(ACL_ERROR_INVALID_RESOURCE_HANDLE, "aclrtDestroyEvent: unknown event");
}

aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream) {
  if (event == nullptr || !known(event)) {
    return fail(ACL_ERROR_INVALID_RESOURCE_HANDLE, "aclrtRecordEvent: unknown event");
  }
  return check_stream(stream, "aclrtRecordEvent");
}

aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event) {
  if (event == nullptr || !known(event)) {
    return fail(ACL_ERROR_INVALID_RESOURCE_HANDLE, "aclrtStreamWaitEvent: unknown event");
  }
  return check_stream(stream, "aclrtStreamWaitEvent");
}

aclError aclrtSynchronizeEvent(aclrtEvent event) {
  return event != nullptr && known(event)
             ? ACL_SUCCESS
             : fail(ACL_ERROR_INVALID_RESOURCE_HANDLE, "aclrtSynchronizeEvent: unknown event");
}

aclError aclrtMalloc(void** devPtr, size_t size, aclrtMemMallocPolicy policy) {
  if (policy < ACL_MEM_MALLOC_HUGE_FIRST || policy > ACL_MEM_MALLOC_NORMAL_ONLY_P2P) {
    return fail(ACL_ERROR_INVALID_PARAM, "aclrtMalloc: policy must be an aclrtMemMallocPolicy (0-5), got " +
                std::to_string(static_cast<int>(policy)));
  }
  return allocate(devPtr, size, "aclrtMalloc");
}

aclError aclrtMallocHost(void** hostPtr, size_t size) { return allocate(hostPtr, size, "aclrtMallocHost"); }
aclError aclrtFree(void* devPtr) { return release(devPtr, "aclrtFree"); }
aclError aclrtFreeHost(void* hostPtr) { return release(hostPtr, "aclrtFreeHost"); }

aclError aclrtMemcpy(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind) {
  return copy(dst, destMax, src, count, kind, "aclrtMemcpy");
}

aclError aclrtMemcpyAsync(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind,
                          aclrtStream stream) {
  const aclError status = check_stream(stream, "aclrtMemcpyAsync");
  return status != ACL_SUCCESS ? status : copy(dst, destMax, src, count, kind, "aclrtMemcpyAsync");
}

aclError aclrtMemset(void* devPtr, size_t maxCount, int32_t value, size_t count) {
  if (count == 0) return ACL_SUCCESS;
  if (devPtr == nullptr) return fail(ACL_ERROR_INVALID_PARAM, "aclrtMemset: devPtr is nullptr");
  if (count > maxCount || !fits(devPtr, count)) {
    return fail(ACL_ERROR_INVALID_PARAM, "aclrtMemset: count (" + std::to_string(count) + ") exceeds maxCount (" +
                std::to_string(maxCount) + ") or the aclrtMalloc block");
  }
  std::memset(devPtr, value, count);
  return ACL_SUCCESS;
}

aclError aclrtMemsetAsync(void* devPtr, size_t maxCount, int32_t value, size_t count, aclrtStream stream) {
  const aclError status = check_stream(stream, "aclrtMemsetAsync");
  return status != ACL_SUCCESS ? status : aclrtMemset(devPtr, maxCount, value, count);
}

aclError aclrtGetMemInfo(int32_t /*attr*/, size_t* /*free*/, size_t* /*total*/) {
  return unsupported("aclrtGetMemInfo");
}

}  // extern "C"
