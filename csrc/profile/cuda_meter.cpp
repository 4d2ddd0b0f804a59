// The profiler's meter on a CUDA device: CUDA events for time and the caching allocator's
// statistics for memory (device_meter.h). Compiled only when the torch build has CUDA
// (RANNC_HAVE_CUDA); without it the file is empty and device_meter.cpp refuses CUDA.
#ifdef RANNC_HAVE_CUDA

#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "common/error.h"
#include "profile/device_meter.h"

namespace rannc::profile {
namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;

constexpr size_t kAggregate = static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE);

class CudaEvent {
 public:
  CudaEvent() { C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDefault)); }
  ~CudaEvent() { cudaEventDestroy(event_); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  void record(cudaStream_t stream) { C10_CUDA_CHECK(cudaEventRecord(event_, stream)); }
  void synchronize() { C10_CUDA_CHECK(cudaEventSynchronize(event_)); }
  // Seconds from `earlier` to this event (both recorded and complete).
  double secondsSince(const CudaEvent& earlier) const {
    float ms = 0.0f;
    C10_CUDA_CHECK(cudaEventElapsedTime(&ms, earlier.event_, event_));
    return static_cast<double>(ms) * 1e-3;
  }

 private:
  cudaEvent_t event_ = nullptr;
};

class CudaMeter : public DeviceMeter {
 public:
  explicit CudaMeter(const c10::Device& device)
      : guard_(device), index_(device.index()), ooms_(stats().num_ooms) {}
  ~CudaMeter() override {
    // After an out-of-memory the blocks the failed run left cached would crowd the next
    // measurement (and the training that follows): give them back to the driver.
    if (refused()) {
      try {
        alloc::emptyCache();
      } catch (...) {
      }
    }
  }

  int64_t current() const override { return stats().allocated_bytes[kAggregate].current; }
  int64_t peak() const override { return stats().allocated_bytes[kAggregate].peak; }
  void resetPeak() override { alloc::resetPeakStats(index_); }
  bool refused() const override { return stats().num_ooms != ooms_; }

  void start() override { start_.record(stream()), split_ = false; }
  void forwardDone() override { forward_.record(stream()); }
  void inputPartDone() override { input_part_.record(stream()), split_ = true; }
  void backwardDone() override { backward_.record(stream()); }
  Seconds seconds() override {
    backward_.synchronize();
    return {forward_.secondsSince(start_), backward_.secondsSince(forward_),
            split_ ? backward_.secondsSince(input_part_) : -1.0};
  }

 private:
  c10::cuda::CUDAStream stream() const { return c10::cuda::getCurrentCUDAStream(index_); }
  c10::CachingDeviceAllocator::DeviceStats stats() const { return alloc::getDeviceStats(index_); }

  c10::cuda::CUDAGuard guard_;  // the measured device is current while the meter lives
  c10::DeviceIndex index_;
  int64_t ooms_;
  CudaEvent start_, forward_, input_part_, backward_;
  bool split_ = false;
};

}  // namespace

std::unique_ptr<DeviceMeter> makeCudaMeter(const c10::Device& device) {
  RANNC_CHECK(device.is_cuda() && device.has_index(), "a CUDA meter needs cuda:N, got " << device.str());
  // The caching allocator's statistics exist only once CUDA is initialised in this process;
  // a rank that profiles before it ever made a CUDA tensor got "Invalid device argument".
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  return std::make_unique<CudaMeter>(device);
}

int cudaDeviceCount() { return static_cast<int>(c10::cuda::device_count()); }

int cudaCurrentDevice() { return static_cast<int>(c10::cuda::current_device()); }

std::string cudaDeviceName(int index) {
  cudaDeviceProp prop;
  C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  return prop.name;
}

}  // namespace rannc::profile

#endif  // RANNC_HAVE_CUDA
