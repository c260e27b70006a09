// Counterbalanced crossover: Latin-square / Williams plans and the paired analysis.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "leanstep/checked.h"
#include "leanstep/core.h"
#include "leanstep/stats.h"
#include "core/json_integer.h"
#include "stats/util.h"

namespace leanstep::stats {

using nlohmann::json;

// ---------------------------------------------------------------- plan

namespace {

// Williams design: rows of a Latin square in which every condition immediately follows
// every other condition equally often (first-order carryover balance). For even n one
// square does it; for odd n the square and its mirror image together (2n rows).
// First row: 0, 1, n-1, 2, n-2, ...; row i adds i (mod n) to every entry.
std::vector<std::vector<int>> williams_rows(int n) {
  std::vector<int> first(n);
  for (int j = 0; j < n; ++j) first[j] = j == 0 ? 0 : (j % 2 ? (j + 1) / 2 : n - j / 2);
  std::vector<std::vector<int>> rows;
  for (int i = 0; i < n; ++i) {
    std::vector<int> row(n);
    for (int j = 0; j < n; ++j) row[j] = (first[j] + i) % n;
    rows.push_back(row);
  }
  if (n % 2) {
    for (int i = 0; i < n; ++i) rows.emplace_back(rows[i].rbegin(), rows[i].rend());
  }
  return rows;
}

void check_names(const std::vector<std::string>& names, const char* where, const char* arg) {
  std::set<std::string> seen;
  for (const auto& n : names) {
    LEANSTEP_CHECK_ARG(!n.empty(), where, arg, "must not contain empty names");
    LEANSTEP_CHECK_ARG(n.find(',') == std::string::npos, where, arg,
                       fmt::format("names must not contain ',' (got '{}')", n));
    LEANSTEP_CHECK_ARG(seen.insert(n).second, where, arg, fmt::format("must not repeat a name (got '{}' twice)", n));
  }
}

}  // namespace

int64_t CrossoverPlan::steps_per_run() const {
  const int64_t blocks = checked_mul(static_cast<int64_t>(conditions.size()), cycles, "crossover plan", "blocks per run");
  return checked_add(warmup, checked_mul(block_steps, blocks, "crossover plan", "steps per run"), "crossover plan",
                     "steps per run");
}

PlannedStep CrossoverPlan::at(int run_index, int64_t position) const {
  LEANSTEP_CHECK_ARG(run_index >= 0 && run_index < static_cast<int>(runs.size()), "CrossoverPlan::at", "run_index",
                     fmt::format("must be in [0, {}) (got {})", runs.size(), run_index));
  LEANSTEP_CHECK_ARG(position >= 0 && position < steps_per_run(), "CrossoverPlan::at", "position",
                     fmt::format("must be in [0, {}) steps of the plan (got {})", steps_per_run(), position));
  const auto& run = runs[static_cast<size_t>(run_index)];
  if (position < warmup) return {run.blocks[0], 0, true};
  const int block = static_cast<int>((position - warmup) / block_steps);
  return {run.blocks[static_cast<size_t>(block)], block, false};
}

int CrossoverPlan::run_index(const std::string& name) const {
  for (size_t i = 0; i < runs.size(); ++i)
    if (runs[i].name == name) return static_cast<int>(i);
  return -1;
}

CrossoverPlan plan_crossover(const std::vector<std::string>& conditions, int runs, int64_t block_steps,
                             int64_t warmup, const std::vector<std::string>& allocations_in,
                             int64_t exclude_after_transition, int cycles) {
  const char* where = "crossover plan";
  const int k = static_cast<int>(conditions.size());
  LEANSTEP_CHECK_ARG(k >= 2, where, "conditions", fmt::format("must name at least 2 conditions (got {})", k));
  check_names(conditions, where, "conditions");
  std::vector<std::string> allocations = allocations_in.empty() ? std::vector<std::string>{"default"} : allocations_in;
  check_names(allocations, where, "allocations");
  const int a = static_cast<int>(allocations.size());
  // Limits (docs/stats.md): so that every step count of the plan fits in int64 and the
  // plan itself in memory.
  LEANSTEP_CHECK_ARG(k <= kMaxPlanConditions, where, "conditions",
                     fmt::format("must name at most {} conditions (got {})", kMaxPlanConditions, k));
  LEANSTEP_CHECK_ARG(allocations.size() <= static_cast<size_t>(kMaxPlanConditions), where, "allocations",
                     fmt::format("must name at most {} allocations (got {})", kMaxPlanConditions, allocations.size()));
  LEANSTEP_CHECK_ARG(block_steps >= 1 && block_steps <= kMaxPlanSteps, where, "block_steps",
                     fmt::format("must be in [1, 2^40] (got {})", block_steps));
  LEANSTEP_CHECK_ARG(warmup >= 0 && warmup <= kMaxPlanSteps, where, "warmup",
                     fmt::format("must be in [0, 2^40] (got {})", warmup));
  LEANSTEP_CHECK_ARG(runs <= kMaxPlanRuns, where, "runs", fmt::format("must be at most {} (got {})", kMaxPlanRuns, runs));
  LEANSTEP_CHECK_ARG(exclude_after_transition >= 0 && exclude_after_transition < block_steps, where,
                     "exclude_after_transition",
                     fmt::format("must be in [0, block_steps = {}) (got {})", block_steps, exclude_after_transition));
  LEANSTEP_CHECK_ARG(runs >= 1, where, "runs", fmt::format("must be >= 1 (got {})", runs));
  LEANSTEP_CHECK_ARG(cycles >= 1 && cycles <= kMaxPlanCycles, where, "cycles",
                     fmt::format("must be in [1, {}] (got {})", kMaxPlanCycles, cycles));
  const int unit = k * a;
  if (runs % unit != 0) {
    const int lower = runs / unit * unit, upper = lower + unit;
    throw_arg_error(where, "runs",
                    fmt::format("must be a multiple of conditions x allocations = {} x {} = {} so that every condition "
                                "appears equally often at every block position on every allocation (got {}; use {})",
                                k, a, unit, runs,
                                lower > 0 ? fmt::format("{} or {}", lower, upper) : std::to_string(upper)));
  }
  const int per_allocation = runs / a;
  const auto rows = williams_rows(k);
  const bool williams = per_allocation % static_cast<int>(rows.size()) == 0;

  CrossoverPlan plan;
  plan.conditions = conditions;
  plan.allocations = allocations;
  plan.block_steps = block_steps;
  plan.warmup = warmup;
  plan.exclude_after_transition = exclude_after_transition;
  plan.cycles = cycles;
  plan.design = williams ? "williams" : "cyclic latin square";
  // Cycle c of every run uses the square's row (first row + shift[c]). A shift is the same
  // for all runs, so every cycle is itself a set of whole squares (position balance holds
  // block by block). The shifts are chosen one cycle at a time so that the transitions
  // from the end of one cycle into the next, counted over all runs, even out the ordered
  // pairs (first-order carryover) and never repeat a condition; check_balance says
  // whether the whole plan came out exactly balanced.
  const int num_rows = static_cast<int>(rows.size());
  auto first_row = [&](int r) { return (r / a) % num_rows; };
  std::vector<int> shift(static_cast<size_t>(cycles), 0);
  using Counts = std::vector<std::vector<int64_t>>;
  // Adds, over all runs, the ordered pairs of the cycle that uses shift `s` (its own pairs,
  // and with `previous` >= 0 the step into it from the cycle that used shift `previous`);
  // true when that step repeats a condition.
  auto add_cycle = [&](Counts& counts, int previous, int s) {
    bool repeats = false;
    for (int r = 0; r < runs; ++r) {
      const auto& next = rows[static_cast<size_t>((first_row(r) + s) % num_rows)];
      if (previous >= 0) {
        const auto& prev = rows[static_cast<size_t>((first_row(r) + previous) % num_rows)];
        repeats = repeats || prev.back() == next.front();
        ++counts[static_cast<size_t>(prev.back())][static_cast<size_t>(next.front())];
      }
      for (size_t j = 0; j + 1 < next.size(); ++j) ++counts[static_cast<size_t>(next[j])][static_cast<size_t>(next[j + 1])];
    }
    return repeats;
  };
  Counts follows(static_cast<size_t>(k), std::vector<int64_t>(static_cast<size_t>(k), 0));
  add_cycle(follows, -1, 0);
  for (int c = 1; c < cycles; ++c) {
    const int previous = shift[static_cast<size_t>(c - 1)];
    int best = -1;
    std::pair<int64_t, int64_t> best_cost{0, 0};
    for (int s = 0; s < num_rows; ++s) {
      // Cost: the largest pair count after this cycle (within-cycle pairs included), then
      // the sum of squares; a shift that puts one condition twice in a row is refused
      // unless nothing else exists (k = 2 with one row has no other choice).
      Counts trial = follows;
      const bool repeats = add_cycle(trial, previous, s);
      int64_t worst = 0, squares = 0;
      for (int i = 0; i < k; ++i)
        for (int j = 0; j < k; ++j)
          if (i != j) {
            const int64_t n = trial[static_cast<size_t>(i)][static_cast<size_t>(j)];
            worst = std::max(worst, n);
            squares += n * n;
          }
      const std::pair<int64_t, int64_t> cost =
          repeats ? std::pair<int64_t, int64_t>{INT64_MAX / 2, INT64_MAX / 2} : std::pair<int64_t, int64_t>{worst, squares};
      if (best < 0 || cost < best_cost) best = s, best_cost = cost;
    }
    shift[static_cast<size_t>(c)] = best;
    add_cycle(follows, previous, best);
  }
  for (int r = 0; r < runs; ++r) {
    // Runs alternate between allocations; on each allocation the runs walk through the
    // square's rows, so every allocation holds whole Latin squares.
    const int alloc = r % a;
    PlannedRun run;
    run.name = fmt::format("run{}", r);
    run.allocation = allocations[static_cast<size_t>(alloc)];
    for (int c = 0; c < cycles; ++c)
      for (int cond : rows[static_cast<size_t>((first_row(r) + shift[static_cast<size_t>(c)]) % num_rows)])
        run.blocks.push_back(conditions[static_cast<size_t>(cond)]);
    plan.runs.push_back(std::move(run));
  }
  plan.carryover_balanced = check_balance(plan).carryover_balanced;
  return plan;
}

PlanBalance check_balance(const CrossoverPlan& plan) {
  PlanBalance b;
  const size_t k = plan.conditions.size();
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < k; ++i) index[plan.conditions[i]] = i;
  b.every_run_complete = !plan.runs.empty();
  // counts[allocation][position][condition]
  std::map<std::string, std::vector<std::vector<int64_t>>> counts;
  std::vector<std::vector<int64_t>> follows(k, std::vector<int64_t>(k, 0));
  const size_t cycles = static_cast<size_t>(std::max<int64_t>(plan.cycles, 1));
  const size_t blocks = k * cycles;
  std::vector<std::vector<int64_t>> overall(blocks, std::vector<int64_t>(k, 0));
  for (const auto& run : plan.runs) {
    // Complete: every condition exactly `cycles` times.
    std::map<std::string, size_t> times;
    for (const auto& c : run.blocks) ++times[c];
    bool known = run.blocks.size() == blocks && times.size() == k;
    for (const auto& [c, n] : times) known = known && index.count(c) && n == cycles;
    if (!known) {
      b.every_run_complete = false;
      continue;
    }
    auto& ac = counts[run.allocation];
    if (ac.empty()) ac.assign(blocks, std::vector<int64_t>(k, 0));
    for (size_t p = 0; p < blocks; ++p) {
      ++ac[p][index[run.blocks[p]]];
      ++overall[p][index[run.blocks[p]]];
      if (p + 1 < blocks) ++follows[index[run.blocks[p]]][index[run.blocks[p + 1]]];
    }
  }
  auto uniform = [](const std::vector<std::vector<int64_t>>& m) {
    for (const auto& row : m)
      for (int64_t v : row)
        if (v != m[0][0]) return false;
    return true;
  };
  b.positions_balanced = b.every_run_complete && uniform(overall) && overall[0][0] > 0;
  for (const auto& [alloc, m] : counts) b.positions_balanced = b.positions_balanced && uniform(m);
  b.carryover_balanced = b.every_run_complete;
  int64_t expected = -1;
  for (size_t i = 0; i < k; ++i)
    for (size_t j = 0; j < k; ++j) {
      if (i == j) continue;
      if (expected < 0) expected = follows[i][j];
      b.carryover_balanced = b.carryover_balanced && follows[i][j] == expected && expected > 0;
    }
  return b;
}

json to_json(const CrossoverPlan& plan) {
  json runs = json::array();
  for (const auto& r : plan.runs) runs.push_back({{"run", r.name}, {"allocation", r.allocation}, {"blocks", r.blocks}});
  return {{"design", plan.design},
          {"conditions", plan.conditions},
          {"allocations", plan.allocations},
          {"block_steps", plan.block_steps},
          {"cycles", plan.cycles},
          {"warmup", plan.warmup},
          {"exclude_after_transition", plan.exclude_after_transition},
          {"steps_per_run", plan.steps_per_run()},
          {"carryover_balanced", plan.carryover_balanced},
          {"runs", runs}};
}

CrossoverPlan plan_from_json(const json& j, const std::string& name) {
  auto bad = [&](const std::string& what) { throw Error(fmt::format("{}: {}", name, what)); };
  if (!j.is_object()) bad("a crossover plan must be a JSON object");
  // A JSON integer in int64 range; anything else (a float such as 1e300 or a
  // literal too large for 64 bits, which the parser keeps as a double, or a
  // string) is an error naming the key, never a cast out of range.
  auto integer = [&](const char* key, std::optional<int64_t> fallback) -> int64_t {
    if (!j.contains(key)) {
      if (!fallback) bad(fmt::format("malformed crossover plan (key '{}' not found)", key));
      return *fallback;
    }
    const std::optional<int64_t> value = json_integer<int64_t>(j.at(key));
    if (!value) bad(fmt::format("'{}' must be an integer in [0, 2^40] (got {})", key, j.at(key).dump()));
    return *value;
  };
  CrossoverPlan p;
  try {
    p.conditions = j.at("conditions").get<std::vector<std::string>>();
    p.allocations = j.contains("allocations") ? j.at("allocations").get<std::vector<std::string>>()
                                              : std::vector<std::string>{"default"};
    p.block_steps = integer("block_steps", std::nullopt);
    p.warmup = integer("warmup", int64_t{0});
    p.exclude_after_transition = integer("exclude_after_transition", int64_t{0});
    p.cycles = integer("cycles", int64_t{1});
    p.design = j.value("design", std::string("custom"));
    for (const auto& r : j.at("runs")) {
      PlannedRun run;
      run.name = r.at("run").get<std::string>();
      run.allocation = r.value("allocation", p.allocations.empty() ? std::string("default") : p.allocations[0]);
      run.blocks = r.at("blocks").get<std::vector<std::string>>();
      p.runs.push_back(std::move(run));
    }
  } catch (const json::exception& e) {
    bad(fmt::format("malformed crossover plan ({})", e.what()));
  }
  if (p.conditions.size() < 2) bad("a crossover plan needs at least 2 conditions");
  if (p.conditions.size() > static_cast<size_t>(kMaxPlanConditions))
    bad(fmt::format("a crossover plan has at most {} conditions (got {})", kMaxPlanConditions, p.conditions.size()));
  if (p.block_steps < 1 || p.block_steps > kMaxPlanSteps)
    bad(fmt::format("'block_steps' must be in [1, 2^40] (got {})", p.block_steps));
  if (p.warmup < 0 || p.warmup > kMaxPlanSteps) bad(fmt::format("'warmup' must be in [0, 2^40] (got {})", p.warmup));
  if (p.exclude_after_transition < 0 || p.exclude_after_transition > kMaxPlanSteps)
    bad(fmt::format("'exclude_after_transition' must be in [0, 2^40] (got {})", p.exclude_after_transition));
  if (p.cycles < 1 || p.cycles > kMaxPlanCycles)
    bad(fmt::format("'cycles' must be in [1, {}] (got {})", kMaxPlanCycles, p.cycles));
  if (p.runs.empty()) bad("a crossover plan needs at least one run");
  if (p.runs.size() > static_cast<size_t>(kMaxPlanRuns))
    bad(fmt::format("a crossover plan has at most {} runs (got {})", kMaxPlanRuns, p.runs.size()));
  std::set<std::string> names;
  const std::set<std::string> conds(p.conditions.begin(), p.conditions.end());
  if (conds.size() != p.conditions.size()) bad("a crossover plan must not name a condition twice");
  for (const auto& r : p.runs) {
    if (!names.insert(r.name).second) bad(fmt::format("run '{}' appears twice", r.name));
    std::map<std::string, int64_t> times;
    for (const auto& c : r.blocks) ++times[c];
    bool complete = static_cast<int64_t>(r.blocks.size()) == static_cast<int64_t>(p.conditions.size()) * p.cycles;
    for (const auto& [c, n] : times) complete = complete && conds.count(c) && n == p.cycles;
    if (!complete || times.size() != conds.size())
      bad(p.cycles == 1 ? fmt::format("run '{}' must hold every condition exactly once as a block", r.name)
                        : fmt::format("run '{}' must hold every condition exactly {} times (cycles) as a block", r.name,
                                      p.cycles));
  }
  p.carryover_balanced = check_balance(p).carryover_balanced;
  return p;
}

CrossoverPlan read_plan(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(fmt::format("crossover plan: cannot open '{}'", path));
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers such as 1e400
    throw Error(fmt::format("{}: invalid JSON ({})", path, e.what()));
  }
  return plan_from_json(j, path);
}

void write_plan(const std::string& path, const CrossoverPlan& plan) {
  std::ofstream out(path);
  if (!out) throw Error(fmt::format("crossover plan: cannot open '{}' for writing", path));
  out << to_json(plan).dump(2) << "\n";
  if (!out) throw Error(fmt::format("crossover plan: writing '{}' failed", path));
}

std::string format_plan(const CrossoverPlan& plan) {
  const PlanBalance b = check_balance(plan);
  std::string out = fmt::format(
      "{} design: {} conditions, {} runs, {} cycle(s) of blocks of {} steps after {} warm-up steps ({} steps per run)\n",
      plan.design, plan.conditions.size(), plan.runs.size(), plan.cycles, plan.block_steps, plan.warmup,
      plan.steps_per_run());
  out += fmt::format("balanced over block positions{}: {}; first-order carryover balanced: {}\n",
                     plan.allocations.size() > 1 ? " and allocations" : "", b.positions_balanced ? "yes" : "NO",
                     b.carryover_balanced ? "yes" : "no");
  size_t w = 3;
  for (const auto& r : plan.runs) w = std::max(w, r.name.size());
  size_t aw = 10;
  for (const auto& a : plan.allocations) aw = std::max(aw, a.size());
  std::vector<size_t> cw(plan.conditions.size(), 0);
  for (const auto& c : plan.conditions) cw[0] = std::max(cw[0], c.size());
  std::string header = fmt::format("{:<{}}  {:<{}}", "run", w, "allocation", aw);  // trailing spaces trimmed below
  const size_t blocks = plan.runs.empty() ? 0 : plan.runs[0].blocks.size();
  for (size_t p = 0; p < blocks; ++p) {
    const int64_t first = plan.warmup + static_cast<int64_t>(p) * plan.block_steps;
    header += fmt::format("  {:<{}}", fmt::format("block {} [{}-{})", p, first, first + plan.block_steps),
                          std::max(cw[0], size_t{16}));
  }
  while (!header.empty() && header.back() == ' ') header.pop_back();
  out += header + "\n" + std::string(header.size(), '-') + "\n";
  for (const auto& r : plan.runs) {
    std::string line = fmt::format("{:<{}}  {:<{}}", r.name, w, r.allocation, aw);
    for (const auto& c : r.blocks) line += fmt::format("  {:<{}}", c, std::max(cw[0], size_t{16}));
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  if (plan.warmup > 0)
    out += fmt::format("warm-up steps [0-{}) run the condition of block 0; the analysis excludes the first {} step(s) of every block\n",
                       plan.warmup, plan.exclude_after_transition);
  return out;
}

// ---------------------------------------------------------------- interval over runs

double student_t_975(int64_t df) {
  LEANSTEP_CHECK_ARG(df >= 1, "student_t_975", "df", fmt::format("must be >= 1 (got {})", df));
  static constexpr double kTable[30] = {12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624,
                                        2.306004,  2.262157, 2.228139, 2.200985, 2.178813, 2.160369, 2.144787,
                                        2.131450,  2.119905, 2.109816, 2.100922, 2.093024, 2.085963, 2.079614,
                                        2.073873,  2.068658, 2.063899, 2.059539, 2.055529, 2.051831, 2.048407,
                                        2.045230,  2.042272};
  if (df <= 30) return kTable[df - 1];
  // Cornish-Fisher expansion around the normal quantile (error < 1e-6 beyond 30).
  const double z = 1.959963984540054, n = static_cast<double>(df);
  const double z3 = z * z * z, z5 = z3 * z * z, z7 = z5 * z * z;
  return z + (z3 + z) / (4 * n) + (5 * z5 + 16 * z3 + 3 * z) / (96 * n * n) +
         (3 * z7 + 19 * z5 + 17 * z3 - 15 * z) / (384 * n * n * n);
}

RunContrastCI run_contrast_ci(const std::vector<double>& contributions) {
  RunContrastCI ci;
  const size_t n = contributions.size();
  ci.runs = static_cast<int64_t>(n);
  ci.low = ci.high = std::nan("");
  if (n == 0) {
    ci.log_ratio = std::nan("");
    return ci;
  }
  double sum = 0;
  for (double z : contributions) sum += z;
  ci.log_ratio = sum;
  if (ci.runs < kMinIntervalRuns) return ci;  // too few independent units: no interval
  const double mean = sum / static_cast<double>(n);
  double squares = 0;
  for (double z : contributions) squares += (z - mean) * (z - mean);
  const double variance = static_cast<double>(n) / static_cast<double>(n - 1) * squares;
  const double half = student_t_975(ci.runs - 1) * std::sqrt(variance);
  ci.low = sum - half;
  ci.high = sum + half;
  return ci;
}

// ---------------------------------------------------------------- analysis

namespace {

// Per step position: the logarithm of each used step duration, its condition and run.
struct UsedStep {
  std::string condition;
  double log_duration;
  size_t run;
};
using PositionMap = std::map<int64_t, std::vector<UsedStep>>;

// The paired estimate of x against y, the seed's: the mean over matched positions of the
// difference of the sides' mean log durations (several runs may hold a condition at one
// position when runs = m x conditions); and each run's contribution to it (their sum),
// for the interval (see run_contrast_ci), over the runs that take part.
struct PairedEstimate {
  double mean_log_ratio = 0;  // NaN without a matched position
  int64_t positions = 0;
  std::vector<double> run_contributions;
};

PairedEstimate paired_estimate(const PositionMap& positions, const std::string& x, const std::string& y,
                               size_t num_runs) {
  PairedEstimate e;
  std::vector<double> contribution(num_runs, 0.0);
  std::vector<bool> takes_part(num_runs, false);
  double sum = 0;
  for (const auto& [pos, entries] : positions) {
    double sx = 0, sy = 0;
    int nx = 0, ny = 0;
    for (const auto& u : entries) {
      if (u.condition == x) sx += u.log_duration, ++nx;
      else if (u.condition == y) sy += u.log_duration, ++ny;
    }
    if (!nx || !ny) continue;
    sum += sx / nx - sy / ny;
    ++e.positions;
    for (const auto& u : entries) {
      if (u.condition != x && u.condition != y) continue;
      contribution[u.run] += u.condition == x ? u.log_duration / nx : -u.log_duration / ny;
      takes_part[u.run] = true;
    }
  }
  e.mean_log_ratio = e.positions ? sum / static_cast<double>(e.positions) : std::nan("");
  for (size_t r = 0; r < num_runs; ++r)
    if (takes_part[r]) e.run_contributions.push_back(contribution[r] / static_cast<double>(e.positions));
  return e;
}

}  // namespace

CrossoverResult analyze_crossover(const std::vector<StepRecord>& records_in, const CrossoverOptions& options) {
  const char* where = "crossover analyze";
  LEANSTEP_CHECK_ARG(!records_in.empty(), where, "records", "must not be empty");
  const CrossoverPlan* plan = options.plan;
  CrossoverResult res;
  res.series = build_series(records_in);
  res.num_runs = static_cast<int>(res.series.size());
  res.warmup = options.warmup.value_or(plan ? plan->warmup : 0);
  res.exclude_after_transition = options.exclude_after_transition.value_or(plan ? plan->exclude_after_transition : 2);
  LEANSTEP_CHECK_ARG(res.warmup >= 0, where, "warmup", fmt::format("must be >= 0 (got {})", res.warmup));
  LEANSTEP_CHECK_ARG(res.exclude_after_transition >= 0, where, "exclude_after_transition",
                     fmt::format("must be >= 0 (got {})", res.exclude_after_transition));

  // The plan checks the logs and supplies conditions/blocks the logs did not record.
  if (plan) {
    std::set<std::string> logged;
    for (auto& s : res.series) {
      logged.insert(s.run);
      const int idx = plan->run_index(s.run);
      if (idx < 0)
        throw Error(fmt::format("{}: run '{}' of the logs is not in the plan (the plan names run0..run{})", where,
                                s.run, plan->runs.size() - 1));
      for (size_t i = 0; i < s.steps.size(); ++i) {
        const int64_t pos = s.steps[i] - s.first_step;
        if (pos >= plan->steps_per_run())
          throw Error(fmt::format("{}: run '{}' step {} lies beyond the plan's {} steps per run", where, s.run,
                                  s.steps[i], plan->steps_per_run()));
        const PlannedStep ps = plan->at(idx, pos);
        if (s.condition[i].empty()) s.condition[i] = ps.condition;
        else if (s.condition[i] != ps.condition)
          throw Error(fmt::format("{}: run '{}' step {} logged condition '{}' but the plan says '{}'", where, s.run,
                                  s.steps[i], s.condition[i], ps.condition));
        if (s.block[i] < 0) s.block[i] = ps.block;
        else if (s.block[i] != ps.block)
          throw Error(fmt::format("{}: run '{}' step {} logged block {} but the plan says {}", where, s.run, s.steps[i],
                                  s.block[i], ps.block));
      }
      const std::string& planned_alloc = plan->runs[static_cast<size_t>(idx)].allocation;
      if (!s.allocation.empty() && s.allocation != planned_alloc)
        res.notes.push_back(fmt::format("run '{}' logged allocation '{}' but the plan says '{}'", s.run, s.allocation,
                                        planned_alloc));
    }
    for (const auto& r : plan->runs)
      if (!logged.count(r.name))
        res.notes.push_back(fmt::format("run '{}' of the plan has no logs: the design is no longer balanced", r.name));
  }

  // Conditions: the plan's order, else order of first appearance.
  std::vector<std::string> conditions = plan ? plan->conditions : std::vector<std::string>{};
  for (const auto& s : res.series)
    for (size_t i = 0; i < s.steps.size(); ++i) {
      if (s.condition[i].empty())
        throw Error(fmt::format("{}: run '{}' step {} has no condition; log the 'condition' key or pass the plan",
                                where, s.run, s.steps[i]));
      if (std::find(conditions.begin(), conditions.end(), s.condition[i]) == conditions.end())
        conditions.push_back(s.condition[i]);
    }
  LEANSTEP_CHECK_ARG(conditions.size() >= 2, where, "records",
                     fmt::format("must hold at least 2 conditions to compare (got {})", conditions.size()));
  res.conditions = conditions;
  res.baseline = options.baseline.empty() ? conditions[0] : options.baseline;
  if (std::find(conditions.begin(), conditions.end(), res.baseline) == conditions.end())
    throw_arg_error(where, "baseline",
                    fmt::format("must be one of the logged conditions (got '{}')", res.baseline));

  // Used steps by position, with and without the first steps after each transition; the
  // same for every other field (its own map per field name).
  PositionMap with_transitions, without_transitions;
  std::map<std::string, std::vector<double>> per_condition;
  struct FieldSteps {
    PositionMap with_transitions, without_transitions;
    std::map<std::string, std::vector<double>> per_condition;
    int64_t skipped = 0;
  };
  std::map<std::string, FieldSteps> field_steps;
  for (const auto& s : res.series)
    for (const auto& [f, values] : s.fields) field_steps[f];
  for (size_t run = 0; run < res.series.size(); ++run) {
    const StepSeries& s = res.series[run];
    std::string previous_key;
    int64_t block_start = 0;
    int64_t incomplete = 0;
    for (size_t i = 0; i < s.steps.size(); ++i) {
      const int64_t pos = s.steps[i] - s.first_step;
      // A transition: the block (or, when blocks are not logged, the condition) changes.
      // The run's start counts as one too (a cold start after warm-up 0).
      const std::string key = s.block[i] >= 0 ? "b" + std::to_string(s.block[i]) : "c" + s.condition[i];
      if (i == 0 || key != previous_key) block_start = pos;
      previous_key = key;
      if (pos < res.warmup) continue;
      // The end of warm-up starts the first block for the exclusion too: every block then
      // loses the same K positions, so each run contributes equally to every condition and
      // run-to-run speed differences cancel exactly in the paired geometric mean.
      const int64_t since_block_start = pos - std::max(block_start, res.warmup);
      if (!s.complete[i]) {
        ++incomplete;
        continue;
      }
      const double logd = std::log(s.duration_s[i]);
      const bool after_transition = since_block_start >= res.exclude_after_transition;
      with_transitions[pos].push_back({s.condition[i], logd, run});
      if (after_transition) {
        without_transitions[pos].push_back({s.condition[i], logd, run});
        per_condition[s.condition[i]].push_back(s.duration_s[i]);
      }
      for (auto& [f, fs] : field_steps) {
        const auto it = s.fields.find(f);
        const double v = it == s.fields.end() ? std::nan("") : it->second[i];
        if (!(std::isfinite(v) && v > 0)) {  // ratios need positive values
          if (after_transition) ++fs.skipped;
          continue;
        }
        fs.with_transitions[pos].push_back({s.condition[i], std::log(v), run});
        if (after_transition) {
          fs.without_transitions[pos].push_back({s.condition[i], std::log(v), run});
          fs.per_condition[s.condition[i]].push_back(v);
        }
      }
    }
    if (incomplete)
      res.notes.push_back(fmt::format("run '{}': {} step(s) with missing ranks excluded (not filled)", s.run, incomplete));
    if (!s.missing_steps.empty())
      res.notes.push_back(fmt::format("run '{}': {} step(s) logged by no rank: {}", s.run, s.missing_step_count,
                                      list_steps(s.missing_steps, 8, s.missing_step_count)));
  }
  for (const auto& c : conditions) {
    ConditionSummary cs;
    cs.condition = c;
    const auto& v = per_condition[c];
    cs.steps_used = static_cast<int64_t>(v.size());
    cs.mean_s = mean_of(v);
    cs.median_s = median_of(v);
    res.condition_summaries.push_back(cs);
  }

  auto pair_of = [&](const PositionMap& without, const PositionMap& with, const std::string& x,
                     const std::string& y, bool note) {
    PairResult p;
    p.condition = x;
    p.versus = y;
    const size_t runs = res.series.size();
    const PairedEstimate a = paired_estimate(without, x, y, runs);
    const PairedEstimate b = paired_estimate(with, x, y, runs);
    const RunContrastCI ia = run_contrast_ci(a.run_contributions), ib = run_contrast_ci(b.run_contributions);
    p.geomean_ratio = std::exp(a.mean_log_ratio);
    p.reduction = 1 - p.geomean_ratio;
    p.ci_low = 1 - std::exp(ia.high);  // a larger ratio is a smaller reduction
    p.ci_high = 1 - std::exp(ia.low);
    p.matched_positions = a.positions;
    p.independent_runs = ia.runs;
    p.geomean_ratio_with_transitions = std::exp(b.mean_log_ratio);
    p.reduction_with_transitions = 1 - p.geomean_ratio_with_transitions;
    p.ci_low_with_transitions = 1 - std::exp(ib.high);
    p.ci_high_with_transitions = 1 - std::exp(ib.low);
    p.matched_positions_with_transitions = b.positions;
    p.independent_runs_with_transitions = ib.runs;
    if (!note) return p;
    if (a.positions == 0)
      res.notes.push_back(fmt::format("'{}' and '{}' never share a step position: no paired ratio", x, y));
    else if (ia.runs < kMinIntervalRuns)
      res.notes.push_back(fmt::format("'{}' vs '{}' rests on {} independent run(s): too few for an interval "
                                      "(at least {}; the steps of one run are not independent)",
                                      x, y, ia.runs, kMinIntervalRuns));
    return p;
  };
  auto pair = [&](const std::string& x, const std::string& y) {
    return pair_of(without_transitions, with_transitions, x, y, true);
  };
  for (const auto& c : conditions)
    if (c != res.baseline) res.comparisons.push_back(pair(c, res.baseline));
  for (const auto& [f, fs] : field_steps) {
    FieldResult fr;
    fr.field = f;
    fr.steps_skipped = fs.skipped;
    for (const auto& c : conditions) {
      ConditionSummary cs;
      cs.condition = c;
      const auto it = fs.per_condition.find(c);
      const std::vector<double> none;
      const auto& v = it == fs.per_condition.end() ? none : it->second;
      cs.steps_used = static_cast<int64_t>(v.size());
      cs.mean_s = mean_of(v);
      cs.median_s = median_of(v);
      fr.conditions.push_back(cs);
    }
    for (const auto& c : conditions)
      if (c != res.baseline) fr.comparisons.push_back(pair_of(fs.without_transitions, fs.with_transitions, c, res.baseline, false));
    if (fs.skipped)
      res.notes.push_back(fmt::format("field '{}': {} used step(s) without a positive value on every rank left out",
                                      f, fs.skipped));
    res.fields.push_back(std::move(fr));
  }
  std::vector<std::string> others;
  for (const auto& c : conditions)
    if (c != res.baseline) others.push_back(c);
  for (size_t i = 0; i < others.size(); ++i)
    for (size_t j = i + 1; j < others.size(); ++j) res.comparisons.push_back(pair(others[j], others[i]));

  // Interaction view.
  auto known = [&](const std::string& c) { return std::find(conditions.begin(), conditions.end(), c) != conditions.end(); };
  auto interactions = options.interactions;
  for (const auto& c : conditions) {
    const size_t plus = c.find('+');
    if (plus == std::string::npos || c.find('+', plus + 1) != std::string::npos) continue;
    const std::string first = c.substr(0, plus), second = c.substr(plus + 1);
    const bool listed = std::any_of(interactions.begin(), interactions.end(), [&](const auto& e) { return e.first == c; });
    if (known(first) && known(second) && !listed) interactions.push_back({c, {first, second}});
  }
  auto find_pair = [&](const std::string& x, const std::string& y) {
    for (const auto& p : res.comparisons) {
      if (p.condition == x && p.versus == y) return p.geomean_ratio;
      if (p.condition == y && p.versus == x) return 1 / p.geomean_ratio;
    }
    return std::nan("");
  };
  for (const auto& [combined, parts] : interactions) {
    for (const auto& name : {combined, parts.first, parts.second})
      if (!known(name))
        throw_arg_error(where, "interactions", fmt::format("names a condition that was not logged (got '{}')", name));
    if (combined == res.baseline || parts.first == res.baseline || parts.second == res.baseline ||
        parts.first == parts.second || combined == parts.first || combined == parts.second)
      throw_arg_error(where, "interactions",
                      fmt::format("must name a combined condition and two distinct parts, none the baseline (got {}={},{})",
                                  combined, parts.first, parts.second));
    Interaction in;
    in.combined = combined;
    in.first = parts.first;
    in.second = parts.second;
    const double rc = find_pair(combined, res.baseline), r1 = find_pair(parts.first, res.baseline),
                 r2 = find_pair(parts.second, res.baseline);
    in.combined_vs_baseline = 1 - rc;
    in.first_vs_baseline = 1 - r1;
    in.second_vs_baseline = 1 - r2;
    in.combined_vs_first = 1 - find_pair(combined, parts.first);
    in.combined_vs_second = 1 - find_pair(combined, parts.second);
    in.independent_prediction = 1 - r1 * r2;
    res.interactions.push_back(in);
  }
  return res;
}

namespace {

std::string ci_text(double lo, double hi) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) return "n/a";
  return fmt::format("[{:+.2f}%, {:+.2f}%]", lo * 100, hi * 100);
}

json number_or_null(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

// A field named "..._s" holds seconds; any other is shown as a plain number.
std::string format_value(const std::string& field, double v) {
  if (!std::isfinite(v)) return "n/a";
  if (field.size() > 2 && field.compare(field.size() - 2, 2, "_s") == 0) return format_seconds(v);
  return fmt::format("{:.4g}", v);
}

json pair_json(const PairResult& p) {
  return {{"condition", p.condition},
          {"versus", p.versus},
          {"reduction", number_or_null(p.reduction)},
          {"ci_low", number_or_null(p.ci_low)},
          {"ci_high", number_or_null(p.ci_high)},
          {"matched_positions", p.matched_positions},
          {"independent_runs", p.independent_runs},
          {"independent_runs_with_transitions", p.independent_runs_with_transitions},
          {"reduction_with_transitions", number_or_null(p.reduction_with_transitions)},
          {"geomean_ratio", number_or_null(p.geomean_ratio)},
          {"ci_low_with_transitions", number_or_null(p.ci_low_with_transitions)},
          {"ci_high_with_transitions", number_or_null(p.ci_high_with_transitions)},
          {"matched_positions_with_transitions", p.matched_positions_with_transitions}};
}

json condition_json(const ConditionSummary& c) {
  return {{"condition", c.condition},
          {"steps_used", c.steps_used},
          {"mean_s", number_or_null(c.mean_s)},
          {"median_s", number_or_null(c.median_s)}};
}

}  // namespace

std::string format_crossover(const CrossoverResult& r) {
  std::string out = fmt::format(
      "crossover: {} runs, baseline '{}'; warm-up {} step(s) discarded; the first {} step(s) of every block "
      "(transition steps) excluded\n",
      r.num_runs, r.baseline, r.warmup, r.exclude_after_transition);
  out += "step duration = max over ranks; ratios at the same step position, geometric mean over positions\n\n";
  size_t w = 9;
  for (const auto& c : r.conditions) w = std::max(w, c.size());
  out += fmt::format("{:<{}}  {:>8}  {:>12}  {:>12}\n", "condition", w, "steps", "mean", "median");
  for (const auto& c : r.condition_summaries)
    out += fmt::format("{:<{}}  {:>8}  {:>12}  {:>12}\n", c.condition, w, c.steps_used, format_seconds(c.mean_s),
                       format_seconds(c.median_s));
  out += "\npaired step-duration reduction (1 - geomean of condition/versus; positive = faster)\n";
  std::vector<std::string> labels;
  size_t lw = 10;
  for (const auto& p : r.comparisons) {
    labels.push_back(p.condition + " vs " + p.versus);
    lw = std::max(lw, labels.back().size());
  }
  out += fmt::format("{:<{}}  {:>10}  {:>22}  {:>5}  {:>8}  {:>12}  {:>8}\n", "comparison", lw, "reduction",
                     "95% CI", "runs", "matched", "incl. trans.", "matched");
  for (size_t i = 0; i < r.comparisons.size(); ++i) {
    const auto& p = r.comparisons[i];
    out += fmt::format("{:<{}}  {:>10}  {:>22}  {:>5}  {:>8}  {:>12}  {:>8}\n", labels[i], lw,
                       format_percent(p.reduction), ci_text(p.ci_low, p.ci_high), p.independent_runs,
                       p.matched_positions, format_percent(p.reduction_with_transitions),
                       p.matched_positions_with_transitions);
  }
  if (!r.fields.empty()) {
    out += "\nother logged fields (per-phase durations, ...): median per condition, paired reduction vs " +
           r.baseline + " with its 95% CI\n";
    size_t fw = 5;
    for (const auto& f : r.fields) fw = std::max(fw, f.field.size());
    out += fmt::format("{:<{}}  {:<{}}  {:>12}  {:>12}  {:>10}  {:>22}  {:>5}\n", "field", fw, "condition", w,
                       "median", "baseline", "reduction", "95% CI", "runs");
    for (const auto& f : r.fields) {
      double base_median = std::nan("");
      for (const auto& c : f.conditions)
        if (c.condition == r.baseline) base_median = c.median_s;
      for (const auto& p : f.comparisons) {
        double median = std::nan("");
        for (const auto& c : f.conditions)
          if (c.condition == p.condition) median = c.median_s;
        out += fmt::format("{:<{}}  {:<{}}  {:>12}  {:>12}  {:>10}  {:>22}  {:>5}\n", f.field, fw, p.condition, w,
                           format_value(f.field, median), format_value(f.field, base_median),
                           format_percent(p.reduction), ci_text(p.ci_low, p.ci_high), p.independent_runs);
      }
    }
  }
  if (!r.interactions.empty()) out += "\ninteractions (gains need not add up):\n";
  for (const auto& in : r.interactions) {
    out += fmt::format("  {}: {} vs {}; {} alone {}, {} alone {}; if independent {}\n", in.combined,
                       format_percent(in.combined_vs_baseline), r.baseline, in.first, format_percent(in.first_vs_baseline),
                       in.second, format_percent(in.second_vs_baseline), format_percent(in.independent_prediction));
    out += fmt::format("    adding {} on top of {}: {};  adding {} on top of {}: {}\n", in.second, in.first,
                       format_percent(in.combined_vs_first), in.first, in.second, format_percent(in.combined_vs_second));
  }
  out += fmt::format(
      "\n95% CI: Student t over the runs' contributions to the estimate (the runs are the independent units: the "
      "steps of one run share its offset and drift), runs - 1 degrees of freedom; none below {} runs\n",
      kMinIntervalRuns);
  if (!r.notes.empty()) {
    out += "notes:\n";
    for (const auto& n : r.notes) out += "  " + n + "\n";
  }
  return out;
}

json to_json(const CrossoverResult& r) {
  json comparisons = json::array();
  for (const auto& p : r.comparisons) comparisons.push_back(pair_json(p));
  json fields = json::array();
  for (const auto& f : r.fields) {
    json conds = json::array(), pairs = json::array();
    for (const auto& c : f.conditions) conds.push_back(condition_json(c));
    for (const auto& p : f.comparisons) pairs.push_back(pair_json(p));
    fields.push_back({{"field", f.field}, {"conditions", conds}, {"comparisons", pairs},
                      {"steps_skipped", f.steps_skipped}});
  }
  json interactions = json::array();
  for (const auto& in : r.interactions)
    interactions.push_back({{"combined", in.combined},
                            {"first", in.first},
                            {"second", in.second},
                            {"combined_vs_baseline", number_or_null(in.combined_vs_baseline)},
                            {"first_vs_baseline", number_or_null(in.first_vs_baseline)},
                            {"second_vs_baseline", number_or_null(in.second_vs_baseline)},
                            {"combined_vs_first", number_or_null(in.combined_vs_first)},
                            {"combined_vs_second", number_or_null(in.combined_vs_second)},
                            {"independent_prediction", number_or_null(in.independent_prediction)}});
  json conditions = json::array();
  for (const auto& c : r.condition_summaries) conditions.push_back(condition_json(c));
  return {{"baseline", r.baseline},
          {"comparisons", comparisons},
          {"fields", fields},
          {"interactions", interactions},
          {"conditions", conditions},
          {"runs", r.num_runs},
          {"warmup", r.warmup},
          {"exclude_after_transition", r.exclude_after_transition},
          {"interval", {{"method", "student t over runs' contributions"}, {"min_runs", kMinIntervalRuns}}},
          {"notes", r.notes}};
}

}  // namespace leanstep::stats
