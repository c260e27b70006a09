// Configs: the training step's (parse_config) and the LoRA planner's
// (parse_model_config, then a plan of it when it is small enough to be quick).
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "leanstep/lora.h"
#include "leanstep/train.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  leanstep::fuzz::run_one([&] { (void)leanstep::train::parse_config(text, "."); });
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    return 0;  // the callers of parse_model_config parse (and name) the JSON themselves
  }
  return leanstep::fuzz::run_one([&] {
    const leanstep::lora::ModelConfig c = leanstep::lora::parse_model_config(j, "fuzz");
    // Plans are exact within the documented limits; keep the iterations fast.
    if (c.num_layers * std::max<int64_t>(c.num_experts, 1) > 4096) return;
    leanstep::lora::PlanOptions o;
    o.targets = {leanstep::lora::kAllLinear};
    o.lora_rank = 8;
    (void)leanstep::lora::plan_to_json(leanstep::lora::plan(c, o));
  });
}
