# The dispatch stress test also runs under ThreadSanitizer (`make test-tsan`
# builds tsan_tests and runs the tests labelled "tsan"). The whole program runs
# as one test there; its discovered cases keep the plain "dispatch" label.
if(TARGET test_dispatch_tsan)
  add_dependencies(tsan_tests test_dispatch_tsan)
  add_test(NAME dispatch_tsan_stress COMMAND test_dispatch_tsan)
  set_tests_properties(dispatch_tsan_stress PROPERTIES LABELS "dispatch;tsan" TIMEOUT 300)
endif()
