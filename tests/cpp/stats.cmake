# CLI smoke tests of the stats area: the example logs through `leanstep steps` and
# `leanstep crossover` (text, --json, --plot), and a malformed log's error. Each
# checks the exit status and the output (tests/cli/expect.sh, see cli.cmake).
if(TARGET leanstep_cli)
  set(_stats_examples ${PROJECT_SOURCE_DIR}/examples/logs)
  set(_cli $<TARGET_FILE:leanstep_cli>)
  leanstep_cli_test(stats_cli_summarize stats --match "baseline +2 +100/120" --match "plot: .*summary.svg"
    -- ${_cli} steps summarize ${_stats_examples}/baseline.jsonl ${_stats_examples}/fused.jsonl
       --warmup 20 --window 20 --plot @TMP@/summary.svg)
  leanstep_cli_test(stats_cli_compare_json stats --match "\"windows_improved\":5"
    -- ${_cli} steps compare ${_stats_examples}/baseline.jsonl ${_stats_examples}/fused.jsonl --json
       --plot @TMP@/compare.svg)
  leanstep_cli_test(stats_cli_plan stats
    --match "balanced over block positions: yes\\; first-order carryover balanced: yes"
    --match "plan written to .*plan.json"
    -- ${_cli} crossover plan --conditions baseline,rmsnorm,grad,rmsnorm+grad --runs 4
       --block-steps 25 --warmup 10 --out @TMP@/plan.json)
  leanstep_cli_test(stats_cli_plan_impossible stats --rc 2
    --match "argument 'runs' must be a multiple of conditions x allocations = 3 x 1 = 3"
    -- ${_cli} crossover plan --conditions A,B,C --runs 4 --block-steps 5)
  leanstep_cli_test(stats_cli_analyze stats --match "rmsnorm\\+grad vs baseline +\\+1[0-9]\\.[0-9][0-9]%"
    -- ${_cli} crossover analyze ${_stats_examples}/crossover
       --plan ${_stats_examples}/crossover_plan.json --plot @TMP@/crossover.svg)
  leanstep_cli_test(stats_cli_analyze_json stats --match "\"independent_runs\":4,"
    -- ${_cli} crossover analyze ${_stats_examples}/crossover --warmup 10 --json)
  leanstep_cli_test(stats_cli_malformed stats --rc 2
    --setup "printf '{\"rank\":0,\"step\":0,\"duration_s\":1}\\n{\"rank\":0,\"step\":1}\\n' > bad.jsonl"
    --match "bad.jsonl:2: missing required key 'duration_s'"
    -- ${_cli} steps summarize @TMP@/bad.jsonl)
endif()
