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

std::vector<Bucket> make_buckets(const nn::ParameterStore& params, int64_t bucket_bytes, const std::vector<bool>& expert) {
  TALLY_CHECK(bucket_bytes > 0, "--bucket-mb must be positive");
  auto is_expert = [&](size_t i) { return i < expert.size() && expert[i]; };
  std::vector<Bucket> out;
  size_t i = params.size();
  while (i > 0) {
    Bucket b;
    b.last = i;
    b.experts = is_expert(i - 1);
    int64_t bytes = 0;
    while (i > 0 && is_expert(i - 1) == b.experts && (bytes == 0 || bytes + params[i - 1].nbytes() <= bucket_bytes)) {
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

GradientAllReduce::GradientAllReduce(nn::ParameterStore& params, Communicator& group, int64_t bucket_bytes,
                                     Communicator* expert_group, const std::vector<bool>& expert)
    : params_(params),
      group_(group),
      expert_group_(expert_group),
      buckets_(make_buckets(params, bucket_bytes, expert_group ? expert : std::vector<bool>{})) {
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
  next_ = 0;
}

// Buckets start in their own order only: bucket b once it and every bucket before it are
// final. Which gradients a backward reaches, and so the order buckets become final in,
// can differ between ranks (an expert no token of one rank chose), and each
// communicator's collectives must come in one order on all of them.
void GradientAllReduce::gradient_final(size_t b) {
  if (!armed_ || --pending_[b] != 0) return;
  while (next_ < buckets_.size() && pending_[next_] == 0) start(next_++);
}

void GradientAllReduce::start(size_t b) {
  const Bucket& bucket = buckets_[b];
  Communicator& group = bucket.experts ? *expert_group_ : group_;
  works_[b] = group.all_reduce_async(params_.grads_of(bucket.first, bucket.last), ReduceOp::Sum);
}

void GradientAllReduce::start_rest() {
  if (!armed_ || rest_started_) return;
  rest_started_ = true;
  finished_at_ = now_seconds();
  // Buckets no gradient reached (unused parameters) still take part: every rank must run
  // the same collectives.
  while (next_ < buckets_.size()) start(next_++);
}

void GradientAllReduce::finish() {
  start_rest();
  if (!armed_) return;
  armed_ = false;
  rest_started_ = false;
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
