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
  ValueId none() {
    ValueId v = constant("None");
    g.mutableValue(v).kind = ValueKind::None;
    return v;
  }
  // A batch tensor made by `op` from `inputs`.
  ValueId rows(const std::string& op, std::vector<ValueId> inputs) {
    ValueId out = batch(tensor(g, op));
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

TEST(ABatchReduction, IsUnknownForALossOverAValueWithoutRows) {
  // DeepSets: the rows pooled into one per set (index_add_ by a set id), then a classifier's
  // cross entropy over the sets: a function of a statistic over the rows, no mean of theirs
  LossGraph l;
  ValueId pooled = tensor(l.g, "pooled", ValueRole::Intermediate, {2, 8});
  l.g.mutableValue(pooled).batch_dependent = true;
  l.g.addTask("aten::zeros+aten::index_add_", {l.h}, {pooled});
  ValueId labels = tensor(l.g, "y", ValueRole::Input, {2});
  ValueId loss = l.scalar("aten::cross_entropy_loss", {pooled, labels, l.constant("None"), l.constant("1"),
                                                       l.constant("-100"), l.constant("0.")});
  EXPECT_EQ(batchReduction(l.g, loss), BatchReduction::Unknown);
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

TEST(ABatchReduction, SeesAProductContractingTheRowsAsASum) {
  // a confusion count, one_hot(y).t() @ one_hot(pred): [C, B] @ [B, C] -> [C, C]
  LossGraph l;
  ValueId ht = l.rows("aten::t", {l.h});
  ValueId counts = tensor(l.g, "counts", ValueRole::Intermediate, {8, 8});
  l.g.mutableValue(counts).batch_dependent = true;
  l.g.addTask("aten::mm", {ht, l.h}, {counts});
  EXPECT_EQ(batchReduction(l.g, counts), BatchReduction::Sum);
  // h @ h.t() pairs the rows ([Note: rows paired]): no reduction over them
  EXPECT_EQ(batchReduction(l.g, l.rows("aten::mm", {l.h, ht})), BatchReduction::Unknown);
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

TEST(AnOutput, HasTheTermsThatAddUpToItWithTheirKinds) {
  // loss_sum / num_items + 0.1 * aux_mean + penalty(w) - 2
  LossGraph l;
  ValueId n = tensor(l.g, "num_items", ValueRole::Input, {});
  ValueId sum = l.scalar("aten::div", {l.scalar("aten::sum", {l.h, l.none()}), n});
  ValueId aux = l.scalar("aten::mul", {l.scalar("aten::mean", {l.h, l.none()}), l.constant("0.1")});
  ValueId penalty = l.scalar("aten::sum", {tensor(l.g, "w", ValueRole::Param), l.none()});
  ValueId first = l.scalar("aten::add", {sum, aux, l.constant("1")});
  ValueId second = l.scalar("aten::add", {first, penalty, l.constant("1")});
  ValueId loss = l.scalar("aten::sub", {second, l.constant("2"), l.constant("1")});
  std::vector<OutputTerm> terms = outputTerms(l.g, loss);
  ASSERT_EQ(terms.size(), 4u);
  const TaskId add1 = l.g.value(first).producer, add2 = l.g.value(second).producer, sub = l.g.value(loss).producer;
  EXPECT_EQ(terms[0].task, add1);
  EXPECT_EQ(terms[0].input, 0u);
  EXPECT_EQ(terms[0].reduction, BatchReduction::Sum);
  EXPECT_EQ(terms[1].task, add1);  // the mean itself, under its product with a constant
  EXPECT_EQ(terms[1].input, 1u);
  EXPECT_EQ(terms[1].reduction, BatchReduction::Mean);
  EXPECT_EQ(terms[2].task, add2);
  EXPECT_TRUE(terms[2].fixed);
  EXPECT_EQ(terms[3].task, sub);
  EXPECT_EQ(terms[3].input, 1u);
  EXPECT_TRUE(terms[3].fixed);
  EXPECT_EQ(outputReduction(terms), BatchReduction::Sum);  // a sum is among them
  EXPECT_EQ(batchReduction(l.g, loss), BatchReduction::Unknown);  // as one reduction: none
}

TEST(AnOutput, CombinesAsAMeanWhereATermIsOneAndNoneASum) {
  LossGraph l;
  ValueId mean = l.scalar("aten::mean", {l.h, l.none()});
  ValueId fixed = l.scalar("aten::sum", {tensor(l.g, "w", ValueRole::Param), l.none()});
  EXPECT_EQ(outputReduction(outputTerms(l.g, l.scalar("aten::add", {mean, fixed, l.constant("1")}))),
            BatchReduction::Mean);
  ValueId odd = l.scalar("aten::exp", {mean});
  EXPECT_EQ(outputReduction(outputTerms(l.g, l.scalar("aten::add", {mean, odd, l.constant("1")}))),
            BatchReduction::Mean);  // the term of no known kind weighted by rows, as a mean's
  EXPECT_EQ(outputReduction(outputTerms(l.g, l.scalar("aten::add", {odd, fixed, l.constant("1")}))),
            BatchReduction::Unknown);
  std::vector<OutputTerm> one = outputTerms(l.g, odd);  // no + or -: the output is its one term
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].task, kNoId);
  // a product of two terms that depend on the rows is one term, of no known kind
  std::vector<OutputTerm> product = outputTerms(l.g, l.scalar("aten::mul", {mean, mean}));
  ASSERT_EQ(product.size(), 1u);
  EXPECT_EQ(product[0].reduction, BatchReduction::Unknown);
}

TEST(ATask, SelectsByDataWhereItsOpsMakeAsManyElementsAsAMaskKeeps) {
  LossGraph l;
  ValueId mask = l.rows("aten::gt", {l.x, l.constant("0")});
  l.g.mutableValue(mask).dtype = DType::Bool;
  ValueId ids = l.rows("aten::argmax", {l.h});
  l.g.mutableValue(ids).dtype = DType::Int64;
  auto task = [&](const std::string& op, std::vector<ValueId> inputs) -> const Task& {
    return l.g.task(l.g.value(l.rows(op, std::move(inputs))).producer);
  };
  EXPECT_TRUE(selectsByData(l.g, task("prim::ListConstruct+aten::index", {mask, l.h})));  // h[mask], glued
  EXPECT_TRUE(selectsByData(l.g, task("aten::nonzero", {l.h})));
  EXPECT_FALSE(selectsByData(l.g, task("prim::ListConstruct+aten::index", {l.h, ids})));  // h[ids]
  EXPECT_FALSE(selectsByData(l.g, task("prim::ListConstruct+aten::index_put", {l.h, mask, l.h})));
  EXPECT_TRUE(task("aten::zeros_like+aten::index_put_", {l.h}).runs("aten::index_put_"));
  EXPECT_FALSE(task("aten::zeros_like+aten::index_put_", {l.h}).runs("aten::index"));
}

TEST(ABatchCount, FollowsCastsAndOneClampToASumOverTheRows) {
  // (loss * mask).sum() / mask.float().sum().clamp(min=1)
  LossGraph l;
  ValueId mask = l.rows("aten::gt", {l.x, l.constant("0")});
  ValueId count = l.scalar("aten::sum", {mask, l.none()});
  ValueId clamped = l.scalar("aten::clamp", {l.scalar("aten::to", {count, l.constant("6")}), l.constant("1"), l.none()});
  std::optional<BatchCount> c = batchCount(l.g, clamped);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->counted, mask);
  EXPECT_FALSE(c->nonzero);
  EXPECT_EQ(c->clamp_min, std::optional<double>(1.0));
  ValueId sum = l.scalar("aten::sum", {l.rows("aten::mul", {l.h, mask}), l.none()});
  EXPECT_EQ(batchReduction(l.g, l.scalar("aten::div", {sum, clamped})), BatchReduction::Mean);
  // (labels != -100).count_nonzero(): no clamp
  std::optional<BatchCount> nonzero = batchCount(l.g, l.scalar("aten::count_nonzero", {mask, l.none()}));
  ASSERT_TRUE(nonzero.has_value());
  EXPECT_TRUE(nonzero->nonzero);
  EXPECT_FALSE(nonzero->clamp_min.has_value());
}

TEST(ABatchCount, FollowsProductsWithNumbersTheSameForAnyRows) {
  // (se * mask).sum() / (mask.sum().clamp(min=1) * channels * 2): channels a size, 2 a constant
  LossGraph l;
  ValueId mask = l.rows("aten::gt", {l.x, l.constant("0")});
  ValueId channels = tensor(l.g, "channels", ValueRole::Intermediate, {});
  l.g.mutableValue(channels).int_values = {3};
  l.g.mutableValue(channels).int_batch_multiples = {0};
  ValueId inside = l.scalar("aten::mul", {l.scalar("aten::sum", {mask, l.none()}), l.constant("4")});
  ValueId clamped = l.scalar("aten::clamp_min", {inside, l.constant("1")});
  ValueId count = l.scalar("aten::mul", {l.scalar("aten::mul", {clamped, channels}), l.constant("2")});
  std::optional<BatchCount> c = batchCount(l.g, count);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->counted, mask);
  EXPECT_EQ(c->inner, 4.0);
  EXPECT_EQ(c->outer, 6.0);
  // by something computed from the rows it is no count
  EXPECT_FALSE(batchCount(l.g, l.scalar("aten::mul", {inside, l.scalar("aten::sum", {l.h, l.none()})})));
}

TEST(ABatchCount, IsNoneForScalarsThatAreNotSumsOfTheShares) {
  LossGraph l;
  ValueId count = l.scalar("aten::sum", {l.h, l.none()});
  EXPECT_FALSE(batchCount(l.g, l.scalar("aten::clamp", {count, l.constant("1"), l.constant("9")})));  // a max
  ValueId once = l.scalar("aten::clamp_min", {count, l.constant("1")});
  EXPECT_FALSE(batchCount(l.g, l.scalar("aten::clamp_min", {once, l.constant("2")})));  // two clamps
  EXPECT_FALSE(batchCount(l.g, l.scalar("aten::exp", {count})));
  EXPECT_FALSE(batchCount(l.g, l.scalar("aten::neg", {count})));
  ValueId fixed = tensor(l.g, "w", ValueRole::Param);
  EXPECT_FALSE(batchCount(l.g, l.scalar("aten::sum", {fixed, l.none()})));  // not over the rows
}

TEST(AScalar, ReachesTheOutputsLinearlyOnlyAsATermOfThem) {
  LossGraph l;
  ValueId mean = l.scalar("aten::div", {l.scalar("aten::sum", {l.h, l.none()}), l.batchSize()});
  ValueId other = l.scalar("aten::mean", {l.h, l.none()});
  ValueId term = l.scalar("aten::mul", {mean, l.constant("2")});
  l.scalar("aten::add", {l.scalar("aten::to", {term, l.constant("6")}), other, l.constant("1")});
  EXPECT_TRUE(reachesOutputsLinearly(l.g, mean));
  // a normaliser of activations is the share's own
  LossGraph n;
  ValueId m = n.scalar("aten::mean", {n.h, n.none()});
  n.rows("aten::sub", {n.h, m, n.constant("1")});
  EXPECT_FALSE(reachesOutputsLinearly(n.g, m));
  // a square, a product with another share's value, a division of something by it
  for (const char* op : {"square", "product", "divides"}) {
    LossGraph q;
    ValueId v = q.scalar("aten::mean", {q.h, q.none()});
    const std::string which = op;
    if (which == "square") q.scalar("aten::mul", {v, v});
    if (which == "product") q.scalar("aten::mul", {v, q.scalar("aten::sum", {q.h, q.none()})});
    if (which == "divides") q.scalar("aten::div", {q.constant("1"), v});
    EXPECT_FALSE(reachesOutputsLinearly(q.g, v)) << op;
  }
}

}  // namespace
}  // namespace rannc::ir
