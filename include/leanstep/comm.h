// Collective communication for the optimizer step: the bucketed gradient
// all-reduce and the reduction of norms, found_inf flags and zero counts.
//
// Every collective is deterministic: a SUM is always combined in rank order
// (rank 0 + rank 1 + ...), so all ranks get bitwise the same answer, run after
// run, and the in-process and MPI implementations agree bitwise. MAX and MIN
// propagate NaN (a NaN on any rank gives NaN), so a NaN norm is never lost.
#pragma once

#include <memory>
#include <string>

#include "leanstep/core.h"

namespace leanstep::comm {

enum class ReduceOp { kSum, kMax, kMin };
const char* reduce_op_name(ReduceOp op);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place over a contiguous fp32, fp64 or int64 tensor (any numel, also 0).
  // Every rank must call with the same dtype and numel.
  virtual void allreduce(const Tensor& inout, ReduceOp op) = 0;
  // Copies root's tensor into every rank's tensor (contiguous, any dtype).
  virtual void broadcast(const Tensor& inout, int root) = 0;
  virtual void barrier() = 0;
  virtual std::string name() const = 0;
};

// A communicator of one rank: every collective is the identity.
class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void allreduce(const Tensor& inout, ReduceOp op) override;
  void broadcast(const Tensor& inout, int root) override;
  void barrier() override {}
  std::string name() const override { return "self"; }
};

// N ranks as N threads of this process. Hand communicator(r) to the thread
// playing rank r. A collective that some rank never joins fails with Error
// after `timeout_seconds` instead of hanging.
class InProcessGroup {
 public:
  explicit InProcessGroup(int size, double timeout_seconds = 60.0);
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;
  int size() const;
  Communicator& communicator(int rank);

  struct State;

 private:
  std::unique_ptr<State> state_;
};

// True when the library was built with MPI (LEANSTEP_HAVE_MPI).
bool mpi_available();

// A communicator over MPI_COMM_WORLD (duplicated; MPI is initialised if needed
// and finalised at exit if leanstep initialised it). Collectives are
// nonblocking MPI calls polled until `timeout_seconds`: a dead or missing peer
// gives Error("comm: allreduce did not complete within ... s ...") instead of
// a hang. Throws Error when built without MPI.
std::unique_ptr<Communicator> mpi_world(double timeout_seconds = 300.0);

}  // namespace leanstep::comm
