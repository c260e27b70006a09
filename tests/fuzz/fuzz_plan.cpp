// Plans and layout dumps: a crossover plan (plan_from_json, its balance and
// every step's condition) and a `lora diff` input (read_rank_layouts, then a diff
// against itself, which must be identical).
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "leanstep/lora.h"
#include "leanstep/stats.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(data), size));
  } catch (const nlohmann::json::exception&) {
    return 0;  // read_plan and lora diff parse (and name) the JSON themselves
  }
  leanstep::fuzz::run_one([&] {
    const auto plan = leanstep::stats::plan_from_json(j, "fuzz.json");
    (void)leanstep::stats::to_json(plan).dump();
    (void)leanstep::stats::format_plan(plan);
    const int64_t steps = plan.steps_per_run();
    for (int r = 0; r < static_cast<int>(plan.runs.size()) && r < 4; ++r)
      for (int64_t pos : {int64_t{0}, steps / 2, steps - 1}) (void)plan.at(r, pos);
  });
  return leanstep::fuzz::run_one([&] {
    const auto ranks = leanstep::lora::read_rank_layouts(j, "fuzz.json");
    const auto d = leanstep::lora::diff_layouts(ranks, ranks, "a", "b", 20);
    if (!d.identical()) std::abort();
  });
}
