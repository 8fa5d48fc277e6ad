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
  pending_.assign(buckets_.size(), 0);
  works_.resize(buckets_.size());
  if (group_.size() == 1) return;
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (size_t i = buckets_[b].first; i < buckets_[b].last; ++i)
      hooks_.push_back(params_[i].register_post_accumulate_hook([this, b](const Tensor&) { gradient_final(b); }));
}

GradientAllReduce::~GradientAllReduce() {
  for (HookHandle& h : hooks_) h.remove();
}

void GradientAllReduce::arm() {
  if (group_.size() == 1) return;
  armed_ = true;
  armed_at_ = now_seconds();
  for (size_t b = 0; b < buckets_.size(); ++b) pending_[b] = static_cast<int>(buckets_[b].last - buckets_[b].first);
  std::fill(works_.begin(), works_.end(), nullptr);
}

void GradientAllReduce::gradient_final(size_t b) {
  if (armed_ && --pending_[b] == 0) start(b);
}

void GradientAllReduce::start(size_t b) {
  const Bucket& bucket = buckets_[b];
  works_[b] = group_.all_reduce_async(params_.grads_of(bucket.first, bucket.last), ReduceOp::Sum);
}

void GradientAllReduce::finish() {
  if (!armed_) return;
  armed_ = false;
  finished_at_ = now_seconds();
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
    s.hidden_seconds += std::max(0.0, std::min(end, finished_at_) - std::max(start, armed_at_));
    works_[b] = nullptr;
  }
  grads.storage().bump_version();
  last_ = s;
}

}  // namespace tally::dist
