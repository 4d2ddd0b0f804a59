#include "partition/sim/schedule.h"

#include <algorithm>
#include <sstream>

#include "common/error.h"

namespace rannc::partition {

const char* scheduleName(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::OneFOneB: return "1f1b";
    case ScheduleKind::FillDrain: return "fill-drain";
    case ScheduleKind::ZeroBubbleH1: return "zb-h1";
    case ScheduleKind::Interleaved: return "interleaved";
    case ScheduleKind::Auto: return "auto";
  }
  return "?";
}

const char* actionName(ActionKind kind) {
  switch (kind) {
    case ActionKind::Forward: return "F";
    case ActionKind::Backward: return "B";
    case ActionKind::BackwardInput: return "Bi";
    case ActionKind::BackwardWeight: return "W";
  }
  return "?";
}

bool splitsBackward(ScheduleKind kind) { return kind == ScheduleKind::ZeroBubbleH1; }

namespace {

// [Note: interleaved 1F1B]: the k-th forward (backward) of every device.
Action interleavedAction(ActionKind kind, int k, int devices, int chunks) {
  const int group = devices * chunks;
  int chunk = (k % group) / devices;
  if (kind != ActionKind::Forward) chunk = chunks - 1 - chunk;
  return {kind, (k / group) * devices + k % devices, chunk};
}

std::vector<Action> interleavedDevice(int device, int devices, int micro_batches, int chunks) {
  const int total = micro_batches * chunks;
  const int warmup = std::min(total, 2 * (devices - 1 - device) + (chunks - 1) * devices);
  std::vector<Action> a;
  int f = 0, b = 0;
  for (; f < warmup; ++f) a.push_back(interleavedAction(ActionKind::Forward, f, devices, chunks));
  while (f < total) {
    a.push_back(interleavedAction(ActionKind::Forward, f++, devices, chunks));
    a.push_back(interleavedAction(ActionKind::Backward, b++, devices, chunks));
  }
  while (b < total) a.push_back(interleavedAction(ActionKind::Backward, b++, devices, chunks));
  return a;
}

}  // namespace

Schedule buildSchedule(ScheduleKind kind, int devices, int micro_batches, int chunks) {
  const int stages = devices;
  if (devices < 1 || micro_batches < 1 || chunks < 1) {
    throw InvalidGraphError("a schedule needs at least one device, micro-batch and chunk (got " +
                            std::to_string(devices) + " devices, " + std::to_string(micro_batches) +
                            " micro-batches, " + std::to_string(chunks) + " chunks)");
  }
  if (kind == ScheduleKind::Auto) {
    throw InvalidGraphError("schedule auto is a planner option: a plan names the schedule it chose");
  }
  if ((kind == ScheduleKind::Interleaved) != (chunks > 1)) {
    throw InvalidGraphError(std::string("schedule ") + scheduleName(kind) + " runs " +
                            (kind == ScheduleKind::Interleaved ? "at least 2 chunks" : "one chunk") +
                            " per device, not " + std::to_string(chunks));
  }
  Schedule s(devices);
  if (kind == ScheduleKind::Interleaved) {
    if (micro_batches % devices != 0) {
      throw InvalidGraphError("interleaved 1F1B runs micro-batches in groups of the " + std::to_string(devices) +
                              " devices; " + std::to_string(micro_batches) + " is not a multiple");
    }
    for (int d = 0; d < devices; ++d) s[d] = interleavedDevice(d, devices, micro_batches, chunks);
    return s;
  }
  for (int i = 0; i < stages; ++i) {
    auto& a = s[i];
    if (kind == ScheduleKind::FillDrain) {
      for (int m = 0; m < micro_batches; ++m) a.push_back({ActionKind::Forward, m});
      for (int m = 0; m < micro_batches; ++m) a.push_back({ActionKind::Backward, m});
      continue;
    }
    const int warmup = std::min(stages - 1 - i, micro_batches);
    const bool split = splitsBackward(kind);
    const int defer = split ? i : 0;  // [Note: ZB-H1]
    int f = 0, b = 0, w = 0;
    auto backward = [&] {
      a.push_back({split ? ActionKind::BackwardInput : ActionKind::Backward, b++});
      if (split && b - w > defer) a.push_back({ActionKind::BackwardWeight, w++});
    };
    for (; f < warmup; ++f) a.push_back({ActionKind::Forward, f});
    while (f < micro_batches) {
      a.push_back({ActionKind::Forward, f++});
      backward();
    }
    while (b < micro_batches) backward();
    while (split && w < micro_batches) a.push_back({ActionKind::BackwardWeight, w++});
  }
  return s;
}

int maxInFlight(ScheduleKind kind, int stage, int stages, int micro_batches, int chunks) {
  switch (kind) {
    case ScheduleKind::OneFOneB: return std::min(stages - stage, micro_batches);
    case ScheduleKind::ZeroBubbleH1: return std::min(stages, micro_batches);
    case ScheduleKind::FillDrain:
    case ScheduleKind::Auto: return micro_batches;
    case ScheduleKind::Interleaved: {
      const int devices = stages / chunks;
      const int device = stage % devices, chunk = stage / devices;
      int held = 0, peak = 0;
      for (const Action& a : interleavedDevice(device, devices, micro_batches, chunks)) {
        if (a.chunk != chunk) continue;
        held += a.kind == ActionKind::Forward ? 1 : -1;
        peak = std::max(peak, held);
      }
      return peak;
    }
  }
  return micro_batches;
}

void validateSchedule(const Schedule& schedule, int micro_batches, int chunks) {
  for (size_t i = 0; i < schedule.size(); ++i) {
    // per (chunk, micro-batch): 0 nothing, 1 forward done, 2 input backward done, 3 backward done
    std::vector<int> done(static_cast<size_t>(micro_batches) * chunks, 0);
    for (const Action& a : schedule[i]) {
      const int m = a.micro_batch;
      RANNC_CHECK(m >= 0 && m < micro_batches, "device " << i << " runs unknown micro-batch " << m);
      RANNC_CHECK(a.chunk >= 0 && a.chunk < chunks, "device " << i << " runs unknown chunk " << a.chunk);
      int& state = done[static_cast<size_t>(a.chunk) * micro_batches + m];
      const int before = a.kind == ActionKind::Forward         ? 0
                         : a.kind == ActionKind::BackwardWeight ? 2
                                                                : 1;
      RANNC_CHECK(state == before, "device " << i << " runs " << actionName(a.kind) << m
                                             << (chunks > 1 ? "." + std::to_string(a.chunk) : "")
                                             << (state > before ? " twice or too late" : " too early"));
      state = a.kind == ActionKind::Forward ? 1 : a.kind == ActionKind::BackwardInput ? 2 : 3;
    }
    for (size_t k = 0; k < done.size(); ++k) {
      RANNC_CHECK(done[k] == 3, "device " << i << " never finishes the backward of " << k % micro_batches
                                          << (chunks > 1 ? " on chunk " + std::to_string(k / micro_batches) : ""));
    }
  }
}

std::string formatSchedule(const Schedule& schedule) {
  bool chunked = false;
  for (const auto& list : schedule) {
    for (const Action& a : list) chunked = chunked || a.chunk > 0;
  }
  std::ostringstream os;
  for (size_t i = 0; i < schedule.size(); ++i) {
    os << i << ":";
    for (const Action& a : schedule[i]) {
      os << ' ' << actionName(a.kind) << a.micro_batch;
      if (chunked) os << '.' << a.chunk;
    }
    os << '\n';
  }
  return os.str();
}

}  // namespace rannc::partition
