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

  struct Logged {
    StepRecord step;
    std::string run, condition, allocation;
    int block = -1;
  };
  std::vector<Logged> logged;
  const int64_t total = steps_per_run * num_runs;
  int64_t done = 0;
  RunResult result;
  std::unique_ptr<Trainer> trainer = std::move(first);
  for (int run = 0; run < num_runs; ++run) {
    if (!trainer || run > 0) trainer = make_trainer();  // every run from the same state
    const std::string run_name = plan ? plan->runs[static_cast<size_t>(run)].name : o.preset;
    std::string previous;
    for (int64_t pos = 0; pos < steps_per_run; ++pos) {
      Logged l;
      l.run = run_name;
      if (plan) {
        const stats::PlannedStep ps = plan->at(run, pos);
        l.condition = ps.condition;
        l.block = ps.block;
        l.allocation = plan->runs[static_cast<size_t>(run)].allocation;
      } else {
        l.condition = o.preset;
      }
      if (trainer->preset() != l.condition) trainer->set_preset(l.condition);
      l.step = trainer->step();
      if (o.log) {
        stats::StepRecord r;
        r.run = l.run;
        r.rank = rank;
        r.step = l.step.step;
        r.duration_s = l.step.duration_s;
        r.condition = l.condition;
        if (l.block >= 0) r.block = l.block;
        r.loss = l.step.loss;
        r.grad_norm = l.step.grad_norm;
        r.allocation = l.allocation;
        o.log->write(r);
      }
      ++done;
      if (o.on_step) {
        RunStep s{l.run, l.condition, l.block, pos, steps_per_run, done, total,
                  pos > 0 && previous != l.condition, l.step};
        o.on_step(s);
      }
      previous = l.condition;
      logged.push_back(std::move(l));
    }
  }
  if (!logged.empty()) {
    result.first = logged.front().step;
    result.last = logged.back().step;
  }
  result.trainer = std::move(trainer);

  // Every rank's durations to rank 0 in one all-reduce (the others add zeros).
  const int64_t n = static_cast<int64_t>(logged.size());
  std::vector<double> durations(static_cast<size_t>(n * world), 0.0);
  for (int64_t i = 0; i < n; ++i) durations[static_cast<size_t>(rank * n + i)] = logged[static_cast<size_t>(i)].step.duration_s;
  if (comm) comm->allreduce(Tensor(durations.data(), DType::kFloat64, {n * world}), comm::ReduceOp::kSum);
  if (rank != 0) return result;
  for (int r = 0; r < world; ++r)
    for (int64_t i = 0; i < n; ++i) {
      const Logged& l = logged[static_cast<size_t>(i)];
      stats::StepRecord s;
      s.run = l.run;
      s.rank = r;
      s.step = l.step.step;
      s.duration_s = durations[static_cast<size_t>(r * n + i)];
      s.condition = l.condition;
      if (l.block >= 0) s.block = l.block;
      s.loss = l.step.loss;
      s.grad_norm = l.step.grad_norm;
      s.allocation = l.allocation;
      result.records.push_back(std::move(s));
    }
  return result;
}

}  // namespace leanstep::train
