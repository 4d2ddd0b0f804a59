#pragma once
// Link bandwidth from a short probe between ranks at start-up (DESIGN §5): ping-pong
// transfers of a few sizes between rank 0 and one rank on its node (intra-node) and one
// rank on another node (inter-node); bandwidth = bytes / (half the round trip), the best
// of the repetitions at the largest size. Rank 0's results are broadcast, so every rank
// plans with the same numbers.
//
// Fallbacks (documented in docs/profile.md): with one rank, or no other rank on rank 0's
// node, the intra-node figure is this process's memory-copy bandwidth (what a transfer
// between two ranks of one host costs at best); with no rank on another node, the
// inter-node figure is `fallback_inter` (the DeviceSpec default unless the caller says).
#include <cstdint>
#include <memory>
#include <vector>

namespace rannc::comm {
class Communicator;
}

namespace rannc::profile {

struct Bandwidth {
  double intra_node = 0.0;  // bytes/s
  double inter_node = 0.0;  // bytes/s
  double latency = 0.0;     // seconds of the smallest transfer's half round trip
  bool intra_measured = false;
  bool inter_measured = false;
};

// Collective over `comm` (every rank calls it). `node_of_rank[r]` is the node of rank r of
// `comm`. Blocks for well under a second with the default sizes.
Bandwidth probeBandwidth(const std::shared_ptr<comm::Communicator>& comm,
                         const std::vector<int>& node_of_rank, double fallback_inter,
                         int64_t max_bytes = 8 << 20, int repetitions = 3);

// Bytes/s of a memory copy of `bytes` on this host (best of `repetitions`).
double memcpyBandwidth(int64_t bytes = 8 << 20, int repetitions = 3);

}  // namespace rannc::profile
