// Layout builder: Megatron-Core DDP buffer placement, computed by hand here.
#include "grad_util.h"
#include "fixtures/model_layouts.h"
#include "leanstep/layout.h"

namespace leanstep {
namespace {
using layout::LayoutOptions;
using layout::ParamSpec;

std::vector<ParamSpec> three(int64_t a, int64_t b, int64_t c) {
  return {{"p0", {a}}, {"p1", {b}}, {"p2", {c}}};
}

TEST(GradLayout, ReverseOrderBackToBackWithoutDistributedOptimizer) {
  std::vector<ParamSpec> params = {{"p0", {10}}, {"p1", {3, 4}}, {"p2", {5}}};
  const auto l = layout::build_buffer_layout(params, {});
  ASSERT_EQ(l.params.size(), 3u);
  EXPECT_EQ(l.params[2].offset, 0);  // the last registered param sits at offset 0
  EXPECT_EQ(l.params[1].offset, 5);
  EXPECT_EQ(l.params[0].offset, 17);
  EXPECT_EQ(l.numel, 27);
  EXPECT_EQ(l.numel_unpadded, 27);
  ASSERT_EQ(l.buckets.size(), 1u);
  EXPECT_EQ(l.buckets[0].begin, 0);
  EXPECT_EQ(l.buckets[0].end, 27);
  EXPECT_EQ(l.params[1].shape, (std::vector<int64_t>{3, 4}));
}

TEST(GradLayout, DistributedOptimizerPadsParamStartsAndBucketEnd) {
  LayoutOptions o;
  o.distributed_optimizer = true;
  o.dp_size = 4;
  const auto l = layout::build_buffer_layout(three(10, 12, 5), o);
  EXPECT_EQ(l.params[2].offset, 0);
  EXPECT_EQ(l.params[1].offset, 64);   // 5 rounded up to 64
  EXPECT_EQ(l.params[0].offset, 128);  // 76 rounded up to 64
  EXPECT_EQ(l.numel, 256);             // 138 rounded up to lcm(4, 128) = 128
  EXPECT_EQ(l.numel_unpadded, 27);
}

TEST(GradLayout, BucketsCloseAtTheElementBudget) {
  LayoutOptions o;
  o.bucket_size = 100;
  auto l = layout::build_buffer_layout(three(60, 60, 60), o);
  ASSERT_EQ(l.buckets.size(), 2u);
  EXPECT_EQ(l.buckets[0].end, 120);
  EXPECT_EQ(l.buckets[1].begin, 120);
  EXPECT_EQ(l.buckets[1].end, 180);
  EXPECT_EQ(l.params[2].bucket, 0);
  EXPECT_EQ(l.params[0].bucket, 1);

  o.distributed_optimizer = true;
  o.dp_size = 3;  // lcm(3, 128) = 384
  l = layout::build_buffer_layout(three(60, 60, 60), o);
  ASSERT_EQ(l.buckets.size(), 2u);
  EXPECT_EQ(l.params[1].offset, 64);
  EXPECT_EQ(l.buckets[0].end, 384);  // 124 padded
  EXPECT_EQ(l.buckets[0].numel_unpadded, 124);
  EXPECT_EQ(l.params[0].offset, 384);
  EXPECT_EQ(l.buckets[1].end, 768);
  EXPECT_EQ(l.numel, 768);

  o.pad_for_high_busbw = true;  // lcm(3, 128, 65536) = 196608
  l = layout::build_buffer_layout(three(60, 60, 60), o);
  EXPECT_EQ(l.buckets[0].end, 196608);
  EXPECT_EQ(l.numel, 2 * 196608);
}

TEST(GradLayout, OwnBucketParamAndGroupsByDtypeAndExpert) {
  std::vector<ParamSpec> params = {{"emb", {100}, DType::kBFloat16, false, true},
                                   {"w", {64}, DType::kBFloat16},
                                   {"e0", {32}, DType::kBFloat16, true},
                                   {"norm", {10}, DType::kFloat32}};
  LayoutOptions o;
  o.distributed_optimizer = true;
  const auto buffers = layout::build_ddp_buffers(params, o);
  ASSERT_EQ(buffers.size(), 3u);
  const auto& dense = buffers[0];
  EXPECT_FALSE(dense.is_expert);
  ASSERT_EQ(dense.params.size(), 2u);
  EXPECT_EQ(dense.params[0].param_index, 0u);
  EXPECT_EQ(dense.params[1].offset, 0);    // w first (reverse order)
  ASSERT_EQ(dense.buckets.size(), 2u);     // the shared embedding gets its own bucket
  EXPECT_EQ(dense.buckets[0].end, 128);
  EXPECT_EQ(dense.params[0].offset, 128);
  EXPECT_TRUE(buffers[1].is_expert);
  EXPECT_EQ(buffers[1].params[0].param_index, 2u);
  EXPECT_EQ(buffers[2].param_dtype, DType::kFloat32);

  Buffer storage(DType::kFloat32, {dense.numel});
  const auto views = dense.views(storage.data());
  EXPECT_EQ(views[0].data, storage.data_as<float>() + 128);
  EXPECT_EQ(views[1].numel(), 64);
}

TEST(GradLayout, ModelLayoutsHaveTheExpectedSizes) {
  const auto lora = fixtures::qwen3_omni_lora_rank_params();
  EXPECT_EQ(lora.size(), 48u * (2 + 16 * 4));
  int64_t n = 0;
  for (const auto& p : lora) n += p.shape[0] * p.shape[1];
  EXPECT_EQ(n, 48 * ((8 * 2048 + 5120 * 8) + 16 * (8 * 2048 + 1536 * 8 + 8 * 768 + 2048 * 8)));
  LayoutOptions o;
  o.distributed_optimizer = true;
  o.dp_size = 6;
  o.bucket_size = 40'000'000;
  const auto dense = layout::build_buffer_layout(fixtures::dense_100m_params(), o);
  EXPECT_GT(dense.numel_unpadded, 95'000'000);
  EXPECT_LT(dense.numel_unpadded, 105'000'000);
  EXPECT_GE(dense.buckets.size(), 2u);
  EXPECT_EQ(dense.numel % 6, 0);
}

TEST(GradLayout, BadOptionsAreErrors) {
  LayoutOptions o;
  o.dp_size = 0;
  EXPECT_LEANSTEP_ERROR(layout::build_buffer_layout({}, o), "dp_size");
  o = {};
  std::vector<ParamSpec> bad = {{"x", {-1, 3}}};
  EXPECT_LEANSTEP_ERROR(layout::build_buffer_layout(bad, o), "non-negative");
}

}  // namespace
}  // namespace leanstep
