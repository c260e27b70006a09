# The data-parallel training test runs under mpirun with 2 ranks (its gtest
# cases are also discovered as ordinary tests; run without mpirun they skip).
# Leak detection is off for this one test: OpenMPI's dynamically loaded
# components leak at finalize and are unloaded before LeakSanitizer reports
# (no module to suppress by). The trainer's own memory is leak-checked by the
# in-process tests (test_train), which run the same code paths.
if(MPI_FOUND AND TARGET test_train_mpi AND MPIEXEC_EXECUTABLE)
  add_test(NAME train_mpi_2_ranks
           COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 --oversubscribe
                   $<TARGET_FILE:test_train_mpi>)
  set_tests_properties(train_mpi_2_ranks PROPERTIES
    LABELS "train;mpi"
    TIMEOUT 300
    ENVIRONMENT "LEANSTEP_REQUIRE_MPI_RANKS=2;OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMP_NUM_THREADS=1;OPENBLAS_NUM_THREADS=1;ASAN_OPTIONS=detect_leaks=0:abort_on_error=1")
endif()
