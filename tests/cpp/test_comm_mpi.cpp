// The MPI communicator, run by CTest under `mpirun -np 2` (tests/cpp/comm.cmake).
// Run alone (not under mpirun) the tests skip.
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <thread>

#include "grad_util.h"
#include "leanstep/comm.h"
#include "leanstep/grad.h"
#include "mpi_test_util.h"

namespace leanstep {
namespace {
using comm::ReduceOp;
using namespace leanstep::testing;


TEST(CommMpi, AllreduceSumIsRankOrderedAndIdentical) {
  SKIP_UNLESS_MPI();
  comm::Communicator& c = world();
  ASSERT_EQ(c.size(), 2);
  // Deterministic inputs that depend on the rank (same seed on both ranks).
  std::mt19937_64 rng(12345);
  std::vector<std::vector<float>> inputs(2, std::vector<float>(100003));
  for (auto& v : inputs)
    for (auto& x : v) x = static_cast<float>(std::normal_distribution<double>(0, 1e3)(rng));
  std::vector<float> mine = inputs[static_cast<size_t>(c.rank())];
  c.allreduce(Tensor(mine.data(), DType::kFloat32, {100003}), ReduceOp::kSum);
  for (size_t i = 0; i < mine.size(); ++i) ASSERT_EQ(mine[i], inputs[0][i] + inputs[1][i]) << i;
  int64_t count = c.rank() + 1;
  c.allreduce(Tensor(&count, DType::kInt64, {1}), ReduceOp::kSum);
  EXPECT_EQ(count, 3);
  double m[2] = {c.rank() == 1 ? NAN : 1.0, static_cast<double>(c.rank())};
  c.allreduce(Tensor(m, DType::kFloat64, {2}), ReduceOp::kMax);
  EXPECT_TRUE(std::isnan(m[0]));
  EXPECT_EQ(m[1], 1.0);
  double empty_storage = 0;
  c.allreduce(Tensor(&empty_storage, DType::kFloat64, {0}), ReduceOp::kSum);
  float b[3] = {0, 0, 0};
  if (c.rank() == 1) b[0] = 1.5f, b[1] = -2, b[2] = 3;
  c.broadcast(Tensor(b, DType::kFloat32, {3}), 1);
  EXPECT_EQ(b[0], 1.5f);
  EXPECT_EQ(b[2], 3.0f);
  c.barrier();
}

TEST(CommMpi, DistributedGradNormMatchesTheInProcessGroup) {
  SKIP_UNLESS_MPI();
  comm::Communicator& c = world();
  std::mt19937_64 rng(777);
  std::vector<Buffer> shards;
  for (int r = 0; r < 2; ++r) {
    shards.emplace_back(DType::kFloat32, std::vector<int64_t>{70000 + 13 * r});
    fill_normal(shards.back().view(), rng);
  }
  shards[1].data_as<float>()[5] = 0.0f;
  const grad::Plan plan(std::vector<Tensor>{shards[static_cast<size_t>(c.rank())].view()});
  Scalar n, flag, zeros(DType::kInt64);
  grad::norm(plan, n.t(), 2.0, flag.p(), &c);
  grad::count_zeros(plan, zeros.t(), &c);
  // the same through two in-process ranks
  comm::InProcessGroup group(2);
  float expected[2] = {0, 0};
  std::thread other([&] {
    grad::norm(grad::Plan(std::vector<Tensor>{shards[1].view()}), Tensor(&expected[1], DType::kFloat32, {1}), 2.0,
               nullptr, &group.communicator(1));
  });
  grad::norm(grad::Plan(std::vector<Tensor>{shards[0].view()}), Tensor(&expected[0], DType::kFloat32, {1}), 2.0,
             nullptr, &group.communicator(0));
  other.join();
  EXPECT_EQ(static_cast<float>(n.get()), expected[0]);  // bitwise: the same rank-order combination
  EXPECT_EQ(flag.get(), 0.0);
  EXPECT_GE(zeros.get(), 1.0);
  // found_inf on rank 0 only reaches rank 1
  if (c.rank() == 0) shards[0].data_as<float>()[3] = INFINITY;
  Scalar n2, flag2;
  grad::norm(plan, n2.t(), grad::kInfNorm, flag2.p(), &c);
  EXPECT_EQ(flag2.get(), 1.0);
  EXPECT_TRUE(std::isinf(n2.get()));
}

// A peer that never joins, or joins after the timeout, is tested by mpi_fault (a
// timeout poisons MPI for the rest of the process, so it cannot run here).

}  // namespace
}  // namespace leanstep
