#include <gtest/gtest.h>

#include "ir/reduction.h"
#include "test_graphs.h"

namespace rannc::ir {
namespace {

using testing::tensor;

// x [B, 8] (the batch) -> h; small builders for the scalar ops on top.
struct LossGraph {
  Graph g;
  ValueId x, h;

  LossGraph() {
    x = batch(tensor(g, "x", ValueRole::Input));
    h = batch(tensor(g, "h"));
    g.setInputs({x});
    g.addTask("aten::relu", {x}, {h});
  }
  ValueId batch(ValueId v) {
    Value& val = g.mutableValue(v);
    val.batch_dim = 0;
    val.batch_multiple = 1;
    val.batch_dependent = true;
    return v;
  }
  ValueId constant(const std::string& printed) {
    Value v;
    v.kind = ValueKind::Int;
    v.role = ValueRole::Constant;
    v.constant = printed;
    return g.addValue(v);
  }
  // A scalar made by `op` from `inputs`, depending on the batch when any input does.
  ValueId scalar(const std::string& op, std::vector<ValueId> inputs) {
    ValueId out = tensor(g, op, ValueRole::Intermediate, {});
    Value& val = g.mutableValue(out);
    for (ValueId in : inputs) val.batch_dependent |= g.value(in).batch_dependent;
    g.addTask(op, inputs, {out});
    return out;
  }
  ValueId batchSize() {
    ValueId n = scalar("aten::size", {h, constant("0")});
    Value& val = g.mutableValue(n);
    val.kind = ValueKind::Int;
    val.int_values = {4};
    val.int_batch_multiples = {1};
    return n;
  }
};

TEST(ABatchReduction, ReadsTheReductionOfALossOp) {
  LossGraph l;
  ValueId target = l.batch(tensor(l.g, "y", ValueRole::Input));
  EXPECT_EQ(batchReduction(l.g, l.scalar("aten::mse_loss", {l.h, target, l.constant("1")})), BatchReduction::Mean);
  ValueId sum = l.scalar("aten::cross_entropy_loss",
                         {l.h, target, l.constant("None"), l.constant("2"), l.constant("-100"), l.constant("0.")});
  EXPECT_EQ(batchReduction(l.g, sum), BatchReduction::Sum);
}

TEST(ABatchReduction, SeesASumDividedByACountFromOutsideAsASum) {
  // transformers' num_items_in_batch: loss = cross_entropy(..., reduction="sum") / n
  LossGraph l;
  ValueId n = tensor(l.g, "num_items", ValueRole::Input, {});
  ValueId sum = l.scalar("aten::sum", {l.h, l.constant("None")});
  EXPECT_EQ(batchReduction(l.g, l.scalar("aten::div", {sum, n})), BatchReduction::Sum);
}

TEST(ABatchReduction, SeesASumDividedByTheBatchSizeAsAMean) {
  LossGraph l;
  ValueId sum = l.scalar("aten::sum", {l.h, l.constant("None")});
  EXPECT_EQ(batchReduction(l.g, l.scalar("aten::div", {sum, l.batchSize()})), BatchReduction::Mean);
}

TEST(ABatchReduction, FollowsScalarArithmeticAndCasts) {
  LossGraph l;
  ValueId mean = l.scalar("aten::mean", {l.h, l.constant("None")});
  ValueId scaled = l.scalar("aten::mul", {mean, l.constant("2")});
  ValueId cast = l.scalar("aten::to", {scaled, l.constant("6")});
  ValueId other = l.scalar("aten::mean", {l.batch(l.scalar("aten::relu", {l.h})), l.constant("None")});
  EXPECT_EQ(batchReduction(l.g, l.scalar("aten::add", {cast, other, l.constant("1")})), BatchReduction::Mean);
}

TEST(ABatchReduction, IsUnknownWhereTermsDisagreeOrAnOpIsNotArithmetic) {
  LossGraph l;
  ValueId mean = l.scalar("aten::mean", {l.h, l.constant("None")});
  ValueId sum = l.scalar("aten::sum", {l.h, l.constant("None")});
  EXPECT_EQ(batchReduction(l.g, l.scalar("aten::add", {mean, sum, l.constant("1")})), BatchReduction::Unknown);
  EXPECT_EQ(batchReduction(l.g, l.scalar("aten::exp", {sum})), BatchReduction::Unknown);
  EXPECT_EQ(batchReduction(l.g, l.scalar("aten::mul", {sum, mean})), BatchReduction::Unknown);
  EXPECT_EQ(batchReduction(l.g, l.constant("3")), BatchReduction::Unknown);
}

}  // namespace
}  // namespace rannc::ir
