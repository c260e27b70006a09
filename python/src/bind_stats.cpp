// Step-time statistics: run summaries, comparisons and crossover analysis of
// step logs, returned as the JSON the `leanstep steps` / `crossover` commands print.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nlohmann/json.hpp>

#include <leanstep/stats.h>

#include "bindings.h"

namespace leanstep::py {

void bind_stats(nb::module_& m) {
  m.def(
      "stats_summarize_json",
      [](const std::vector<std::string>& paths, int64_t warmup, int64_t window) {
        nb::gil_scoped_release release;
        const auto records = stats::read_step_logs(paths);
        return stats::summaries_to_json(stats::summarize(records, warmup, window)).dump();
      },
      nb::arg("paths"), nb::arg("warmup") = 20, nb::arg("window") = 20);
  m.def(
      "stats_compare_json",
      [](const std::vector<std::string>& old_paths, const std::vector<std::string>& new_paths,
         int64_t warmup, int64_t window) {
        nb::gil_scoped_release release;
        const auto c = stats::compare(stats::read_step_logs(old_paths),
                                      stats::read_step_logs(new_paths), warmup, window);
        return stats::to_json(c).dump();
      },
      nb::arg("old_paths"), nb::arg("new_paths"), nb::arg("warmup") = 20, nb::arg("window") = 20);
  m.def(
      "stats_crossover_json",
      [](const std::vector<std::string>& paths, const std::string& plan_path,
         const std::string& baseline, std::optional<int64_t> warmup, const std::string& plot,
         const std::string& reductions_plot, const std::string& title) {
        nb::gil_scoped_release release;
        stats::CrossoverOptions options;
        std::unique_ptr<stats::CrossoverPlan> plan;
        if (!plan_path.empty()) {
          plan = std::make_unique<stats::CrossoverPlan>(stats::read_plan(plan_path));
          options.plan = plan.get();
        }
        options.baseline = baseline;
        options.warmup = warmup;
        const auto result = stats::analyze_crossover(stats::read_step_logs(paths), options);
        if (!plot.empty()) stats::plot_crossover(plot, result);
        if (!reductions_plot.empty()) stats::plot_reductions(reductions_plot, result, title);
        return stats::to_json(result).dump();
      },
      nb::arg("paths"), nb::arg("plan") = "", nb::arg("baseline") = "",
      nb::arg("warmup").none() = nb::none(), nb::arg("plot") = "", nb::arg("reductions_plot") = "",
      nb::arg("title") = "");
  m.def(
      "stats_crossover_plan_json",
      [](const std::vector<std::string>& conditions, int runs, int64_t block_steps,
         int64_t warmup, const std::vector<std::string>& allocations,
         int64_t exclude_after_transition, int cycles) {
        return stats::to_json(stats::plan_crossover(conditions, runs, block_steps, warmup,
                                                    allocations, exclude_after_transition, cycles))
            .dump();
      },
      nb::arg("conditions"), nb::arg("runs"), nb::arg("block_steps"), nb::arg("warmup"),
      nb::arg("allocations") = std::vector<std::string>{},
      nb::arg("exclude_after_transition") = 2, nb::arg("cycles") = 1,
      "The `leanstep crossover plan --json` of these settings (balanced, or an Error).");
}

}  // namespace leanstep::py
