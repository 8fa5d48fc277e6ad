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
// Expert parallel: the experts' gradients are sums over the expert-parallel group already
// (their tokens came to them from every rank of it), so they are reduced over the ranks
// holding the same experts only; a bucket never mixes the two kinds.
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
  bool experts = false;         // its parameters are experts' (see expert_group below)
};
// `expert[i]`: parameter i is an expert's (empty: none is); a bucket holds one kind.
std::vector<Bucket> make_buckets(const nn::ParameterStore& params, int64_t bucket_bytes,
                                 const std::vector<bool>& expert = {});

// What the last reduction cost, for the once-per-run report.
struct ReductionStats {
  int64_t payload_bytes = 0;     // bytes all-reduced in the step (4P)
  double comm_seconds = 0;       // wall time the all-reduces ran
  double hidden_seconds = 0;     // of which while backward was still running
  int buckets = 0;
};

class GradientAllReduce final {
 public:
  // `expert_group`, with `expert` marking the parameters it reduces: the expert replicas
  // (null: every parameter over `group`).
  GradientAllReduce(nn::ParameterStore& params, Communicator& group, int64_t bucket_bytes,
                    Communicator* expert_group = nullptr, const std::vector<bool>& expert = {});
  ~GradientAllReduce();
  GradientAllReduce(const GradientAllReduce&) = delete;
  GradientAllReduce& operator=(const GradientAllReduce&) = delete;

  // The next backward is the step's last microbatch: reduce its buckets as they complete.
  void arm();
  // Starts every bucket not started yet (parameters no gradient reached), in order: the
  // step's backward is over. Before any other collective on the group, so that each
  // rank's collectives come in the same order whichever gradients its backward reached.
  void start_rest();
  // start_rest(), then waits for all.
  void finish();
  const std::vector<Bucket>& buckets() const { return buckets_; }
  const ReductionStats& last() const { return last_; }

 private:
  void gradient_final(size_t bucket);  // a parameter of `bucket` has its final gradient
  void start(size_t bucket);

  nn::ParameterStore& params_;
  Communicator& group_;
  Communicator* expert_group_;  // null without expert parallel
  std::vector<Bucket> buckets_;
  std::vector<int> pending_;                  // per bucket: parameters not final yet
  size_t next_ = 0;                           // the first bucket not started
  std::vector<std::shared_ptr<Work>> works_;
  std::vector<HookHandle> hooks_;             // one post-accumulate hook per parameter, removed with this
  bool armed_ = false;
  bool rest_started_ = false;  // start_rest() ran since arm()
  double armed_at_ = 0, finished_at_ = 0;     // the last backward's span, for the share hidden behind it
  ReductionStats last_;
};

}  // namespace tally::dist
