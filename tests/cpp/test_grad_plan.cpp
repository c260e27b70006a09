// Planner: regions, generic views and their reasons on realistic layouts.
#include <algorithm>
#include <numeric>

#include "fixtures/model_layouts.h"
#include "grad_util.h"
#include "leanstep/grad.h"
#include "leanstep/layout.h"

namespace leanstep {
namespace {
using grad::Plan;
using namespace leanstep::testing;

// Number of maximal runs of back-to-back params in a layout (independent count).
size_t contiguous_runs(const layout::BufferLayout& l) {
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const auto& p : l.params)
    if (p.numel > 0) spans.push_back({p.offset, p.offset + p.numel});
  std::sort(spans.begin(), spans.end());
  size_t runs = 0;
  int64_t end = -1;
  for (const auto& [b, e] : spans) {
    if (b != end) ++runs;
    end = e;
  }
  return runs;
}

TEST(GradPlan, ShuffledPaddedBucketedLayoutCoalescesAndSkipsPadding) {
  std::mt19937_64 rng(test_seed());
  std::vector<layout::ParamSpec> params;
  std::uniform_int_distribution<int64_t> dim(1, 300);
  for (int i = 0; i < 200; ++i) params.push_back({"p" + std::to_string(i), {dim(rng), dim(rng) % 7 + 1}});
  layout::LayoutOptions o;
  o.distributed_optimizer = true;
  o.dp_size = 3;
  o.bucket_size = 20000;
  const auto l = layout::build_buffer_layout(params, o);
  Buffer storage(DType::kFloat32, {l.numel});
  auto views = l.views(storage.data());
  std::shuffle(views.begin(), views.end(), rng);  // optimizer order is not address order
  const Plan plan(views, std::vector<Tensor>{storage.view()});
  EXPECT_EQ(plan.num_tensors(), 200u);
  EXPECT_EQ(plan.num_generic(), 0u);
  EXPECT_EQ(plan.num_regions(), contiguous_runs(l));
  EXPECT_GT(plan.num_regions(), 1u);
  size_t bytes = 0;
  for (const auto& r : plan.regions()) {
    bytes += r.nbytes();
    EXPECT_EQ(r.multiplicity, 1);
  }
  EXPECT_EQ(bytes, static_cast<size_t>(l.numel_unpadded) * 4);  // padding never part of a region
  EXPECT_EQ(plan.touched_bytes(), bytes);

  layout::LayoutOptions plain;
  const auto l2 = layout::build_buffer_layout(params, plain);
  Buffer storage2(DType::kFloat32, {l2.numel});
  const Plan one(l2.views(storage2.data()));
  EXPECT_EQ(one.num_regions(), 1u);
  EXPECT_EQ(one.regions()[0].numel, l2.numel);
}

TEST(GradPlan, QwenOmniLoraRankCoalescesIntoOneRegionPerBuffer) {
  layout::LayoutOptions o;
  o.distributed_optimizer = true;
  o.dp_size = 1;
  const auto buffers = layout::build_ddp_buffers(fixtures::qwen3_omni_lora_rank_params(1), o);
  ASSERT_EQ(buffers.size(), 2u);
  std::vector<Buffer> storage;
  std::vector<Tensor> views;
  for (const auto& b : buffers) {
    storage.emplace_back(DType::kFloat32, std::vector<int64_t>{b.numel});
    for (const Tensor& v : b.views(storage.back().data())) views.push_back(v);
  }
  const Plan plan(views);
  EXPECT_EQ(plan.num_tensors(), 48u * 66u);
  EXPECT_EQ(plan.num_generic(), 0u);
  EXPECT_EQ(plan.num_regions(), contiguous_runs(buffers[0]) + contiguous_runs(buffers[1]));
  EXPECT_LE(plan.num_regions(), 2u * 48 * 66);
}

TEST(GradPlan, DuplicatesSubViewsAndPartialOverlapsAreCountedPerListing) {
  Buffer buf(DType::kFloat32, {100});
  const Tensor a = sub_view(buf.view(), 0, {40});
  const Tensor b = sub_view(buf.view(), 40, {60});
  const Tensor sub = sub_view(buf.view(), 10, {5});       // inside a
  const Tensor overlap = sub_view(buf.view(), 30, {20});  // straddles a and b
  const std::vector<Tensor> list = {b, a, a, sub, overlap};
  const Plan plan(list);
  EXPECT_EQ(plan.num_generic(), 0u);
  // coverage: [0,10) 2, [10,15) 3, [15,30) 2, [30,40) 3, [40,50) 2, [50,100) 1
  const std::vector<std::pair<int64_t, int>> expected = {{10, 2}, {5, 3}, {15, 2}, {10, 3}, {10, 2}, {50, 1}};
  ASSERT_EQ(plan.num_regions(), expected.size());
  for (size_t k = 0; k < expected.size(); ++k) {
    EXPECT_EQ(plan.regions()[k].numel, expected[k].first) << k;
    EXPECT_EQ(plan.regions()[k].multiplicity, expected[k].second) << k;
  }
  EXPECT_NE(plan.summary().find("more than one listed view"), std::string::npos);
}

TEST(GradPlan, StridedMixedDtypeAndEmptyViews) {
  Buffer f32(DType::kFloat32, {64});
  Buffer bf16(DType::kBFloat16, {64});
  Buffer other(DType::kFloat32, {64});
  const Tensor strided = strided_view(other.data(), DType::kFloat32, 4, 4, 8, 2);
  const Tensor empty(f32.data_as<float>() + 5, DType::kFloat32, {0, 3});
  const Tensor alias_bf16(f32.data(), DType::kBFloat16, {8});  // the same bytes as another dtype
  const std::vector<Tensor> list = {sub_view(f32.view(), 16, {48}), bf16.view(), strided, empty,
                                    sub_view(f32.view(), 0, {16}), alias_bf16};
  const Plan plan(list);
  EXPECT_EQ(plan.num_tensors(), 6u);
  EXPECT_EQ(plan.num_empty(), 1u);
  ASSERT_EQ(plan.num_generic(), 3u);
  EXPECT_EQ(plan.generic()[0].index, 2u);
  EXPECT_EQ(plan.generic()[0].reason, "non-contiguous strides");
  EXPECT_EQ(plan.generic()[1].index, 4u);
  EXPECT_EQ(plan.generic()[1].reason, "shares memory with a view of another dtype");
  EXPECT_EQ(plan.generic()[2].index, 5u);
  EXPECT_TRUE(plan.generic_aliases());
  // f32 [16,64) (its neighbour [0,16) shares bytes with the bf16 alias and is generic) + the bf16 buffer
  EXPECT_EQ(plan.num_regions(), 2u);
  const std::string s = plan.summary();
  EXPECT_NE(s.find("6 tensors (1 empty)"), std::string::npos) << s;
  EXPECT_NE(s.find("non-contiguous strides"), std::string::npos) << s;
}

TEST(GradPlan, EmptyListIsAnEmptyPlan) {
  const Plan plan(std::vector<Tensor>{});
  EXPECT_EQ(plan.num_tensors(), 0u);
  EXPECT_EQ(plan.num_regions(), 0u);
  EXPECT_TRUE(plan.chunks().empty());
}

TEST(GradPlan, BadInputIsAnError) {
  Buffer buf(DType::kFloat32, {16});
  Buffer ints(DType::kInt32, {4});
  Buffer outside(DType::kFloat32, {4});
  EXPECT_LEANSTEP_ERROR(Plan(std::vector<Tensor>{ints.view()}), "grads[0]");
  Tensor null_view(nullptr, DType::kFloat32, {3});
  EXPECT_LEANSTEP_ERROR(Plan(std::vector<Tensor>{buf.view(), null_view}), "grads[1]");
  const std::vector<Tensor> declared = {sub_view(buf.view(), 0, {8})};
  EXPECT_LEANSTEP_ERROR(Plan(std::vector<Tensor>{sub_view(buf.view(), 4, {8})}, declared), "declared buffers");
  EXPECT_LEANSTEP_ERROR(Plan(std::vector<Tensor>{outside.view()}, declared), "grads[0]");
  EXPECT_NO_THROW(Plan(std::vector<Tensor>{sub_view(buf.view(), 2, {6})}, declared));
}

}  // namespace
}  // namespace leanstep

namespace leanstep {

// The plain-data view an op receives: the same arrays as the Plan, read
// through pointers and counts (what crosses the dispatch ABI).
TEST(GradPlanView, IsThePlansArraysAsPlainData) {
  std::vector<float> buf(300, 1.0f);
  std::vector<float> strided(40, 2.0f);
  Tensor a = Tensor::contiguous(buf.data(), DType::kFloat32, std::vector<int64_t>{100}.data(), 1);
  Tensor b = Tensor::contiguous(buf.data() + 100, DType::kFloat32, std::vector<int64_t>{200}.data(), 1);
  Tensor g = Tensor::contiguous(strided.data(), DType::kFloat32, std::vector<int64_t>{4, 5}.data(), 2);
  g.strides[0] = 10;
  const std::vector<Tensor> grads = {a, g, b};
  const grad::Plan plan(grads);
  const grad::PlanView v = plan;
  EXPECT_EQ(v.num_tensors(), plan.num_tensors());
  EXPECT_EQ(v.num_regions(), plan.num_regions());
  EXPECT_EQ(v.num_generic(), 1u);
  EXPECT_EQ(v.generic()[0].index, 1u);
  EXPECT_EQ(v.generic()[0].view.data, g.data);
  EXPECT_EQ(v.chunks().size(), plan.chunks().size());
  EXPECT_EQ(v.regions().data(), plan.regions().data());  // no copy
  EXPECT_EQ(v.listed_bytes(), plan.listed_bytes());
  EXPECT_EQ(v.touched_bytes(), plan.touched_bytes());
  EXPECT_EQ(v.generic_aliases(), plan.generic_aliases());
  static_assert(std::is_trivially_copyable_v<grad::PlanView>);
}

}  // namespace leanstep
