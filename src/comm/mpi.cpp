// MPI communicator: nonblocking collectives polled against a deadline, so a
// dead peer gives an Error instead of a hang. The SUM is computed by us in
// rank order (a deterministic reduce-scatter over all-to-all, then an
// all-gather), never by MPI's reduction whose combination order is unspecified.
#include <fmt/format.h>

#include <unistd.h>

#include <atomic>
#include <memory>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
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

// After a timeout the process's MPI state is unsafe: the abandoned request is still
// outstanding (collective requests cannot be cancelled), and MPI_Finalize would wait
// for it forever (a stopped peer) or complete it later (a peer that comes back). So a
// timeout poisons MPI for the rest of the process: every communicator refuses further
// collectives, the request's buffers are kept alive (never freed: a late peer writes
// into valid memory), and at exit MPI_Abort replaces MPI_Finalize, which ends this
// process with a non-zero status in bounded time and makes mpirun stop the others.
std::atomic<bool> g_poisoned{false};
std::mutex g_abandoned_mutex;
// Everything a nonblocking collective reads or writes until it completes: the data
// and the count/displacement arrays.
struct Buffers {
  std::vector<char> send, recv;
  std::vector<int> counts, displs, recv_counts, recv_displs;
};
struct Abandoned {
  MPI_Request request;
  std::unique_ptr<Buffers> buffers;
};
std::vector<Abandoned*>* g_abandoned = nullptr;  // leaked on purpose (see above)
constexpr int kPoisonedExitCode = 2;

void abort_at_exit() {
  if (!g_poisoned.load()) return;
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  std::fflush(stdout);
  std::fflush(stderr);
  if (initialized && !finalized) {
    static const char msg[] = "leanstep: comm: MPI was poisoned by a collective that timed out: aborting instead of MPI_Finalize\n";
    (void)!::write(2, msg, sizeof(msg) - 1);
    MPI_Abort(MPI_COMM_WORLD, kPoisonedExitCode);
  }
  std::_Exit(kPoisonedExitCode);
}

bool g_we_initialised = false;
void finalize_at_exit() {
  if (g_poisoned.load()) return abort_at_exit();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void poison(MPI_Request request, std::unique_ptr<Buffers> buffers) {
  std::lock_guard lock(g_abandoned_mutex);
  if (!g_abandoned) g_abandoned = new std::vector<Abandoned*>();
  // The buffers move into the (leaked) record: the request's pointers stay valid.
  g_abandoned->push_back(new Abandoned{request, std::move(buffers)});
  if (!g_poisoned.exchange(true) && !g_we_initialised) std::atexit(abort_at_exit);
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
    // A poisoned communicator may still have a request in flight: leave it to MPI_Abort.
    if (!finalized && !g_poisoned.load()) MPI_Comm_free(&comm_);
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
    refuse_if_poisoned("allreduce");
    // Element ranges owned by each rank (fixed by n and size only). MPI only ever
    // touches memory owned by `bufs` (the caller's tensor is copied in and out): after
    // a timeout it is kept alive for the abandoned request.
    auto bufs = std::make_unique<Buffers>();
    Buffers& B = *bufs;
    B.counts.resize(size_), B.displs.resize(size_), B.recv_counts.resize(size_), B.recv_displs.resize(size_);
    for (int r = 0; r < size_; ++r) {
      const int64_t b = n * r / size_, e = n * (r + 1) / size_;
      B.counts[r] = static_cast<int>((e - b) * static_cast<int64_t>(esize));
      B.displs[r] = static_cast<int>(b * static_cast<int64_t>(esize));
    }
    const int mine = B.counts[rank_];
    for (int r = 0; r < size_; ++r) {
      B.recv_counts[r] = mine;
      B.recv_displs[r] = r * mine;
    }
    B.send.resize(inout.nbytes());
    if (!B.send.empty()) std::memcpy(B.send.data(), inout.data, B.send.size());
    // 1) every rank receives all ranks' copies of its own range
    B.recv.resize(static_cast<size_t>(mine) * size_);
    MPI_Request req;
    check_mpi(MPI_Ialltoallv(B.send.data(), B.counts.data(), B.displs.data(), MPI_BYTE, B.recv.data(),
                             B.recv_counts.data(), B.recv_displs.data(), MPI_BYTE, comm_, &req),
              "allreduce");
    wait(req, "allreduce", bufs);
    // 2) combine them in rank order
    const int64_t my_elems = mine / static_cast<int64_t>(esize);
    for (int r = 1; r < size_; ++r)
      detail::combine_into(B.recv.data(), B.recv.data() + static_cast<size_t>(r) * mine, inout.dtype, my_elems, op);
    // 3) everyone gathers every reduced range
    check_mpi(MPI_Iallgatherv(B.recv.data(), mine, MPI_BYTE, B.send.data(), B.counts.data(), B.displs.data(), MPI_BYTE,
                              comm_, &req),
              "allreduce");
    wait(req, "allreduce", bufs);
    if (!B.send.empty()) std::memcpy(inout.data, B.send.data(), B.send.size());
  }

  void broadcast(const Tensor& inout, int root) override {
    detail::check_broadcast_arg(inout, root, size_, "broadcast");
    LEANSTEP_CHECK_ARG(inout.nbytes() < (size_t{1} << 31), "broadcast", "inout", "must be smaller than 2 GiB");
    refuse_if_poisoned("broadcast");
    auto bufs = std::make_unique<Buffers>();
    std::vector<char>& buffer = bufs->send;
    buffer.resize(inout.nbytes());
    if (!buffer.empty()) std::memcpy(buffer.data(), inout.data, buffer.size());
    MPI_Request req;
    check_mpi(MPI_Ibcast(buffer.data(), static_cast<int>(buffer.size()), MPI_BYTE, root, comm_, &req), "broadcast");
    wait(req, "broadcast", bufs);
    if (!buffer.empty()) std::memcpy(inout.data, buffer.data(), buffer.size());
  }

  void barrier() override {
    refuse_if_poisoned("barrier");
    auto bufs = std::make_unique<Buffers>();
    MPI_Request req;
    check_mpi(MPI_Ibarrier(comm_, &req), "barrier");
    wait(req, "barrier", bufs);
  }
 private:
  void refuse_if_poisoned(const char* op) const {
    if (g_poisoned.load())
      throw Error(fmt::format("comm: {} refused: MPI is poisoned by an earlier collective that timed out (the process "
                              "must exit; it aborts at exit instead of finalizing)",
                              op));
  }

  // Polls the request until done or the deadline (then Error naming the op). On a
  // timeout the request stays outstanding: it and the buffers it uses are handed to
  // poison(), which keeps them alive for the rest of the process.
  void wait(MPI_Request& req, const char* op, std::unique_ptr<Buffers>& buffers) {
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + std::chrono::duration<double>(timeout_seconds_);
    for (int polls = 0;; ++polls) {
      int done = 0;
      check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), op);
      if (done) return;
      const auto now = std::chrono::steady_clock::now();
      if (now > deadline) {
        poison(req, std::move(buffers));
        throw Error(fmt::format("comm: {} did not complete within {} s (a peer may have died, stopped or not joined); "
                                "MPI is now poisoned: later collectives fail and the process aborts at exit",
                                op, timeout_seconds_));
      }
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
