// Tensors: geometry, views over one storage, dtype conversion, explicit release (R6).
#include <gtest/gtest.h>

#include <fstream>

#include "core/tensor.h"
#include "memory/report.h"
#include "memory/caching_allocator.h"
#include "runtime/backend.h"
#include "sanitizer/sanitizer.h"
#include "ops/ops.h"
#include "support.h"

using namespace tally;

TEST(Tensor, ContiguousStridesAreRowMajor) {
  Tensor t = Tensor::zeros({2, 3, 4});
  EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
  EXPECT_EQ(t.numel(), 24);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.dtype(), DType::F32);
}

TEST(Tensor, TransposeIsAViewWithSwappedStrides) {
  Tensor t = Tensor::from_vector<float>({0, 1, 2, 3, 4, 5}, {2, 3});
  Tensor tt = t.transpose(0, 1);
  EXPECT_EQ(tt.shape(), (Shape{3, 2}));
  EXPECT_EQ(tt.strides(), (Shape{1, 3}));
  EXPECT_EQ(&tt.storage(), &t.storage());
  EXPECT_FALSE(tt.is_contiguous());
  EXPECT_EQ(tt.contiguous().to_vector<float>(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
}

TEST(Tensor, SliceWithStepViewsTheRightElements) {
  Tensor t = Tensor::from_vector<float>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, {10});
  Tensor s = t.slice(0, 1, 9, 3);
  EXPECT_EQ(s.to_vector<float>(), (std::vector<float>{1, 4, 7}));
  EXPECT_EQ(s.offset(), 1);
}

TEST(Tensor, ExpandUsesZeroStrides) {
  Tensor t = Tensor::from_vector<float>({1, 2, 3}, {3, 1});
  Tensor e = t.expand({3, 4});
  EXPECT_EQ(e.strides(), (Shape{1, 0}));
  EXPECT_EQ(e.contiguous().to_vector<float>(), (std::vector<float>{1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3}));
}

TEST(Tensor, ViewOfNonContiguousTensorFailsButReshapeCopies) {
  Tensor t = Tensor::zeros({4, 6}).transpose(0, 1);
  EXPECT_THROW(t.view({24}), Error);
  Tensor r = t.reshape({24});
  EXPECT_EQ(r.shape(), (Shape{24}));
  EXPECT_NE(&r.storage(), &t.storage());
}

TEST(Tensor, ViewSplitsAContiguousRunWithoutCopy) {
  Tensor t = Tensor::zeros({2, 12}).slice(1, 0, 12);  // contiguous rows
  Tensor v = Tensor::zeros({4, 6}).transpose(0, 1).slice(0, 0, 3);  // (3,4) strides (1,6)
  Tensor u = v.unsqueeze(0);
  EXPECT_EQ(u.shape(), (Shape{1, 3, 4}));
  EXPECT_EQ(&u.storage(), &v.storage());
  (void)t;
}

TEST(Tensor, PermuteMovesDims) {
  Tensor t = test::random_tensor({2, 3, 4}, 1);
  Tensor p = t.permute({2, 0, 1});
  EXPECT_EQ(p.shape(), (Shape{4, 2, 3}));
  auto a = t.to_vector<double>();
  auto b = p.contiguous().to_vector<double>();
  // p[k][i][j] == t[i][j][k]
  EXPECT_EQ(b[(3 * 2 + 1) * 3 + 2], a[(1 * 3 + 2) * 4 + 3]);
}

TEST(Tensor, DtypeConversionRoundsBf16ToNearestEven) {
  Tensor t = Tensor::from_vector<float>({1.0f, 1.00390625f, 1.01171875f, -2.5f}, {4});
  Tensor b = t.to(DType::BF16);
  EXPECT_EQ(b.dtype(), DType::BF16);
  // 1 + 2^-8 is a tie between 1 and 1+2^-7: rounds to even (1.0); 1+3*2^-8 rounds up.
  EXPECT_EQ(b.to_vector<float>(), (std::vector<float>{1.0f, 1.0f, 1.015625f, -2.5f}));
}

TEST(Tensor, ItemRequiresOneElement) {
  EXPECT_DOUBLE_EQ(Tensor::scalar(3.5).item(), 3.5);
  EXPECT_THROW(Tensor::zeros({2}).item(), Error);
}

TEST(Tensor, DataAccessorChecksDtype) {
  Tensor t = Tensor::zeros({2}, DType::F64);
  EXPECT_NO_THROW(t.data<double>());
  EXPECT_THROW(t.data<float>(), Error);
}

// R6: release returns the bytes at once, even with views alive, and a later use of
// any view fails naming the releaser.
TEST(StorageRelease, ReturnsBytesImmediatelyAndViewsFailWithReleaserName) {
  auto& L = runtime::ledger();
  int64_t before = L.stats().allocated;
  Tensor padded = Tensor::zeros({1024}, DType::F32, Device::cpu(), make_owner(Category::Parameter, "gathered.w"));
  Tensor view = padded.slice(0, 0, 1000).set_name("w_view");
  EXPECT_EQ(L.stats().allocated - before, 4096);
  padded.storage().release("zero3.release(h.0.attn.w)");
  EXPECT_EQ(L.stats().allocated, before);
  try {
    view.to_vector<float>();
    FAIL() << "use of a released view did not throw";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("zero3.release(h.0.attn.w)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("w_view"), std::string::npos) << msg;
  }
}

// A storage saved for backward, released and given bytes again under another owner (ZeRO-3
// gathers into the same storage): when the last saver went, the new allocation was retagged
// an activation, a parameter's bytes counted as non-persistent activation memory.
TEST(StorageRelease, ASaveBeforeAReleaseDoesNotRetagTheNextOwnersBytes) {
  auto& L = runtime::ledger();
  Tensor t = Tensor::zeros({1024}, DType::F32, Device::cpu(), make_owner(Category::Activation, "h.0.out"));
  t.storage().add_saver();
  EXPECT_EQ(t.storage().owner().category, Category::SavedForBackward);
  t.storage().release("test.release");
  t.storage().reacquire(make_owner(Category::Parameter, "gathered.w", /*persistent=*/true));
  const int64_t non_persistent = L.stats().live_non_persistent;
  t.storage().remove_saver();
  EXPECT_EQ(t.storage().owner().category, Category::Parameter);
  EXPECT_EQ(L.stats().live_non_persistent, non_persistent);
  // Saved while held by a new activation owner, it is saved_for_backward again, and an
  // activation after its last saver.
  t.storage().add_saver();
  t.storage().release("test.release");
  t.storage().reacquire(make_owner(Category::Activation, "h.1.out"));
  EXPECT_EQ(t.storage().owner().category, Category::SavedForBackward);
  t.storage().remove_saver();
  EXPECT_EQ(t.storage().owner().category, Category::Activation);
}

TEST(StorageHolders, ListsEveryViewOfAStorage) {
  Tensor base = Tensor::zeros({8}).set_name("base");
  Tensor a = base.slice(0, 0, 4).set_name("first_half");
  Tensor b = base.view({2, 4}).set_name("as_matrix");
  auto holders = sanitizer::storage_holders(base.storage());
  ASSERT_EQ(holders.size(), 3u);
  std::string all;
  for (auto& h : holders) all += h + "\n";
  EXPECT_NE(all.find("first_half"), std::string::npos) << all;
  EXPECT_NE(all.find("as_matrix"), std::string::npos) << all;
  a = Tensor();
  EXPECT_EQ(sanitizer::storage_holders(base.storage()).size(), 2u);
}

TEST(Allocator, CachesFreedBlocksBySizeClass) {
  auto& L = runtime::ledger();
  { Tensor t = Tensor::empty({1000}); }
#if defined(__SANITIZE_ADDRESS__)
  // There a freed block is quarantined until as many bytes again were freed after it.
  { Tensor after = Tensor::empty({memory::CachingAllocator::kQuarantineBytes / 4}); }
#endif
  auto s0 = L.stats();
  { Tensor t = Tensor::empty({1000}); }
  auto s1 = L.stats();
  EXPECT_EQ(s1.num_system_allocs, s0.num_system_allocs);
  EXPECT_EQ(s1.num_cache_hits, s0.num_cache_hits + 1);
  EXPECT_EQ(s1.reserved, s0.reserved);
}

TEST(Allocator, SizeClassesWasteAtMostOneEighth) {
  for (int64_t b : {1, 255, 4096, 4097, 100000, 123456789}) {
    int64_t c = memory::size_class(b);
    EXPECT_GE(c, b);
    EXPECT_LE(c - b, std::max<int64_t>(255, b / 8)) << b;
  }
}

TEST(Allocator, ARequestTooLargeForASizeClassIsAnErrorNotANullBlock) {
  // 2^63 - 4 bytes passes the shape's overflow checks; rounding it up to its size class
  // overflowed int64, the block "succeeded" with a null pointer and 2^63 - 4 bytes were
  // counted as allocated (the first write crashed).
  EXPECT_EQ(memory::size_class(int64_t{1} << 62), int64_t{1} << 62);
  auto& L = runtime::ledger();
  const int64_t before = L.stats().allocated;
  const std::string msg = test::message_of<Error>([] { Tensor::empty({(int64_t{1} << 61) - 1}, DType::F32); });
  EXPECT_NE(msg.find("9223372036854775804 bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("exceeds"), std::string::npos) << msg;
  EXPECT_EQ(L.stats().allocated, before) << "nothing counted for a block never made";
}

TEST(Ledger, TagsAllocationsWithCategoryModuleAndClock) {
  Clock::set(7, 3);
  OwnerScope h("h");
  OwnerScope l("2");
  Tensor t = Tensor::empty({16});
  memory::LiveAllocation a = runtime::ledger().find(t.storage().allocation_id());
  EXPECT_EQ(a.owner.category, Category::Activation);
  EXPECT_EQ(a.owner.name_str(), "h.2");
  EXPECT_EQ(a.owner.step, 7);
  EXPECT_EQ(a.owner.microbatch, 3);
  Clock::set(-1, -1);
}

TEST(Ledger, ExportsChromeTraceWithCategoryCounters) {
  auto& L = runtime::ledger();
  L.clear_history();
  L.enable_history(true, true);
  { Tensor t = Tensor::empty({1 << 20}, DType::F32, Device::cpu(), make_owner(Category::Workspace, "ws")); }
  L.enable_history(false);
  auto events = L.history();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].delta, 4 << 20);
  EXPECT_EQ(events[1].delta, -(4 << 20));
  ASSERT_TRUE(events[0].stack);
  EXPECT_FALSE(events[0].stack->empty());
  std::string path = test::temp_path("trace.json");
  memory::write_chrome_trace(path, events);
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(text.find("\"traceEvents\""), std::string::npos);
  EXPECT_NE(text.find("\"workspace\":4194304"), std::string::npos) << text.substr(0, 400);
  L.clear_history();
}

TEST(Ledger, WritesASelfContainedHtmlReportWithPlotAndLargestOwners) {
  auto& L = runtime::ledger();
  L.clear_history();
  L.enable_history(true);
  { Tensor t = Tensor::empty({1 << 18}, DType::F32, Device::cpu(), make_owner(Category::Activation, "h.0.mlp<fc>")); }
  L.enable_history(false);
  std::string path = test::temp_path("memory.html");
  memory::write_html_report(path, L.history());
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(text.find("<svg"), std::string::npos);
  EXPECT_NE(text.find("peak <b>1.00 MiB</b>"), std::string::npos) << text.substr(0, 400);
  EXPECT_NE(text.find("h.0.mlp&lt;fc&gt;"), std::string::npos);  // owner names are escaped
  EXPECT_EQ(text.find("<script"), std::string::npos);         // self-contained, nothing to run
  L.clear_history();
}
