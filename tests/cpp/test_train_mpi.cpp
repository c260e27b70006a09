// Data parallel training over MPI, run by CTest under `mpirun -np 2`
// (tests/cpp/train.cmake). Run alone (not under mpirun) the tests skip.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>

#include <unistd.h>

#include "leanstep/comm.h"
#include "leanstep/train.h"
#include "test_util.h"
#include "mpi_test_util.h"

namespace {

using namespace leanstep;
using namespace leanstep::train;
using leanstep::testing::world;


Config small_config() {
  Config c = load_config(std::string(LEANSTEP_SOURCE_DIR) + "/examples/tiny-moe/micro.json");
  c.train.seq_len = 16;
  c.train.micro_batch_size = 2;
  return c;
}

// Each MPI rank trains on its microbatch; every rank also runs, alone, one rank
// with both microbatches accumulated. Same tolerances as the in-process test
// (test_train.cpp): only the order of fp32 additions differs.
TEST(TrainMpi, TwoRanksEqualOneRankOnTheCombinedBatch) {
  SKIP_UNLESS_MPI();
  comm::Communicator& c = world();
  ASSERT_EQ(c.size(), 2);
  Config two = small_config();
  Config one = small_config();
  one.train.grad_accum_steps = 2;
  TrainerOptions o;
  o.comm = &c;
  Trainer dp(two, o);
  Trainer single(one);
  for (int i = 0; i < 4; ++i) {
    const StepRecord a = dp.step(), b = single.step();
    EXPECT_NEAR(a.loss, b.loss, 1e-5 * b.loss) << "step " << i;
    EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-5 * b.grad_norm) << "step " << i;
  }
  const Tensor p = dp.params(), q = single.params();
  double worst = 0;
  for (int64_t i = 0; i < p.numel(); ++i)
    worst = std::max(worst, std::abs(double(p.data_as<float>()[i]) - q.data_as<float>()[i]));
  EXPECT_LT(worst, 1e-4);
  // Every rank holds the same parameters, bit for bit.
  std::vector<float> mine(p.data_as<float>(), p.data_as<float>() + p.numel()), other = mine;
  c.broadcast(Tensor(other.data(), DType::kFloat32, {p.numel()}), 0);
  EXPECT_EQ(std::memcmp(mine.data(), other.data(), mine.size() * sizeof(float)), 0);
}

// Rank 0 writes the checkpoint; a resumed 2-rank run continues bit-identically.
TEST(TrainMpi, CheckpointResumeAcrossRanks) {
  SKIP_UNLESS_MPI();
  comm::Communicator& c = world();
  Config cfg = small_config();
  TrainerOptions o;
  o.comm = &c;
  // Same directory on both ranks (rank 0's pid, broadcast).
  int64_t id = static_cast<int64_t>(::getpid());
  c.broadcast(Tensor(&id, DType::kInt64, {1}), 0);
  const std::string dir = (std::filesystem::temp_directory_path() / ("leanstep_train_mpi_" + std::to_string(id))).string();
  Trainer a(cfg, o);
  for (int i = 0; i < 2; ++i) a.step();
  a.save(dir);
  std::vector<StepRecord> cont;
  for (int i = 0; i < 2; ++i) cont.push_back(a.step());
  Trainer b(cfg, o);
  b.load(dir);
  for (int i = 0; i < 2; ++i) {
    const StepRecord r = b.step();
    EXPECT_EQ(r.step, cont[static_cast<size_t>(i)].step);
    EXPECT_EQ(r.loss, cont[static_cast<size_t>(i)].loss);
    EXPECT_EQ(r.grad_norm, cont[static_cast<size_t>(i)].grad_norm);
  }
  c.barrier();
  if (c.rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace
