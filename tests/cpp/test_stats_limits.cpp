// Step logs and plans at and beyond their limits: far step indices (counted,
// not listed), integers above int64, numbers beyond the double range, text
// that is not UTF-8, sums that overflow, plan sizes that overflow.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "leanstep/stats.h"
#include "test_util.h"

namespace {

using namespace leanstep;
using namespace leanstep::stats;

TEST(StatsLimits, FarStepsAreCountedNotListed) {
  const auto rs = parse_step_log(
      "{\"rank\":0,\"step\":0,\"duration_s\":1}\n{\"rank\":0,\"step\":1000000000,\"duration_s\":1}\n", "far.jsonl",
      false);
  const auto s = summarize(rs, 0, 1);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].missing_step_count, 999999999);
  EXPECT_EQ(s[0].missing_steps.size(), kMaxListedSteps);
  EXPECT_EQ(s[0].missing_steps.back(), static_cast<int64_t>(kMaxListedSteps));
  EXPECT_NE(format_summary_table(s).find("999999999 step(s) logged by no rank"), std::string::npos);
  EXPECT_EQ(to_json(s[0])["missing_step_count"], 999999999);
}

TEST(StatsLimits, IntegersBeyondTheLimitsNameTheKeyAndValue) {
  EXPECT_LEANSTEP_ERROR(parse_step_log("{\"rank\":0,\"step\":9223372036854775813,\"duration_s\":1}", "a.jsonl", false),
                        "a.jsonl:1: 'step' must be at most 2^62 (got 9223372036854775813)");
  EXPECT_LEANSTEP_ERROR(parse_step_log("{\"rank\":0,\"step\":4611686018427387905,\"duration_s\":1}", "a.jsonl", false),
                        "'step' must be in [0, 2^62] (got 4611686018427387905)");
  EXPECT_LEANSTEP_ERROR(parse_step_log("{\"rank\":1099511627776,\"step\":1,\"duration_s\":1}", "a.jsonl", false),
                        "'rank' must be in [0, 2^31 - 1] (got 1099511627776)");
  EXPECT_LEANSTEP_ERROR(parse_step_log("rank,step,duration_s\n0,9223372036854775813,1\n", "a.csv", true),
                        "a.csv:2: 'step' must be an integer in [0, 2^62] (got \"9223372036854775813\")");
}

TEST(StatsLimits, NumbersBeyondTheDoubleRangeAndBadTextAreErrors) {
  EXPECT_LEANSTEP_ERROR(parse_step_log("{\"rank\":0,\"step\":1,\"duration_s\":1e400}", "a.jsonl", false),
                        "a.jsonl:1: invalid JSON: number overflow parsing '1e400'");
  EXPECT_LEANSTEP_ERROR(parse_step_log("rank,step,duration_s,loss\n0,1,1,-1e400\n", "a.csv", true),
                        "a.csv:2: 'loss' must be a number within the double range (got \"-1e400\")");
  EXPECT_LEANSTEP_ERROR(parse_step_log("rank,step,duration_s,run\n0,1,1,\xff\xfe\n", "a.csv", true),
                        "a.csv:2: 'run' must be valid UTF-8 text");
  EXPECT_LEANSTEP_ERROR(parse_step_log("rank,step,duration_s,condition\n0,1,1,\xed\xa0\x80\n", "a.csv", true),
                        "'condition' must be valid UTF-8 text");  // a UTF-16 surrogate
  // Valid multi-byte text is kept, and JSON output of it works.
  const auto ok = parse_step_log("rank,step,duration_s,run\n0,1,1,r\xc3\xa9sum\xc3\xa9\n", "a.csv", true);
  EXPECT_EQ(ok.at(0).run, "r\xc3\xa9sum\xc3\xa9");
  EXPECT_NO_THROW(to_json(summarize(ok, 0, 1).at(0)).dump());
  const auto dir = std::filesystem::temp_directory_path() / "leanstep_stats_limits_plan.json";
  std::ofstream(dir) << R"({"conditions":["A","B"],"block_steps":1e400,"runs":[]})";
  EXPECT_LEANSTEP_ERROR(read_plan(dir.string()), "invalid JSON");
  std::filesystem::remove(dir);
}

TEST(StatsLimits, HugeDurationsHaveAFiniteMeanAndMedian) {
  const auto rs = parse_step_log(
      "{\"rank\":0,\"step\":1,\"duration_s\":1.7e308}\n{\"rank\":0,\"step\":2,\"duration_s\":1.7e308}\n", "h.jsonl",
      false);
  const auto s = summarize(rs, 0, 2);
  EXPECT_EQ(s[0].mean_s, 1.7e308);
  EXPECT_EQ(s[0].median_s, 1.7e308);
  EXPECT_EQ(s[0].stddev_s, 0.0);
  ASSERT_EQ(s[0].windows.size(), 1u);
  EXPECT_EQ(s[0].windows[0], 1.7e308);
  const auto j = to_json(s[0]);
  EXPECT_FALSE(j["mean_s"].is_null());
  EXPECT_FALSE(j["median_s"].is_null());
  // Spread of huge values: finite (the deviations are scaled before squaring).
  const auto spread = parse_step_log(
      "{\"rank\":0,\"step\":1,\"duration_s\":1.7e308}\n{\"rank\":0,\"step\":2,\"duration_s\":0.5e308}\n", "s.jsonl",
      false);
  const auto t = summarize(spread, 0, 2);
  EXPECT_NEAR(t[0].stddev_s, std::sqrt(2.0) * 0.6e308, 1e295);
  EXPECT_NEAR(t[0].mean_s, 1.1e308, 1e294);
}

TEST(StatsLimits, PlanSizesBeyondTheLimitsAreErrorsNotOverflow) {
  EXPECT_LEANSTEP_ERROR(plan_crossover({"A", "B"}, 2, int64_t{1} << 62, 0),
                        "argument 'block_steps' must be in [1, 2^40] (got 4611686018427387904)");
  EXPECT_LEANSTEP_ERROR(plan_crossover({"A", "B"}, 2000000000, 3, 0), "argument 'runs' must be at most 10000");
  EXPECT_LEANSTEP_ERROR(plan_crossover({"A", "B"}, 2, 3, int64_t{1} << 41), "argument 'warmup' must be in [0, 2^40]");
  CrossoverPlan p;  // built in code, beyond the limits: steps_per_run is checked, never negative
  p.conditions = {"A", "B", "C", "D"};
  p.block_steps = int64_t{1} << 62;
  EXPECT_LEANSTEP_ERROR(p.steps_per_run(), "crossover plan: steps per run overflows int64");
  nlohmann::json j = to_json(plan_crossover({"A", "B"}, 2, 3, 0));
  j["block_steps"] = int64_t{1} << 62;
  EXPECT_LEANSTEP_ERROR(plan_from_json(j, "p.json"), "p.json: 'block_steps' must be in [1, 2^40]");
  // Numbers that are not int64 integers are errors naming the key, never a
  // cast out of range (a literal too large for 64 bits parses as a double).
  for (const char* key : {"warmup", "block_steps", "exclude_after_transition"}) {
    SCOPED_TRACE(key);
    nlohmann::json k = to_json(plan_crossover({"A", "B"}, 2, 3, 0));
    k[key] = nlohmann::json::parse("166666666666666666666666666666666666666666666666666666666666660");
    EXPECT_LEANSTEP_ERROR(plan_from_json(k, "p.json"), std::string("'") + key + "' must be an integer");
    k[key] = 1e300;
    EXPECT_LEANSTEP_ERROR(plan_from_json(k, "p.json"), std::string("'") + key + "' must be an integer");
    k[key] = 2.5;
    EXPECT_LEANSTEP_ERROR(plan_from_json(k, "p.json"), "must be an integer");
    k[key] = "3";
    EXPECT_LEANSTEP_ERROR(plan_from_json(k, "p.json"), "must be an integer");
    k[key] = nlohmann::json::parse("18446744073709551615");  // uint64 max
    EXPECT_LEANSTEP_ERROR(plan_from_json(k, "p.json"), "must be an integer");
  }
  nlohmann::json missing = to_json(plan_crossover({"A", "B"}, 2, 3, 0));
  missing.erase("block_steps");
  EXPECT_LEANSTEP_ERROR(plan_from_json(missing, "p.json"), "key 'block_steps' not found");
}

}  // namespace
