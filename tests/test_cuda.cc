// CUDA backend: the GPU allocator carries the same owner tags, statistics and explicit
// release as the CPU one. Skipped (and reported as skipped) without CUDA or a GPU.
#include <gtest/gtest.h>

#include "core/tensor.h"
#include "memory/caching_allocator.h"
#include "memory/report.h"
#include "runtime/backend.h"

using namespace tally;

namespace {
void require_gpu() {
#ifndef TALLY_CUDA
  GTEST_SKIP() << "built without CUDA (-DTALLY_CUDA=OFF)";
#else
  if (runtime::device_count(DeviceType::CUDA) == 0) GTEST_SKIP() << "no CUDA device visible";
#endif
}
}  // namespace

TEST(CudaAllocator, TagsAndCountsGpuAllocations) {
  require_gpu();
  if (::testing::Test::IsSkipped()) return;
  auto& L = runtime::ledger(Device::cuda(0));
  int64_t before = L.stats().allocated;
  {
    Tensor t = Tensor::empty({1 << 20}, DType::F32, Device::cuda(0),
                             make_owner(Category::Activation, "gpu.test"));
    EXPECT_EQ(L.stats().allocated - before, 4 << 20);
    EXPECT_EQ(L.find(t.storage().allocation_id()).owner.name_str(), "gpu.test");
  }
  EXPECT_EQ(L.stats().allocated, before);
  { Tensor t = Tensor::empty({1 << 20}, DType::F32, Device::cuda(0)); }
  EXPECT_GE(L.stats().num_cache_hits, 1);
}

TEST(CudaAllocator, ReleasedGpuStorageFailsOnUseNamingTheReleaser) {
  require_gpu();
  if (::testing::Test::IsSkipped()) return;
  Tensor t = Tensor::empty({256}, DType::F32, Device::cuda(0));
  Tensor v = t.slice(0, 0, 128);
  t.storage().release("test.release");
  EXPECT_THROW(v.raw_data(), Error);
}

TEST(CudaAllocator, CpuKernelsRefuseGpuTensors) {
  require_gpu();
  if (::testing::Test::IsSkipped()) return;
  Tensor t = Tensor::empty({4}, DType::F32, Device::cuda(0));
  EXPECT_THROW(t.fill_(1.0), Error);
}
