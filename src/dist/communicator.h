// Communicators: the collective and point-to-point operations of a process group.
//
// Every operation has an asynchronous form that returns a Work handle at once, so
// communication overlaps compute (data parallel starts a bucket's all-reduce while
// backward goes on). The blocking forms are the asynchronous ones followed by wait().
//
// Versions: an operation writes its outputs' bytes and leaves their storages' version
// counters alone. Whether the values are new is the caller's to say (it bumps the
// version), since a collective may also restore values a saved tensor already holds
// (ZeRO-3 gathering a layer again for backward).
//
// Ownership: a Work holds the tensors of its operation (shared handles) until it
// completes, so a buffer can never be freed, reused or released while the engine still
// reads or writes it. Staging buffers the communicator allocates itself carry a
// `comm:<op>` owner (Category::Communication) in the ledger and die with the Work.
//
// Implementations: MPI (dist/mpi_communicator.h: OpenMPI, launched with mpirun, one
// worker thread per communicator issuing the MPI calls, as PyTorch's ProcessGroupMPI
// does) and the single-process one (a world of one, no MPI). Collectives take
// contiguous tensors and equal sizes on every rank, which is what NCCL offers too; the
// uneven forms are built on them here by padding, so an NCCL communicator plugs in
// behind the same interface by implementing the even ones.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tally::dist {

enum class ReduceOp { Sum, Max };

// An operation in flight.
class Work {
 public:
  virtual ~Work() = default;
  virtual bool done() = 0;  // non-blocking
  virtual void wait() = 0;  // blocks until complete; rethrows the operation's error
  // Timing on a steady clock in seconds (0 until known): when the operation was
  // submitted, started on the wire, and finished.
  virtual double submitted() const = 0;
  virtual double started() const = 0;
  virtual double finished() const = 0;
};

// What a communicator has moved so far.
struct CommStats {
  int64_t operations = 0;
  int64_t payload_bytes = 0;  // bytes of the tensors handed to operations
  double busy_seconds = 0;    // wall time operations spent running
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;  // "world", "dp", ...

  // ---- the asynchronous operations every implementation provides
  // In place over `t`, on every rank.
  virtual std::shared_ptr<Work> all_reduce_async(const Tensor& t, ReduceOp op = ReduceOp::Sum) = 0;
  // `in` holds size() * out.numel() elements; rank r receives the reduction of block r.
  virtual std::shared_ptr<Work> reduce_scatter_async(const Tensor& out, const Tensor& in,
                                                     ReduceOp op = ReduceOp::Sum) = 0;
  // `out` holds size() * in.numel() elements; block r is rank r's `in`.
  virtual std::shared_ptr<Work> all_gather_async(const Tensor& out, const Tensor& in) = 0;
  virtual std::shared_ptr<Work> broadcast_async(const Tensor& t, int root) = 0;
  // Personalised exchange (MPI_Alltoallv): `in` holds, one block after another, the
  // send_counts[r] elements for each rank r; `out` receives recv_counts[r] elements from
  // each rank r, in rank order. Counts are elements, one per rank of the group, and must
  // agree pairwise (what r sends s is what s expects from r): exchange the counts first.
  virtual std::shared_ptr<Work> all_to_all_async(const Tensor& out, const Tensor& in,
                                                 const std::vector<int64_t>& send_counts,
                                                 const std::vector<int64_t>& recv_counts) = 0;
  virtual std::shared_ptr<Work> send_async(const Tensor& t, int dst, int tag = 0) = 0;
  virtual std::shared_ptr<Work> recv_async(const Tensor& t, int src, int tag = 0) = 0;
  virtual std::shared_ptr<Work> barrier_async() = 0;
  virtual CommStats stats() const = 0;

  // ---- blocking forms
  void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::Sum) { all_reduce_async(t, op)->wait(); }
  void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op = ReduceOp::Sum) {
    reduce_scatter_async(out, in, op)->wait();
  }
  void all_gather(const Tensor& out, const Tensor& in) { all_gather_async(out, in)->wait(); }
  void broadcast(const Tensor& t, int root) { broadcast_async(t, root)->wait(); }
  void send(const Tensor& t, int dst, int tag = 0) { send_async(t, dst, tag)->wait(); }
  void recv(const Tensor& t, int src, int tag = 0) { recv_async(t, src, tag)->wait(); }
  void barrier() { barrier_async()->wait(); }
  void all_to_all(const Tensor& out, const Tensor& in, const std::vector<int64_t>& send_counts,
                  const std::vector<int64_t>& recv_counts) {
    all_to_all_async(out, in, send_counts, recv_counts)->wait();
  }

  // ---- uneven sizes, by padding every rank's block to the largest
  // Rank r contributes `in` (counts[r] elements); returns the concatenation of all ranks'
  // blocks (sum of counts elements).
  Tensor all_gather_uneven(const Tensor& in, const std::vector<int64_t>& counts);

  // What each rank will send this one, given what this one sends each rank (`counts[r]`
  // for rank r): the all-to-all of one int64 per pair that goes before an uneven exchange.
  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& counts);

  // ---- scalars, for metrics and agreement
  // Where a scalar collective's buffer lives: the host, or for a dry run's stand-in the
  // meta device, so that the dry run's ledger counts its bytes as the real run's does.
  virtual Device scalar_device() const { return Device::cpu(); }
  double all_reduce_scalar(double value, ReduceOp op);
  std::vector<double> all_gather_scalar(double value);
};

// The single-process communicator: a world of one. Every collective is the identity
// (or a copy); point-to-point to anyone is an error.
std::unique_ptr<Communicator> make_self_communicator(const std::string& name);
// A dry run's stand-in for rank `rank` of a group of `size`: every operation completes at
// once and moves nothing (its tensors are on the meta device).
std::unique_ptr<Communicator> make_meta_communicator(const std::string& name, int size, int rank);

// The MPI datatype-independent check every implementation makes: contiguous, defined,
// on the CPU (until a device communicator exists).
void check_buffer(const char* op, const Tensor& t);
// The counts and sizes of an all-to-all over a group of `size` (the error names `group`).
void check_all_to_all(const std::string& group, int size, const Tensor& out, const Tensor& in,
                      const std::vector<int64_t>& send_counts, const std::vector<int64_t>& recv_counts);

}  // namespace tally::dist
