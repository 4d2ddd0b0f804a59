#include "profile/device_meter.h"

#include <chrono>
#include <optional>

#include "common/error.h"
#include "profile/memory_counter.h"

namespace rannc::profile {
namespace {

using Clock = std::chrono::steady_clock;

double secondsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

class CpuMeter : public DeviceMeter {
 public:
  explicit CpuMeter(int64_t limit)
      : counter_(MemoryCounter::get()), saved_limit_(counter_.limit()), refusals_(counter_.refusals()) {
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

  void start() override { t0_ = Clock::now(); }
  void forwardDone() override { t1_ = Clock::now(); }
  void backwardDone() override { t2_ = Clock::now(); }
  Seconds seconds() override { return {secondsBetween(t0_, t1_), secondsBetween(t1_, t2_)}; }

 private:
  MemoryCounter& counter_;
  std::optional<MemoryCounter::Scope> scope_;
  int64_t saved_limit_;
  int64_t refusals_;
  Clock::time_point t0_, t1_, t2_;
};

}  // namespace

std::unique_ptr<DeviceMeter> makeDeviceMeter(const c10::Device& device, int64_t limit) {
  if (device.is_cpu()) return std::make_unique<CpuMeter>(limit);
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
