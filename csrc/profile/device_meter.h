#pragma once
// The clock and the memory counters the profiler reads on one device (profiler.cpp).
//
// CPU: the counting allocator (memory_counter.h), installed while the meter lives and
// refusing allocations past the limit, and a clock (CpuClock): the calling thread's CPU
// time when torch runs single-threaded, else the wall clock ([Note: CPU clock]).
// CUDA (only when the build has CUDA torch, RANNC_HAVE_CUDA): CUDA events on the current
// stream, read after synchronising, and the caching allocator's statistics
// (allocated bytes, current and peak since resetPeak). The caching allocator cannot be
// given a byte limit without changing it for the whole process, so the limit is checked
// against the measured peak after each run; a real out-of-memory raises c10's
// OutOfMemoryError, counted in the allocator's `num_ooms`, and the meter's destructor
// then returns the cached blocks to the driver.
#include <cstdint>
#include <memory>
#include <string>

#include <c10/core/Device.h>

namespace rannc::profile {

// [Note: CPU clock] On a CPU shared with other processes, wall time includes the time the
// OS gave them: a piece measured while the machine is busy looks slower than the same
// work measured a minute later (bench/results/profile_vs_stage_cpu.md: +50% wall against
// 4% in CPU time across trials). With one intra-op thread every op of a piece, forward
// and backward (the autograd engine runs CPU work on the calling thread), runs on the
// calling thread, so that thread's CPU time is the wall time the piece takes on a core of
// its own, which is what the planner asks. With several intra-op threads it would miss
// the workers' time, so `Auto` then falls back to the wall clock.
enum class CpuClock {
  Auto,    // Thread when at::get_num_threads() == 1, else Wall
  Wall,    // steady clock
  Thread,  // CPU time of the calling thread (CLOCK_THREAD_CPUTIME_ID)
};

// "auto", "wall", "thread"; throws rannc::Error for another name.
CpuClock cpuClockFromName(const std::string& name);
const char* cpuClockName(CpuClock clock);
// The clock `clock` stands for now (Auto resolved for the calling thread).
CpuClock resolveCpuClock(CpuClock clock);

class DeviceMeter {
 public:
  virtual ~DeviceMeter() = default;

  // Bytes allocated on the device now, and the peak since resetPeak().
  virtual int64_t current() const = 0;
  virtual int64_t peak() const = 0;
  virtual void resetPeak() = 0;
  // Did the allocator refuse an allocation (out of memory or past the limit) since the
  // meter was made? Callers that wrap the allocator's error (the interpreter names the
  // op) are recognised by this.
  virtual bool refused() const = 0;

  // One timed run: start(), forwardDone(), backwardDone(), then seconds() (blocks until
  // the device has finished the run's work). A split backward marks the end of its input
  // part with inputPartDone() in between.
  virtual void start() = 0;
  virtual void forwardDone() = 0;
  virtual void inputPartDone() = 0;
  virtual void backwardDone() = 0;
  struct Seconds {
    double forward = 0.0;
    double backward = 0.0;  // the whole backward, split or not
    double weight = -1.0;   // a split backward's weight part (< 0: not split)
  };
  virtual Seconds seconds() = 0;
};

// A meter for `device` ("cpu", or a CUDA device with an index). `limit`: bytes the
// measurement may allocate on top of what is allocated now (0: none); enforced by the
// CPU meter's allocator, on CUDA by the caller against peak(). `cpu_clock`: the CPU
// meter's clock. Throws rannc::Error for a device this build cannot measure.
std::unique_ptr<DeviceMeter> makeDeviceMeter(const c10::Device& device, int64_t limit,
                                             CpuClock cpu_clock = CpuClock::Auto);

// The profiler's device from "cpu", "cuda" (the current CUDA device) or "cuda:N".
// Throws rannc::Error for another name, for CUDA in a build without it or on a machine
// without that device.
c10::Device parseProfileDevice(const std::string& name);

// The cache's device kind: "cpu", or "cuda:<device name>" ("cuda:NVIDIA H100 80GB HBM3"),
// so that profiles are reused on devices of the same model only.
std::string deviceKind(const c10::Device& device);

#ifdef RANNC_HAVE_CUDA
// cuda_meter.cpp
std::unique_ptr<DeviceMeter> makeCudaMeter(const c10::Device& device);
int cudaDeviceCount();
int cudaCurrentDevice();
std::string cudaDeviceName(int index);
#endif

}  // namespace rannc::profile
