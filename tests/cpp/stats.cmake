# CLI smoke tests of the stats area: the example logs through `leanstep steps` and
# `leanstep crossover` (text, --json, --plot), and a malformed log's error.
if(TARGET leanstep_cli)
  set(_stats_examples ${PROJECT_SOURCE_DIR}/examples/logs)
  set(_stats_out ${CMAKE_CURRENT_BINARY_DIR}/stats_cli)
  file(MAKE_DIRECTORY ${_stats_out})
  add_test(NAME stats_cli_summarize
           COMMAND leanstep_cli steps summarize ${_stats_examples}/baseline.jsonl ${_stats_examples}/fused.jsonl
                   --warmup 20 --window 20 --plot ${_stats_out}/summary.svg)
  set_tests_properties(stats_cli_summarize PROPERTIES LABELS stats
                       PASS_REGULAR_EXPRESSION "baseline +2 +100/120")
  add_test(NAME stats_cli_compare_json
           COMMAND leanstep_cli steps compare ${_stats_examples}/baseline.jsonl ${_stats_examples}/fused.jsonl --json
                   --plot ${_stats_out}/compare.svg)
  set_tests_properties(stats_cli_compare_json PROPERTIES LABELS stats
                       PASS_REGULAR_EXPRESSION "\"windows_improved\":5")
  add_test(NAME stats_cli_plan
           COMMAND leanstep_cli crossover plan --conditions baseline,rmsnorm,grad,rmsnorm+grad --runs 4
                   --block-steps 25 --warmup 10 --out ${_stats_out}/plan.json)
  set_tests_properties(stats_cli_plan PROPERTIES LABELS stats
                       PASS_REGULAR_EXPRESSION "balanced over block positions: yes; first-order carryover balanced: yes")
  add_test(NAME stats_cli_plan_impossible
           COMMAND leanstep_cli crossover plan --conditions A,B,C --runs 4 --block-steps 5)
  set_tests_properties(stats_cli_plan_impossible PROPERTIES LABELS stats
                       PASS_REGULAR_EXPRESSION "must be a multiple of conditions x allocations")
  add_test(NAME stats_cli_analyze
           COMMAND leanstep_cli crossover analyze ${_stats_examples}/crossover
                   --plan ${_stats_examples}/crossover_plan.json --plot ${_stats_out}/crossover.svg)
  set_tests_properties(stats_cli_analyze PROPERTIES LABELS stats
                       PASS_REGULAR_EXPRESSION "rmsnorm\\+grad vs baseline +\\+1[0-9]\\.[0-9][0-9]%")
  add_test(NAME stats_cli_analyze_json
           COMMAND leanstep_cli crossover analyze ${_stats_examples}/crossover --warmup 10 --json)
  set_tests_properties(stats_cli_analyze_json PROPERTIES LABELS stats
                       PASS_REGULAR_EXPRESSION "\"baseline\":\"baseline\",\"bootstrap\"")
  file(WRITE ${_stats_out}/bad.jsonl "{\"rank\":0,\"step\":0,\"duration_s\":1}\n{\"rank\":0,\"step\":1}\n")
  add_test(NAME stats_cli_malformed
           COMMAND leanstep_cli steps summarize ${_stats_out}/bad.jsonl)
  set_tests_properties(stats_cli_malformed PROPERTIES LABELS stats
                       PASS_REGULAR_EXPRESSION "bad.jsonl:2: missing required key 'duration_s'")
endif()
