// Communicators: the in-process group (N threads) and the distributed
// gradient norm / found_inf / count_zeros through it.
#include <chrono>
#include <cmath>
#include <limits>
#include <thread>

#include "grad_util.h"
#include "leanstep/comm.h"
#include "leanstep/grad.h"

namespace leanstep {
namespace {
using comm::ReduceOp;
using namespace leanstep::testing;

// Runs body(rank, communicator) on `size` threads; rethrows the first failure.
template <class Body>
void run_ranks(comm::InProcessGroup& group, Body body) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(group.size()));
  for (int r = 0; r < group.size(); ++r)
    threads.emplace_back([&, r] {
      try {
        body(r, group.communicator(r));
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

TEST(Comm, InProcessAllreduceIsDeterministicAndIdenticalOnAllRanks) {
  std::mt19937_64 rng(test_seed());
  for (int size : {1, 2, 3, 4}) {
    comm::InProcessGroup group(size);
    std::vector<Buffer> data;
    for (int r = 0; r < size; ++r) {
      data.emplace_back(DType::kFloat32, std::vector<int64_t>{1001});
      fill_normal(data.back().view(), rng, 0, 1e3);
    }
    // expected: rank-order fp32 sums
    std::vector<float> expected(1001);
    for (int64_t i = 0; i < 1001; ++i) {
      float acc = data[0].data_as<float>()[i];
      for (int r = 1; r < size; ++r) acc += data[static_cast<size_t>(r)].data_as<float>()[i];
      expected[static_cast<size_t>(i)] = acc;
    }
    run_ranks(group, [&](int r, comm::Communicator& c) {
      EXPECT_EQ(c.rank(), r);
      EXPECT_EQ(c.size(), size);
      c.allreduce(data[static_cast<size_t>(r)].view(), ReduceOp::kSum);
    });
    for (int r = 0; r < size; ++r)
      EXPECT_EQ(std::memcmp(data[static_cast<size_t>(r)].data(), expected.data(), 1001 * 4), 0) << "rank " << r;
  }
}

TEST(Comm, InProcessMaxMinPropagateNanAndInt64AndBroadcast) {
  comm::InProcessGroup group(3);
  std::vector<std::vector<double>> d = {{1, 5, NAN, -1}, {2, 4, 0, -7}, {3, NAN, 1, 2}};
  std::vector<std::vector<double>> m = d;
  std::vector<std::vector<int64_t>> ints = {{1, -5}, {10, 7}, {100, 3}};
  std::vector<std::vector<float>> b = {{0, 0}, {7.5f, -1}, {0, 0}};
  std::vector<Buffer> empty;
  for (int r = 0; r < 3; ++r) empty.emplace_back(DType::kFloat64, std::vector<int64_t>{0});
  run_ranks(group, [&](int r, comm::Communicator& c) {
    const auto ru = static_cast<size_t>(r);
    c.allreduce(Tensor(d[ru].data(), DType::kFloat64, {4}), ReduceOp::kMax);
    c.allreduce(Tensor(m[ru].data(), DType::kFloat64, {4}), ReduceOp::kMin);
    c.allreduce(Tensor(ints[ru].data(), DType::kInt64, {2}), ReduceOp::kSum);
    c.allreduce(empty[ru].view(), ReduceOp::kSum);
    c.broadcast(Tensor(b[ru].data(), DType::kFloat32, {2}), 1);
    c.barrier();
  });
  for (int r = 0; r < 3; ++r) {
    const auto ru = static_cast<size_t>(r);
    EXPECT_EQ(d[ru][0], 3);
    EXPECT_TRUE(std::isnan(d[ru][1]));
    EXPECT_TRUE(std::isnan(d[ru][2]));
    EXPECT_EQ(d[ru][3], 2);
    EXPECT_EQ(m[ru][0], 1);
    EXPECT_TRUE(std::isnan(m[ru][1]));
    EXPECT_EQ(m[ru][3], -7);
    EXPECT_EQ(ints[ru][0], 111);
    EXPECT_EQ(ints[ru][1], 5);
    EXPECT_EQ(b[ru][0], 7.5f);
    EXPECT_EQ(b[ru][1], -1.0f);
  }
}

TEST(Comm, AMissingRankTimesOutWithAnError) {
  comm::InProcessGroup group(2, /*timeout_seconds=*/0.2);
  double x = 1;
  EXPECT_LEANSTEP_ERROR(group.communicator(0).allreduce(Tensor(&x, DType::kFloat64, {1}), ReduceOp::kSum),
                        "allreduce did not complete within 0.2 s");
  EXPECT_LEANSTEP_ERROR(group.communicator(1).barrier(), "broken");
}

TEST(Comm, BadArgumentsAreErrors) {
  comm::InProcessGroup group(2, 5.0);
  EXPECT_LEANSTEP_ERROR(comm::InProcessGroup(0), "size");
  EXPECT_LEANSTEP_ERROR(group.communicator(2), "rank");
  int32_t i32 = 0;
  EXPECT_LEANSTEP_ERROR(group.communicator(0).allreduce(Tensor(&i32, DType::kInt32, {1}), ReduceOp::kSum), "inout");
  float f = 0;
  EXPECT_LEANSTEP_ERROR(group.communicator(0).broadcast(Tensor(&f, DType::kFloat32, {1}), 5), "root");
  // numel mismatch across ranks: every rank gets an Error, nobody hangs
  std::vector<std::vector<float>> data = {{1, 2}, {1, 2, 3}};
  int errors = 0;
  std::mutex mu;
  run_ranks(group, [&](int r, comm::Communicator& c) {
    try {
      c.allreduce(Tensor(data[static_cast<size_t>(r)].data(), DType::kFloat32,
                         {static_cast<int64_t>(data[static_cast<size_t>(r)].size())}),
                  ReduceOp::kSum);
    } catch (const Error& e) {
      std::lock_guard lock(mu);
      ++errors;
      EXPECT_NE(std::string(e.what()).find("same dtype and numel"), std::string::npos);
    }
  });
  EXPECT_EQ(errors, 2);
  comm::SelfCommunicator self;
  double x = 4;
  self.allreduce(Tensor(&x, DType::kFloat64, {1}), ReduceOp::kSum);
  EXPECT_EQ(x, 4);
}

// Each rank holds a shard; the distributed norm equals the norm of the union,
// bitwise the same on every rank; found_inf on one rank reaches all; a rank
// with no grads still joins.
TEST(Comm, DistributedNormFlagAndZerosOverFourRanks) {
  std::mt19937_64 rng(test_seed());
  const int size = 4;
  std::vector<Buffer> shards;
  std::vector<Tensor> all;
  for (int r = 0; r < size; ++r) {
    shards.emplace_back(DType::kFloat32, std::vector<int64_t>{r == 2 ? 0 : 5000 + 37 * r});  // rank 2 has nothing
    fill_normal(shards.back().view(), rng);
    if (r == 1) shards.back().data_as<float>()[10] = 0.0f;
    all.push_back(shards.back().view());
  }
  for (double p : {2.0, grad::kInfNorm, 1.5}) {
    Scalar whole;
    grad::norm(grad::Plan(all), whole.t(), p);
    std::vector<float> norms(size);
    std::vector<float> flags(size, 0);
    std::vector<int64_t> zeros(size);
    comm::InProcessGroup group(size);
    run_ranks(group, [&](int r, comm::Communicator& c) {
      const grad::Plan plan(std::vector<Tensor>{shards[static_cast<size_t>(r)].view()});
      Tensor n(&norms[static_cast<size_t>(r)], DType::kFloat32, {1});
      Tensor f(&flags[static_cast<size_t>(r)], DType::kFloat32, {1});
      grad::norm(plan, n, p, &f, &c);
      grad::count_zeros(plan, Tensor(&zeros[static_cast<size_t>(r)], DType::kInt64, {1}), &c);
    });
    for (int r = 0; r < size; ++r) {
      EXPECT_EQ(norms[static_cast<size_t>(r)], norms[0]);
      EXPECT_EQ(flags[static_cast<size_t>(r)], 0.0f);
      EXPECT_GE(zeros[static_cast<size_t>(r)], 1);
    }
    EXPECT_LE(std::fabs(norms[0] - whole.get()) / whole.get(), 0x1p-22) << p;
  }
  // a NaN on rank 3 only: every rank sees NaN and the flag
  shards[3].data_as<float>()[7] = NAN;
  comm::InProcessGroup group(size);
  std::vector<float> norms(size), flags(size, 0), inf_norms(size);
  run_ranks(group, [&](int r, comm::Communicator& c) {
    const grad::Plan plan(std::vector<Tensor>{shards[static_cast<size_t>(r)].view()});
    Tensor f(&flags[static_cast<size_t>(r)], DType::kFloat32, {1});
    grad::norm(plan, Tensor(&norms[static_cast<size_t>(r)], DType::kFloat32, {1}), 2.0, &f, &c);
    grad::norm(plan, Tensor(&inf_norms[static_cast<size_t>(r)], DType::kFloat32, {1}), grad::kInfNorm, nullptr, &c);
  });
  for (int r = 0; r < size; ++r) {
    EXPECT_TRUE(std::isnan(norms[static_cast<size_t>(r)]));
    EXPECT_TRUE(std::isnan(inf_norms[static_cast<size_t>(r)]));
    EXPECT_EQ(flags[static_cast<size_t>(r)], 1.0f);
  }
}

TEST(Comm, MpiIsReportedConsistently) {
#ifdef LEANSTEP_HAVE_MPI
  EXPECT_TRUE(comm::mpi_available());
#else
  EXPECT_FALSE(comm::mpi_available());
  EXPECT_LEANSTEP_ERROR(comm::mpi_world(), "without MPI");
#endif
}

}  // namespace
}  // namespace leanstep
