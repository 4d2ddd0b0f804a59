#pragma once
// Peak memory of CPU work: a counting allocator wrapped around c10's CPU allocator.
//
// While a MemoryCounter::Scope is alive, every CPU tensor allocation goes through the
// counting allocator (installed with c10::SetCPUAllocator), which keeps the bytes live
// and their peak since the last reset. With a limit, an allocation that would pass it
// throws c10::OutOfMemoryError before allocating, which is how an artificial device
// memory limit makes profiling report a piece as not fitting. Allocations made under the
// scope may be freed after it (the deleter stays valid for the life of the process).
#include <cstdint>

namespace rannc::profile {

class MemoryCounter {
 public:
  // The process-wide counter (never destroyed: tensors may outlive every scope).
  static MemoryCounter& get();

  // Installs the counting allocator for its lifetime (scopes nest); restores the
  // previous CPU allocator on exit. Not for concurrent use from several threads that
  // each open scopes; allocation itself is thread-safe.
  class Scope {
   public:
    Scope();
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
  };

  int64_t current() const;  // bytes allocated through the counter and not yet freed
  int64_t peak() const;     // largest current() since resetPeak()
  void resetPeak();
  // Bytes current() may reach; an allocation past it throws c10::OutOfMemoryError.
  // 0: no limit.
  void setLimit(int64_t bytes);
  int64_t limit() const;
  // Allocations refused for the limit so far: callers that wrap c10's OutOfMemoryError
  // into another error (the interpreter names the op) are recognised by this count.
  int64_t refusals() const;
};

}  // namespace rannc::profile
