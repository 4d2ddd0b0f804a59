// A plan read from a file (or from rank 0) is refused with the origin and the field when
// a value makes no sense, however valid its checksum: each test corrupts one field of a
// planned deployment and serialises it again, so the frame is intact and only the sense
// checks of deserializeDeployment stand between the file and the runtime.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "common/error.h"
#include "ir/serialize.h"
#include "partition/cost/analytic_cost_model.h"
#include "partition/partition_graphs.h"
#include "partition/planner.h"

namespace rannc::partition {
namespace {

class APlanFile : public ::testing::Test {
 protected:
  APlanFile() : graph_(testing::uniformChain(8)), costs_(graph_, DeviceSpec{}) {
    PlannerOptions o;
    o.world_size = 4;
    o.num_blocks = 8;
    o.num_stages = 2;
    o.memory_limit = 1LL << 40;
    plan_ = plan(graph_, costs_, o);
  }

  // The message deserializeDeployment refuses `bytes` with ("" when it accepts them).
  std::string refusal(const std::string& bytes, int64_t batch_size = 0, int world_size = 0) {
    try {
      deserializeDeployment(bytes, graph_, "plan.rannc", batch_size, world_size);
    } catch (const SerializationError& e) {
      return e.what();
    }
    return "";
  }
  std::string refusal(const Deployment& d) { return refusal(serializeDeployment(d)); }

  // A deployment payload by hand up to its stage count: the graph's hash, the format's
  // fields for `world` ranks and `batch` rows, one pipeline copy and micro-batch, 1f1b.
  ir::BinaryWriter header(int world, int64_t batch) {
    ir::BinaryWriter w;
    w.u64(graph_.contentHash());
    w.str("rannc");
    w.i32(world);
    w.i64(batch);
    w.i32(1);
    w.i32(1);
    w.u8(0);   // schedule 1f1b
    w.i32(1);  // one chunk
    w.u8(2);
    w.i64(1 << 20);
    w.f64(1.0);
    w.u8(1);
    return w;
  }

  ir::Graph graph_;
  AnalyticCostModel costs_;
  Deployment plan_;
};

// Both the file and the field must be in the message.
#define EXPECT_NAMES(msg, field)                                    \
  do {                                                              \
    const std::string m_ = (msg);                                   \
    EXPECT_EQ(m_.rfind("plan.rannc: ", 0), 0u) << m_;               \
    EXPECT_NE(m_.find(field), std::string::npos) << m_;             \
  } while (0)

TEST_F(APlanFile, AsPlannedIsAccepted) {
  ASSERT_EQ(plan_.numStages(), 2);
  EXPECT_EQ(refusal(plan_), "");
  EXPECT_EQ(refusal(serializeDeployment(plan_), plan_.batch_size, plan_.world_size), "");
}

TEST_F(APlanFile, WithACountPastItsBytesIsRefusedBeforeAllocating) {
  // The header of a valid plan, then a stage whose task count would need 2^64 bytes:
  // count x 4 wraps around to 0, which a multiplying check would let through.
  ir::BinaryWriter w = header(plan_.world_size, plan_.batch_size);
  w.u64(1);
  w.u64(1ULL << 62);
  // Bytes enough for the stage, not for its tasks.
  const std::string payload = w.bytes() + std::string(4096, '\0');
  const std::string msg = refusal(ir::frame("deployment", kDeploymentFormatVersion, payload));
  EXPECT_NAMES(msg, "stages[0].tasks");
  EXPECT_NE(msg.find("count 4611686018427387904"), std::string::npos) << msg;
}

TEST_F(APlanFile, WithAStageCountBeyondTheWorldIsRefused) {
  ir::BinaryWriter w = header(4, 8);
  w.u64(1ULL << 40);
  const std::string msg = refusal(ir::frame("deployment", kDeploymentFormatVersion, w.bytes()));
  EXPECT_NAMES(msg, "stages: count 1099511627776");
}

TEST_F(APlanFile, WithABatchOf2To40RowsIsRefused) {
  Deployment d = plan_;
  d.batch_size = 1LL << 40;
  // Alone, the rows of each replica give it away; against the model's batch, the batch.
  const std::string msg = refusal(d);
  EXPECT_NAMES(msg, "micro_batch_rows");
  EXPECT_NE(msg.find("batch_size 1099511627776"), std::string::npos) << msg;
  const std::string against_model = refusal(serializeDeployment(d), plan_.batch_size);
  EXPECT_NAMES(against_model, "batch_size");
  EXPECT_NE(against_model.find("1099511627776"), std::string::npos) << against_model;
}

TEST_F(APlanFile, ForAnotherBatchOrWorldIsRefusedSayingWhich) {
  const std::string bytes = serializeDeployment(plan_);
  EXPECT_NAMES(refusal(bytes, 2 * plan_.batch_size), "batch_size");
  EXPECT_NAMES(refusal(bytes, 0, 2 * plan_.world_size), "world_size");
}

TEST_F(APlanFile, WithANanTimeIsRefused) {
  Deployment d = plan_;
  d.stages[1].forward_time = std::numeric_limits<double>::quiet_NaN();
  EXPECT_NAMES(refusal(d), "stages[1].forward_time");
  d = plan_;
  d.iteration_time = std::numeric_limits<double>::infinity();
  EXPECT_NAMES(refusal(d), "iteration_time");
}

TEST_F(APlanFile, WithANegativeTimeIsRefused) {
  Deployment d = plan_;
  d.stages[0].backward_time = -0.5;
  EXPECT_NAMES(refusal(d), "stages[0].backward_time");
}

TEST_F(APlanFile, WithNegativeMemoryIsRefused) {
  Deployment d = plan_;
  d.stages[1].memory_bytes = -4096;
  EXPECT_NAMES(refusal(d), "stages[1].memory_bytes");
  d = plan_;
  d.memory_limit = -1;
  EXPECT_NAMES(refusal(d), "memory_limit");
}

TEST_F(APlanFile, WithImpossibleCountsIsRefused) {
  Deployment d = plan_;
  d.micro_batches = 0;
  EXPECT_NAMES(refusal(d), "micro_batches");
  d = plan_;
  d.micro_batches = static_cast<int>(d.batch_size) + 1;
  EXPECT_NAMES(refusal(d), "micro_batches");
  d = plan_;
  d.world_size = 0;
  EXPECT_NAMES(refusal(d), "world_size");
  d = plan_;
  d.pipelines = d.world_size + 1;
  EXPECT_NAMES(refusal(d), "pipelines");
  d = plan_;
  d.stages[0].ranks.push_back(d.world_size);
  EXPECT_NAMES(refusal(d), "stages[0].ranks");
  d = plan_;
  d.stages[1].ranks.clear();
  EXPECT_NAMES(refusal(d), "stages[1].ranks");
}

}  // namespace
}  // namespace rannc::partition

namespace rannc::ir {
namespace {

// A graph file's body up to its first value's dtype (batch size 4, one value named "x").
BinaryWriter graphUpToTheFirstDtype(uint8_t dtype) {
  BinaryWriter w;
  w.i64(4);
  w.u64(1);
  w.str("x");
  w.u8(0);
  w.u8(0);
  w.u8(dtype);
  return w;
}

TEST(AGraphFile, WithACountPastItsBytesIsRefusedNamingTheField) {
  BinaryWriter w = graphUpToTheFirstDtype(1);
  w.u64(1ULL << 62);  // shape: 2^62 dimensions of 8 bytes
  try {
    deserializeGraph(frame("graph", kGraphFormatVersion, w.bytes() + std::string(4096, '\0')), "model.rannc");
    FAIL() << "expected SerializationError";
  } catch (const SerializationError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("model.rannc: ", 0), 0u) << msg;
    EXPECT_NE(msg.find("values[0].shape"), std::string::npos) << msg;
  }
}

TEST(AGraphFile, WithAnUnknownDtypeIsRefusedNamingTheField) {
  BinaryWriter w = graphUpToTheFirstDtype(200);
  try {
    deserializeGraph(frame("graph", kGraphFormatVersion, w.bytes() + std::string(4096, '\0')), "model.rannc");
    FAIL() << "expected SerializationError";
  } catch (const SerializationError& e) {
    EXPECT_NE(std::string(e.what()).find("values[0].dtype"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace rannc::ir
