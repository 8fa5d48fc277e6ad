// Data parallel: each rank runs the same model on different data, and the gradients are
// averaged over the data-parallel group before the optimizer step.
//
// The gradient block is cut into buckets of about --bucket-mb, walking the parameters
// from the last to the first (the order backward finishes them; the block is laid out by
// unit, so a bucket is a contiguous range). On a step's last microbatch, as soon as every
// parameter of a bucket has its final gradient (a post-accumulate hook on each parameter,
// which this object installs and owns; sunk gradients included) the bucket's all-reduce
// starts, in place, while backward goes on with earlier layers; finish() waits for the
// rest before the gradient norm is taken.
// The losses are scaled by 1 / (microbatches x ranks), so the sum the all-reduce makes is
// the mean a single process with all the microbatches would compute.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "dist/communicator.h"
#include "nn/parameters.h"

namespace tally::dist {

// The buckets of a parameter block: contiguous ranges of whole parameters, last first.
struct Bucket {
  int64_t begin = 0, end = 0;   // element range of the block
  size_t first = 0, last = 0;   // parameter indices [first, last)
};
std::vector<Bucket> make_buckets(const nn::ParameterStore& params, int64_t bucket_bytes);

// What the last reduction cost, for the once-per-run report.
struct ReductionStats {
  int64_t payload_bytes = 0;     // bytes all-reduced in the step (4P)
  double comm_seconds = 0;       // wall time the all-reduces ran
  double hidden_seconds = 0;     // of which while backward was still running
  int buckets = 0;
};

class GradientAllReduce final {
 public:
  GradientAllReduce(nn::ParameterStore& params, Communicator& group, int64_t bucket_bytes);
  ~GradientAllReduce();
  GradientAllReduce(const GradientAllReduce&) = delete;
  GradientAllReduce& operator=(const GradientAllReduce&) = delete;

  // The next backward is the step's last microbatch: reduce its buckets as they complete.
  void arm();
  // Starts any bucket not started yet (parameters no gradient reached), waits for all.
  void finish();
  const std::vector<Bucket>& buckets() const { return buckets_; }
  const ReductionStats& last() const { return last_; }

 private:
  void gradient_final(size_t bucket);  // a parameter of `bucket` has its final gradient
  void start(size_t bucket);

  nn::ParameterStore& params_;
  Communicator& group_;
  std::vector<Bucket> buckets_;
  std::vector<int> pending_;                  // per bucket: parameters not final yet
  std::vector<std::shared_ptr<Work>> works_;
  std::vector<HookHandle> hooks_;             // one post-accumulate hook per parameter, removed with this
  bool armed_ = false;
  double armed_at_ = 0, finished_at_ = 0;     // the last backward's span, for the share hidden behind it
  ReductionStats last_;
};

}  // namespace tally::dist
