// The [N, V] gradient buffers of the C++ backend (stream_backward, loss_forward).
//
// A gradient is a fresh [N, V] buffer written once per call. On fresh pages the kernel zeroes every
// page at the first touch, which costs more than the gradient kernel itself (a 250 MB gradient:
// ~3x the time of writing into memory that is already mapped). So, as the CUDA caching allocator
// does on GPU, the largest freed gradient buffer is kept (one block, at least kMinCached bytes) and
// handed to the next call whose gradient fits in it without wasting more than half of it. New
// blocks are 2 MiB aligned and ask for transparent huge pages (512x fewer faults). The block is
// given back to the OS when a larger one replaces it or by empty_gradient_cache (kltriton.empty_cache());
// KLTRITON_CPU_GRAD_CACHE=0 keeps none. A gradient in such a block has a fixed-size storage: it cannot be
// resize_'d larger.
#include <cctype>
#include <cstdlib>
#include <mutex>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "common.h"

namespace kltriton_cpp {
namespace {

constexpr size_t kHuge = size_t{1} << 21;
constexpr size_t kMinCached = size_t{8} << 20;  // smaller gradients come from the default allocator

struct Cache {
  std::mutex mu;
  void* block = nullptr;
  size_t bytes = 0;
  // Off for 0 / false / no / off (kltriton/_env.py parses the same values and refuses any other).
  const bool enabled = [] {
    const char* env = std::getenv("KLTRITON_CPU_GRAD_CACHE");
    if (env == nullptr) return true;
    std::string value(env);
    for (char& ch : value) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return !(value == "0" || value == "false" || value == "no" || value == "off");
  }();
};

// Never destroyed: gradients may be freed during interpreter shutdown, after static destructors.
Cache& cache() {
  static Cache* c = new Cache();
  return *c;
}

void release(void* block, size_t bytes) {
  Cache& c = cache();
  void* drop = block;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    if (c.enabled && bytes > c.bytes) {  // keep the larger block
      drop = c.block;
      c.block = block;
      c.bytes = bytes;
    }
  }
  std::free(drop);
}

void* take(size_t bytes, size_t& capacity) {
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    if (c.block != nullptr && c.bytes >= bytes && c.bytes <= 2 * bytes) {
      void* block = c.block;
      capacity = c.bytes;
      c.block = nullptr;
      c.bytes = 0;
      return block;
    }
  }
  capacity = (bytes + kHuge - 1) / kHuge * kHuge;
  void* block = nullptr;
  TORCH_CHECK(posix_memalign(&block, kHuge, capacity) == 0, "kltriton_cpp: out of memory allocating ",
              capacity, " bytes for a gradient");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  (void)madvise(block, capacity, MADV_HUGEPAGE);  // only advice: a failure is harmless
#endif
  return block;
}

}  // namespace

int64_t empty_gradient_cache() {
  Cache& c = cache();
  void* block = nullptr;
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    std::swap(block, c.block);
    std::swap(bytes, c.bytes);
  }
  std::free(block);
  return static_cast<int64_t>(bytes);
}

at::Tensor gradient_buffer(int64_t N, int64_t V, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(N) * static_cast<size_t>(V) * c10::elementSize(options.dtype().toScalarType());
  if (bytes < kMinCached) return at::empty({N, V}, options);
  size_t capacity = 0;
  void* block = take(bytes, capacity);
  return at::from_blob(block, {N, V}, [capacity](void* p) { release(p, capacity); }, options);
}

}  // namespace kltriton_cpp
