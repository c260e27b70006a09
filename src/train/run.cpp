// train::run_crossover: the steps of a run or of every run of a crossover plan,
// logged per rank, with every rank's durations gathered on rank 0.
#include <memory>
#include <utility>

#include "leanstep/comm.h"
#include "leanstep/train.h"

namespace leanstep::train {

RunResult run_crossover(const std::function<std::unique_ptr<Trainer>()>& make_trainer, const RunOptions& o,
                        comm::Communicator* comm, std::unique_ptr<Trainer> first) {
  const stats::CrossoverPlan* plan = o.plan;
  LEANSTEP_CHECK_ARG(static_cast<bool>(make_trainer), "train::run_crossover", "make_trainer", "must be given");
  const int64_t steps_per_run = plan ? plan->steps_per_run() : o.steps;
  LEANSTEP_CHECK_ARG(steps_per_run >= 1, "train::run_crossover", "steps", "must be >= 1 (or a plan given)");
  const int num_runs = plan ? static_cast<int>(plan->runs.size()) : 1;
  const int rank = comm ? comm->rank() : 0, world = comm ? comm->size() : 1;

  // This rank's record of each step (duration: its own), in order.
  std::vector<stats::StepRecord> local;
  const int64_t total = steps_per_run * num_runs;
  RunResult result;
  std::unique_ptr<Trainer> trainer = std::move(first);
  for (int run = 0; run < num_runs; ++run) {
    if (!trainer || run > 0) trainer = make_trainer();  // every run from the same state
    const std::string run_name = plan ? plan->runs[static_cast<size_t>(run)].name : o.preset;
    for (int64_t pos = 0; pos < steps_per_run; ++pos) {
      stats::StepRecord r;
      r.run = run_name;
      r.rank = rank;
      if (plan) {
        const stats::PlannedStep ps = plan->at(run, pos);
        r.condition = ps.condition;
        r.block = ps.block;
        r.allocation = plan->runs[static_cast<size_t>(run)].allocation;
      } else {
        r.condition = o.preset;
      }
      const bool condition_changed = pos > 0 && local.back().condition != r.condition;
      if (trainer->preset() != r.condition) trainer->set_preset(r.condition);
      const StepRecord step = trainer->step();
      r.step = step.step;
      r.duration_s = step.duration_s;
      r.loss = step.loss;
      r.grad_norm = step.grad_norm;
      if (o.log) o.log->write(r);
      if (local.empty()) result.first = step;
      result.last = step;
      local.push_back(r);
      if (o.on_step) {
        o.on_step(RunStep{r.run, r.condition, r.block.value_or(-1), pos, steps_per_run,
                          static_cast<int64_t>(local.size()), total, condition_changed, step});
      }
    }
  }
  result.trainer = std::move(trainer);

  // Every rank's durations to rank 0 in one all-reduce (the others add zeros).
  const int64_t n = static_cast<int64_t>(local.size());
  std::vector<double> durations(static_cast<size_t>(n * world), 0.0);
  for (int64_t i = 0; i < n; ++i) durations[static_cast<size_t>(rank * n + i)] = local[static_cast<size_t>(i)].duration_s;
  if (comm) comm->allreduce(Tensor(durations.data(), DType::kFloat64, {n * world}), comm::ReduceOp::kSum);
  if (rank != 0) return result;
  for (int r = 0; r < world; ++r)
    for (int64_t i = 0; i < n; ++i) {
      stats::StepRecord s = local[static_cast<size_t>(i)];  // the same step on rank r
      s.rank = r;
      s.duration_s = durations[static_cast<size_t>(r * n + i)];
      result.records.push_back(std::move(s));
    }
  return result;
}

}  // namespace leanstep::train
