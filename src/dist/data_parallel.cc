#include "dist/data_parallel.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"

namespace tally::dist {

namespace {
double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

std::vector<Bucket> make_buckets(const nn::ParameterStore& params, int64_t bucket_bytes) {
  TALLY_CHECK(bucket_bytes > 0, "--bucket-mb must be positive");
  std::vector<Bucket> out;
  size_t i = params.size();
  while (i > 0) {
    Bucket b;
    b.last = i;
    int64_t bytes = 0;
    while (i > 0 && (bytes == 0 || bytes + params[i - 1].nbytes() <= bucket_bytes)) {
      bytes += params[i - 1].nbytes();
      --i;
    }
    b.first = i;
    b.begin = params.offset(b.first);
    b.end = params.offset(b.last - 1) + params[b.last - 1].numel();
    out.push_back(b);
  }
  return out;
}

GradientAllReduce::GradientAllReduce(nn::ParameterStore& params, Communicator& group, int64_t bucket_bytes)
    : params_(params), group_(group), buckets_(make_buckets(params, bucket_bytes)) {
  TALLY_CHECK(params_.has_grad_block(), "data parallel all-reduce needs the gradient block");
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (size_t i = buckets_[b].first; i < buckets_[b].last; ++i) bucket_of_[params_[i].impl()] = b;
  pending_.assign(buckets_.size(), 0);
  works_.resize(buckets_.size());
  if (group_.size() > 1) registration_.emplace(static_cast<autograd::EngineObserver&>(*this));
}

GradientAllReduce::~GradientAllReduce() = default;

void GradientAllReduce::arm() {
  if (group_.size() == 1) return;
  armed_ = true;
  for (size_t b = 0; b < buckets_.size(); ++b) pending_[b] = static_cast<int>(buckets_[b].last - buckets_[b].first);
  std::fill(works_.begin(), works_.end(), nullptr);
}

void GradientAllReduce::backward_begins(const std::vector<Tensor>&) {
  if (armed_) backward_start_ = now_seconds();
}

void GradientAllReduce::backward_ends() {
  if (armed_) backward_end_ = now_seconds();
}

void GradientAllReduce::gradient_ready(const Tensor& leaf) {
  if (!armed_) return;
  auto it = bucket_of_.find(leaf.impl());
  if (it == bucket_of_.end()) return;  // not one of our parameters
  if (--pending_[it->second] == 0) start(it->second);
}

void GradientAllReduce::start(size_t b) {
  const Bucket& bucket = buckets_[b];
  works_[b] = group_.all_reduce_async(params_.grads_of(bucket.first, bucket.last), ReduceOp::Sum);
}

void GradientAllReduce::finish() {
  if (!armed_) return;
  armed_ = false;
  // Buckets no gradient reached (unused parameters) still take part: every rank must run
  // the same collectives.
  for (size_t b = 0; b < buckets_.size(); ++b)
    if (!works_[b]) start(b);
  const Tensor& grads = params_.flat_grads();  // settles nothing: each bucket's start did
  ReductionStats s;
  s.buckets = static_cast<int>(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    works_[b]->wait();
    const double start = works_[b]->started(), end = works_[b]->finished();
    s.payload_bytes += (buckets_[b].end - buckets_[b].begin) * static_cast<int64_t>(dtype_size(grads.dtype()));
    s.comm_seconds += end - start;
    s.hidden_seconds += std::max(0.0, std::min(end, backward_end_) - std::max(start, backward_start_));
    works_[b] = nullptr;
  }
  grads.storage().bump_version();
  last_ = s;
}

}  // namespace tally::dist
