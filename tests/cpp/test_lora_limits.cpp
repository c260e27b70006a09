// The LoRA planner at and beyond its limits: sizes that would overflow int64 or
// exhaust memory are Errors naming the key and the value; every count is exact.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "leanstep/lora.h"
#include "test_util.h"

namespace {

using namespace leanstep;
using nlohmann::json;

const std::string kSource = LEANSTEP_SOURCE_DIR;

json qwen() {
  std::ifstream in(kSource + "/examples/models/qwen3-30b-a3b.config.json");
  return json::parse(in);
}

lora::Plan plan_with(const lora::ModelConfig& c, int64_t rank, lora::Parallel par = {}) {
  lora::PlanOptions o;
  o.targets = {lora::kAllLinear};
  o.lora_rank = rank;
  o.parallel = par;
  return lora::plan(c, o);
}

TEST(LoraLimits, ConfigSizesBeyondTheLimitsAreErrors) {
  json j = qwen();
  j["num_experts"] = int64_t{1} << 40;
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(j, "c"), "key 'num_experts' must be <= 65536 (got 1099511627776)");
  j = qwen();
  j["num_hidden_layers"] = int64_t{1} << 31;
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(j, "c"), "key 'num_hidden_layers' must be <= 16384 (got 2147483648)");
  j = qwen();
  j["hidden_size"] = int64_t{1} << 62;
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(j, "c"),
                        "key 'hidden_size' must be <= 16777216 (got 4611686018427387904)");
  j = qwen();
  j["hidden_size"] = 9223372036854775813ull;
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(j, "c"), "key 'hidden_size' must be <= 16777216");
  j = qwen();
  j["hidden_size"] = 1e300;
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(j, "c"), "key 'hidden_size' must be <= 16777216");
}

TEST(LoraLimits, ParameterCountsAreExactOrErrors) {
  const lora::ModelConfig c = lora::parse_model_config(qwen(), "c");
  const lora::Plan p = plan_with(c, 32);
  EXPECT_GT(p.total_params, 0);
  EXPECT_LEANSTEP_ERROR(plan_with(c, 10000000000000000LL), "argument 'lora_rank' must be in [1, 2^20]");
  EXPECT_LEANSTEP_ERROR(plan_with(c, 32, {.pp = 2, .first_stage_layers = -5}),
                        "argument 'first_stage_layers' must be >= 0, or -1 for the even split (got -5)");
  // A config built in code beyond the limits: an Error, never a wrapped count.
  lora::ModelConfig big = c;
  big.hidden_size = int64_t{1} << 62;
  EXPECT_LEANSTEP_ERROR(plan_with(big, 8), "key 'hidden_size' must be in [0, 2^24] (got 4611686018427387904)");
  // At the limits every product still fits: the count is exact.
  lora::ModelConfig wide = c;
  wide.hidden_size = int64_t{1} << 24;
  const lora::Plan q = plan_with(wide, 1 << 20, {.ep = 128});
  EXPECT_GT(q.total_params, 0);
  const lora::TensorSpec huge{"x", {int64_t{1} << 40, int64_t{1} << 40}, DType::kFloat32};
  EXPECT_LEANSTEP_ERROR(huge.numel(), "overflows int64");
}

TEST(LoraLimits, TooManyAdapterTensorsOrRanksAreErrors) {
  json j = qwen();
  j["num_experts"] = 65536;
  j["num_hidden_layers"] = 16384;
  const lora::ModelConfig c = lora::parse_model_config(j, "c");
  EXPECT_LEANSTEP_ERROR(plan_with(c, 8), "more than 2^22");
  EXPECT_LEANSTEP_ERROR(plan_with(lora::parse_model_config(qwen(), "c"), 8, {.tp = 1, .pp = 48, .ep = 65536}),
                        "must be at most 2^20 ranks");
}

TEST(LoraLimits, HugeNumbersInLayoutFilesAreErrors) {
  const auto path = std::filesystem::temp_directory_path() / "leanstep_lora_limits.json";
  std::ofstream(path) << R"({"ranks": [{"pp_stage": 0, "tp_rank": 0, "ep_rank": 0, "layout": [], "x": 1e400}]})";
  EXPECT_LEANSTEP_ERROR(lora::load_rank_layouts(path.string()), "not valid JSON");
  std::filesystem::remove(path);
}

}  // namespace
