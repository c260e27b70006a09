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

std::string with_commas(int64_t v) {
  std::string digits = std::to_string(v < 0 ? -v : v), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, units[u]);
}

std::string shape_text(const std::vector<int64_t>& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

// One table row: modules of the same kind (name pattern and adapter shapes) on a stage.
struct Row {
  std::string pattern;
  std::vector<int64_t> a_shape, b_shape;
  int64_t copies = 1;
  bool grouped = false;
  int64_t modules = 0, params = 0;
  bool operator==(const Row& o) const {
    return pattern == o.pattern && a_shape == o.a_shape && b_shape == o.b_shape && copies == o.copies &&
           modules == o.modules && params == o.params;
  }
};

std::string pattern_of(const lora::Module& m) {
  if (m.layer < 0) return m.name;
  auto pos = m.name.rfind(m.local_name);
  std::string head = m.name.substr(0, pos);  // "decoder.layers.3."
  auto dot = head.find_last_of('.', head.size() - 2);
  return head.substr(0, dot + 1) + "*." + m.local_name;
}

std::vector<Row> stage_rows(const lora::StagePlan& st) {
  std::vector<Row> rows;
  for (const lora::AdaptedModule& am : st.adapted) {
    Row key{pattern_of(*am.module), am.a_shape, am.b_shape, am.copies, am.module->grouped_experts, 0, 0};
    auto it = std::find_if(rows.begin(), rows.end(), [&](const Row& r) {
      return r.pattern == key.pattern && r.a_shape == key.a_shape && r.b_shape == key.b_shape && r.copies == key.copies;
    });
    if (it == rows.end()) {
      rows.push_back(key);
      it = rows.end() - 1;
    }
    it->modules += 1;
    it->params += am.params;
  }
  return rows;
}

std::string stage_range(const std::vector<int64_t>& stages) {
  if (stages.size() == 1) return fmt::format("stage {}", stages[0]);
  bool contiguous = stages.back() - stages.front() + 1 == static_cast<int64_t>(stages.size());
  return contiguous ? fmt::format("stages {}-{}", stages.front(), stages.back())
                    : fmt::format("stages {}", fmt::join(stages, ", "));
}

void print_plan(const lora::Plan& p, const PlanArgs& args) {
  const auto& par = p.parallel;
  std::printf("LoRA plan for %s (%s)\n", p.model_type.c_str(), args.config.c_str());
  std::printf("parallel: tp %lld, pp %lld, ep %lld, etp 1 -> %zu ranks; %lld local experts per EP rank\n",
              (long long)par.tp, (long long)par.pp, (long long)par.ep, p.ranks.size(), (long long)p.local_experts);
  std::printf("lora rank %lld, adapter dtype %s, layer index in names: %s\n", (long long)p.lora_rank,
              args.dtype.c_str(), args.layer_index.c_str());
  std::printf("targets: %s; scope %s%s\n", fmt::format("{}", fmt::join(p.targets, ", ")).c_str(), lora::scope_name(p.scope),
              p.scope == lora::Scope::kAll ? " (tower modules are matched too)" : " (language model only)");
  for (const std::string& note : p.notes) std::printf("note: %s\n", note.c_str());

  // One table per distinct rank shape: stages whose rows are equal share a table.
  std::vector<std::vector<Row>> rows;
  std::vector<std::vector<int64_t>> groups;
  for (const lora::StagePlan& st : p.stages) {
    std::vector<Row> r = stage_rows(st);
    size_t g = 0;
    while (g < rows.size() && !(rows[g] == r)) ++g;
    if (g == rows.size()) {
      rows.push_back(std::move(r));
      groups.emplace_back();
    }
    groups[g].push_back(st.pp_stage);
  }
  for (size_t g = 0; g < rows.size(); ++g) {
    const lora::StagePlan& st = p.stages[static_cast<size_t>(groups[g][0])];
    auto span = [](int64_t n) { return n == 1 ? std::string("0") : fmt::format("0-{}", n - 1); };
    std::printf("\n%s: each of its ranks (tp %s x ep %s) trains:\n", stage_range(groups[g]).c_str(),
                span(par.tp).c_str(), span(par.ep).c_str());
    Table t({"module", "modules", "tensors", "lora_A", "lora_B", "params"});
    for (const Row& r : rows[g])
      t.add_row({r.pattern + (r.grouped ? fmt::format(" (x{} local experts)", r.copies) : ""),
                 with_commas(r.modules), with_commas(2 * r.copies * r.modules), shape_text(r.a_shape),
                 shape_text(r.b_shape), with_commas(r.params)});
    t.add_row({"total", with_commas(st.modules), with_commas(st.tensors), "", "", with_commas(st.params)});
    t.print();
  }

  std::printf("\nper rank totals (memory = %lld bytes per trainable parameter: fp32 grad, master, 2 Adam moments)\n",
              (long long)lora::kOptimizerBytesPerParam);
  Table t({"stage", "layers", "ranks", "modules", "tensors", "params", "memory"});
  int64_t all_rank_params = 0;
  for (const lora::StagePlan& st : p.stages) {
    std::string layers = st.num_layers == 0 ? "none"
                                             : fmt::format("{}-{}", st.first_layer, st.first_layer + st.num_layers - 1);
    t.add_row({std::to_string(st.pp_stage), layers, std::to_string(par.tp * par.ep), with_commas(st.modules),
               with_commas(st.tensors), with_commas(st.params), human_bytes(static_cast<double>(st.memory_bytes))});
    all_rank_params += st.params * par.tp * par.ep;
  }
  t.print();
  std::printf("\nmodel: %s adapted modules, %s trainable parameters (unique, all experts); %s over all ranks\n",
              with_commas(p.total_modules).c_str(), with_commas(p.total_params).c_str(),
              human_bytes(static_cast<double>(all_rank_params * lora::kOptimizerBytesPerParam)).c_str());
}

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
    print_plan(p, args);
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
