// The readable `leanstep lora plan` report (lora::format_plan).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "leanstep/lora.h"
#include "leanstep/table.h"

namespace leanstep::lora {
namespace {

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

std::string pattern_of(const Module& m) {
  if (m.layer < 0) return m.name;
  auto pos = m.name.rfind(m.local_name);
  std::string head = m.name.substr(0, pos);  // "decoder.layers.3."
  auto dot = head.find_last_of('.', head.size() - 2);
  return head.substr(0, dot + 1) + "*." + m.local_name;
}

std::vector<Row> stage_rows(const StagePlan& st) {
  std::vector<Row> rows;
  for (const AdaptedModule& am : st.adapted) {
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

std::string format_plan_impl(const Plan& p, std::string_view source) {
  std::string out;
  const auto& par = p.parallel;
  out += fmt::format("LoRA plan for {} ({})\n", p.model_type, source);
  out += fmt::format("parallel: tp {}, pp {}, ep {}, etp 1 -> {} ranks; {} local experts per EP rank\n", par.tp,
                     par.pp, par.ep, p.ranks.size(), p.local_experts);
  out += fmt::format("lora rank {}, adapter dtype {}, layer index in names: {}\n", p.lora_rank, dtype_name(p.dtype),
                     p.numbering == LayerNumbering::kLocal ? "local" : "global");
  out += fmt::format("targets: {}; scope {}{}\n", fmt::join(p.targets, ", "), scope_name(p.scope),
                     p.scope == Scope::kAll ? " (tower modules are matched too)" : " (language model only)");
  for (const std::string& note : p.notes) out += fmt::format("note: {}\n", note);

  // One table per distinct rank shape: stages whose rows are equal share a table.
  std::vector<std::vector<Row>> rows;
  std::vector<std::vector<int64_t>> groups;
  for (const StagePlan& st : p.stages) {
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
    const StagePlan& st = p.stages[static_cast<size_t>(groups[g][0])];
    auto span = [](int64_t n) { return n == 1 ? std::string("0") : fmt::format("0-{}", n - 1); };
    out += fmt::format("\n{}: each of its ranks (tp {} x ep {}) trains:\n", stage_range(groups[g]), span(par.tp),
                       span(par.ep));
    TextTable t({"module", "modules", "tensors", "lora_A", "lora_B", "params"});
    for (const Row& r : rows[g])
      t.add_row({r.pattern + (r.grouped ? fmt::format(" (x{} local experts)", r.copies) : ""),
                 with_commas(r.modules), with_commas(2 * r.copies * r.modules), shape_text(r.a_shape),
                 shape_text(r.b_shape), with_commas(r.params)});
    t.add_row({"total", with_commas(st.modules), with_commas(st.tensors), "", "", with_commas(st.params)});
    out += t.render();
  }

  out += fmt::format("\nper rank totals (memory = {} bytes per trainable parameter: fp32 grad, master, 2 Adam moments)\n",
                     kOptimizerBytesPerParam);
  TextTable t({"stage", "layers", "ranks", "modules", "tensors", "params", "memory"});
  int64_t all_rank_params = 0;
  for (const StagePlan& st : p.stages) {
    std::string layers = st.num_layers == 0 ? "none"
                                             : fmt::format("{}-{}", st.first_layer, st.first_layer + st.num_layers - 1);
    t.add_row({std::to_string(st.pp_stage), layers, std::to_string(par.tp * par.ep), with_commas(st.modules),
               with_commas(st.tensors), with_commas(st.params), human_bytes(static_cast<double>(st.memory_bytes))});
    all_rank_params += st.params * par.tp * par.ep;
  }
  out += t.render();
  out += fmt::format("\nmodel: {} adapted modules, {} trainable parameters (unique, all experts); {} over all ranks\n",
                     with_commas(p.total_modules), with_commas(p.total_params),
                     human_bytes(static_cast<double>(all_rank_params * kOptimizerBytesPerParam)));
  return out;
}

}  // namespace

std::string format_plan(const Plan& plan, std::string_view source) { return format_plan_impl(plan, source); }

}  // namespace leanstep::lora
