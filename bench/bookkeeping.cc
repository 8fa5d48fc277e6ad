// The cost of tally's bookkeeping: what every allocation and every small op pays for
// owner tags, the ledger and the autograd graph. With an asynchronous GPU this host-side
// cost is the floor of a step, so it has a budget (issue 7): <= 0.2 us per alloc+free,
// <= 1 us per recorded small op.
//
//   bench_bookkeeping [iterations=200000]
// Prints one JSON line: nanoseconds per operation, best of 7 rounds, inside a module path
// scope as a model's forward would be ("model.h.11.attn").
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "core/owner.h"
#include "core/tensor.h"
#include "ops/install.h"
#include "ops/ops.h"
#include "runtime/backend.h"

using namespace tally;

namespace {
template <class F> double best_ns_per_op(int n, F&& f) {
  for (int i = 0; i < n / 10; ++i) f();  // warm the caches (allocator, interned names)
  double best = 1e30;
  for (int round = 0; round < 7; ++round) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) f();
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, ns / n);
  }
  return best;
}
}  // namespace

int main(int argc, char** argv) {
  tally::ops::install();
  const int n = argc > 1 ? std::atoi(argv[1]) : 200000;
  OwnerScope model("model"), h("h"), layer("11"), attn("attn");
  Allocator& allocator = runtime::backend(Device::cpu()).allocator();
  const double alloc_free = best_ns_per_op(n, [&] {
    Allocation a = allocator.allocate(256, current_owner("bench"), {});
    allocator.free(a);
  });
  const double tensor_empty = best_ns_per_op(n, [] { Tensor t = Tensor::empty({64}); });
  Tensor x = Tensor::zeros({4});
  x.set_requires_grad(true);
  Tensor y = Tensor::zeros({4});
  const double recorded = best_ns_per_op(n / 2, [&] { Tensor z = ops::add(x, y); });
  Tensor xn = Tensor::zeros({4});
  const double unrecorded = best_ns_per_op(n / 2, [&] { Tensor z = ops::add(xn, y); });
  std::printf(
      "{\"alloc_free_ns\": %.0f, \"tensor_empty_free_ns\": %.0f, \"recorded_add_ns\": %.0f, "
      "\"unrecorded_add_ns\": %.0f, \"iterations\": %d}\n",
      alloc_free, tensor_empty, recorded, unrecorded, n);
  return 0;
}
