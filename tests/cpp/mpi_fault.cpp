// Fault injection for the MPI communicator, run under `mpirun -np 2` by
// tests/cpp/comm.cmake (through tests/cli/expect.sh, which checks the exit
// status, the output and the time taken).
//
//   mpi_fault never   rank 1 stops itself (SIGSTOP) before an allreduce and never
//                     comes back: rank 0 must time out, print the error and exit
//                     non-zero in bounded time (no hang in MPI_Finalize).
//   mpi_fault late    as `never`, but rank 0 resumes rank 1 (SIGCONT) after its
//                     timeout and keeps driving MPI's progress engine: the abandoned
//                     allreduce then completes into buffers that must still be valid
//                     (no crash, no use after free), and the exit is still non-zero.
#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "leanstep/comm.h"

int main(int argc, char** argv) {
  using namespace leanstep;
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "never" && mode != "late") {
    std::fprintf(stderr, "usage: mpi_fault never|late\n");
    return 64;
  }
  try {
    auto comm = comm::mpi_world(1.0);
    if (comm->size() != 2) {
      std::fprintf(stderr, "mpi_fault: needs exactly 2 ranks (got %d)\n", comm->size());
      return 64;
    }
    // Every rank learns the other's pid.
    std::vector<int64_t> pids(2, 0);
    pids[static_cast<size_t>(comm->rank())] = ::getpid();
    comm->allreduce(Tensor(pids.data(), DType::kInt64, {2}), comm::ReduceOp::kSum);
    if (comm->rank() == 1) {
      std::fprintf(stderr, "rank 1: stopping itself\n");
      std::fflush(stderr);
      ::raise(SIGSTOP);
      std::fprintf(stderr, "rank 1: resumed, joining the allreduce rank 0 abandoned\n");
    }
    {
      std::vector<float> grads(1 << 16, 1.0f);  // freed right after the timeout
      try {
        comm->allreduce(Tensor(grads.data(), DType::kFloat32, {1 << 16}), comm::ReduceOp::kSum);
      } catch (const Error& e) {
        if (mode == "late" && comm->rank() == 0) {
          grads.clear();
          grads.shrink_to_fit();
          std::fprintf(stderr, "rank 0: %s\nrank 0: resuming rank 1\n", e.what());
          ::kill(static_cast<pid_t>(pids[1]), SIGCONT);
          // Drive MPI's progress engine while rank 1 completes its side of the exchange (rank 1
          // then waits up to 1 s for the second phase, which rank 0 never posts).
          const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
          while (std::chrono::steady_clock::now() < until) {
            int flag = 0;
            MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE);
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
          // The communicator is poisoned: a further collective fails at once.
          try {
            comm->barrier();
          } catch (const Error& again) {
            std::fprintf(stderr, "rank 0: %s\n", again.what());
          }
        }
        throw;
      }
    }
    std::fprintf(stderr, "rank %d: the allreduce completed (unexpected)\n", comm->rank());
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "leanstep: error: %s\n", e.what());
    return 2;  // exit() runs leanstep's exit handler: MPI_Abort, never a hang in MPI_Finalize
  }
}
