# CLI tests of the LoRA planner (need the `leanstep` command).
if(TARGET leanstep_cli)
  set(_lora_cfg ${PROJECT_SOURCE_DIR}/examples/models/qwen3-30b-a3b.config.json)
  # The stored example outputs are what the planner prints today.
  add_test(NAME lora_examples_current
           COMMAND bash ${PROJECT_SOURCE_DIR}/examples/lora/regenerate.sh $<TARGET_FILE:leanstep_cli> --check)
  # diff: exit 0 on identical plans, 1 when coverage differs (all-linear adds linear_proj).
  add_test(NAME lora_cli_diff_exit_codes
           COMMAND bash -c "set -e; d=$(mktemp -d); trap 'rm -rf $d' EXIT
             \"$1\" lora plan --config \"$2\" --ep 8 --json > $d/a.json
             \"$1\" lora plan --config \"$2\" --ep 8 --targets linear_qkv,linear_proj,linear_fc1,linear_fc2 --json > $d/b.json
             \"$1\" lora plan --config \"$2\" --ep 8 --targets linear_qkv,linear_fc1,linear_fc2 --json > $d/c.json
             \"$1\" lora diff $d/a.json $d/b.json | grep -q 'identical: 8 ranks'
             s=0; \"$1\" lora diff $d/a.json $d/c.json > $d/out.txt || s=$?
             test $s -eq 1
             grep -q 'only in .*a.json: decoder.layers.\\*.self_attention.linear_proj.lora_A.weight x 384' $d/out.txt"
             _ $<TARGET_FILE:leanstep_cli> ${_lora_cfg})
  # Bad parallel sizes: exit 2 with the rule.
  add_test(NAME lora_cli_plan_rejects_bad_sizes
           COMMAND bash -c "s=0; out=$(\"$1\" lora plan --config \"$2\" --ep 3 2>&1) || s=$?
             test $s -eq 2 && echo \"$out\" | grep -q \"argument 'ep' must divide num_experts 128\""
             _ $<TARGET_FILE:leanstep_cli> ${_lora_cfg})
  set_tests_properties(lora_examples_current lora_cli_diff_exit_codes lora_cli_plan_rejects_bad_sizes
                       PROPERTIES LABELS lora)
endif()
