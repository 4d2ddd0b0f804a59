#include "profile/device_meter.h"

#include <time.h>

#include <chrono>
#include <optional>

#include <ATen/Parallel.h>

#include "common/error.h"
#include "profile/memory_counter.h"

namespace rannc::profile {
namespace {

// Seconds on `clock` (Wall or Thread) from an arbitrary origin.
double now(CpuClock clock) {
  if (clock == CpuClock::Thread) {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class CpuMeter : public DeviceMeter {
 public:
  CpuMeter(int64_t limit, CpuClock clock)
      : counter_(MemoryCounter::get()),
        saved_limit_(counter_.limit()),
        refusals_(counter_.refusals()),
        clock_(resolveCpuClock(clock)) {
    scope_.emplace();
    counter_.setLimit(limit > 0 ? counter_.current() + limit : 0);
  }
  ~CpuMeter() override {
    counter_.setLimit(saved_limit_);
    scope_.reset();
  }

  int64_t current() const override { return counter_.current(); }
  int64_t peak() const override { return counter_.peak(); }
  void resetPeak() override { counter_.resetPeak(); }
  bool refused() const override { return counter_.refusals() != refusals_; }

  void start() override { t0_ = now(clock_), split_ = false; }
  void forwardDone() override { t1_ = now(clock_); }
  void inputPartDone() override { t_input_ = now(clock_), split_ = true; }
  void backwardDone() override { t2_ = now(clock_); }
  Seconds seconds() override { return {t1_ - t0_, t2_ - t1_, split_ ? t2_ - t_input_ : -1.0}; }

 private:
  MemoryCounter& counter_;
  std::optional<MemoryCounter::Scope> scope_;
  int64_t saved_limit_;
  int64_t refusals_;
  CpuClock clock_;
  double t0_ = 0.0, t1_ = 0.0, t_input_ = 0.0, t2_ = 0.0;
  bool split_ = false;
};

}  // namespace

CpuClock cpuClockFromName(const std::string& name) {
  if (name == "auto") return CpuClock::Auto;
  if (name == "wall") return CpuClock::Wall;
  if (name == "thread") return CpuClock::Thread;
  throw Error("option profile_cpu_clock is '" + name + "'; expected auto, wall or thread");
}

const char* cpuClockName(CpuClock clock) {
  switch (clock) {
    case CpuClock::Auto: return "auto";
    case CpuClock::Wall: return "wall";
    case CpuClock::Thread: return "thread";
  }
  return "?";
}

CpuClock resolveCpuClock(CpuClock clock) {
  if (clock != CpuClock::Auto) return clock;
  return at::get_num_threads() == 1 ? CpuClock::Thread : CpuClock::Wall;
}

std::unique_ptr<DeviceMeter> makeDeviceMeter(const c10::Device& device, int64_t limit,
                                             CpuClock cpu_clock) {
  if (device.is_cpu()) return std::make_unique<CpuMeter>(limit, cpu_clock);
#ifdef RANNC_HAVE_CUDA
  if (device.is_cuda()) return makeCudaMeter(device);
#endif
  throw Error("cannot profile on device " + device.str() + " (this build measures on " +
#ifdef RANNC_HAVE_CUDA
              "cpu and cuda)"
#else
              "cpu only: it was built against a torch without CUDA)"
#endif
  );
}

c10::Device parseProfileDevice(const std::string& name) {
  std::optional<c10::Device> device;
  try {
    device.emplace(name);
  } catch (const c10::Error&) {
  }
  if (!device || !(device->is_cpu() || device->is_cuda())) {
    throw Error("profiling device is '" + name + "'; expected cpu, cuda or cuda:N");
  }
  if (device->is_cpu()) return c10::Device(c10::kCPU);
#ifdef RANNC_HAVE_CUDA
  const int count = cudaDeviceCount();
  if (count == 0) {
    throw Error("profiling device is '" + name +
                "' but this machine has no CUDA device (use device cpu)");
  }
  const int index = device->has_index() ? device->index() : cudaCurrentDevice();
  if (index < 0 || index >= count) {
    throw Error("profiling device is '" + name + "' but this machine has " +
                std::to_string(count) + " CUDA device(s)");
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
#else
  throw Error("profiling device is '" + name +
              "' but this build of rannc has no CUDA support (it was built against a torch "
              "without CUDA); use device cpu or rebuild against CUDA torch");
#endif
}

std::string deviceKind(const c10::Device& device) {
#ifdef RANNC_HAVE_CUDA
  if (device.is_cuda()) return "cuda:" + cudaDeviceName(device.index());
#endif
  return device.str();
}

}  // namespace rannc::profile
