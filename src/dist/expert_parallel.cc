#include "dist/expert_parallel.h"

#include "autograd/function.h"
#include "autograd/grad_mode.h"
#include "core/error.h"
#include "core/owner.h"
#include "ops/ops.h"

namespace tally::dist {

namespace {

struct RowExchange {
  static constexpr const char* kName = "expert_parallel_exchange";
  struct Context : autograd::Context {
    ExpertParallel* ep = nullptr;  // non-owning: the engine's, outlives every graph
    std::vector<int64_t> send_rows, recv_rows;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    return {ctx.ep->exchanged(grads[0], ctx.recv_rows, ctx.send_rows)};
  }
};

std::vector<int64_t> times(const std::vector<int64_t>& rows, int64_t width) {
  std::vector<int64_t> elements(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) elements[i] = rows[i] * width;
  return elements;
}

}  // namespace

std::vector<int64_t> ExpertParallel::exchange_counts(const std::vector<int64_t>& counts) {
  const int n = size();
  TALLY_CHECK(!counts.empty() && counts.size() % static_cast<size_t>(n) == 0, "expert parallel: ", counts.size(),
              " counts for a group of ", n, " ranks");
  const int64_t per_rank = static_cast<int64_t>(counts.size()) / n;
  const OwnerTag tag = make_owner(Category::Communication, "comm:ep_counts");
  const Shape shape{static_cast<int64_t>(counts.size())};
  Tensor send = Tensor::empty(shape, DType::I64, Device::cpu(), tag), recv = Tensor::empty(shape, DType::I64, Device::cpu(), tag);
  std::copy(counts.begin(), counts.end(), send.data<int64_t>());
  const std::vector<int64_t> each(static_cast<size_t>(n), per_rank);
  group_.all_to_all(recv, send, each, each);
  return recv.to_vector<int64_t>();
}

Tensor ExpertParallel::exchanged(const Tensor& rows, const std::vector<int64_t>& send_rows,
                                 const std::vector<int64_t>& recv_rows) {
  TALLY_CHECK(rows.dim() == 2, "expert parallel: rows must be (n, C), got ", rows.str());
  const int64_t width = rows.shape()[1];
  int64_t received = 0;
  for (int64_t r : recv_rows) received += r;
  const Tensor in = rows.is_contiguous() ? rows : ops::contiguous(rows);
  Tensor out = Tensor::empty({received, width}, rows.dtype(), rows.device(), current_owner("ep_all_to_all"));
  group_.all_to_all(out, in, times(send_rows, width), times(recv_rows, width));
  return out;
}

Tensor ExpertParallel::exchange(const Tensor& rows, const std::vector<int64_t>& send_rows,
                                const std::vector<int64_t>& recv_rows) {
  Tensor out;
  {
    autograd::NoGradGuard no_grad;
    out = exchanged(rows.detach(), send_rows, recv_rows);
  }
  if (autograd::needs_graph({rows})) {
    auto ctx = std::make_unique<RowExchange::Context>();
    ctx->ep = this;
    ctx->send_rows = send_rows;
    ctx->recv_rows = recv_rows;
    autograd::record<RowExchange>(std::move(ctx), {rows}, {out});
  }
  return out;
}

}  // namespace tally::dist
