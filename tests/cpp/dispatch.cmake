# The dispatch stress test also runs under ThreadSanitizer (`make test-tsan`
# builds tsan_tests and runs the tests labelled "tsan"). The whole program runs
# as one test there; its discovered cases keep the plain "dispatch" label.
if(TARGET test_dispatch_tsan)
  add_dependencies(tsan_tests test_dispatch_tsan)
  add_test(NAME dispatch_tsan_stress COMMAND test_dispatch_tsan)
  set_tests_properties(dispatch_tsan_stress PROPERTIES LABELS "dispatch;tsan" TIMEOUT 300)
endif()

# The `leanstep paths` command: the report after demo calls names every area's
# ops with counts and decline reasons; a bad preset is refused (exit 2).
if(TARGET leanstep_cli)
  set(_cli $<TARGET_FILE:leanstep_cli>)
  leanstep_cli_test(dispatch_cli_paths dispatch
    --match "declined: 1 x plan has no coalesced region"
    --match "moe.permute"
    --match "frozen_fused +1 calls +declined: 1 x autocast\\; 1 x weight_requires_grad"
    -- ${_cli} paths --demo-calls)
  leanstep_cli_test(dispatch_cli_paths_json dispatch
    --match "preset 'baseline' disables this op's fast paths"
    --match "\"preset\":\"baseline\""
    -- ${_cli} paths --json --preset baseline --demo-calls)
  leanstep_cli_test(dispatch_cli_bad_preset dispatch --rc 2 --match "'no_such_op' names none"
    -- ${_cli} paths --preset no_such_op)
endif()
