# The dispatch stress test also runs under ThreadSanitizer (`make test-tsan`
# builds tsan_tests and runs the tests labelled "tsan"). The whole program runs
# as one test there; its discovered cases keep the plain "dispatch" label.
if(TARGET test_dispatch_tsan)
  add_dependencies(tsan_tests test_dispatch_tsan)
  add_test(NAME dispatch_tsan_stress COMMAND test_dispatch_tsan)
  set_tests_properties(dispatch_tsan_stress PROPERTIES LABELS "dispatch;tsan" TIMEOUT 300)
endif()

# The `leanstep paths` command: the report after demo calls names every area's
# ops with counts and decline reasons; a bad preset is refused.
if(TARGET leanstep_cli)
  add_test(NAME dispatch_cli_paths COMMAND leanstep_cli paths --demo-calls)
  set_tests_properties(dispatch_cli_paths PROPERTIES LABELS "dispatch;cli" TIMEOUT 120
    PASS_REGULAR_EXPRESSION "declined: 1 x plan has no coalesced region.*moe.permute.*frozen_fused +1 calls +declined: 1 x autocast; 1 x weight_requires_grad")
  add_test(NAME dispatch_cli_paths_json COMMAND leanstep_cli paths --json --preset baseline --demo-calls)
  set_tests_properties(dispatch_cli_paths_json PROPERTIES LABELS "dispatch;cli" TIMEOUT 120
    PASS_REGULAR_EXPRESSION "preset 'baseline' disables this op's fast paths.*\"preset\":\"baseline\"")
  add_test(NAME dispatch_cli_bad_preset COMMAND leanstep_cli paths --preset no_such_op)
  set_tests_properties(dispatch_cli_bad_preset PROPERTIES LABELS "dispatch;cli" TIMEOUT 60
    PASS_REGULAR_EXPRESSION "'no_such_op' names none")
endif()
