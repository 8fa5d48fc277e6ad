// The processes of a job and how they are laid out: data, tensor, context and pipeline
// parallel.
//
// `mpirun -np W tally train --dp D --tp T --cp C --pp P` starts W processes; D * T * C * P
// must be W (D defaults to W / (T * C * P)). Ranks are laid out as Megatron-Core lays them
// out (tp-cp-dp-pp): tensor parallel fastest, then context, data and pipeline parallel,
//   rank = pp_rank * (D * C * T) + dp_rank * (C * T) + cp_rank * T + tp_rank,
// so the T ranks of a tensor-parallel group are neighbours (on one machine, where its
// traffic is heaviest), and the C ranks of a context-parallel group next. Each rank belongs
// to one group of each kind, made with MPI_Comm_split.
//
// Replicas: the D * C ranks of one (pipeline stage, tensor-parallel rank) hold the same
// parameters. The D data-parallel ranks read different batches; the C context-parallel
// ranks of one batch read different tokens of its sequences. Gradients are averaged, and
// ZeRO shards, over all D * C (the replica group); data is split over D.
//
// Expert parallel (--ep E) is carved out of the data-parallel ranks, as Megatron-Core
// carves it: data-parallel rank d is expert-parallel rank d % E of the group of the E
// neighbours d - d % E .. d - d % E + E - 1, which split a sparse layer's experts E ways
// and exchange tokens by all-to-all. The D / E data-parallel ranks with the same d % E
// hold the same experts (the expert replicas): expert gradients are averaged over them,
// every other gradient over all D replicas. E must divide D; not with --cp.
// A plain `tally train` is a world of one that never starts MPI.
#pragma once
#include <memory>
#include <string>

#include "dist/communicator.h"

namespace tally::dist {

struct ParallelConfig {
  int dp = 0;  // 0: world size / (tp * pp * cp)
  int tp = 1;
  int pp = 1;
  int cp = 1;
  int ep = 1;  // expert parallel, within the data-parallel ranks
};

// The most ranks along any one dimension (a million: past any machine MPI runs on).
inline constexpr int kMaxRanksPerDimension = 1 << 20;

class World {
 public:
  // MPI when the process was launched by mpirun, else a world of one. Checks the layout
  // against the world size and names the flags in any error.
  static std::unique_ptr<World> create(const ParallelConfig& config);
  // A world of one (no MPI), whatever launched the process.
  static std::unique_ptr<World> self();
  // A dry run's stand-in for rank `rank` of `config`'s layout over `size` ranks: the ranks,
  // sizes and groups that rank has, on communicators that move nothing (no MPI).
  static std::unique_ptr<World> stand_in(const ParallelConfig& config, int size, int rank);

  int rank() const { return rank_; }
  int size() const { return size_; }
  bool is_root() const { return rank_ == 0; }
  bool uses_mpi() const { return mpi_; }
  int dp() const { return dp_; }
  int tp() const { return tp_; }
  int pp() const { return pp_; }
  int cp() const { return cp_; }
  int ep() const { return ep_; }
  int replicas() const { return dp_ * cp_; }  // ranks holding the same parameters
  int dp_rank() const { return dp_group_->rank(); }
  int tp_rank() const { return tp_group_->rank(); }
  int pp_rank() const { return pp_group_->rank(); }
  int cp_rank() const { return cp_group_->rank(); }
  int ep_rank() const { return ep_group().rank(); }
  int replica_rank() const { return dp_rank() * cp_ + cp_rank(); }  // its rank in the replica group

  Communicator& world() const { return *world_; }
  Communicator& dp_group() const { return *dp_group_; }
  Communicator& tp_group() const { return *tp_group_; }
  Communicator& pp_group() const { return *pp_group_; }
  Communicator& cp_group() const { return *cp_group_; }
  // The D * C replicas of this rank's parameters (the data-parallel group when C is 1).
  Communicator& replica_group() const { return cp_ == 1 ? *dp_group_ : *replica_group_; }
  // The E ranks that split the experts among them (this rank alone without --ep).
  Communicator& ep_group() const { return *ep_group_; }
  // The D / E ranks holding this rank's experts (the replica group without --ep).
  Communicator& expert_replica_group() const { return ep_ == 1 ? replica_group() : *expert_replica_group_; }

  std::string describe() const;  // "4 processes: dp 4 x tp 1 x pp 1 (MPI)", "x cp C" when C > 1

  // Ends the whole job now, after printing "tally: rank R: <message>" on stderr: the other
  // ranks must not wait forever in a collective for a rank that failed.
  [[noreturn]] void abort(const std::string& message) const;
  // A rank that failed before its World existed (its layout does not fit, under mpirun):
  // ends the whole job naming itself, since ranks launched with other layouts (an mpirun
  // app context, a per-node script) fail on some ranks only and the others wait in set-up
  // for ever. Returns without MPI.
  static void end_job_if_launched(const std::string& message);

 private:
  World() = default;
  // The ep group and the expert replicas, split out of the data-parallel ranks.
  void make_expert_groups(bool meta);
  int rank_ = 0, size_ = 1, dp_ = 1, tp_ = 1, pp_ = 1, cp_ = 1, ep_ = 1;
  bool mpi_ = false;
  std::unique_ptr<Communicator> world_, dp_group_, tp_group_, pp_group_, cp_group_, replica_group_;  // owning
  std::unique_ptr<Communicator> ep_group_, expert_replica_group_;                                   // owning
};

}  // namespace tally::dist
