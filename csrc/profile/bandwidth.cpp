#include "profile/bandwidth.h"

#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>

#include "comm/communicator.h"

namespace rannc::profile {
namespace {

using Clock = std::chrono::steady_clock;

// Ping-pong between a and b of `bytes`; returns the best half round trip (seconds) on a,
// 0 elsewhere. Only a and b take part.
double pingPong(comm::Communicator& c, int a, int b, int64_t bytes, int repetitions) {
  const int me = c.rank();
  if (me != a && me != b) return 0.0;
  at::Tensor buf = at::zeros({std::max<int64_t>(bytes, 1)}, at::kByte);
  double best = 1e30;
  for (int i = 0; i < repetitions + 1; ++i) {  // the first round warms the connection up
    auto t0 = Clock::now();
    if (me == a) {
      c.send(buf, b, 77)->wait();
      c.recv(buf, b, 78)->wait();
    } else {
      c.recv(buf, a, 77)->wait();
      c.send(buf, a, 78)->wait();
    }
    const double half = std::chrono::duration<double>(Clock::now() - t0).count() / 2.0;
    if (i > 0) best = std::min(best, half);
  }
  return me == a ? best : 0.0;
}

}  // namespace

double memcpyBandwidth(int64_t bytes, int repetitions) {
  at::Tensor src = at::ones({bytes}, at::kByte), dst = at::empty({bytes}, at::kByte);
  double best = 1e30;
  for (int i = 0; i < repetitions + 1; ++i) {
    auto t0 = Clock::now();
    dst.copy_(src);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (i > 0) best = std::min(best, s);
  }
  return static_cast<double>(bytes) / std::max(best, 1e-9);
}

Bandwidth probeBandwidth(const std::shared_ptr<comm::Communicator>& comm,
                         const std::vector<int>& node_of_rank, double fallback_inter,
                         int64_t max_bytes, int repetitions) {
  Bandwidth bw;
  const int size = comm ? comm->size() : 1;
  int intra_peer = -1, inter_peer = -1;
  for (int r = 1; r < size && r < static_cast<int>(node_of_rank.size()); ++r) {
    if (node_of_rank[r] == node_of_rank[0] && intra_peer < 0) intra_peer = r;
    if (node_of_rank[r] != node_of_rank[0] && inter_peer < 0) inter_peer = r;
  }
  // result[0..4]: intra bandwidth, inter bandwidth, latency, intra measured, inter measured
  at::Tensor result = at::zeros({5}, at::kDouble);
  if (!comm || comm->rank() == 0) {
    result[0] = memcpyBandwidth(max_bytes, repetitions);
    result[1] = fallback_inter;
  }
  for (int kind = 0; kind < 2; ++kind) {
    const int peer = kind == 0 ? intra_peer : inter_peer;
    if (peer < 0) continue;
    const double small = pingPong(*comm, 0, peer, 8, repetitions);
    const double large = pingPong(*comm, 0, peer, max_bytes, repetitions);
    if (comm->rank() == 0) {
      // Bandwidth net of the latency a small message shows.
      result[kind] = static_cast<double>(max_bytes) / std::max(large - small, 1e-9);
      result[3 + kind] = 1.0;
      if (kind == 0 || result[2].item<double>() == 0.0) result[2] = small;
    }
  }
  if (comm && size > 1) comm->broadcast(result, 0)->wait();
  auto r = result.accessor<double, 1>();
  bw.intra_node = r[0];
  bw.inter_node = r[1];
  bw.latency = r[2];
  bw.intra_measured = r[3] != 0.0;
  bw.inter_measured = r[4] != 0.0;
  return bw;
}

}  // namespace rannc::profile
