// `leanstep lora plan` and `leanstep lora diff`: LoRA coverage per rank.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "leanstep/lora.h"
#include "output.h"

namespace leanstep::cli {
namespace {

namespace lora = leanstep::lora;

struct PlanArgs {
  std::string config;
  int64_t tp = 1, pp = 1, ep = 1, etp = 1;
  int64_t pp_first = -1, pp_last = -1;
  int64_t rank = 32;
  std::vector<std::string> targets;
  bool all_linear = false;
  std::string scope = "language";
  std::string dtype = "bfloat16";
  std::string layer_index = "global";
  bool json = false;
};

void run_plan(const PlanArgs& args) {
  lora::ModelConfig config = lora::load_model_config(args.config);
  lora::PlanOptions opt;
  if (args.all_linear && !args.targets.empty())
    throw_arg_error("lora plan", "--targets", "cannot be combined with --all-linear (add all-linear to --targets instead)");
  opt.targets = args.targets.empty() ? std::vector<std::string>{lora::kAllLinear} : args.targets;
  opt.lora_rank = args.rank;
  opt.scope = lora::scope_from_name(args.scope);
  opt.parallel = {args.tp, args.pp, args.ep, args.etp, args.pp_first, args.pp_last};
  opt.dtype = dtype_from_name(args.dtype);
  if (args.layer_index != "global" && args.layer_index != "local")
    throw_arg_error("lora plan", "--layer-index", fmt::format("must be global or local (got {})", args.layer_index));
  opt.numbering = args.layer_index == "local" ? lora::LayerNumbering::kLocal : lora::LayerNumbering::kGlobal;
  lora::Plan p = lora::plan(config, opt);
  if (args.json) {
    std::string text = lora::plan_to_json(p);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fputc('\n', stdout);
  } else {
    const std::string text = lora::format_plan(p, args.config);
    std::fwrite(text.data(), 1, text.size(), stdout);
  }
}

struct DiffArgs {
  std::string a, b;
  int64_t max_lines = 20;
};

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(fmt::format("lora diff: cannot open {}", path));
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for numbers such as 1e400
    throw Error(fmt::format("lora diff: {} is not valid JSON ({})", path, e.what()));
  }
}

void run_diff(const DiffArgs& args) {
  nlohmann::json a = read_json(args.a), b = read_json(args.b);
  auto ra = lora::read_rank_layouts(a, args.a), rb = lora::read_rank_layouts(b, args.b);
  // Plan settings are context, not coverage: print them when they differ.
  if (a.is_object() && b.is_object())
    for (const char* key : {"model_type", "parallel", "lora_rank", "targets"})
      if (a.contains(key) && b.contains(key) && a[key] != b[key])
        std::printf("note: plan key %s differs: %s vs %s\n", key, a[key].dump().c_str(), b[key].dump().c_str());
  lora::LayoutDiff d = lora::diff_layouts(ra, rb, args.a, args.b, args.max_lines);
  for (const std::string& line : d.differences) std::printf("%s\n", line.c_str());
  if (d.identical()) {
    std::printf("identical: %lld ranks, same tensor names, shapes, dtypes and order\n", (long long)d.ranks_compared);
    return;
  }
  std::printf("summary (kind: name pattern x count over all ranks):\n");
  for (const std::string& line : d.summary) std::printf("  %s\n", line.c_str());
  std::printf("%lld differences on %lld of %lld ranks\n", (long long)d.count, (long long)d.ranks_differing,
              (long long)d.ranks_compared);
  throw CLI::RuntimeError(1);
}

}  // namespace

void add_lora_commands(Context& ctx) {
  auto* lora_cmd = ctx.root.add_subcommand("lora", "LoRA coverage: what every rank trains, and whether two runs train the same");
  lora_cmd->require_subcommand(1);

  auto plan_args = std::make_shared<PlanArgs>();
  auto* plan = lora_cmd->add_subcommand("plan", "Adapted modules, tensors, parameters, memory and layout per rank");
  plan->add_option("--config", plan_args->config, "Hugging Face config.json")->required()->check(CLI::ExistingFile);
  plan->add_option("--tp", plan_args->tp, "tensor parallel size")->capture_default_str()->check(integer_in(1, 65536));
  plan->add_option("--pp", plan_args->pp, "pipeline parallel size")->capture_default_str()->check(integer_in(1, 65536));
  plan->add_option("--ep", plan_args->ep, "expert parallel size")->capture_default_str()->check(integer_in(1, 65536));
  plan->add_option("--etp", plan_args->etp, "expert tensor parallel size (only 1 is supported)")->capture_default_str();
  plan->add_option("--pp-first", plan_args->pp_first, "decoder layers on the first pipeline stage, >= 0 (default: even split)")
      ->check(integer_in(0, 16384));
  plan->add_option("--pp-last", plan_args->pp_last, "decoder layers on the last pipeline stage, >= 0 (default: even split)")
      ->check(integer_in(0, 16384));
  plan->add_option("--rank,--lora-rank", plan_args->rank, "LoRA rank r")
      ->capture_default_str()
      ->check(integer_in(1, int64_t{1} << 20, "2^20"));
  auto* targets = plan->add_option("--targets", plan_args->targets,
                                   "module-name suffixes, comma separated; may include all-linear, all-router")
                      ->delimiter(',');
  plan->add_flag("--all-linear", plan_args->all_linear, "every linear of the language model (default)")->excludes(targets);
  plan->add_option("--scope", plan_args->scope, "language (default) or all (towers too)")
      ->check(CLI::IsMember({"language", "all"}))
      ->capture_default_str();
  plan->add_option("--dtype", plan_args->dtype, "adapter parameter dtype")->capture_default_str();
  plan->add_option("--layer-index", plan_args->layer_index,
                   "layer index in names under PP: global (checkpoint names) or local (per-stage module names)")
      ->check(CLI::IsMember({"global", "local"}))
      ->capture_default_str();
  plan->add_flag("--json", plan_args->json, "print one JSON object");
  plan->callback([plan_args] { run_plan(*plan_args); });

  auto diff_args = std::make_shared<DiffArgs>();
  auto* diff = lora_cmd->add_subcommand(
      "diff", "Compare two plans or framework dumps rank by rank; exit 0 only when identical");
  diff->add_option("A", diff_args->a, "plan (--json) or dump: {\"ranks\": [{pp_stage, tp_rank, ep_rank, layout}]}")
      ->required()
      ->check(CLI::ExistingFile);
  diff->add_option("B", diff_args->b, "the other plan or dump")->required()->check(CLI::ExistingFile);
  diff->add_option("--max-lines", diff_args->max_lines, "differences printed per rank")
      ->capture_default_str()
      ->check(integer_in(0, int64_t{1} << 40, "2^40"));
  diff->callback([diff_args] { run_diff(*diff_args); });
}

}  // namespace leanstep::cli
