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
    ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMP_NUM_THREADS=1;ASAN_OPTIONS=detect_leaks=0:abort_on_error=1")
endif()
