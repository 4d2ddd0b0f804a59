#include "partition/stage/preference.h"

#include <algorithm>

#include "common/error.h"

namespace rannc::partition {

PlanShape planShape(const Deployment& plan) {
  PlanShape s;
  s.time = plan.iteration_time;
  s.stages = plan.numStages();
  s.micro_batches = plan.micro_batches;
  s.pipelines = plan.pipelines;
  for (const StagePlan& st : plan.stages) {
    s.replicas.push_back(static_cast<int>(st.ranks.size()) / std::max(1, plan.pipelines));
  }
  return s;
}

namespace {

int spread(const std::vector<int>& replicas) {
  if (replicas.empty()) return 0;
  const auto [lo, hi] = std::minmax_element(replicas.begin(), replicas.end());
  return *hi - *lo;
}

}  // namespace

bool simpler(const PlanShape& a, const PlanShape& b) {
  if (a.stages != b.stages) return a.stages < b.stages;
  if (a.micro_batches != b.micro_batches) return a.micro_batches < b.micro_batches;
  if (a.pipelines != b.pipelines) return a.pipelines < b.pipelines;
  const int sa = spread(a.replicas), sb = spread(b.replicas);
  if (sa != sb) return sa < sb;
  return a.replicas < b.replicas;
}

size_t preferredIndex(const std::vector<PlanShape>& plans, double tolerance) {
  RANNC_CHECK(!plans.empty(), "no plan to prefer");
  double fastest = plans[0].time;
  for (const PlanShape& p : plans) fastest = std::min(fastest, p.time);
  const double bound = fastest * (1.0 + std::max(0.0, tolerance));
  size_t best = plans.size();
  for (size_t i = 0; i < plans.size(); ++i) {
    if (!(plans[i].time <= bound)) continue;
    if (best == plans.size() || simpler(plans[i], plans[best]) ||
        (!simpler(plans[best], plans[i]) && plans[i].time < plans[best].time)) {
      best = i;
    }
  }
  return best;
}

void PreferredPlan::offer(const Deployment& plan) {
  const double t = plan.iteration_time;
  if (near_.empty() || t < fastest_) {
    fastest_ = t;
    const double bound = fastest_ * (1.0 + std::max(0.0, tolerance_));
    near_.erase(std::remove_if(near_.begin(), near_.end(),
                               [&](const Deployment& d) { return !(d.iteration_time <= bound); }),
                near_.end());
  }
  if (t <= fastest_ * (1.0 + std::max(0.0, tolerance_))) near_.push_back(plan);
}

const Deployment& PreferredPlan::choice(double tolerance) const {
  RANNC_CHECK(!near_.empty(), "no plan offered");
  std::vector<PlanShape> shapes;
  for (const Deployment& d : near_) shapes.push_back(planShape(d));
  return near_[preferredIndex(shapes, tolerance)];
}

}  // namespace rannc::partition
