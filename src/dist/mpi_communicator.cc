#include "dist/mpi_communicator.h"

#include <malloc.h>
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "core/error.h"

namespace tally::dist::mpi {

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

MPI_Datatype mpi_type(DType t, const char* op) {
  switch (t) {
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    case DType::I32: return MPI_INT32_T;
    case DType::I64: return MPI_INT64_T;
    case DType::BF16:
    case DType::U16: return MPI_UINT16_T;
  }
  TALLY_FAIL(op, ": no MPI type for ", dtype_name(t));
}

MPI_Op mpi_op(ReduceOp op, DType t) {
  TALLY_CHECK(t != DType::BF16 && t != DType::U16, "reductions over ", dtype_name(t),
              " are not supported by the MPI communicator (reduce in float32)");
  return op == ReduceOp::Sum ? MPI_SUM : MPI_MAX;
}

int count_of(const Tensor& t, const char* op) {
  TALLY_CHECK(t.numel() <= INT_MAX, op, ": ", t.str(), " has ", t.numel(), " elements, more than one MPI call carries (",
              INT_MAX, ")");
  return static_cast<int>(t.numel());
}

class MpiWork final : public Work {
 public:
  MpiWork(std::function<void()> run, std::vector<Tensor> buffers)
      : run_(std::move(run)), buffers_(std::move(buffers)), submitted_(now_seconds()) {}

  bool done() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  void wait() override {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  double submitted() const override { return submitted_; }
  double started() const override { return started_.load(); }
  double finished() const override { return finished_.load(); }

  // On the worker thread.
  void execute() {
    started_ = now_seconds();
    std::exception_ptr error;
    try {
      run_();
    } catch (...) {
      error = std::current_exception();
    }
    finished_ = now_seconds();
    std::function<void()>().swap(run_);
    // The operation is over: its buffers are the caller's alone again. Drop them before
    // announcing completion, so a caller that waited sees no reference left behind.
    buffers_.clear();
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = error;
    done_ = true;
    cv_.notify_all();
  }

 private:
  std::function<void()> run_;
  std::vector<Tensor> buffers_;  // owning: alive while the operation may touch them
  double submitted_;
  std::atomic<double> started_{0}, finished_{0};
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name) : comm_(comm), name_(std::move(name)) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    worker_ = std::thread([this] { work(); });
  }
  ~MpiCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm_ != MPI_COMM_WORLD) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  MPI_Comm comm() const { return comm_; }

  std::shared_ptr<Work> all_reduce_async(const Tensor& t, ReduceOp op) override {
    check_buffer("all_reduce", t);
    const int n = count_of(t, "all_reduce");
    const MPI_Datatype type = mpi_type(t.dtype(), "all_reduce");
    const MPI_Op mop = mpi_op(op, t.dtype());
    void* p = t.raw_data();
    return submit(t.nbytes(), {t}, [=, this] { check(MPI_Allreduce(MPI_IN_PLACE, p, n, type, mop, comm_), "all_reduce"); });
  }

  std::shared_ptr<Work> reduce_scatter_async(const Tensor& out, const Tensor& in, ReduceOp op) override {
    check_buffer("reduce_scatter", out);
    check_buffer("reduce_scatter", in);
    TALLY_CHECK(in.numel() == out.numel() * size_ && in.dtype() == out.dtype(), "reduce_scatter on ", name_, ": input ",
                in.str(), " must hold ", size_, " blocks of the output ", out.str());
    const int n = count_of(out, "reduce_scatter");
    const MPI_Datatype type = mpi_type(in.dtype(), "reduce_scatter");
    const MPI_Op mop = mpi_op(op, in.dtype());
    const void* src = in.raw_data();
    void* dst = out.raw_data();
    return submit(in.nbytes(), {out, in},
                  [=, this] { check(MPI_Reduce_scatter_block(src, dst, n, type, mop, comm_), "reduce_scatter"); });
  }

  std::shared_ptr<Work> all_gather_async(const Tensor& out, const Tensor& in) override {
    check_buffer("all_gather", out);
    check_buffer("all_gather", in);
    TALLY_CHECK(out.numel() == in.numel() * size_ && in.dtype() == out.dtype(), "all_gather on ", name_, ": output ",
                out.str(), " must hold ", size_, " blocks of the input ", in.str());
    const int n = count_of(in, "all_gather");
    const MPI_Datatype type = mpi_type(in.dtype(), "all_gather");
    char* dst = static_cast<char*>(out.raw_data());
    const void* src = in.raw_data();
    // In place when the input already is this rank's block of the output.
    const bool in_place = src == dst + static_cast<int64_t>(rank_) * in.nbytes();
    return submit(in.nbytes() * size_, {out, in}, [=, this] {
      check(MPI_Allgather(in_place ? MPI_IN_PLACE : src, n, type, dst, n, type, comm_), "all_gather");
    });
  }

  std::shared_ptr<Work> broadcast_async(const Tensor& t, int root) override {
    check_buffer("broadcast", t);
    TALLY_CHECK(root >= 0 && root < size_, "broadcast on ", name_, " from rank ", root, " of ", size_);
    const int n = count_of(t, "broadcast");
    const MPI_Datatype type = mpi_type(t.dtype(), "broadcast");
    void* p = t.raw_data();
    return submit(t.nbytes(), {t}, [=, this] { check(MPI_Bcast(p, n, type, root, comm_), "broadcast"); });
  }

  std::shared_ptr<Work> all_to_all_async(const Tensor& out, const Tensor& in, const std::vector<int64_t>& send_counts,
                                         const std::vector<int64_t>& recv_counts) override {
    check_buffer("all_to_all", out);
    check_buffer("all_to_all", in);
    check_all_to_all(name_, size_, out, in, send_counts, recv_counts);
    const MPI_Datatype type = mpi_type(in.dtype(), "all_to_all");
    // MPI_Alltoallv takes int counts and displacements: every offset must fit one.
    auto ints = [&](const std::vector<int64_t>& counts, std::vector<int>& n, std::vector<int>& at) {
      int64_t offset = 0;
      for (int64_t c : counts) {
        TALLY_CHECK(offset + c <= INT_MAX, "all_to_all on ", name_, ": ", offset + c,
                    " elements, more than one MPI call carries (", INT_MAX, ")");
        n.push_back(static_cast<int>(c));
        at.push_back(static_cast<int>(offset));
        offset += c;
      }
    };
    std::vector<int> sn, sat, rn, rat;
    ints(send_counts, sn, sat);
    ints(recv_counts, rn, rat);
    const void* src = in.raw_data();
    void* dst = out.raw_data();
    return submit(in.nbytes(), {out, in}, [=, this] {
      check(MPI_Alltoallv(src, sn.data(), sat.data(), type, dst, rn.data(), rat.data(), type, comm_), "all_to_all");
    });
  }

  // Point-to-point operations are posted at once from the calling thread (MPI_Isend,
  // MPI_Irecv), not queued behind the worker's collectives: a pipeline's stages send and
  // receive in orders that differ between ranks, and a send queued behind a blocking
  // receive (or the reverse) on a worker thread deadlocks two stages that each wait for
  // the other's queue. PyTorch's ProcessGroupMPI posts send/recv the same way.
  std::shared_ptr<Work> send_async(const Tensor& t, int dst, int tag) override;
  std::shared_ptr<Work> recv_async(const Tensor& t, int src, int tag) override;
  // MPI_Isend or MPI_Irecv, posted now from the calling thread (see send_async).
  std::shared_ptr<Work> post(const Tensor& t, int peer, int tag, bool send);

  std::shared_ptr<Work> barrier_async() override {
    return submit(0, {}, [this] { check(MPI_Barrier(comm_), "barrier"); });
  }

  CommStats stats() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  void check(int rc, const char* op) const {
    if (rc == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    TALLY_FAIL(op, " on communicator '", name_, "' (rank ", rank_, " of ", size_, ") failed: ", std::string(text, len));
  }
  void add_busy(double seconds) {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.busy_seconds += seconds;
  }

 private:
  void count(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.operations++;
    stats_.payload_bytes += bytes;
  }

  std::shared_ptr<Work> submit(int64_t bytes, std::vector<Tensor> buffers, std::function<void()> run) {
    auto work = std::make_shared<MpiWork>(std::move(run), std::move(buffers));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      TALLY_CHECK(!stopping_, "communicator '", name_, "' is shutting down");
      queue_.push_back(work);
      stats_.operations++;
      stats_.payload_bytes += bytes;
    }
    cv_.notify_all();
    return work;
  }

  // The worker: runs queued operations one at a time, in submission order.
  void work() {
    for (;;) {
      std::shared_ptr<MpiWork> next;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and nothing left
        next = std::move(queue_.front());
        queue_.pop_front();
      }
      next->execute();
      std::lock_guard<std::mutex> lock(mutex_);
      stats_.busy_seconds += next->finished() - next->started();
    }
  }

  MPI_Comm comm_;
  std::string name_;
  int rank_ = 0, size_ = 1;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<MpiWork>> queue_;
  bool stopping_ = false;
  CommStats stats_;
  std::thread worker_;  // last: started once everything it reads exists
};

// Send buffers of requests dropped unfinished: MPI may still read them (see below), up to
// MPI_Finalize at exit, so they are never freed.
void keep_orphaned_send_buffer(const Tensor& buffer) {
  static std::mutex mutex;
  static auto* buffers = new std::vector<Tensor>();  // never destroyed: outlives MPI_Finalize
  std::lock_guard<std::mutex> lock(mutex);
  buffers->push_back(buffer);
}

// A posted MPI_Isend or MPI_Irecv. Holds its buffer until the request completes; done()
// tests it, wait() waits for it.
class PointToPointWork final : public Work {
 public:
  PointToPointWork(MPI_Request request, Tensor buffer, MpiCommunicator& comm, const char* op, int peer, int expected)
      : request_(request), buffer_(std::move(buffer)), comm_(comm), op_(op), peer_(peer), expected_(expected),
        submitted_(now_seconds()) {}
  // Dropped unfinished only when an error unwinds the caller (every normal path waits).
  // Waiting here could hang the failing rank, whose peer may never answer, before it
  // reports the error and ends the job: a receive is cancelled, and a send is let go
  // with its buffer kept alive for MPI to read.
  ~PointToPointWork() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_ != 0) return;
    if (expected_ >= 0) {
      MPI_Cancel(&request_);
      MPI_Status status;
      MPI_Wait(&request_, &status);
    } else {
      MPI_Request_free(&request_);
      keep_orphaned_send_buffer(buffer_);
    }
  }
  bool done() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_ == 0) {
      int flag = 0;
      MPI_Status status;
      comm_.check(MPI_Test(&request_, &flag, &status), op_);
      if (flag) complete(status);
    }
    return finished_ != 0;
  }
  void wait() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_ == 0) {
      MPI_Status status;
      comm_.check(MPI_Wait(&request_, &status), op_);
      complete(status);
    }
    if (!error_.empty()) TALLY_FAIL(error_);
  }
  double submitted() const override { return submitted_; }
  double started() const override { return submitted_; }
  double finished() const override { return finished_; }

 private:
  void complete(const MPI_Status& status) {
    finished_ = now_seconds();
    comm_.add_busy(finished_ - submitted_);
    if (expected_ >= 0) {
      int got = 0;
      MPI_Get_count(&status, mpi_type(buffer_.dtype(), op_), &got);
      if (got != expected_)
        error_ = std::string(op_) + " on " + comm_.name() + " from rank " + std::to_string(peer_) + ": " +
                 std::to_string(got) + " elements arrived, " + std::to_string(expected_) + " expected";
    }
    buffer_ = Tensor();  // the transfer is over: the buffer is the caller's alone again
  }

  MPI_Request request_;
  Tensor buffer_;  // owning until complete
  MpiCommunicator& comm_;
  const char* op_;
  int peer_, expected_;
  double submitted_;
  double finished_ = 0;
  std::string error_;
  std::mutex mutex_;
};

std::shared_ptr<Work> MpiCommunicator::send_async(const Tensor& t, int dst, int tag) {
  return post(t, dst, tag, true);
}

std::shared_ptr<Work> MpiCommunicator::recv_async(const Tensor& t, int src, int tag) {
  return post(t, src, tag, false);
}

std::shared_ptr<Work> MpiCommunicator::post(const Tensor& t, int peer, int tag, bool send) {
  const char* op = send ? "send" : "recv";
  check_buffer(op, t);
  TALLY_CHECK(peer >= 0 && peer < size_ && peer != rank_, op, " on ", name_, " between rank ", rank_, " and rank ", peer,
              " of ", size_);
  const int n = count_of(t, op);
  const MPI_Datatype type = mpi_type(t.dtype(), op);
  MPI_Request request;
  check(send ? MPI_Isend(t.raw_data(), n, type, peer, tag, comm_, &request)
             : MPI_Irecv(t.raw_data(), n, type, peer, tag, comm_, &request),
        op);
  count(t.nbytes());
  return std::make_shared<PointToPointWork>(request, t, *this, op, peer, send ? -1 : n);
}

void finalize_at_exit() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Finalize();
}

}  // namespace

bool launched_by_mpirun() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"})
    if (std::getenv(var)) return true;
  return false;
}

void initialize() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return;
  // OpenMPI's collectives malloc a temporary as large as their message on every call
  // (reduce_scatter_block's default algorithm: the whole input, on rank 0) and free it at
  // the end. glibc gives a freed block above its mmap threshold back to the kernel and
  // trims the heap's free top above its trim threshold, so by default every call faults
  // its temporary's pages in again: for ZeRO-2 at dp 2 (GPT-2 124M, one 28 MB layer unit
  // per reduce-scatter) that is about 100k page faults a step on rank 0 and 8% of the
  // step's time (bench/RESULTS.md). With these two settings blocks up to 32 MiB (the
  // largest mmap threshold glibc takes) come from the heap, and up to 256 MiB of the
  // heap's free top stays mapped, so a temporary's pages are faulted in once. Larger
  // temporaries (a unit above 32 MiB) are still mapped and unmapped per call. Memory
  // outside the ledger either way: library scratch, not tensors.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  int provided = 0;
  TALLY_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) == MPI_SUCCESS, "MPI_Init_thread failed");
  TALLY_CHECK(provided >= MPI_THREAD_MULTIPLE, "this MPI library does not support MPI_THREAD_MULTIPLE (provided level ",
              provided, "); tally's communicators each run a worker thread");
  std::atexit(finalize_at_exit);
}

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

std::unique_ptr<Communicator> world(const std::string& name) {
  MPI_Comm comm;
  TALLY_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm) == MPI_SUCCESS, "MPI_Comm_dup(MPI_COMM_WORLD) failed");
  return std::make_unique<MpiCommunicator>(comm, name);
}

std::unique_ptr<Communicator> split(Communicator& parent, int color, int key, const std::string& name) {
  auto* mpi_parent = dynamic_cast<MpiCommunicator*>(&parent);
  TALLY_CHECK(mpi_parent, "splitting communicator '", parent.name(), "': it is not an MPI communicator");
  parent.barrier();  // the parent's worker is idle while this thread calls MPI on its communicator
  MPI_Comm comm;
  TALLY_CHECK(MPI_Comm_split(mpi_parent->comm(), color, key, &comm) == MPI_SUCCESS, "MPI_Comm_split of '",
              parent.name(), "' into '", name, "' failed");
  return std::make_unique<MpiCommunicator>(comm, name);
}

void abort_job(int exit_code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

}  // namespace tally::dist::mpi
