// The single-rank and in-process (N threads) communicators.
#include <fmt/format.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <vector>

#include "comm/reduce.h"
#include "leanstep/comm.h"

namespace leanstep::comm {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

void SelfCommunicator::allreduce(const Tensor& inout, ReduceOp) { detail::check_allreduce_arg(inout, "allreduce"); }
void SelfCommunicator::broadcast(const Tensor& inout, int root) {
  detail::check_broadcast_arg(inout, root, 1, "broadcast");
}

// Shared state of an in-process group: a generation-counted barrier with a
// timeout, and one published tensor per rank for the collective in flight.
struct InProcessGroup::State {
  int size;
  double timeout_seconds;
  std::mutex mutex;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool broken = false;  // a rank timed out: later collectives fail fast
  std::vector<Tensor> published;
  std::vector<std::unique_ptr<Communicator>> comms;

  // Waits until all ranks arrive. Throws Error naming `op` on timeout.
  void arrive_and_wait(const char* op) {
    std::unique_lock lock(mutex);
    if (broken) throw Error(fmt::format("comm: {} failed: the in-process group is broken by an earlier timeout", op));
    const uint64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
    if (!cv.wait_until(lock, deadline, [&] { return generation != gen || broken; }) || broken) {
      broken = true;
      cv.notify_all();
      throw Error(fmt::format("comm: {} did not complete within {} s (a rank of the in-process group did not join)",
                              op, timeout_seconds));
    }
  }
};

namespace {

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(InProcessGroup::State* state, int rank) : state_(state), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return state_->size; }
  std::string name() const override { return fmt::format("in-process rank {}/{}", rank_, state_->size); }

  void allreduce(const Tensor& inout, ReduceOp op) override {
    detail::check_allreduce_arg(inout, "allreduce");
    publish(inout, "allreduce");
    // Every rank combines all ranks' inputs in rank order into a private
    // result, then (after everyone has read) writes it: identical everywhere.
    const int64_t n = inout.numel();
    std::vector<char> result(inout.nbytes());
    for (int r = 0; r < state_->size; ++r) {
      const Tensor& src = state_->published[r];
      if (src.numel() != n || src.dtype != inout.dtype) {
        state_->arrive_and_wait("allreduce");  // keep the others moving, then report
        throw Error(fmt::format("comm: allreduce: argument 'inout' must have the same dtype and numel on every rank "
                                "(rank {} has {}, rank {} has {})",
                                rank_, inout.describe(), r, src.describe()));
      }
      if (n == 0) continue;
      if (r == 0) std::memcpy(result.data(), src.data, inout.nbytes());
      else detail::combine_into(result.data(), src.data, inout.dtype, n, op);
    }
    state_->arrive_and_wait("allreduce");
    if (n) std::memcpy(inout.data, result.data(), inout.nbytes());
  }

  void broadcast(const Tensor& inout, int root) override {
    detail::check_broadcast_arg(inout, root, state_->size, "broadcast");
    publish(inout, "broadcast");
    const Tensor& src = state_->published[root];
    const bool ok = src.nbytes() == inout.nbytes();
    if (ok && rank_ != root && inout.nbytes()) std::memcpy(inout.data, src.data, inout.nbytes());
    state_->arrive_and_wait("broadcast");
    if (!ok)
      throw Error(fmt::format("comm: broadcast: argument 'inout' must have the same size on every rank (rank {} has {}, "
                              "root has {})",
                              rank_, inout.describe(), src.describe()));
  }

  void barrier() override { state_->arrive_and_wait("barrier"); }

 private:
  // Publishes this rank's tensor and waits until all have published.
  void publish(const Tensor& t, const char* op) {
    {
      std::lock_guard lock(state_->mutex);
      state_->published[rank_] = t;
    }
    state_->arrive_and_wait(op);
  }

  InProcessGroup::State* state_;
  int rank_;
};

}  // namespace

InProcessGroup::InProcessGroup(int size, double timeout_seconds) : state_(std::make_unique<State>()) {
  LEANSTEP_CHECK_ARG(size >= 1, "InProcessGroup", "size", fmt::format("must be >= 1 (got {})", size));
  LEANSTEP_CHECK_ARG(timeout_seconds > 0, "InProcessGroup", "timeout_seconds",
                     fmt::format("must be > 0 (got {})", timeout_seconds));
  state_->size = size;
  state_->timeout_seconds = timeout_seconds;
  state_->published.resize(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) state_->comms.push_back(std::make_unique<InProcessCommunicator>(state_.get(), r));
}

InProcessGroup::~InProcessGroup() = default;
int InProcessGroup::size() const { return state_->size; }

Communicator& InProcessGroup::communicator(int rank) {
  LEANSTEP_CHECK_ARG(rank >= 0 && rank < state_->size, "InProcessGroup::communicator", "rank",
                     fmt::format("must be in [0, {}) (got {})", state_->size, rank));
  return *state_->comms[static_cast<size_t>(rank)];
}

}  // namespace leanstep::comm
