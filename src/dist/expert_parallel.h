// Expert parallelism over a process group: the count exchange and the row all-to-all that
// nn/expert_parallel.h asks for, the latter as an autograd function (MPI_Alltoallv, counts
// exchanged first, as Megatron-Core's and DeepSpeed-MoE's token dispatchers do).
//
// Buffers: the rows a dispatch or combine receives are an activation of the layer
// (`ep_all_to_all` under the layer's owner), saved by the expert GEMMs that read them and
// freed with the graph; the counts are host vectors of one int64 per (rank, expert).
#pragma once
#include "dist/communicator.h"
#include "nn/expert_parallel.h"

namespace tally::dist {

class ExpertParallel final : public nn::ExpertParallelOps {
 public:
  // `group`: the expert-parallel group (not owned; outlives this).
  explicit ExpertParallel(Communicator& group) : group_(group) {}

  int size() const override { return group_.size(); }
  int rank() const override { return group_.rank(); }
  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& counts) override;
  Tensor exchange(const Tensor& rows, const std::vector<int64_t>& send_rows,
                  const std::vector<int64_t>& recv_rows) override;
  // Without a graph.
  Tensor exchanged(const Tensor& rows, const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows);

 private:
  Communicator& group_;
};

}  // namespace tally::dist
