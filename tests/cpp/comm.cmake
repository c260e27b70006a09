# The communicator tests also drive the gradient engine's distributed norm.
foreach(t test_comm test_comm_mpi)
  if(TARGET ${t} AND TARGET leanstep_grad)
    target_link_libraries(${t} PRIVATE leanstep_grad)
  endif()
endforeach()

# The MPI communicator's test runs under mpirun with 2 ranks. (Its gtest
# cases are also discovered as ordinary tests; run without mpirun they skip.)
# Leak detection is off for this one test: OpenMPI's dynamically loaded
# components leak at finalize (see train.cmake); the in-process communicator
# tests leak-check the same reduction code.
if(MPI_FOUND AND TARGET test_comm_mpi AND MPIEXEC_EXECUTABLE)
  add_test(NAME comm_mpi_2_ranks
           COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 --oversubscribe
                   $<TARGET_FILE:test_comm_mpi>)
  set_tests_properties(comm_mpi_2_ranks PROPERTIES
    LABELS "comm;mpi"
    TIMEOUT 120
    ENVIRONMENT "LEANSTEP_REQUIRE_MPI_RANKS=2;OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMP_NUM_THREADS=1;ASAN_OPTIONS=detect_leaks=0:abort_on_error=1")
endif()

# Faults: a peer stopped (SIGSTOP) in the middle of an allreduce that never comes
# back, and one that comes back after the timeout. The other rank must report the
# timeout and exit non-zero in bounded time (MPI poisoned, MPI_Abort at exit), and
# the late peer must find the abandoned request's buffers alive (no crash).
if(MPI_FOUND AND MPIEXEC_EXECUTABLE AND TARGET leanstep_comm)
  add_executable(mpi_fault ${CMAKE_CURRENT_SOURCE_DIR}/mpi_fault.cpp)
  target_link_libraries(mpi_fault PRIVATE leanstep_comm MPI::MPI_CXX)
  foreach(mode never late)
    leanstep_cli_test(comm_mpi_fault_peer_${mode} "comm;mpi" --rc nonzero --timeout 60
      --match "rank 0: .*allreduce did not complete within 1 s|leanstep: error: comm: allreduce did not complete within 1 s"
      --match "aborting instead of MPI_Finalize"
      --no-match "Segmentation|signal 11|SIGSEGV|AddressSanitizer|the allreduce completed"
      -- ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 --oversubscribe $<TARGET_FILE:mpi_fault> ${mode})
    set_tests_properties(comm_mpi_fault_peer_${mode} PROPERTIES
      ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMP_NUM_THREADS=1;ASAN_OPTIONS=detect_leaks=0:abort_on_error=1")
  endforeach()
  # The late peer: rank 0's next collective is refused at once, and rank 0 is the one that aborts.
  leanstep_cli_test(comm_mpi_fault_late_poisoned "comm;mpi" --rc nonzero --timeout 60
    --match "rank 0: comm: barrier refused: MPI is poisoned by an earlier collective that timed out"
    --match "rank 1: resumed" --match "aborting instead of MPI_Finalize"
    --no-match "Segmentation|signal 11|SIGSEGV|AddressSanitizer"
    -- ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 --oversubscribe $<TARGET_FILE:mpi_fault> late)
  set_tests_properties(comm_mpi_fault_late_poisoned PROPERTIES
    ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMP_NUM_THREADS=1;ASAN_OPTIONS=detect_leaks=0:abort_on_error=1")
endif()

# The 2-rank wrappers cannot pass vacuously: with LEANSTEP_REQUIRE_MPI_RANKS=2 a case
# that would skip (no mpirun) fails, and so does a run with another number of ranks.
if(MPI_FOUND AND TARGET test_comm_mpi AND MPIEXEC_EXECUTABLE)
  leanstep_cli_test(comm_mpi_wrapper_fails_without_mpirun "comm;mpi" --rc nonzero
    --match "LEANSTEP_REQUIRE_MPI_RANKS is set but this is not an MPI run" --match "FAILED"
    -- env LEANSTEP_REQUIRE_MPI_RANKS=2 $<TARGET_FILE:test_comm_mpi>)
  leanstep_cli_test(comm_mpi_wrapper_fails_with_3_ranks "comm;mpi" --rc nonzero --timeout 120
    --match "needs exactly 2 MPI ranks \\(got 3\\)"
    -- env LEANSTEP_REQUIRE_MPI_RANKS=2 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
       ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
       ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 3 --oversubscribe $<TARGET_FILE:test_comm_mpi>)
  # (OpenMPI's components leak at exit: leak detection is off under ASan, as for
  # the other MPI tests.)
endif()
