// The output pool: gradops.cpu._pool's recycled blocks, kept here once the extension is loaded (gradops::output,
// which every native entry allocates its results with, and the pool's bindings).

#include "common.h"

#include <torch/csrc/Dtype.h>

#include <pthread.h>
#include <sys/mman.h>

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using at::Tensor;
using gradops::output;

namespace {
// Every fresh CPU tensor of more than glibc's mmap threshold (up to 32 MiB) is a new mapping whose first write takes
// a page fault per 4 KiB (a fresh 64 MiB embedding table: ~15 ms of faults on 2 cores, more than the backward).
// The pool keeps the memory of outputs that died and hands it out again for the same size. In Python (numpy blocks,
// a weakref finalizer per tensor) a pooled output costs ~10 µs; here a block is a mapping whose tensor's deleter
// returns it to the free list: ~1 µs, and no GIL in a backward. Same rules as the Python pool: blocks of at
// least kPoolMin bytes, at most GRADOPS_CPU_POOL_MB MiB of free blocks (default 2048; read whenever a block dies or
// is asked for; 0 turns the pool off), exact sizes only.
//
// Why not from 128 KiB, glibc's default mmap threshold, where a malloc'ed output can already be fresh pages again
// every step (as free() trims the heap's top)? Measured on 2 cores: with that floor, LayerNorm
// 512 x 256 fp32 forward + backward took no page faults where malloc had given it 0 to 72 per step; but `gradops
// demo` (1024 x 96 activations: 384 KiB outputs) gained nothing - 1.02, 1.01, 0.96x torch against 1.00, 0.99,
// 1.00x with the pool off, alternating - since the rest of a model's tensors still come from malloc's heap,
// and the pool would hold more blocks for it.
constexpr int64_t kPoolMin = 1 << 20;  // gradops.cpu._pool.MIN_BYTES
constexpr int64_t kPage = 4096;
constexpr int64_t kHuge = 2 << 20;     // a transparent huge page
constexpr int64_t kHugeMin = 4 << 20;  // numpy's threshold for advising them

// Thread rules: ``free`` and ``free_bytes`` are touched only under ``lock`` (a tensor's deleter runs on whichever
// thread drops it, the GIL held or not); no critical section takes the GIL or calls into Python, so the two locks
// never nest. fork(): see the pthread_atfork handlers in the module's init.
struct BlockPool {
  std::mutex lock;
  std::unordered_map<int64_t, std::vector<void*>> free;
  int64_t free_bytes = 0;
};

// Leaked on purpose: a tensor's deleter may run after static destructors at exit.
BlockPool& block_pool() {
  static BlockPool* pool = new BlockPool();
  return *pool;
}

// GRADOPS_CPU_POOL_MB in bytes, as gradops.cpu._pool.limit_bytes reads it (not a number: 0).
int64_t pool_limit() {
  const char* text = std::getenv("GRADOPS_CPU_POOL_MB");
  if (text == nullptr) return int64_t{2048} << 20;
  char* end = nullptr;
  const double mib = std::strtod(text, &end);
  while (end != nullptr && std::isspace(static_cast<unsigned char>(*end))) ++end;
  if (end == text || end == nullptr || *end != '\0' || !(mib > 0)) return 0;
  return static_cast<int64_t>(mib * (1 << 20));
}

// A block's length: whole pages, whole huge pages from kHugeMin on.
size_t block_length(int64_t bytes) {
  const int64_t unit = bytes >= kHugeMin ? kHuge : kPage;
  return static_cast<size_t>((bytes + unit - 1) / unit * unit);
}

// A block is an anonymous mapping of its own, outside malloc's heap. From malloc, a block below glibc's dynamic
// mmap threshold (up to 32 MiB) would sit in the heap for as long as the pool keeps it: it would decide where the
// heap's top is, and so when free() trims memory that the rest of the program's tensors then fault in again (in
// the sweep, torch's own twin ran 0.9 or 2.9 ms at 2048 x 512 depending on it), and pool_clear could not give its
// memory back to the OS. From kHugeMin on, 2 MiB-aligned and advised for transparent huge pages, as numpy (whose
// blocks the Python pool hands out) does: a streaming kernel over 16 MiB tensors takes a TLB miss per 4 KiB page
// otherwise.
void* map_block(int64_t bytes) {
  const size_t length = block_length(bytes);
  const bool huge = bytes >= kHugeMin;
  const size_t span = huge ? length + kHuge : length;  // room to cut a 2 MiB-aligned start out of
  void* mapped = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) return nullptr;
  if (!huge) return mapped;
  char* start = static_cast<char*>(mapped);
  char* aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(start) + kHuge - 1) / kHuge * kHuge);
  if (aligned > start) munmap(start, aligned - start);
  const size_t tail = static_cast<size_t>(start + span - (aligned + length));
  if (tail > 0) munmap(aligned + length, tail);
#ifdef MADV_HUGEPAGE
  madvise(aligned, length, MADV_HUGEPAGE);
#endif
  return aligned;
}

void unmap_block(void* block, int64_t bytes) {
  munmap(block, block_length(bytes));
}

void release_block(void* block, int64_t bytes) {
  BlockPool& pool = block_pool();
  {
    std::lock_guard<std::mutex> guard(pool.lock);
    if (pool.free_bytes + bytes <= pool_limit()) {
      pool.free[bytes].push_back(block);
      pool.free_bytes += bytes;
      return;
    }
  }
  unmap_block(block, bytes);
}

}  // namespace

// A contiguous CPU tensor: from the pool from kPoolMin on (a recycled block of the exact size, else a new one), else
// at::empty. Its storage cannot be resized (as the Python pool's).
Tensor gradops::output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  // Checked: a product that wrapped around (an embedding table of 2**62 + 2**18 rows of 4 floats is 2**20 bytes
  // modulo 2**64) would hand out a block smaller than the tensor over it.
  int64_t bytes = static_cast<int64_t>(options.dtype().itemsize());
  for (int64_t size : sizes) {
    TORCH_CHECK(size >= 0 && !__builtin_mul_overflow(bytes, size, &bytes), "gradops.native: could not allocate ",
                sizes, " elements of ", options.dtype().itemsize(), " bytes (more than int64 bytes)");
  }
  if (bytes < kPoolMin || pool_limit() <= 0) return at::empty(sizes, options);
  void* block = nullptr;
  {
    BlockPool& pool = block_pool();
    std::lock_guard<std::mutex> guard(pool.lock);
    auto hit = pool.free.find(bytes);
    if (hit != pool.free.end() && !hit->second.empty()) {
      block = hit->second.back();
      hit->second.pop_back();
      pool.free_bytes -= bytes;
    }
  }
  if (block == nullptr) {
    block = map_block(bytes);
    TORCH_CHECK(block != nullptr, "gradops.native: could not allocate ", bytes, " bytes");
  }
  return at::from_blob(block, sizes, [bytes](void* data) { release_block(data, bytes); }, options);
}

namespace {

// gradops.cpu._pool.empty's body once the extension is loaded.
Tensor pool_empty(std::vector<int64_t> sizes, py::handle dtype) {
  TORCH_CHECK(THPDtype_Check(dtype.ptr()), "gradops.native: pool_empty takes a torch.dtype");
  return output(sizes, at::TensorOptions().dtype(reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type));
}

// Frees every free block; returns their bytes (gradops.empty_cache).
int64_t pool_clear() {
  BlockPool& pool = block_pool();
  std::lock_guard<std::mutex> guard(pool.lock);
  const int64_t released = pool.free_bytes;
  for (auto& [bytes, list] : pool.free) {
    for (void* block : list) unmap_block(block, bytes);
  }
  pool.free.clear();
  pool.free_bytes = 0;
  return released;
}

int64_t pool_free_bytes() {
  BlockPool& pool = block_pool();
  std::lock_guard<std::mutex> guard(pool.lock);
  return pool.free_bytes;
}

}  // namespace

void gradops::register_pool(py::module_& m) {
  // The pool's lock is held across fork() (taken before, released in the parent and in the child): another thread
  // holding it at the fork would leave the child a copy that never opens, over a free list caught mid-change.
  pthread_atfork([] { block_pool().lock.lock(); }, [] { block_pool().lock.unlock(); },
                 [] {
                   forked = true;
                   block_pool().lock.unlock();
                 });
  m.attr("POOL_MIN") = kPoolMin;
  m.def("pool_empty", &pool_empty, "a contiguous CPU tensor from the output pool (1 MiB and more)");
  m.def("pool_clear", &pool_clear, "free the pool's free blocks; their bytes");
  m.def("pool_free_bytes", &pool_free_bytes, "bytes in the pool's free blocks");
}
