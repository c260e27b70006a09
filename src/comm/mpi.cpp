// MPI communicator: nonblocking collectives polled against a deadline, so a
// dead peer gives an Error instead of a hang. The SUM is computed by us in
// rank order (a deterministic reduce-scatter over all-to-all, then an
// all-gather), never by MPI's reduction whose combination order is unspecified.
#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <thread>
#include <vector>

#include "comm/reduce.h"
#include "leanstep/comm.h"

#ifdef LEANSTEP_HAVE_MPI
#include <mpi.h>
#endif

namespace leanstep::comm {

#ifndef LEANSTEP_HAVE_MPI
bool mpi_available() { return false; }
std::unique_ptr<Communicator> mpi_world(double) {
  throw Error("comm: mpi_world: leanstep was built without MPI (configure with MPI installed)");
}
#else
bool mpi_available() { return true; }

namespace {

void check_mpi(int rc, const char* op) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(fmt::format("comm: {} failed in MPI: {}", op, std::string(text, static_cast<size_t>(len))));
}

bool g_we_initialised = false;
void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(double timeout_seconds) : timeout_seconds_(timeout_seconds) {
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return fmt::format("mpi rank {}/{}", rank_, size_); }

  void allreduce(const Tensor& inout, ReduceOp op) override {
    detail::check_allreduce_arg(inout, "allreduce");
    const int64_t n = inout.numel();
    const size_t esize = inout.element_size();
    LEANSTEP_CHECK_ARG(inout.nbytes() < (size_t{1} << 31), "allreduce", "inout",
                       "must be smaller than 2 GiB (split it into buckets)");
    if (size_ == 1) return;
    // Element ranges owned by each rank (fixed by n and size only).
    std::vector<int> counts(size_), displs(size_), recv_counts(size_), recv_displs(size_);
    for (int r = 0; r < size_; ++r) {
      const int64_t b = n * r / size_, e = n * (r + 1) / size_;
      counts[r] = static_cast<int>((e - b) * static_cast<int64_t>(esize));
      displs[r] = static_cast<int>(b * static_cast<int64_t>(esize));
    }
    const int mine = counts[rank_];
    for (int r = 0; r < size_; ++r) {
      recv_counts[r] = mine;
      recv_displs[r] = r * mine;
    }
    // 1) every rank receives all ranks' copies of its own range
    std::vector<char> gathered(static_cast<size_t>(mine) * size_);
    MPI_Request req;
    check_mpi(MPI_Ialltoallv(inout.data, counts.data(), displs.data(), MPI_BYTE, gathered.data(), recv_counts.data(),
                             recv_displs.data(), MPI_BYTE, comm_, &req),
              "allreduce");
    wait(req, "allreduce");
    // 2) combine them in rank order
    const int64_t my_elems = mine / static_cast<int64_t>(esize);
    for (int r = 1; r < size_; ++r)
      detail::combine_into(gathered.data(), gathered.data() + static_cast<size_t>(r) * mine, inout.dtype, my_elems, op);
    // 3) everyone gathers every reduced range
    check_mpi(MPI_Iallgatherv(gathered.data(), mine, MPI_BYTE, inout.data, counts.data(), displs.data(), MPI_BYTE,
                              comm_, &req),
              "allreduce");
    wait(req, "allreduce");
  }

  void broadcast(const Tensor& inout, int root) override {
    detail::check_broadcast_arg(inout, root, size_, "broadcast");
    LEANSTEP_CHECK_ARG(inout.nbytes() < (size_t{1} << 31), "broadcast", "inout", "must be smaller than 2 GiB");
    MPI_Request req;
    check_mpi(MPI_Ibcast(inout.data, static_cast<int>(inout.nbytes()), MPI_BYTE, root, comm_, &req), "broadcast");
    wait(req, "broadcast");
  }

  void barrier() override {
    MPI_Request req;
    check_mpi(MPI_Ibarrier(comm_, &req), "barrier");
    wait(req, "barrier");
  }

 private:
  // Polls the request until done or the deadline (then Error naming the op).
  void wait(MPI_Request& req, const char* op) {
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + std::chrono::duration<double>(timeout_seconds_);
    for (int polls = 0;; ++polls) {
      int done = 0;
      check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), op);
      if (done) return;
      const auto now = std::chrono::steady_clock::now();
      if (now > deadline)
        throw Error(fmt::format("comm: {} did not complete within {} s (a peer may have died or not joined)", op,
                                timeout_seconds_));
      if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
      else std::this_thread::yield();
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  double timeout_seconds_;
};

}  // namespace

std::unique_ptr<Communicator> mpi_world(double timeout_seconds) {
  LEANSTEP_CHECK_ARG(timeout_seconds > 0, "mpi_world", "timeout_seconds",
                     fmt::format("must be > 0 (got {})", timeout_seconds));
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    if (!g_we_initialised) {
      g_we_initialised = true;
      std::atexit(finalize_at_exit);
    }
  }
  return std::make_unique<MpiCommunicator>(timeout_seconds);
}
#endif

}  // namespace leanstep::comm
