// Per-run step series (max over ranks), run summaries and before/after comparison.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "leanstep/core.h"
#include "leanstep/table.h"
#include "leanstep/stats.h"
#include "stats/util.h"

namespace leanstep::stats {

using nlohmann::json;

// ---------------------------------------------------------------- small statistics

double mean_of(const std::vector<double>& v) {
  if (v.empty()) return std::nan("");
  // The plain sum is exact enough for step durations (a few thousand values of similar size).
  const double n = static_cast<double>(v.size());
  const double sum = std::accumulate(v.begin(), v.end(), 0.0);
  if (std::isfinite(sum) || !std::all_of(v.begin(), v.end(), [](double x) { return std::isfinite(x); }))
    return sum / n;
  // Finite values whose sum overflows (e.g. two of 1.7e308): divide first, so the
  // mean of finite values is finite.
  double mean = 0;
  for (double x : v) mean += x / n;
  return mean;
}

double median_of(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  // Halves first: the same bits as 0.5 * (a + b) for normal values, and no overflow.
  return n % 2 ? v[n / 2] : 0.5 * v[n / 2 - 1] + 0.5 * v[n / 2];
}

double stddev_of(const std::vector<double>& v) {
  if (v.size() < 2) return 0.0;
  const double m = mean_of(v);
  double ss = 0;
  for (double x : v) ss += (x - m) * (x - m);
  if (std::isfinite(ss) || !std::isfinite(m)) return std::sqrt(ss / static_cast<double>(v.size() - 1));
  // Squares of finite deviations that overflow: scale by the largest deviation.
  double scale = 0;
  for (double x : v) scale = std::max(scale, std::fabs(x / 2 - m / 2));
  double scaled = 0;
  for (double x : v) {
    const double d = (x / 2 - m / 2) / scale;
    scaled += d * d;
  }
  return 2 * scale * std::sqrt(scaled / static_cast<double>(v.size() - 1));
}

double percentile_sorted(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return std::nan("");
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (pos - static_cast<double>(lo)) * (sorted[hi] - sorted[lo]);
}

std::string list_steps(const std::vector<int64_t>& steps, size_t limit, int64_t total) {
  std::string s;
  for (size_t i = 0; i < steps.size() && i < limit; ++i) {
    if (i) s += ", ";
    s += std::to_string(steps[i]);
  }
  const int64_t all = std::max<int64_t>(total, static_cast<int64_t>(steps.size()));
  if (all > static_cast<int64_t>(limit) && !steps.empty())
    s += fmt::format(", ... {} more", all - static_cast<int64_t>(std::min(limit, steps.size())));
  return s;
}

std::string format_seconds(double s) {
  if (!std::isfinite(s)) return "-";
  if (std::fabs(s) < 1.0) return fmt::format("{:.3f} ms", s * 1e3);
  return fmt::format("{:.4f} s", s);
}

std::string format_percent(double x) {
  if (!std::isfinite(x)) return "-";
  return fmt::format("{:+.2f}%", x * 100);
}

// ---------------------------------------------------------------- series

std::vector<StepSeries> build_series(const std::vector<StepRecord>& records) {
  check_unique_records(records);
  std::vector<std::string> order;
  std::unordered_map<std::string, std::vector<const StepRecord*>> by_run;
  for (const auto& r : records) {
    auto& v = by_run[r.run];
    if (v.empty()) order.push_back(r.run);
    v.push_back(&r);
  }
  std::vector<StepSeries> out;
  for (const auto& run : order) {
    const auto& recs = by_run[run];
    StepSeries s;
    s.run = run;
    std::set<int> ranks;
    std::map<int64_t, std::vector<const StepRecord*>> by_step;
    const StepRecord* allocation_from = nullptr;
    for (const StepRecord* r : recs) {
      ranks.insert(r->rank);
      by_step[r->step].push_back(r);
      if (!r->allocation.empty()) {
        if (allocation_from && allocation_from->allocation != r->allocation)
          throw Error(fmt::format("step log: run '{}' is on allocation '{}' ({}) and '{}' ({}); a run has one allocation",
                                  run, allocation_from->allocation, allocation_from->origin, r->allocation, r->origin));
        allocation_from = r;
      }
    }
    if (allocation_from) s.allocation = allocation_from->allocation;
    std::set<std::string> field_names;
    for (const StepRecord* r : recs)
      for (const auto& [k, v] : r->fields) field_names.insert(k);
    s.ranks.assign(ranks.begin(), ranks.end());
    s.first_step = by_step.begin()->first;
    int64_t expected = s.first_step;
    for (const auto& [step, rs] : by_step) {
      if (expected < step) {
        s.missing_step_count += step - expected;
        for (; expected < step && s.missing_steps.size() < kMaxListedSteps; ++expected) s.missing_steps.push_back(expected);
      }
      expected = step + 1;
      const StepRecord* slowest = nullptr;
      std::string condition;
      const StepRecord* condition_from = nullptr;
      int block = -1;
      const StepRecord* block_from = nullptr;
      std::vector<double> losses, grad_norms;
      for (const StepRecord* r : rs) {
        if (!slowest || r->duration_s > slowest->duration_s ||
            (r->duration_s == slowest->duration_s && r->rank < slowest->rank))
          slowest = r;
        if (!r->condition.empty()) {
          if (condition_from && condition != r->condition)
            throw Error(fmt::format("step log: run '{}' step {} has condition '{}' on rank {} ({}) but '{}' on rank {} ({})",
                                    run, step, condition, condition_from->rank, condition_from->origin,
                                    r->condition, r->rank, r->origin));
          condition = r->condition;
          condition_from = r;
        }
        if (r->block) {
          if (block_from && block != *r->block)
            throw Error(fmt::format("step log: run '{}' step {} has block {} on rank {} ({}) but {} on rank {} ({})",
                                    run, step, block, block_from->rank, block_from->origin, *r->block, r->rank,
                                    r->origin));
          block = *r->block;
          block_from = r;
        }
        if (r->loss) losses.push_back(*r->loss);
        if (r->grad_norm) grad_norms.push_back(*r->grad_norm);
      }
      s.steps.push_back(step);
      s.duration_s.push_back(slowest->duration_s);
      s.slowest_rank.push_back(slowest->rank);
      const bool complete = rs.size() == ranks.size();
      s.complete.push_back(complete);
      if (!complete) {
        std::vector<int> missing;
        std::set<int> present;
        for (const StepRecord* r : rs) present.insert(r->rank);
        for (int rk : ranks)
          if (!present.count(rk)) missing.push_back(rk);
        s.incomplete.emplace_back(step, std::move(missing));
      }
      s.condition.push_back(condition);
      s.block.push_back(block);
      s.loss.push_back(losses.empty() ? std::nullopt : std::optional<double>(mean_of(losses)));
      s.grad_norm.push_back(grad_norms.empty() ? std::nullopt : std::optional<double>(mean_of(grad_norms)));
      // A field's value is its maximum over ranks, like the step's: known only when every
      // rank of the run logged it at this step.
      for (const auto& f : field_names) {
        double value = complete ? -INFINITY : std::nan("");
        for (const StepRecord* r : rs) {
          const auto it = r->fields.find(f);
          if (it == r->fields.end() || std::isnan(it->second)) {
            value = std::nan("");
            break;
          }
          value = std::max(value, it->second);
        }
        s.fields[f].push_back(value);
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

// ---------------------------------------------------------------- summaries

RunSummary summarize_series(const StepSeries& s, int64_t warmup, int64_t window) {
  LEANSTEP_CHECK_ARG(warmup >= 0, "summarize", "warmup", fmt::format("must be >= 0 (got {})", warmup));
  LEANSTEP_CHECK_ARG(window >= 1, "summarize", "window", fmt::format("must be >= 1 (got {})", window));
  RunSummary r;
  r.run = s.run;
  r.num_ranks = static_cast<int>(s.ranks.size());
  r.steps_logged = static_cast<int64_t>(s.steps.size());
  r.warmup = warmup;
  r.window = window;
  r.missing_steps = s.missing_steps;
  r.missing_step_count = s.missing_step_count;
  r.incomplete = s.incomplete;
  std::vector<double> used;
  std::map<int, int64_t> slowest;
  for (size_t i = 0; i < s.steps.size(); ++i) {
    if (s.steps[i] - s.first_step < warmup || !s.complete[i]) continue;
    used.push_back(s.duration_s[i]);
    ++slowest[s.slowest_rank[i]];
  }
  for (auto [rank, n] : slowest) r.slowest_rank_counts.emplace_back(rank, n);
  r.steps_used = static_cast<int64_t>(used.size());
  if (!used.empty()) {
    r.mean_s = mean_of(used);
    r.median_s = median_of(used);
    r.min_s = *std::min_element(used.begin(), used.end());
    r.max_s = *std::max_element(used.begin(), used.end());
    r.stddev_s = stddev_of(used);
  } else {
    r.mean_s = r.median_s = r.min_s = r.max_s = std::nan("");
  }
  for (size_t w = 0; (w + 1) * static_cast<size_t>(window) <= used.size(); ++w) {
    std::vector<double> part(used.begin() + static_cast<std::ptrdiff_t>(w * window),
                             used.begin() + static_cast<std::ptrdiff_t>((w + 1) * window));
    r.windows.push_back(mean_of(part));
  }
  for (size_t i = 0; i < s.steps.size(); ++i) {
    if (s.loss[i]) {
      ++r.loss_values;
      r.loss_finite = r.loss_finite && std::isfinite(*s.loss[i]);
    }
    if (s.grad_norm[i]) {
      ++r.grad_norm_values;
      r.grad_norm_finite = r.grad_norm_finite && std::isfinite(*s.grad_norm[i]);
    }
  }
  return r;
}

std::vector<RunSummary> summarize(const std::vector<StepRecord>& records, int64_t warmup, int64_t window) {
  std::vector<RunSummary> out;
  for (const auto& s : build_series(records)) out.push_back(summarize_series(s, warmup, window));
  return out;
}

namespace {

const StepSeries& single_run(const std::vector<StepSeries>& series, const char* side) {
  if (series.size() != 1) {
    std::string names;
    for (const auto& s : series) {
      if (!names.empty()) names += ", ";
      names += "'" + s.run + "'";
    }
    throw Error(fmt::format("compare: argument '{}' must hold exactly one run (got {}: {})", side, series.size(),
                            names.empty() ? "none" : names));
  }
  return series[0];
}

struct Agreement {
  double mae = 0, max_abs = 0;
  int64_t n = 0;
};

}  // namespace

Comparison compare(const std::vector<StepRecord>& old_records, const std::vector<StepRecord>& new_records,
                   int64_t warmup, int64_t window) {
  const auto old_series = build_series(old_records);
  const auto new_series = build_series(new_records);
  const StepSeries& a = single_run(old_series, "old");
  const StepSeries& b = single_run(new_series, "new");
  Comparison c;
  c.old_run = summarize_series(a, warmup, window);
  c.new_run = summarize_series(b, warmup, window);
  c.mean_change = c.new_run.mean_s / c.old_run.mean_s - 1;
  c.median_change = c.new_run.median_s / c.old_run.median_s - 1;
  c.windows_compared = static_cast<int64_t>(std::min(c.old_run.windows.size(), c.new_run.windows.size()));
  for (int64_t w = 0; w < c.windows_compared; ++w)
    if (c.new_run.windows[w] < c.old_run.windows[w]) ++c.windows_improved;
  // Agreement over the step positions both logged (by position, so 0- and 1-based logs match).
  std::map<int64_t, size_t> new_at;
  for (size_t i = 0; i < b.steps.size(); ++i) new_at[b.steps[i] - b.first_step] = i;
  Agreement loss, grad;
  auto add = [](Agreement& g, const std::optional<double>& x, const std::optional<double>& y) {
    if (!x || !y || !std::isfinite(*x) || !std::isfinite(*y)) return;
    const double d = std::fabs(*x - *y);
    g.mae += d;
    g.max_abs = std::max(g.max_abs, d);
    ++g.n;
  };
  for (size_t i = 0; i < a.steps.size(); ++i) {
    auto it = new_at.find(a.steps[i] - a.first_step);
    if (it == new_at.end()) continue;
    ++c.agreement_steps;
    add(loss, a.loss[i], b.loss[it->second]);
    add(grad, a.grad_norm[i], b.grad_norm[it->second]);
  }
  if (loss.n) c.loss_mae = loss.mae / static_cast<double>(loss.n), c.loss_max_abs = loss.max_abs;
  if (grad.n) c.grad_norm_mae = grad.mae / static_cast<double>(grad.n), c.grad_norm_max_abs = grad.max_abs;
  c.all_finite = c.old_run.loss_finite && c.old_run.grad_norm_finite && c.new_run.loss_finite &&
                 c.new_run.grad_norm_finite;
  return c;
}

// ---------------------------------------------------------------- text

namespace {

// Renders rows under a header with the library's text table.
std::string render_table(std::vector<std::string> header, const std::vector<std::vector<std::string>>& rows) {
  TextTable table(std::move(header));
  for (const auto& r : rows) table.add_row(r);
  return table.render();
}

std::string finite_word(int64_t values, bool finite) {
  if (values == 0) return "not logged";
  return finite ? "all finite" : "NOT all finite";
}

std::string missing_lines(const RunSummary& r) {
  std::string out;
  if (!r.missing_steps.empty())
    out += fmt::format("  run '{}': {} step(s) logged by no rank: {}\n", r.run, r.missing_step_count,
                       list_steps(r.missing_steps, 8, r.missing_step_count));
  if (!r.incomplete.empty()) {
    std::vector<int64_t> steps;
    for (const auto& [s, ranks] : r.incomplete) steps.push_back(s);
    const auto& first = r.incomplete.front();
    std::string ranks;
    for (int rk : first.second) {
      if (!ranks.empty()) ranks += ",";
      ranks += std::to_string(rk);
    }
    out += fmt::format("  run '{}': {} step(s) with missing ranks, excluded (step {} lacks rank {}): {}\n", r.run,
                       r.incomplete.size(), first.first, ranks, list_steps(steps));
  }
  return out;
}

}  // namespace

std::string format_summary_table(const std::vector<RunSummary>& summaries) {
  std::vector<std::vector<std::string>> rows;
  size_t max_windows = 0;
  for (const auto& r : summaries) max_windows = std::max(max_windows, r.windows.size());
  for (const auto& r : summaries) {
    std::string windows;
    if (r.windows.size() <= 8) {
      for (size_t w = 0; w < r.windows.size(); ++w) {
        if (w) windows += " ";
        windows += fmt::format("{:.4g}", r.windows[w] * 1e3);
      }
    } else {
      // Many windows: their range says whether the effect is stable (--json lists them all).
      const auto [lo, hi] = std::minmax_element(r.windows.begin(), r.windows.end());
      windows = fmt::format("{} windows {:.4g}..{:.4g}", r.windows.size(), *lo * 1e3, *hi * 1e3);
    }
    rows.push_back({r.run, std::to_string(r.num_ranks), fmt::format("{}/{}", r.steps_used, r.steps_logged),
                    format_seconds(r.mean_s), format_seconds(r.median_s), format_seconds(r.min_s),
                    format_seconds(r.max_s), windows.empty() ? "-" : windows,
                    finite_word(r.loss_values, r.loss_finite), finite_word(r.grad_norm_values, r.grad_norm_finite)});
  }
  std::string out;
  if (!summaries.empty())
    out += fmt::format("step duration = max over ranks; warm-up {} step(s) discarded; windows of {} steps (ms)\n",
                       summaries[0].warmup, summaries[0].window);
  out += render_table({"run", "ranks", "used/logged", "mean", "median", "min", "max", "window means (ms)", "loss",
                       "grad_norm"},
                      rows);
  std::string missing;
  for (const auto& r : summaries) missing += missing_lines(r);
  if (!missing.empty()) out += "missing (reported, not filled):\n" + missing;
  return out;
}

std::string format_comparison(const Comparison& c) {
  std::string out = format_summary_table({c.old_run, c.new_run});
  out += fmt::format("\nnew vs old: mean {}, median {} (new/old - 1; negative = faster)\n",
                     format_percent(c.mean_change), format_percent(c.median_change));
  out += fmt::format("windows improved: {} of {}\n", c.windows_improved, c.windows_compared);
  auto agreement = [](const char* what, const std::optional<double>& mae, const std::optional<double>& mx) {
    if (!mae) return fmt::format("{}: no common finite values\n", what);
    return fmt::format("{}: mean abs diff {:.6g}, max abs diff {:.6g}\n", what, *mae, *mx);
  };
  out += fmt::format("numeric agreement over {} common step(s):\n", c.agreement_steps);
  out += "  " + agreement("loss", c.loss_mae, c.loss_max_abs);
  out += "  " + agreement("grad_norm", c.grad_norm_mae, c.grad_norm_max_abs);
  out += fmt::format("  all loss and grad_norm values finite: {}\n", c.all_finite ? "yes" : "NO");
  out += "  (per-step agreement does not prove long-term convergence equivalence)\n";
  return out;
}

// ---------------------------------------------------------------- JSON

namespace {

json number_or_null(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }
json optional_number(const std::optional<double>& v) { return v ? number_or_null(*v) : json(nullptr); }

}  // namespace

json to_json(const RunSummary& r) {
  json windows = json::array();
  for (double w : r.windows) windows.push_back(w);
  json incomplete = json::array();
  for (const auto& [step, ranks] : r.incomplete) incomplete.push_back({{"step", step}, {"missing_ranks", ranks}});
  json slowest = json::object();
  for (auto [rank, n] : r.slowest_rank_counts) slowest[std::to_string(rank)] = n;
  return {{"run", r.run},
          {"steps_used", r.steps_used},
          {"mean_s", number_or_null(r.mean_s)},
          {"median_s", number_or_null(r.median_s)},
          {"windows", windows},
          {"min_s", number_or_null(r.min_s)},
          {"max_s", number_or_null(r.max_s)},
          {"stddev_s", number_or_null(r.stddev_s)},
          {"ranks", r.num_ranks},
          {"steps_logged", r.steps_logged},
          {"warmup", r.warmup},
          {"window", r.window},
          {"loss_finite", r.loss_values ? json(r.loss_finite) : json(nullptr)},
          {"grad_norm_finite", r.grad_norm_values ? json(r.grad_norm_finite) : json(nullptr)},
          {"missing_steps", r.missing_steps},
          {"missing_step_count", r.missing_step_count},
          {"incomplete_steps", incomplete},
          {"slowest_rank_steps", slowest}};
}

json summaries_to_json(const std::vector<RunSummary>& summaries) {
  json runs = json::array();
  for (const auto& r : summaries) runs.push_back(to_json(r));
  return {{"runs", runs}};
}

json to_json(const Comparison& c) {
  auto side = [](const RunSummary& r) {
    json j = to_json(r);
    return j;
  };
  return {{"old", side(c.old_run)},
          {"new", side(c.new_run)},
          {"mean_change", number_or_null(c.mean_change)},
          {"median_change", number_or_null(c.median_change)},
          {"windows_improved", c.windows_improved},
          {"windows_compared", c.windows_compared},
          {"loss_mae", optional_number(c.loss_mae)},
          {"loss_max_abs", optional_number(c.loss_max_abs)},
          {"grad_norm_mae", optional_number(c.grad_norm_mae)},
          {"grad_norm_max_abs", optional_number(c.grad_norm_max_abs)},
          {"agreement_steps", c.agreement_steps},
          {"all_finite", c.all_finite}};
}

}  // namespace leanstep::stats
