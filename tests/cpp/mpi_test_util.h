// Shared by the tests that CTest runs under `mpirun -np 2` (test_comm_mpi,
// test_train_mpi): the world communicator and the rule for when a case runs.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>

#include "leanstep/comm.h"

namespace leanstep::testing {

inline bool under_mpirun() { return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE"); }

// One communicator for the whole test program (MPI is initialised once).
inline comm::Communicator& world() {
  static std::unique_ptr<comm::Communicator> c = comm::mpi_world(60.0);
  return *c;
}

}  // namespace leanstep::testing

// Run alone the cases skip. Under the CTest wrapper (LEANSTEP_REQUIRE_MPI_RANKS=2)
// a case that cannot run is a failure: a wrapper whose cases all skip must not pass,
// nor one started with the wrong number of ranks.
#define SKIP_UNLESS_MPI()                                                                            \
  do {                                                                                               \
    const char* required = std::getenv("LEANSTEP_REQUIRE_MPI_RANKS");                                \
    if (!::leanstep::comm::mpi_available() || !::leanstep::testing::under_mpirun()) {                \
      if (required)                                                                                  \
        FAIL() << "LEANSTEP_REQUIRE_MPI_RANKS is set but this is not an MPI run (built "             \
               << (::leanstep::comm::mpi_available() ? "with" : "without") << " MPI)";              \
      GTEST_SKIP() << "needs mpirun -np 2";                                                          \
    }                                                                                                \
    if (required && ::leanstep::testing::world().size() != std::atoi(required))                     \
      FAIL() << "needs exactly " << required << " MPI ranks (got "                                   \
             << ::leanstep::testing::world().size() << ")";                                          \
  } while (0)
