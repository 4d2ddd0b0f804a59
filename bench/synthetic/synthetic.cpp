#include "synthetic/synthetic.h"

#include <string>

namespace rannc::partition {
namespace {

class Builder {
 public:
  explicit Builder(int64_t batch) : batch_(batch) { g_.setBatchSize(batch); }

  // A tensor whose first dimension is the batch.
  ir::ValueId act(const std::string& name, std::vector<int64_t> rest,
                  ir::DType dtype = ir::DType::Float32) {
    ir::Value v;
    v.name = name;
    v.dtype = dtype;
    v.shape = {batch_};
    v.shape.insert(v.shape.end(), rest.begin(), rest.end());
    v.batch_dim = 0;
    v.batch_multiple = 1;
    v.batch_dependent = true;
    v.requires_grad = dtype == ir::DType::Float32;
    return g_.addValue(v);
  }
  // A tensor of `shape` (at the traced batch) whose dimension `batch_dim` is
  // `batch_multiple` x the batch.
  ir::ValueId tensor(const std::string& name, std::vector<int64_t> shape, int batch_dim,
                     int64_t batch_multiple = 1, ir::DType dtype = ir::DType::Float32) {
    ir::Value v;
    v.name = name;
    v.dtype = dtype;
    v.shape = std::move(shape);
    v.batch_dim = batch_dim;
    v.batch_multiple = batch_multiple;
    v.batch_dependent = true;
    v.requires_grad = dtype == ir::DType::Float32;
    return g_.addValue(v);
  }
  // [Note: shape values] in ir/value.h: a size the trace observed, `mult` x the batch
  // when it scales with it (0: fixed).
  ir::ValueId intValue(const std::string& name, int64_t value, int64_t mult) {
    return shapeValue(name, ir::ValueKind::Int, {}, {value}, {mult});
  }
  // The same size as a 0-dim integer tensor (prim::NumToTensor, arithmetic on sizes).
  ir::ValueId shapeTensor(const std::string& name, int64_t value, int64_t mult) {
    return shapeValue(name, ir::ValueKind::Tensor, {}, {value}, {mult});
  }
  ir::ValueId intList(const std::string& name, std::vector<int64_t> values,
                      std::vector<int64_t> mults) {
    return shapeValue(name, ir::ValueKind::IntList, {}, std::move(values), std::move(mults));
  }
  ir::ValueId param(const std::string& name, std::vector<int64_t> shape) {
    ir::Value v;
    v.name = name;
    v.role = ir::ValueRole::Param;
    v.dtype = ir::DType::Float32;
    v.shape = std::move(shape);
    v.requires_grad = true;
    return g_.addValue(v);
  }
  ir::ValueId buffer(const std::string& name, std::vector<int64_t> shape,
                     ir::DType dtype = ir::DType::Float32) {
    ir::Value v;
    v.name = name;
    v.role = ir::ValueRole::Buffer;
    v.dtype = dtype;
    v.shape = std::move(shape);
    return g_.addValue(v);
  }
  ir::ValueId constant(const std::string& text) {
    ir::Value v;
    v.name = "c" + std::to_string(g_.numValues());
    v.kind = ir::ValueKind::Int;
    v.role = ir::ValueRole::Constant;
    v.constant = text;
    return g_.addValue(v);
  }
  ir::ValueId op(const std::string& name, std::vector<ir::ValueId> in, ir::ValueId out,
                 const std::string& scope) {
    g_.addTask(name, std::move(in), {out}, scope);
    return out;
  }
  // The mean loss over the batch: the value the backward starts from, the graph's output.
  void loss(std::vector<ir::ValueId> in, const std::string& scope,
            const std::string& op_name = "aten::cross_entropy") {
    ir::Value loss;
    loss.name = "loss";
    loss.dtype = ir::DType::Float32;
    loss.batch_dependent = true;
    loss.is_loss = true;
    loss.requires_grad = true;
    ir::ValueId l = g_.addValue(loss);
    op(op_name, std::move(in), l, scope);
    g_.setOutputs({l});
  }
  void inputs(const std::vector<ir::ValueId>& in) {
    for (ir::ValueId v : in) g_.mutableValue(v).role = ir::ValueRole::Input;
    g_.setInputs(in);
  }
  ir::Graph& graph() { return g_; }

 private:
  ir::ValueId shapeValue(const std::string& name, ir::ValueKind kind, std::vector<int64_t> shape,
                         std::vector<int64_t> values, std::vector<int64_t> mults) {
    ir::Value v;
    v.name = name;
    v.kind = kind;
    if (kind == ir::ValueKind::Tensor) v.dtype = ir::DType::Int64;
    v.shape = std::move(shape);
    v.batch_dependent = true;
    v.int_values = std::move(values);
    v.int_batch_multiples = std::move(mults);
    return g_.addValue(v);
  }

  int64_t batch_;
  ir::Graph g_;
};

}  // namespace

// [Note: traced encoder layer] One layer as the frontend traces examples/models.py's BERT
// (nn.TransformerEncoderLayer, post-norm, GELU, torch 2.x): the layer runs sequence-first
// (batch in dimension 1), takes sizes of its input (aten::size -> prim::NumToTensor ->
// aten::Int), packs q/k/v out of one in-projection (unflatten, unsqueeze, transpose,
// squeeze, contiguous, select), reshapes each into heads with views whose shapes are
// built from those sizes (mul, prim::ListConstruct), calls scaled_dot_product_attention,
// and projects back in one fused task (the frontend merges reshape, linear and view
// there). 86 tasks, 83 of them non-constant (three ListConstructs of constant ints are
// cloned into their readers): 50 on sizes, 19 views, 14 kernels. The task ids in
// comments are those of layer 0 in the trace.
ir::Graph syntheticTransformer(const SyntheticTransformerOptions& o) {
  Builder b(o.batch_size);
  const int64_t B = o.batch_size, H = o.hidden, L = o.seq_len, nh = o.heads, dh = o.hidden / o.heads;
  ir::ValueId ids = b.act("input_ids", {L}, ir::DType::Int64);
  ir::ValueId labels = b.act("labels", {L}, ir::DType::Int64);
  std::vector<ir::ValueId> inputs{ids, labels};
  ir::ValueId mask = ir::kNoId;
  if (o.with_mask) {
    ir::ValueId raw = b.act("attention_mask", {L}, ir::DType::Float32);
    b.graph().mutableValue(raw).requires_grad = false;
    inputs.push_back(raw);
    ir::ValueId m1 = b.op("aten::unsqueeze", {raw, b.constant("1")}, b.act("mask1", {1, 1, L}), "embeddings");
    ir::ValueId m2 = b.op("aten::rsub", {m1, b.constant("1.0")}, b.act("mask2", {1, 1, L}), "embeddings");
    mask = b.op("aten::mul", {m2, b.constant("-10000.0")}, b.act("mask", {1, 1, L}), "embeddings");
    b.graph().mutableValue(mask).requires_grad = false;
  }
  b.inputs(inputs);
  // Embeddings: token + position (arange over the traced sequence length), layer norm.
  ir::ValueId seq = b.op("aten::size", {ids, b.constant("1")}, b.intValue("seq", L, 0), "");
  seq = b.op("prim::NumToTensor", {seq}, b.shapeTensor("seq_t", L, 0), "");
  seq = b.op("aten::ScalarImplicit", {seq}, b.intValue("seq_s", L, 0), "");
  ir::Value pos;
  pos.name = "position_ids";
  pos.dtype = ir::DType::Int64;
  pos.shape = {L};
  ir::ValueId pos_ids = b.op("aten::arange", {seq}, b.graph().addValue(pos), "");
  ir::ValueId tok_w = b.param("tok.weight", {o.vocab, H});
  ir::ValueId pos_w = b.param("pos.weight", {L, H});
  ir::ValueId tok = b.op("aten::embedding", {tok_w, ids}, b.act("tok", {L, H}), "tok");
  ir::Value pe;
  pe.name = "pos_emb";
  pe.dtype = ir::DType::Float32;
  pe.shape = {L, H};
  pe.requires_grad = true;
  ir::ValueId pemb = b.op("aten::embedding", {pos_w, pos_ids}, b.graph().addValue(pe), "pos");
  ir::ValueId h = b.op("aten::add", {tok, pemb}, b.act("emb", {L, H}), "");
  auto layerNorm = [&](ir::ValueId x, const std::string& name, std::vector<int64_t> rest,
                       int batch_dim) {
    ir::ValueId shape = b.op("prim::ListConstruct", {b.constant(std::to_string(H))},
                             b.intList(name + ".shape", {H}, {0}), name);
    ir::ValueId w = b.param(name + ".weight", {H});
    ir::ValueId bias = b.param(name + ".bias", {H});
    return b.op("aten::layer_norm", {x, shape, w, bias}, b.tensor(name, std::move(rest), batch_dim), name);
  };
  auto linear = [&](ir::ValueId x, int64_t in, int64_t out, const std::string& name,
                    std::vector<int64_t> shape, int batch_dim, const std::string& op = "aten::linear",
                    std::vector<ir::ValueId> extra = {}) {
    ir::ValueId w = b.param(name + ".weight", {out, in});
    ir::ValueId bias = b.param(name + ".bias", {out});
    std::vector<ir::ValueId> in_values{x};
    in_values.insert(in_values.end(), extra.begin(), extra.end());
    in_values.push_back(w);
    in_values.push_back(bias);
    return b.op(op, std::move(in_values), b.tensor(name, std::move(shape), batch_dim), name);
  };
  h = layerNorm(h, "ln", {B, L, H}, 0);

  for (int i = 0; i < o.layers; ++i) {
    const std::string s = "encoder.layers." + std::to_string(i);
    const std::string a = s + ".self_attn";
    auto size = [&](ir::ValueId x, int dim, int64_t value, int64_t mult) {  // size, NumToTensor
      ir::ValueId n = b.op("aten::size", {x, b.constant(std::to_string(dim))}, b.intValue(a + ".size", value, mult), a);
      return b.op("prim::NumToTensor", {n}, b.shapeTensor(a + ".size_t", value, mult), a);
    };
    auto toInt = [&](ir::ValueId t, int64_t value, int64_t mult) {
      return b.op("aten::Int", {t}, b.intValue(a + ".int", value, mult), a);
    };
    // 9-33: sequence-first input and its sizes.
    ir::ValueId x = b.op("aten::transpose", {h, b.constant("1"), b.constant("0")}, b.tensor(a + ".x", {L, B, H}, 1), a);
    ir::ValueId tL = size(x, 0, L, 0);
    ir::ValueId L1 = toInt(tL, L, 0), L2 = toInt(tL, L, 0), L3 = toInt(tL, L, 0);
    ir::ValueId tB = size(x, 1, B, 1);
    std::vector<ir::ValueId> Bs;
    for (int j = 0; j < 4; ++j) Bs.push_back(toInt(tB, B, 1));
    ir::ValueId tH = size(x, 2, H, 0);
    ir::ValueId H1 = toInt(tH, H, 0);
    ir::ValueId tdh = b.op("aten::div", {tH, b.constant(std::to_string(nh)), b.constant("trunc")},
                           b.shapeTensor(a + ".head_dim", dh, 0), a);
    std::vector<ir::ValueId> dhs;
    for (int j = 0; j < 6; ++j) dhs.push_back(toInt(tdh, dh, 0));
    ir::ValueId H2 = toInt(size(x, -1, H, 0), H, 0);
    // 34-43: packed in-projection split into q, k, v.
    ir::ValueId qkv = linear(x, H, 3 * H, a + ".in_proj", {L, B, 3 * H}, 1);
    ir::ValueId unfl = b.op("prim::ListConstruct", {b.constant("3"), H2}, b.intList(a + ".unflatten", {3, H}, {0, 0}), a);
    qkv = b.op("aten::unflatten", {qkv, b.constant("-1"), unfl}, b.tensor(a + ".qkv_u", {L, B, 3, H}, 1), a);
    qkv = b.op("aten::unsqueeze", {qkv, b.constant("0")}, b.tensor(a + ".qkv_1", {1, L, B, 3, H}, 2), a);
    qkv = b.op("aten::transpose", {qkv, b.constant("0"), b.constant("-2")}, b.tensor(a + ".qkv_t", {3, L, B, 1, H}, 2), a);
    qkv = b.op("aten::squeeze", {qkv, b.constant("-2")}, b.tensor(a + ".qkv_s", {3, L, B, H}, 2), a);
    qkv = b.op("aten::contiguous", {qkv, b.constant("0")}, b.tensor(a + ".qkv_c", {3, L, B, H}, 2), a);
    std::vector<ir::ValueId> qkv_parts;
    for (int j = 0; j < 3; ++j) {
      qkv_parts.push_back(b.op("aten::select", {qkv, b.constant("0"), b.constant(std::to_string(j))},
                               b.tensor(a + ".qkv" + std::to_string(j), {L, B, H}, 1), a));
    }
    // 44-64: each of q, k, v viewed as (L, B * heads, head_dim) and made batch-first;
    // k and v take their sequence length anew.
    std::vector<ir::ValueId> heads;
    for (int j = 0; j < 3; ++j) {
      ir::ValueId len = L3;
      if (j > 0) len = toInt(size(qkv_parts[j], 0, L, 0), L, 0);
      ir::ValueId bh = b.op("aten::mul", {tB, b.constant(std::to_string(nh))}, b.shapeTensor(a + ".bh", B * nh, nh), a);
      bh = toInt(bh, B * nh, nh);
      ir::ValueId shape = b.op("prim::ListConstruct", {len, bh, dhs[5 - j]},
                               b.intList(a + ".heads", {L, B * nh, dh}, {0, nh, 0}), a);
      ir::ValueId v = b.op("aten::view", {qkv_parts[j], shape}, b.tensor(a + ".v", {L, B * nh, dh}, 1, nh), a);
      heads.push_back(b.op("aten::transpose", {v, b.constant("0"), b.constant("1")},
                           b.tensor(a + ".t", {B * nh, L, dh}, 0, nh), a));
    }
    // 65-75: (batch, heads, L, head_dim) views and the attention kernel.
    ir::ValueId tS = size(heads[0], 1, L, 0);
    ir::ValueId S1 = toInt(tS, L, 0), S2 = toInt(tS, L, 0);
    const ir::ValueId seq_of[3] = {L2, S1, S2};
    for (int j = 0; j < 3; ++j) {
      ir::ValueId shape = b.op("prim::ListConstruct", {Bs[j], b.constant(std::to_string(nh)), seq_of[j], dhs[j]},
                               b.intList(a + ".bhld", {B, nh, L, dh}, {1, 0, 0, 0}), a);
      heads[j] = b.op("aten::view", {heads[j], shape}, b.tensor(a + ".bhld_v", {B, nh, L, dh}, 0), a);
    }
    ir::ValueId attn_mask = mask != ir::kNoId ? mask : b.constant("None");
    ir::ValueId ctx = b.op("aten::scaled_dot_product_attention",
                           {heads[0], heads[1], heads[2], attn_mask, b.constant("0.1"), b.constant("False")},
                           b.tensor(a + ".ctx", {B, nh, L, dh}, 0), a);
    // 76-82: back to (L, B, H) through the fused out-projection, then batch-first.
    ir::ValueId perm = b.op("prim::ListConstruct", {b.constant("2"), b.constant("0"), b.constant("1"), b.constant("3")},
                            b.intList(a + ".perm", {2, 0, 1, 3}, {0, 0, 0, 0}), a);
    ctx = b.op("aten::permute", {ctx, perm}, b.tensor(a + ".ctx_p", {L, B, nh, dh}, 1), a);
    ir::ValueId bl = b.op("aten::mul", {tB, tL}, b.shapeTensor(a + ".rows", B * L, L), a);
    bl = toInt(bl, B * L, L);
    ir::ValueId flat = b.op("prim::ListConstruct", {bl, H1}, b.intList(a + ".flat", {B * L, H}, {L, 0}), a);
    ir::ValueId att = linear(ctx, H, H, a + ".out_proj", {L, B, H}, 1,
                             "aten::reshape+aten::linear+aten::size+prim::NumToTensor+aten::Int+"
                             "prim::ListConstruct+aten::view",
                             {flat, L1, Bs[3]});
    att = b.op("aten::transpose", {att, b.constant("1"), b.constant("0")}, b.tensor(a + ".out", {B, L, H}, 0), a);
    // 83-94: residuals, layer norms and the GELU feed-forward, batch-first.
    att = b.op("aten::dropout", {att, b.constant("0.1"), b.constant("True")}, b.act(s + ".dropout1", {L, H}), s + ".dropout1");
    att = b.op("aten::add", {h, att, b.constant("1")}, b.act(s + ".res1", {L, H}), s);
    ir::ValueId h1 = layerNorm(att, s + ".norm1", {B, L, H}, 0);
    ir::ValueId f = linear(h1, H, 4 * H, s + ".linear1", {B, L, 4 * H}, 0);
    f = b.op("aten::gelu", {f, b.constant("none")}, b.act(s + ".gelu", {L, 4 * H}), s);
    f = b.op("aten::dropout", {f, b.constant("0.1"), b.constant("True")}, b.act(s + ".dropout", {L, 4 * H}), s + ".dropout");
    f = linear(f, 4 * H, H, s + ".linear2", {B, L, H}, 0);
    f = b.op("aten::dropout", {f, b.constant("0.1"), b.constant("True")}, b.act(s + ".dropout2", {L, H}), s + ".dropout2");
    f = b.op("aten::add", {h1, f, b.constant("1")}, b.act(s + ".res2", {L, H}), s);
    h = layerNorm(f, s + ".norm2", {B, L, H}, 0);
  }
  // Head: dense + GELU + layer norm, a decoder tied to the token embedding, the loss over
  // (B * L) rows.
  ir::ValueId t = linear(h, H, H, "head.0", {B, L, H}, 0);
  t = b.op("aten::gelu", {t, b.constant("none")}, b.act("head.1", {L, H}), "head.1");
  t = layerNorm(t, "head.2", {B, L, H}, 0);
  ir::ValueId dec_b = b.param("decoder.bias", {o.vocab});
  ir::ValueId logits = b.op("aten::linear", {t, tok_w, dec_b}, b.act("decoder", {L, o.vocab}), "decoder");
  ir::ValueId nv = b.op("aten::size", {logits, b.constant("-1")}, b.intValue("vocab", o.vocab, 0), "");
  nv = b.op("prim::NumToTensor", {nv}, b.shapeTensor("vocab_t", o.vocab, 0), "");
  nv = b.op("aten::Int", {nv}, b.intValue("vocab_i", o.vocab, 0), "");
  ir::ValueId shape = b.op("prim::ListConstruct", {b.constant("-1"), nv}, b.intList("logits_shape", {-1, o.vocab}, {0, 0}), "");
  logits = b.op("aten::view", {logits, shape}, b.tensor("logits", {B * L, o.vocab}, 0, L), "");
  ir::ValueId flat = b.op("prim::ListConstruct", {b.constant("-1")}, b.intList("labels_shape", {-1}, {0}), "");
  ir::ValueId flat_labels = b.op("aten::view", {labels, flat}, b.tensor("labels_flat", {B * L}, 0, L, ir::DType::Int64), "");
  b.loss({logits, flat_labels}, "", "aten::cross_entropy_loss");
  return std::move(b.graph());
}

ir::Graph syntheticGpt(const SyntheticGptOptions& o) {
  Builder b(o.batch_size);
  const int64_t H = o.hidden, L = o.seq_len, nh = o.heads, dh = o.hidden / o.heads;
  ir::ValueId ids = b.act("input_ids", {L}, ir::DType::Int64);
  ir::ValueId labels = b.act("labels", {L}, ir::DType::Int64);
  b.inputs({ids, labels});
  // Position ids are baked into the trace (arange): a constant task cloned into its reader.
  ir::Value pos;
  pos.name = "position_ids";
  pos.dtype = ir::DType::Int64;
  pos.shape = {1, L};
  ir::ValueId pos_ids = b.op("aten::arange", {b.constant(std::to_string(L))}, b.graph().addValue(pos), "transformer");
  ir::ValueId wte = b.param("transformer.wte.weight", {o.vocab, H});
  ir::ValueId wpe = b.param("transformer.wpe.weight", {L, H});
  ir::ValueId tok = b.op("aten::embedding", {wte, ids}, b.act("tok_emb", {L, H}), "transformer");
  ir::Value pe;
  pe.name = "pos_emb";
  pe.dtype = ir::DType::Float32;
  pe.shape = {1, L, H};
  pe.requires_grad = true;
  ir::ValueId pemb = b.op("aten::embedding", {wpe, pos_ids}, b.graph().addValue(pe), "transformer");
  ir::ValueId h = b.op("aten::add", {tok, pemb}, b.act("emb", {L, H}), "transformer");
  h = b.op("aten::dropout", {h, b.constant("0.1")}, b.act("emb_d", {L, H}), "transformer");

  auto linear = [&](ir::ValueId x, int64_t in, int64_t out, const std::string& name,
                    std::vector<int64_t> out_rest, const std::string& scope) {
    ir::ValueId w = b.param(scope + "." + name + ".weight", {out, in});
    ir::ValueId bias = b.param(scope + "." + name + ".bias", {out});
    return b.op("aten::linear", {x, w, bias}, b.act(scope + "." + name, std::move(out_rest)), scope);
  };
  auto layerNorm = [&](ir::ValueId x, const std::string& name) {
    ir::ValueId w = b.param(name + ".weight", {H});
    ir::ValueId bias = b.param(name + ".bias", {H});
    return b.op("aten::layer_norm", {x, w, bias}, b.act(name, {L, H}), name);
  };
  for (int i = 0; i < o.layers; ++i) {
    const std::string s = "transformer.h." + std::to_string(i);
    ir::ValueId x = layerNorm(h, s + ".ln_1");
    ir::ValueId qkv = linear(x, H, 3 * H, "attn.c_attn", {L, 3 * H}, s);
    auto heads = [&](const std::string& name, int part) {
      ir::ValueId p = b.op("aten::slice", {qkv, b.constant("2," + std::to_string(part * H))},
                           b.act(s + "." + name, {L, H}), s);
      ir::ValueId v = b.op("aten::view", {p, b.constant("shape")}, b.act(s + "." + name + "_v", {L, nh, dh}), s);
      return b.op("aten::permute", {v, b.constant("0,2,1,3")}, b.act(s + "." + name + "_t", {nh, L, dh}), s);
    };
    ir::ValueId q = heads("q", 0), k = heads("k", 1), v = heads("v", 2);
    ir::ValueId kt = b.op("aten::transpose", {k, b.constant("-1,-2")}, b.act(s + ".kt", {nh, dh, L}), s);
    ir::ValueId sc = b.op("aten::matmul", {q, kt}, b.act(s + ".scores", {nh, L, L}), s);
    sc = b.op("aten::div", {sc, b.constant("8.0")}, b.act(s + ".scaled", {nh, L, L}), s);
    // The causal mask is a per-layer buffer, as in GPT-2 (attn.bias).
    ir::ValueId causal = b.buffer(s + ".attn.bias", {1, 1, L, L}, ir::DType::Bool);
    sc = b.op("aten::where", {causal, sc, b.constant("-inf")}, b.act(s + ".masked", {nh, L, L}), s);
    ir::ValueId p = b.op("aten::softmax", {sc, b.constant("-1")}, b.act(s + ".probs", {nh, L, L}), s);
    p = b.op("aten::dropout", {p, b.constant("0.1")}, b.act(s + ".probs_d", {nh, L, L}), s);
    ir::ValueId ctx = b.op("aten::matmul", {p, v}, b.act(s + ".ctx", {nh, L, dh}), s);
    ctx = b.op("aten::permute", {ctx, b.constant("0,2,1,3")}, b.act(s + ".ctx_t", {L, nh, dh}), s);
    ctx = b.op("aten::reshape", {ctx, b.constant("shape")}, b.act(s + ".ctx_r", {L, H}), s);
    ir::ValueId att = linear(ctx, H, H, "attn.c_proj", {L, H}, s);
    att = b.op("aten::dropout", {att, b.constant("0.1")}, b.act(s + ".att_d", {L, H}), s);
    h = b.op("aten::add", {att, h}, b.act(s + ".res1", {L, H}), s);
    x = layerNorm(h, s + ".ln_2");
    ir::ValueId f = linear(x, H, 4 * H, "mlp.c_fc", {L, 4 * H}, s);
    f = b.op("aten::gelu", {f}, b.act(s + ".gelu", {L, 4 * H}), s);
    f = linear(f, 4 * H, H, "mlp.c_proj", {L, H}, s);
    f = b.op("aten::dropout", {f, b.constant("0.1")}, b.act(s + ".mlp_d", {L, H}), s);
    h = b.op("aten::add", {f, h}, b.act(s + ".res2", {L, H}), s);
  }
  h = layerNorm(h, "transformer.ln_f");
  // Tied LM head: the token embedding's weight, no bias.
  ir::ValueId logits = b.op("aten::linear", {h, wte}, b.act("lm_head", {L, o.vocab}), "lm_head");
  b.loss({logits, labels}, "lm_head");
  return std::move(b.graph());
}

ir::Graph syntheticResNet(const SyntheticResNetOptions& o) {
  Builder b(o.batch_size);
  const int64_t w = o.width_factor;
  ir::ValueId image = b.act("images", {3, o.image, o.image});
  b.graph().mutableValue(image).requires_grad = false;
  ir::ValueId labels = b.act("labels", {}, ir::DType::Int64);
  b.inputs({image, labels});
  int64_t size = o.image;  // spatial side of the current activation
  auto conv = [&](ir::ValueId x, int64_t in, int64_t out, int64_t kernel, int64_t stride,
                  const std::string& name) {
    ir::ValueId wt = b.param(name + ".weight", {out, in, kernel, kernel});
    const int64_t pad = kernel / 2;
    const int64_t side = (size + 2 * pad - kernel) / stride + 1;
    return b.op("aten::conv2d",
                {x, wt, b.constant(std::to_string(stride)), b.constant(std::to_string(pad))},
                b.act(name, {out, side, side}), name);
  };
  auto bn = [&](ir::ValueId x, int64_t ch, int64_t side, const std::string& name) {
    ir::ValueId wt = b.param(name + ".weight", {ch});
    ir::ValueId bias = b.param(name + ".bias", {ch});
    ir::ValueId mean = b.buffer(name + ".running_mean", {ch});
    ir::ValueId var = b.buffer(name + ".running_var", {ch});
    return b.op("aten::batch_norm", {x, wt, bias, mean, var}, b.act(name, {ch, side, side}), name);
  };
  auto relu = [&](ir::ValueId x, int64_t ch, int64_t side, const std::string& name) {
    return b.op("aten::relu_", {x}, b.act(name + ".relu", {ch, side, side}), name);
  };
  int64_t ch = 64 * w;
  ir::ValueId x = conv(image, 3, ch, 7, 2, "conv1");
  size = (size + 6 - 7) / 2 + 1;
  x = relu(bn(x, ch, size, "bn1"), ch, size, "bn1");
  size = (size + 2 - 3) / 2 + 1;
  x = b.op("aten::max_pool2d", {x, b.constant("3,2,1")}, b.act("maxpool", {ch, size, size}), "maxpool");
  for (size_t stage = 0; stage < o.blocks.size(); ++stage) {
    const int64_t mid = (64 << stage) * w, out = 4 * mid;
    for (int i = 0; i < o.blocks[stage]; ++i) {
      const std::string s = "layer" + std::to_string(stage + 1) + "." + std::to_string(i);
      const int64_t stride = (i == 0 && stage > 0) ? 2 : 1;
      const int64_t in_size = size, out_size = (size + 2 - 3) / stride + 1;
      ir::ValueId y = conv(x, ch, mid, 1, 1, s + ".conv1");
      y = relu(bn(y, mid, in_size, s + ".bn1"), mid, in_size, s + ".bn1");
      y = conv(y, mid, mid, 3, stride, s + ".conv2");
      size = out_size;
      y = relu(bn(y, mid, size, s + ".bn2"), mid, size, s + ".bn2");
      y = bn(conv(y, mid, out, 1, 1, s + ".conv3"), out, size, s + ".bn3");
      ir::ValueId shortcut = x;
      if (i == 0) {
        // Projection shortcut: a strided 1x1 conv from the block's input side.
        size = in_size;
        ir::ValueId d = conv(x, ch, out, 1, stride, s + ".downsample.0");
        size = out_size;
        shortcut = bn(d, out, size, s + ".downsample.1");
      }
      y = b.op("aten::add_", {y, shortcut}, b.act(s + ".add", {out, size, size}), s);
      x = relu(y, out, size, s);
      ch = out;
    }
  }
  x = b.op("aten::adaptive_avg_pool2d", {x, b.constant("1,1")}, b.act("avgpool", {ch, 1, 1}), "avgpool");
  x = b.op("aten::flatten", {x, b.constant("1")}, b.act("flatten", {ch}), "avgpool");
  ir::ValueId fw = b.param("fc.weight", {o.classes, ch});
  ir::ValueId fb = b.param("fc.bias", {o.classes});
  ir::ValueId logits = b.op("aten::linear", {x, fw, fb}, b.act("fc", {o.classes}), "fc");
  b.loss({logits, labels}, "fc");
  return std::move(b.graph());
}

}  // namespace rannc::partition
