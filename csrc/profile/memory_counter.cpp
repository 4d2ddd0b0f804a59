#include "profile/memory_counter.h"

#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

namespace rannc::profile {
namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_limit{0};
std::atomic<int64_t> g_refusals{0};

// What the counting deleter needs to free a block: the inner allocation and its size,
// found by data pointer. The context of a counted allocation is its data pointer (some
// callers, raw_allocate among them, require that), so the blocks live in a side table.
struct Block {
  c10::DataPtr inner;
  int64_t bytes;
};

std::mutex& blocksMutex() {
  static auto* m = new std::mutex();
  return *m;
}

std::unordered_map<void*, Block>& blocks() {
  static auto* table = new std::unordered_map<void*, Block>();
  return *table;
}

void deleteBlock(void* data) {
  if (data == nullptr) return;
  Block block;
  {
    std::lock_guard<std::mutex> lock(blocksMutex());
    auto it = blocks().find(data);
    if (it == blocks().end()) return;
    block = std::move(it->second);
    blocks().erase(it);
  }
  g_current.fetch_sub(block.bytes, std::memory_order_relaxed);
  // `block.inner` frees the allocation through its own deleter when it goes out of scope.
}

class CountingAllocator final : public c10::Allocator {
 public:
  void setInner(c10::Allocator* inner) { inner_ = inner; }
  c10::Allocator* inner() const { return inner_; }

  c10::DataPtr allocate(size_t n) override {
    const auto bytes = static_cast<int64_t>(n);
    const int64_t limit = g_limit.load(std::memory_order_relaxed);
    int64_t now = g_current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    if (limit > 0 && now > limit) {
      g_current.fetch_sub(bytes, std::memory_order_relaxed);
      g_refusals.fetch_add(1);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "rannc profiling: allocating ", n,
                       " bytes would pass the memory limit of ", limit, " bytes (", now - bytes,
                       " in use)");
    }
    int64_t peak = g_peak.load(std::memory_order_relaxed);
    while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
    c10::DataPtr inner;
    try {
      inner = inner_->allocate(n);
    } catch (...) {
      g_current.fetch_sub(bytes, std::memory_order_relaxed);
      throw;
    }
    void* data = inner.get();
    c10::Device device = inner.device();
    if (data == nullptr) {  // zero bytes: nothing to count or free
      g_current.fetch_sub(bytes, std::memory_order_relaxed);
      return {nullptr, nullptr, &deleteBlock, device};
    }
    {
      std::lock_guard<std::mutex> lock(blocksMutex());
      blocks()[data] = Block{std::move(inner), bytes};
    }
    return {data, data, &deleteBlock, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &deleteBlock; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  c10::Allocator* inner_ = nullptr;
};

CountingAllocator& counting() {
  static auto* allocator = new CountingAllocator();  // leaked on purpose: see the header
  return *allocator;
}

std::mutex g_scope_mutex;
int g_depth = 0;

}  // namespace

MemoryCounter& MemoryCounter::get() {
  static auto* counter = new MemoryCounter();
  return *counter;
}

MemoryCounter::Scope::Scope() {
  std::lock_guard<std::mutex> lock(g_scope_mutex);
  if (g_depth++ == 0) {
    counting().setInner(c10::GetCPUAllocator());
    c10::SetCPUAllocator(&counting(), /*priority=*/0);
  }
}

MemoryCounter::Scope::~Scope() {
  std::lock_guard<std::mutex> lock(g_scope_mutex);
  if (--g_depth == 0) c10::SetCPUAllocator(counting().inner(), /*priority=*/0);
}

int64_t MemoryCounter::current() const { return g_current.load(); }
int64_t MemoryCounter::peak() const { return g_peak.load(); }
void MemoryCounter::resetPeak() { g_peak.store(g_current.load()); }
void MemoryCounter::setLimit(int64_t bytes) { g_limit.store(bytes); }
int64_t MemoryCounter::limit() const { return g_limit.load(); }
int64_t MemoryCounter::refusals() const { return g_refusals.load(); }

}  // namespace rannc::profile
