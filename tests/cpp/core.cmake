# The output pool's concurrency test also runs under ThreadSanitizer
# (`make test-tsan` builds tsan_tests and runs the tests labelled "tsan").
if(TARGET test_core_host_memory)
  add_dependencies(tsan_tests test_core_host_memory)
  add_test(NAME core_host_memory_tsan COMMAND test_core_host_memory
           --gtest_filter=HostPool.ConcurrentTakesNeverShareABlock)
  set_tests_properties(core_host_memory_tsan PROPERTIES LABELS "core;tsan" TIMEOUT 300)
endif()
