#include "dist/communicator.h"

#include <algorithm>
#include <chrono>

#include "core/device_hooks.h"
#include "core/error.h"

namespace tally::dist {

namespace {
double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// An operation that completed when it was submitted (the single-process world).
class CompletedWork final : public Work {
 public:
  CompletedWork() : t_(now_seconds()) {}
  bool done() override { return true; }
  void wait() override {}
  double submitted() const override { return t_; }
  double started() const override { return t_; }
  double finished() const override { return t_; }

 private:
  double t_;
};

class SelfCommunicator final : public Communicator {
 public:
  explicit SelfCommunicator(std::string name) : name_(std::move(name)) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::string& name() const override { return name_; }

  std::shared_ptr<Work> all_reduce_async(const Tensor& t, ReduceOp) override {
    check_buffer("all_reduce", t);
    return done(t.nbytes());
  }
  std::shared_ptr<Work> reduce_scatter_async(const Tensor& out, const Tensor& in, ReduceOp) override {
    check_buffer("reduce_scatter", out);
    check_buffer("reduce_scatter", in);
    TALLY_CHECK(in.numel() == out.numel(), "reduce_scatter on ", name_, ": input ", in.str(), " for output ",
                out.str(), " in a group of 1");
    if (in.raw_data() != out.raw_data()) copy_bytes(out, in);
    return done(in.nbytes());
  }
  std::shared_ptr<Work> all_gather_async(const Tensor& out, const Tensor& in) override {
    check_buffer("all_gather", out);
    check_buffer("all_gather", in);
    TALLY_CHECK(in.numel() == out.numel(), "all_gather on ", name_, ": input ", in.str(), " for output ", out.str(),
                " in a group of 1");
    if (in.raw_data() != out.raw_data()) copy_bytes(out, in);
    return done(in.nbytes());
  }
  std::shared_ptr<Work> broadcast_async(const Tensor& t, int root) override {
    TALLY_CHECK(root == 0, "broadcast on ", name_, " from rank ", root, " in a group of 1");
    return done(t.nbytes());
  }
  std::shared_ptr<Work> all_to_all_async(const Tensor& out, const Tensor& in, const std::vector<int64_t>& send_counts,
                                         const std::vector<int64_t>& recv_counts) override {
    check_all_to_all(name_, 1, out, in, send_counts, recv_counts);
    if (in.numel() > 0 && in.raw_data() != out.raw_data()) copy_bytes(out, in);
    return done(in.nbytes());
  }
  std::shared_ptr<Work> send_async(const Tensor&, int dst, int) override {
    TALLY_FAIL("send on ", name_, " to rank ", dst, ": a single-process group has no other rank");
  }
  std::shared_ptr<Work> recv_async(const Tensor&, int src, int) override {
    TALLY_FAIL("recv on ", name_, " from rank ", src, ": a single-process group has no other rank");
  }
  std::shared_ptr<Work> barrier_async() override { return std::make_shared<CompletedWork>(); }
  CommStats stats() const override { return stats_; }

 private:
  // Writes out's bytes as MPI does, leaving its version counter alone: whether the values
  // are new is the caller's to say (ZeRO-3's re-gather before backward restores the values
  // that forward's saved weights hold, and must not look like an in-place write).
  static void copy_bytes(const Tensor& out, const Tensor& in) { copy_hooks(out.device(), in.device()).copy(out, in); }
  std::shared_ptr<Work> done(int64_t bytes) {
    stats_.operations++;
    stats_.payload_bytes += bytes;
    return std::make_shared<CompletedWork>();
  }
  std::string name_;
  CommStats stats_;
};
// A completed operation that holds its tensors while its handle lives, as MPI's Work does
// (a pipeline keeps a send's handle, and so its buffer, until its next send).
class HeldWork final : public Work {
 public:
  explicit HeldWork(std::vector<Tensor> held) : held_(std::move(held)) {}
  bool done() override { return true; }
  void wait() override {}
  double submitted() const override { return 0; }
  double started() const override { return 0; }
  double finished() const override { return 0; }

 private:
  std::vector<Tensor> held_;
};

// A stand-in for rank `rank` of a group of `size` in a dry run (train/dry_run.h): every
// operation completes at once and moves nothing. Its tensors are the meta device's (no
// bytes) or small host scalars whose values the dry run does not read; the buffers the
// real group's callers make for it are made all the same, by those callers.
class MetaCommunicator final : public Communicator {
 public:
  MetaCommunicator(std::string name, int size, int rank) : name_(std::move(name)), size_(size), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  std::shared_ptr<Work> all_reduce_async(const Tensor& t, ReduceOp) override { return done("all_reduce", t); }
  std::shared_ptr<Work> reduce_scatter_async(const Tensor& out, const Tensor& in, ReduceOp) override {
    TALLY_CHECK(in.numel() == out.numel() * size_, "reduce_scatter on ", name_, ": input ", in.str(), " for output ",
                out.str(), " in a group of ", size_);
    return done("reduce_scatter", in, out);
  }
  std::shared_ptr<Work> all_gather_async(const Tensor& out, const Tensor& in) override {
    TALLY_CHECK(out.numel() == in.numel() * size_, "all_gather on ", name_, ": output ", out.str(), " for input ",
                in.str(), " in a group of ", size_);
    return done("all_gather", in, out);
  }
  std::shared_ptr<Work> broadcast_async(const Tensor& t, int) override { return done("broadcast", t); }
  std::shared_ptr<Work> all_to_all_async(const Tensor& out, const Tensor& in, const std::vector<int64_t>& send_counts,
                                         const std::vector<int64_t>& recv_counts) override {
    check_all_to_all(name_, size_, out, in, send_counts, recv_counts);
    return done("all_to_all", in, out);
  }
  std::shared_ptr<Work> send_async(const Tensor& t, int, int) override { return done("send", t); }
  std::shared_ptr<Work> recv_async(const Tensor& t, int, int) override { return done("recv", t); }
  std::shared_ptr<Work> barrier_async() override { return std::make_shared<CompletedWork>(); }
  CommStats stats() const override { return stats_; }
  Device scalar_device() const override { return Device::meta(DeviceType::CPU); }

 private:
  std::shared_ptr<Work> done(const char* op, const Tensor& t, const Tensor& other = Tensor()) {
    for (const Tensor* x : {&t, &other})
      if (x->defined())
        TALLY_CHECK(x->is_contiguous() && (x->device().is_meta() || x->device().is_cpu()), op, " on ", name_,
                    ": tensor ", x->str(), " must be contiguous, on the meta device or the host");
    stats_.operations++;
    stats_.payload_bytes += t.nbytes();
    return std::make_shared<HeldWork>(std::vector<Tensor>{t, other});
  }
  std::string name_;
  int size_, rank_;
  CommStats stats_;
};
}  // namespace

void check_all_to_all(const std::string& group, int size, const Tensor& out, const Tensor& in,
                      const std::vector<int64_t>& send_counts, const std::vector<int64_t>& recv_counts) {
  TALLY_CHECK(static_cast<int>(send_counts.size()) == size && static_cast<int>(recv_counts.size()) == size,
              "all_to_all on ", group, ": ", send_counts.size(), " send and ", recv_counts.size(), " receive counts for ",
              size, " ranks");
  int64_t sent = 0, received = 0;
  for (int r = 0; r < size; ++r) {
    TALLY_CHECK(send_counts[static_cast<size_t>(r)] >= 0 && recv_counts[static_cast<size_t>(r)] >= 0, "all_to_all on ",
                group, ": a negative count for rank ", r);
    sent += send_counts[static_cast<size_t>(r)];
    received += recv_counts[static_cast<size_t>(r)];
  }
  TALLY_CHECK(in.numel() == sent && out.numel() == received && in.dtype() == out.dtype(), "all_to_all on ", group,
              ": input ", in.str(), " and output ", out.str(), " for counts that send ", sent, " and receive ", received,
              " elements");
  if (size == 1)
    TALLY_CHECK(sent == received, "all_to_all on ", group, ": a group of 1 sends itself ", sent, " elements and expects ",
                received);
}

std::vector<int64_t> Communicator::exchange_counts(const std::vector<int64_t>& counts) {
  const int64_t n = size();
  TALLY_CHECK(static_cast<int64_t>(counts.size()) == n, "exchange_counts on ", name(), ": ", counts.size(),
              " counts for ", n, " ranks");
  const OwnerTag tag = make_owner(Category::Communication, "comm:exchange_counts");
  Tensor send = Tensor::empty({n}, DType::I64, Device::cpu(), tag), recv = Tensor::empty({n}, DType::I64, Device::cpu(), tag);
  std::copy(counts.begin(), counts.end(), send.data<int64_t>());
  const std::vector<int64_t> ones(static_cast<size_t>(n), 1);
  all_to_all(recv, send, ones, ones);
  return recv.to_vector<int64_t>();
}

void check_buffer(const char* op, const Tensor& t) {
  TALLY_CHECK(t.defined(), op, ": undefined tensor");
  TALLY_CHECK(t.is_contiguous(), op, ": tensor ", t.str(), " must be contiguous");
  TALLY_CHECK(t.device().is_cpu(), op, ": tensor ", t.str(), " is on ", t.device().str(),
              "; this communicator moves host memory");
}

Tensor Communicator::all_gather_uneven(const Tensor& in, const std::vector<int64_t>& counts) {
  TALLY_CHECK(static_cast<int>(counts.size()) == size(), "all_gather_uneven on ", name(), ": ", counts.size(),
              " counts for ", size(), " ranks");
  TALLY_CHECK(in.numel() == counts[static_cast<size_t>(rank())], "all_gather_uneven on ", name(), ": rank ", rank(),
              " has ", in.numel(), " elements but its count is ", counts[static_cast<size_t>(rank())]);
  const int64_t block = *std::max_element(counts.begin(), counts.end());
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  // Pad each rank's block to the largest; the padding never leaves this function.
  Tensor send = Tensor::zeros({block}, in.dtype(), in.device(), make_owner(Category::Communication, "comm:all_gather.send"));
  if (in.numel() > 0) send.slice(0, 0, in.numel()).detach().copy_(in.reshape({-1}).detach());
  Tensor gathered = Tensor::empty({block * size()}, in.dtype(), in.device(),
                                  make_owner(Category::Communication, "comm:all_gather.recv"));
  all_gather(gathered, send);
  Tensor out = Tensor::empty({total}, in.dtype(), in.device(), current_owner("all_gather"));
  int64_t at = 0;
  for (int r = 0; r < size(); ++r) {
    const int64_t c = counts[static_cast<size_t>(r)];
    if (c > 0) out.slice(0, at, at + c).detach().copy_(gathered.slice(0, r * block, r * block + c).detach());
    at += c;
  }
  return out;
}

double Communicator::all_reduce_scalar(double value, ReduceOp op) {
  Tensor t = Tensor::empty({1}, DType::F64, scalar_device(), make_owner(Category::Communication, "comm:all_reduce_scalar"));
  if (t.device().is_meta()) return value;  // a dry run's: its bytes counted, its value not read
  t.fill_(value);
  all_reduce(t, op);
  return t.item();
}

std::vector<double> Communicator::all_gather_scalar(double value) {
  Tensor in = Tensor::empty({1}, DType::F64, scalar_device(), make_owner(Category::Communication, "comm:all_gather_scalar"));
  Tensor out = Tensor::empty({size()}, DType::F64, scalar_device(), make_owner(Category::Communication, "comm:all_gather"));
  if (in.device().is_meta()) return std::vector<double>(static_cast<size_t>(size()), value);  // as all_reduce_scalar
  in.fill_(value);
  all_gather(out, in);
  return out.to_vector<double>();
}

std::unique_ptr<Communicator> make_self_communicator(const std::string& name) {
  return std::make_unique<SelfCommunicator>(name);
}

std::unique_ptr<Communicator> make_meta_communicator(const std::string& name, int size, int rank) {
  TALLY_CHECK(size >= 1 && rank >= 0 && rank < size, "internal: meta communicator ", name, " rank ", rank, " of ", size);
  return std::make_unique<MetaCommunicator>(name, size, rank);
}

}  // namespace tally::dist
