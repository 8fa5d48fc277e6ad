#include "dist/world.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "dist/mpi_communicator.h"

namespace tally::dist {

std::unique_ptr<World> World::self() {
  std::unique_ptr<World> w(new World());
  w->world_ = make_self_communicator("world");
  w->dp_group_ = make_self_communicator("dp");
  w->tp_group_ = make_self_communicator("tp");
  w->pp_group_ = make_self_communicator("pp");
  w->cp_group_ = make_self_communicator("cp");
  w->ep_group_ = make_self_communicator("ep");
  return w;
}

std::unique_ptr<World> World::stand_in(const ParallelConfig& c, int size, int rank) {
  const int64_t model_ranks = int64_t{c.tp} * c.pp * c.cp;
  const int dp = c.dp > 0 ? c.dp : static_cast<int>(size / std::max<int64_t>(model_ranks, 1));
  TALLY_CHECK(c.tp >= 1 && c.pp >= 1 && c.cp >= 1 && dp * model_ranks == size && rank >= 0 && rank < size,
              "a stand-in for rank ", rank, " of ", size, ": --dp ", dp, " x --tp ", c.tp, " x --cp ", c.cp, " x --pp ",
              c.pp, " is not the world size");
  std::unique_ptr<World> w(new World());
  w->rank_ = rank;
  w->size_ = size;
  w->dp_ = dp, w->tp_ = c.tp, w->pp_ = c.pp, w->cp_ = c.cp;
  const int tp_rank = rank % c.tp, cp_rank = (rank / c.tp) % c.cp, dp_rank = (rank / (c.tp * c.cp)) % dp,
            pp_rank = rank / (c.tp * c.cp * dp);
  w->world_ = make_meta_communicator("world", size, rank);
  w->dp_group_ = make_meta_communicator("dp", dp, dp_rank);
  w->tp_group_ = make_meta_communicator("tp", c.tp, tp_rank);
  w->pp_group_ = make_meta_communicator("pp", c.pp, pp_rank);
  w->cp_group_ = make_meta_communicator("cp", c.cp, cp_rank);
  if (c.cp > 1) w->replica_group_ = make_meta_communicator("replicas", dp * c.cp, dp_rank * c.cp + cp_rank);
  w->ep_ = c.ep;
  w->make_expert_groups(true);
  return w;
}

std::unique_ptr<World> World::create(const ParallelConfig& c) {
  TALLY_CHECK(c.dp >= 0, "--dp must be >= 0 (0: the world size / (tp * cp * pp)), got ", c.dp);
  TALLY_CHECK(c.tp >= 1 && c.pp >= 1 && c.cp >= 1, "--tp, --cp and --pp must be >= 1, got ", c.tp, ", ", c.cp, " and ",
              c.pp);
  // Bounded so that the product of the four fits an int64 (as ints, tp x pp = 2^32 wraps to 0).
  for (auto [flag, value] : {std::pair{"--dp", c.dp}, {"--tp", c.tp}, {"--pp", c.pp}, {"--cp", c.cp}})
    TALLY_CHECK(value <= kMaxRanksPerDimension, flag, " ", value, ": each of --dp, --tp, --cp and --pp must be at most ",
                kMaxRanksPerDimension);
  const std::string cp_factor = c.cp > 1 ? " x --cp " + std::to_string(c.cp) : "";
  if (!mpi::launched_by_mpirun()) {
    const int64_t needed = int64_t{std::max(c.dp, 1)} * c.tp * c.pp * c.cp;
    TALLY_CHECK(needed == 1, "--dp ", std::max(c.dp, 1), " x --tp ", c.tp, cp_factor, " x --pp ", c.pp, " needs ", needed,
                " processes: launch with `mpirun -np ", needed, " tally train ...`");
    TALLY_CHECK(c.ep == 1, "--ep ", c.ep, " splits the experts over ", c.ep,
                " data-parallel ranks: launch with `mpirun -np ", c.ep, " tally train ... --ep ", c.ep, "`");
    return self();
  }
  mpi::initialize();
  std::unique_ptr<World> w(new World());
  w->mpi_ = true;
  w->rank_ = mpi::world_rank();
  w->size_ = mpi::world_size();
  const int tp = c.tp, pp = c.pp, cp = c.cp;
  const int64_t model_ranks = int64_t{tp} * pp * cp;
  // Without --dp the data-parallel ranks are what the world leaves: it must be a multiple
  // of tp x cp x pp (the error names the world size, not a --dp the user did not give).
  TALLY_CHECK(c.dp > 0 || w->size_ % model_ranks == 0, "mpirun started ", w->size_, " processes, not a multiple of --tp ",
              tp, cp_factor, " x --pp ", pp, " = ", model_ranks, " (each data-parallel rank needs that many processes)");
  const int dp = c.dp > 0 ? c.dp : static_cast<int>(w->size_ / model_ranks);
  TALLY_CHECK(dp * model_ranks == w->size_, "--dp ", dp, " x --tp ", tp, cp_factor, " x --pp ", pp, " = ",
              dp * model_ranks, " processes, but mpirun started ", w->size_, " (the product must equal the world size)");
  w->dp_ = dp;
  w->tp_ = tp;
  w->pp_ = pp;
  w->cp_ = cp;
  const int r = w->rank_;
  const int tp_rank = r % tp, cp_rank = (r / tp) % cp, dp_rank = (r / (tp * cp)) % dp, pp_rank = r / (tp * cp * dp);
  // Each split's colour names the coordinates the group shares, its key orders the members.
  w->world_ = mpi::world("world");
  w->dp_group_ = mpi::split(*w->world_, (pp_rank * cp + cp_rank) * tp + tp_rank, dp_rank, "dp");
  w->tp_group_ = mpi::split(*w->world_, (pp_rank * dp + dp_rank) * cp + cp_rank, tp_rank, "tp");
  w->pp_group_ = mpi::split(*w->world_, (dp_rank * cp + cp_rank) * tp + tp_rank, pp_rank, "pp");
  w->cp_group_ = mpi::split(*w->world_, (pp_rank * dp + dp_rank) * tp + tp_rank, cp_rank, "cp");
  if (cp > 1) w->replica_group_ = mpi::split(*w->world_, pp_rank * tp + tp_rank, dp_rank * cp + cp_rank, "replicas");
  w->ep_ = c.ep;
  w->make_expert_groups(false);
  return w;
}

void World::make_expert_groups(bool meta) {
  const int E = ep_;
  TALLY_CHECK(E >= 1 && E <= kMaxRanksPerDimension, "--ep must be 1..", kMaxRanksPerDimension, ", got ", E);
  TALLY_CHECK(E == 1 || cp_ == 1, "--ep ", E, " with --cp ", cp_, ": expert parallel is carved out of the data-parallel ",
              "ranks and does not compose with context parallel yet");
  TALLY_CHECK(dp_ % E == 0, "--ep ", E, ": expert parallel is carved out of the ", dp_,
              " data-parallel ranks, so it must divide them (--dp ", dp_, ")");
  const int d = dp_rank(), ep_rank = d % E, replica = d / E;
  if (meta) {
    ep_group_ = make_meta_communicator("ep", E, ep_rank);
    if (E > 1) expert_replica_group_ = make_meta_communicator("expert_replicas", dp_ / E, replica);
    return;
  }
  // Colours name what the members share: (stage, cp rank, tp rank) and the block of E, or
  // the expert shard. Split whatever E is (E = 1: groups of one, and the data-parallel
  // group), so that every rank makes the same collective calls even when the ranks were
  // started with different --ep: the settings check after set-up then names the flag, where
  // a split only some ranks call would wait for ever.
  const int shared = (pp_rank() * cp_ + cp_rank()) * tp_ + tp_rank();
  ep_group_ = mpi::split(*world_, shared * (dp_ / E) + replica, ep_rank, "ep");
  expert_replica_group_ = mpi::split(*world_, shared * E + ep_rank, replica, "expert_replicas");
}

std::string World::describe() const {
  return std::to_string(size_) + (size_ == 1 ? " process" : " processes") + ": dp " + std::to_string(dp_) + " x tp " +
         std::to_string(tp_) + " x pp " + std::to_string(pp_) + (cp_ > 1 ? " x cp " + std::to_string(cp_) : "") +
         (ep_ > 1 ? " (ep " + std::to_string(ep_) + " within dp)" : "") + (mpi_ ? " (MPI)" : "");
}

namespace {
// Prints "tally: rank R: <message>" and ends the job (all of it under MPI).
[[noreturn]] void end_job(int rank, bool mpi, const std::string& message) {
  const std::string text = message.rfind("tally: ", 0) == 0 ? message.substr(7) : message;
  std::fprintf(stderr, "tally: rank %d: %s\n", rank, text.c_str());
  std::fflush(stderr);
  if (mpi) mpi::abort_job(1);
  std::exit(1);
}
}  // namespace

void World::abort(const std::string& message) const { end_job(rank_, mpi_, message); }

void World::end_job_if_launched(const std::string& message) {
  if (!mpi::launched_by_mpirun()) return;
  mpi::initialize();  // once per process: a no-op when create got that far
  end_job(mpi::world_rank(), true, message);
}

}  // namespace tally::dist
