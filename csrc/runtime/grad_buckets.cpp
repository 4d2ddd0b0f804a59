#include "runtime/grad_buckets.h"

#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "comm/world.h"
#include "runtime/channels.h"

namespace rannc::runtime {

GradBuckets::GradBuckets(
    std::vector<std::pair<std::shared_ptr<comm::Communicator>, std::vector<ir::ValueId>>> groups,
    std::map<ir::ValueId, at::Tensor> own, const std::map<ir::ValueId, int64_t>& bytes, bool staged,
    int64_t bucket_bytes)
    : own_(std::move(own)), staged_(staged) {
  for (auto& [comm, ids] : groups) {
    if (!comm || ids.empty()) continue;
    std::sort(ids.rbegin(), ids.rend());
    // [Note: buckets of one dtype] A bucket is one flat tensor, so its gradients share a
    // dtype: a stage with bf16 and fp32 parameters (a model cast in part by the user) had
    // its bf16 gradients summed into an fp32 bucket and handed back in fp32 (AdamW then
    // failed on the dtypes; SGD kept an fp32 momentum for a bf16 parameter).
    std::map<at::ScalarType, std::pair<Bucket, int64_t>> open;  // per dtype: bucket, bytes
    for (ir::ValueId v : ids) {
      auto [it, _] = open.try_emplace(own_.at(v).scalar_type(), Bucket{comm, {}}, 0);
      auto& [current, size] = it->second;
      current.ids.push_back(v);
      size += bytes.at(v);
      if (size >= bucket_bytes) {
        buckets_.push_back(std::move(current));
        current = Bucket{comm, {}};
        size = 0;
      }
    }
    for (auto& [_, bucket] : open) {
      if (!bucket.first.ids.empty()) buckets_.push_back(std::move(bucket.first));
    }
  }
}

GradBuckets::~GradBuckets() { disarm(); }

void GradBuckets::arm() {
  // what a step that failed midway launched must not pass for this step's
  ready_.clear();
  launched_.clear();
  none_here_.clear();
  for (const auto& b : buckets_) {
    for (ir::ValueId v : b.ids) {
      auto acc = torch::autograd::impl::grad_accumulator(own_.at(v));
      auto key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, v](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            markFinal(v);
            return outputs;
          }));
      unhook_.push_back([acc, key] { acc->del_post_hook(key); });
    }
  }
}

void GradBuckets::disarm() {
  for (auto& f : unhook_) f();
  unhook_.clear();
}

void GradBuckets::markFinal(ir::ValueId id) {
  ready_.insert(id);
  // A hook on autograd's CUDA device thread may call MPI only where MPI allows threads.
  if (staged_ && !comm::World::get().threadMultiple()) return;
  launch(false);
}

at::Tensor GradBuckets::gradOf(ir::ValueId id) const {
  const at::Tensor& t = own_.at(id);
  return t.grad().defined() ? t.grad() : at::zeros_like(t);
}

void GradBuckets::launch(bool all) {
  while (launched_.size() < buckets_.size()) {
    const Bucket& b = buckets_[launched_.size()];
    if (!all) {
      for (ir::ValueId v : b.ids) {
        if (!ready_.count(v)) return;
      }
    }
    std::vector<at::Tensor> parts;
    std::vector<int64_t> unreached;  // [Note: gradients reached elsewhere]
    for (ir::ValueId v : b.ids) {
      at::Tensor g = gradOf(v);
      if (!own_.at(v).grad().defined()) {
        unreached.push_back(static_cast<int64_t>(parts.size()));
        none_here_.insert(v);
      }
      // [Note: sparse gradients] nn.Embedding(sparse=True): summed dense over the replicas
      // (a reshape of a sparse tensor failed on every rank), then sparse again for
      // SparseAdam, its rows those of the sum that are not all zeros
      if (g.is_sparse()) {
        sparse_dims_[v] = g.sparse_dim();
        g = g.to_dense();
      }
      parts.push_back(g.reshape(-1));
    }
    // made where the gradients are: a host vector copied to a GPU from pageable memory
    // would wait for the stream, in the middle of the backward
    at::Tensor reached = at::ones({static_cast<int64_t>(parts.size())}, parts.front().options());
    for (int64_t i : unreached) reached.narrow(0, i, 1).zero_();
    parts.push_back(reached);
    at::Tensor flat = at::cat(parts);
    comm::WorkPtr work;
    if (staged_ && !flat.is_cpu()) {
      at::Tensor host = flat.to(c10::kCPU);
      work = stagedThroughHost(b.comm->allReduce(host), host, flat);
    } else {
      work = b.comm->allReduce(flat);
    }
    launched_.push_back({&b, flat, std::move(work)});
  }
}

void GradBuckets::finish(std::map<ir::ValueId, at::Tensor>& grads) {
  disarm();
  launch(true);
  for (auto& l : launched_) {
    l.work->wait();
    int64_t offset = 0;
    for (ir::ValueId v : l.bucket->ids) {
      const at::Tensor& p = own_.at(v);
      // detached: the bucket's memory, but no view of it, so .grad takes what PyTorch's
      // takes (detach_(), an in-place op with a tensor that requires grad)
      grads[v] = l.flat.narrow(0, offset, p.numel()).view(p.sizes()).detach();
      auto sparse = sparse_dims_.find(v);
      if (sparse != sparse_dims_.end()) grads[v] = grads[v].to_sparse(sparse->second);
      offset += p.numel();
    }
    // the parameters no rank's stage reached keep .grad None (one host read, only where
    // this rank's own stage did not reach one)
    for (size_t i = 0; i < l.bucket->ids.size(); ++i) {
      const ir::ValueId v = l.bucket->ids[i];
      if (none_here_.count(v) && l.flat[offset + static_cast<int64_t>(i)].item<double>() == 0.0) {
        grads[v] = at::Tensor();
      }
    }
  }
  launched_.clear();
  sparse_dims_.clear();
  none_here_.clear();
}

}  // namespace rannc::runtime
