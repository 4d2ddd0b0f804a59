#pragma once
// The NCCL data plane (CUDA tensors), present when the build defines RANNC_HAVE_NCCL.
#include <memory>

#include "comm/communicator.h"

namespace rannc::comm {

#ifdef RANNC_HAVE_NCCL
// The communicator of all ranks for CUDA tensors, on cuda:`device` (< 0: local rank mod
// device count); created on first use (collective over all ranks). Throws CommError
// without a device, or when a later call names another device than the first.
std::shared_ptr<Communicator> worldCudaCommunicator(int device = -1);
#endif

}  // namespace rannc::comm
