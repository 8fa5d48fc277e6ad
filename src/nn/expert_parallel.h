// Expert parallelism as seen from the model (nn/): the E_ranks ranks of an expert-parallel
// group each hold n_experts / E_ranks of every sparse layer's experts (rank r experts
// r * El .. r * El + El - 1), and tokens travel to their experts' rank and back by
// all-to-all. An interface the model calls and dist/expert_parallel.h implements over the
// group, as nn/tensor_parallel.h is for tensor parallelism.
//
// A sparse layer on rank r (every rank routes its own tokens):
//   1. route: each (token, slot) pair to an expert; the pairs grouped by expert are
//      grouped by the rank that holds it;
//   2. counts: each rank tells each other how many pairs it sends each of its experts;
//   3. dispatch: the pairs' rows to their experts' ranks (all-to-all), which regroup what
//      they receive by expert and run each expert's GEMMs over its rows from every rank;
//   4. combine: the outputs go back the way they came (the reverse all-to-all), and each
//      rank weights and sums its own tokens' outputs as one process does.
// Backward runs the two exchanges in reverse: the gradient of a dispatch is the combine of
// the gradient, and the other way round.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace tally::nn {

class ExpertParallelOps {
 public:
  virtual ~ExpertParallelOps() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // `counts` holds, for each rank r of the group in turn, the pairs this rank sends each of
  // r's experts (size() x experts_per_rank); returns, source rank by source rank, what each
  // sends each of this rank's experts (the same shape).
  virtual std::vector<int64_t> exchange_counts(const std::vector<int64_t>& counts) = 0;
  // rows (n, C): send_rows[r] rows for each rank r, one block after another; returns the
  // recv_rows[s] rows from each rank s, in rank order (sum recv_rows, C). Every rank of the
  // group calls it in the same order. When rows need a graph, backward exchanges the
  // gradient back (recv_rows out, send_rows in): each rank's backward takes part in its
  // peers' exchanges only if its rows had a graph too, so a rank with no rows to send
  // passes empty rows that carry one.
  virtual Tensor exchange(const Tensor& rows, const std::vector<int64_t>& send_rows,
                          const std::vector<int64_t>& recv_rows) = 0;
};

}  // namespace tally::nn
