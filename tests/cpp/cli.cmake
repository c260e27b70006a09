# CLI tests: `leanstep` commands run through tests/cli/expect.sh, which checks
# the exit status AND the output (a message printed by a command that exited
# with the wrong status fails). Bad input must give exit 2 and a message naming
# the argument, the rule and the value, before any work is done.
#
#   leanstep_cli_test(NAME LABELS [--rc N] [--match ERE]... [--no-match ERE]...
#                     [--setup 'sh'] [--timeout S] -- COMMAND ARGS...)
# "@TMP@" stands for a fresh temporary directory of the run. No ';' in arguments
# (CMake splits lists there): join setup commands with '&&'.
set(LEANSTEP_CLI_EXPECT ${PROJECT_SOURCE_DIR}/tests/cli/expect.sh)
function(leanstep_cli_test name labels)
  add_test(NAME ${name} COMMAND bash ${LEANSTEP_CLI_EXPECT} ${ARGN})
  set_tests_properties(${name} PROPERTIES LABELS "${labels};cli" TIMEOUT 300)
endfunction()

if(NOT TARGET leanstep_cli)
  return()
endif()

set(_cli $<TARGET_FILE:leanstep_cli>)
set(_src ${PROJECT_SOURCE_DIR})
set(_micro ${_src}/examples/tiny-moe/micro.json)
set(_corpus ${_src}/data/corpus.txt)
# A micro config in @TMP@/c.json with the corpus as an absolute path; EDIT is a
# sed expression applied to it (the bad value under test).
function(_train_config_setup out edit)
  set(${out} "sed -e 's|\"../../data/corpus.txt\"|\"${_corpus}\"|' -e '${edit}' ${_micro} > c.json" PARENT_SCOPE)
endfunction()
set(_no_step "--no-match" "\\[1/[0-9]+\\]")  # no training step ran

# ---------------------------------------------------------------- train: options
leanstep_cli_test(train_cli_steps_zero train --rc 2 ${_no_step}
  --match "train: argument '--steps' must be in \\[1, 2\\^40\\] \\(got 0\\)"
  -- ${_cli} train --config ${_micro} --steps 0)
leanstep_cli_test(train_cli_steps_zero_save train --rc 2 ${_no_step}
  --match "argument '--steps' must be in \\[1, 2\\^40\\] \\(got 0\\)"
  -- ${_cli} train --config ${_micro} --steps 0 --save @TMP@/ck)
leanstep_cli_test(train_cli_steps_negative train --rc 2 ${_no_step}
  --match "argument '--steps' must be in \\[1, 2\\^40\\] \\(got -1\\)" --no-match "is required"
  -- ${_cli} train --config ${_micro} --steps -1)
leanstep_cli_test(train_cli_steps_missing train --rc 2 ${_no_step}
  --match "argument '--steps' is required without --crossover"
  -- ${_cli} train --config ${_micro})
leanstep_cli_test(train_cli_warmup_negative train --rc 2 ${_no_step}
  --match "argument '--warmup' must be in \\[0, 2\\^40\\] \\(got -1\\)"
  -- ${_cli} train --config ${_micro} --steps 3 --warmup -1)
leanstep_cli_test(train_cli_warmup_too_long train --rc 2 ${_no_step}
  --match "argument '--warmup' must be less than the steps per run \\(3\\) so that the summary has steps \\(got 3\\)"
  -- ${_cli} train --config ${_micro} --steps 3 --warmup 3)
leanstep_cli_test(train_cli_window_zero train --rc 2 ${_no_step}
  --match "argument '--window' must be in \\[1, 2\\^40\\] \\(got 0\\)"
  -- ${_cli} train --config ${_micro} --steps 3 --window 0)
leanstep_cli_test(train_cli_save_is_a_file train --rc 2 ${_no_step} --setup "touch afile"
  --match "argument '--save' must name a directory \\(got '.*afile', which is not a directory\\)"
  -- ${_cli} train --config ${_micro} --steps 3 --save @TMP@/afile)
leanstep_cli_test(train_cli_save_below_a_file train --rc 2 ${_no_step} --setup "touch afile"
  --match "argument '--save' cannot be created: '.*afile' is not a directory"
  -- ${_cli} train --config ${_micro} --steps 3 --save @TMP@/afile/ck)
leanstep_cli_test(train_cli_save_unwritable train --rc 2 ${_no_step}
  --match "argument '--save' cannot be created \\(got '/proc/leanstep-no-such/ck'"
  -- ${_cli} train --config ${_micro} --steps 3 --save /proc/leanstep-no-such/ck)
leanstep_cli_test(train_cli_save_refuses_overwrite train --rc 2 ${_no_step}
  --setup "${_cli} train --config ${_micro} --steps 2 --save ck > /dev/null 2>&1"
  --match "argument '--save' names a directory that already holds a checkpoint \\(got '.*ck'\\; pass --overwrite"
  -- ${_cli} train --config ${_micro} --steps 2 --save @TMP@/ck)
leanstep_cli_test(train_cli_save_overwrite_and_resume train --rc 0
  --setup "${_cli} train --config ${_micro} --steps 2 --save ck > /dev/null 2>&1"
  --match "first microbatch hashes \\(steps 2, 3\\)" --match "checkpoint written to .*ck/adapters.safetensors"
  --match "final step 3: loss [0-9.]+"
  -- ${_cli} train --config ${_micro} --steps 2 --resume @TMP@/ck --save @TMP@/ck --overwrite)
leanstep_cli_test(train_cli_resume_missing train --rc 2 ${_no_step}
  --match "argument '--resume' must name a checkpoint directory \\(got '.*nothing', which does not exist\\)"
  -- ${_cli} train --config ${_micro} --steps 2 --resume @TMP@/nothing)
# A flipped data byte: the checksum refuses the checkpoint before any step.
leanstep_cli_test(train_cli_resume_corrupt train --rc 2 ${_no_step}
  --setup "${_cli} train --config ${_micro} --steps 2 --save ck > /dev/null 2>&1 && f=ck/adapters.safetensors && n=$(stat -c %s $f) && printf 'Z' | dd of=$f bs=1 seek=$((n - 7)) conv=notrunc status=none"
  --match "checkpoint '.*ck/adapters.safetensors' is corrupt: tensor '.*' does not match its checksum"
  -- ${_cli} train --config ${_micro} --steps 2 --resume @TMP@/ck)

# ---------------------------------------------------------------- train: configs
foreach(case
    "unknown_train_key|s/\"seed\": 7/\"sedd\": 7/|train config: unknown key 'train.sedd' \\(known: seq_len"
    "unknown_lora_key|s/\"alpha\": 4/\"alpah\": 4/|train config: unknown key 'lora.alpah'"
    "missing_lora|/\"lora\"/d|train config: missing key 'lora'"
    "experts_2p31|s/\"num_experts\": 4/\"num_experts\": 2147483648/|key 'num_experts' must be in \\[1, 1024\\] \\(got 2147483648\\)"
    "hidden_2p20|s/\"hidden_size\": 16/\"hidden_size\": 1048576/|key 'hidden_size' must be in \\[1, 65536\\] \\(got 1048576\\)"
    "accum_2p31|s/\"grad_accum_steps\": 1/\"grad_accum_steps\": 2147483648/|key 'train.grad_accum_steps' must be in \\[1, 65536\\] \\(got 2147483648\\)"
    "too_large|s/\"seq_len\": 6/\"seq_len\": 65536/|need [0-9]+ elements, more than the limit of 2\\^31"
    "number_1e400|s/\"lr\": 0.01/\"lr\": 1e400/|train config: not valid JSON: .*number overflow"
    "corpus_is_a_directory|s#\"${_corpus}\"#\"${_src}/data\"#|key 'train.corpus' must name a text file \\(got '.*data', which is a directory\\)")
  string(REPLACE "|" ";" parts "${case}")
  list(GET parts 0 cname)
  list(GET parts 1 edit)
  list(GET parts 2 message)
  _train_config_setup(setup "${edit}")
  leanstep_cli_test(train_cli_config_${cname} train --rc 2 ${_no_step} --setup "${setup}" --match "${message}"
    -- ${_cli} train --config @TMP@/c.json --steps 2)
endforeach()
leanstep_cli_test(train_cli_runs train --rc 0 --match "final step 2: loss [0-9.]+, grad_norm [0-9.]+"
  --match "all +1 +2/3"
  -- ${_cli} train --config ${_micro} --steps 3 --warmup 1)

# ---------------------------------------------------------------- steps / crossover
set(_logs ${_src}/examples/logs)
leanstep_cli_test(stats_cli_compare_warmup_too_long stats --rc 2
  --match "steps compare: argument '--warmup' must be less than the 120 step position\\(s\\) of run 'baseline' so that steps are left \\(got 500\\)"
  -- ${_cli} steps compare ${_logs}/baseline.jsonl ${_logs}/fused.jsonl --warmup 500)
leanstep_cli_test(stats_cli_summarize_warmup_too_long stats --rc 2
  --match "steps summarize: argument '--warmup' must be less than"
  -- ${_cli} steps summarize ${_logs}/baseline.jsonl --warmup 5000)
leanstep_cli_test(stats_cli_analyze_warmup_too_long stats --rc 2
  --match "crossover analyze: argument '--warmup' must be less than the longest run's [0-9]+ step position\\(s\\) so that steps are left \\(got 100000\\)"
  -- ${_cli} crossover analyze ${_logs}/crossover --warmup 100000)
leanstep_cli_test(stats_cli_summarize_warmup_negative stats --rc 2 --match "--warmup: must be >= 0 \\(got -1\\)"
  -- ${_cli} steps summarize ${_logs}/baseline.jsonl --warmup -1)
# Steps 0 and 10^9: 999,999,999 missing steps are counted, not listed (bounded memory and time).
leanstep_cli_test(stats_cli_far_step_is_bounded stats --rc 0 --timeout 30
  --setup "printf '{\"rank\":0,\"step\":0,\"duration_s\":1}\\n{\"rank\":0,\"step\":1000000000,\"duration_s\":1}\\n' > far.jsonl"
  --match "run 'far': 999999999 step\\(s\\) logged by no rank: 1, 2, 3, 4, 5, 6, 7, 8, \\.\\.\\. 999999991 more"
  -- ${_cli} steps summarize @TMP@/far.jsonl --warmup 0)
leanstep_cli_test(stats_cli_step_above_int64 stats --rc 2
  --setup "printf '{\"rank\":0,\"step\":9223372036854775813,\"duration_s\":1}\\n' > big.jsonl"
  --match "big.jsonl:1: 'step' must be at most 2\\^62 \\(got 9223372036854775813\\)" --no-match "got -"
  -- ${_cli} steps summarize @TMP@/big.jsonl)
leanstep_cli_test(stats_cli_rank_2p40 stats --rc 2
  --setup "printf '{\"rank\":1099511627776,\"step\":1,\"duration_s\":1}\\n' > r.jsonl"
  --match "r.jsonl:1: 'rank' must be in \\[0, 2\\^31 - 1\\] \\(got 1099511627776\\)"
  -- ${_cli} steps summarize @TMP@/r.jsonl)
leanstep_cli_test(stats_cli_huge_durations_mean stats --rc 0
  --setup "printf '{\"rank\":0,\"step\":1,\"duration_s\":1.7e308}\\n{\"rank\":0,\"step\":2,\"duration_s\":1.7e308}\\n' > h.jsonl"
  --match "\"mean_s\":1\\.7e\\+308" --match "\"median_s\":1\\.7e\\+308" --no-match "\"(mean|median)_s\":null"
  -- ${_cli} steps summarize @TMP@/h.jsonl --warmup 0 --json)
leanstep_cli_test(stats_cli_csv_not_utf8 stats --rc 2
  --setup "printf 'rank,step,duration_s,run\\n0,1,1,\\377\\376\\n' > bad.csv"
  --match "bad.csv:2: 'run' must be valid UTF-8 text" --no-match "internal error"
  -- ${_cli} steps summarize @TMP@/bad.csv --json)
leanstep_cli_test(stats_cli_number_1e400_jsonl stats --rc 2
  --setup "printf '{\"rank\":0,\"step\":1,\"duration_s\":1e400}\\n' > n.jsonl"
  --match "n.jsonl:1: invalid JSON: number overflow parsing '1e400'" --no-match "internal error"
  -- ${_cli} steps summarize @TMP@/n.jsonl)
leanstep_cli_test(stats_cli_number_1e400_csv stats --rc 2
  --setup "printf 'rank,step,duration_s,loss\\n0,1,1,1e400\\n' > n.csv"
  --match "n.csv:2: 'loss' must be a number within the double range \\(got \"1e400\"\\)"
  -- ${_cli} steps summarize @TMP@/n.csv)
leanstep_cli_test(stats_cli_plan_number_1e400 stats --rc 2
  --setup "sed 's/\"block_steps\": [0-9]*/\"block_steps\": 1e400/' ${_logs}/crossover_plan.json > p.json"
  --match "p.json: invalid JSON .*number overflow" --no-match "internal error"
  -- ${_cli} crossover analyze ${_logs}/crossover --plan @TMP@/p.json)
leanstep_cli_test(stats_cli_plan_runs_2e9 stats --rc 2 --timeout 30
  --match "--runs: must be in \\[1, 10000\\] \\(got 2000000000\\)"
  -- ${_cli} crossover plan --conditions A,B --runs 2000000000 --block-steps 3)
leanstep_cli_test(stats_cli_plan_block_steps_2p62 stats --rc 2
  --match "--block-steps: must be in \\[1, 2\\^40\\] \\(got 4611686018427387904\\)"
  -- ${_cli} crossover plan --conditions A,B --runs 2 --block-steps 4611686018427387904)

# ---------------------------------------------------------------- lora
set(_qwen ${_src}/examples/models/qwen3-30b-a3b.config.json)
leanstep_cli_test(lora_cli_pp_first_negative lora --rc 2 --match "--pp-first: must be >= 0 \\(got -5\\)"
  -- ${_cli} lora plan --config ${_qwen} --pp 2 --pp-first -5)
leanstep_cli_test(lora_cli_rank_1e16 lora --rc 2 --match "--rank: must be in \\[1, 2\\^20\\] \\(got 10000000000000000\\)"
  -- ${_cli} lora plan --config ${_qwen} --rank 10000000000000000)
foreach(case
    "experts_2p40|s/\"num_experts\": 128/\"num_experts\": 1099511627776/|key 'num_experts' must be <= 65536 \\(got 1099511627776\\)"
    "layers_2p31|s/\"num_hidden_layers\": 48/\"num_hidden_layers\": 2147483648/|key 'num_hidden_layers' must be <= 16384 \\(got 2147483648\\)"
    "hidden_2p62|s/\"hidden_size\": 2048/\"hidden_size\": 4611686018427387904/|key 'hidden_size' must be <= 16777216 \\(got 4611686018427387904\\)"
    "number_1e400|s/\"rope_theta\": 1000000/\"rope_theta\": 1e400/|not valid JSON .*number overflow")
  string(REPLACE "|" ";" parts "${case}")
  list(GET parts 0 cname)
  list(GET parts 1 edit)
  list(GET parts 2 message)
  leanstep_cli_test(lora_cli_config_${cname} lora --rc 2 --timeout 30 --setup "sed -e '${edit}' ${_qwen} > c.json"
    --match "${message}" --no-match "trainable parameters"
    -- ${_cli} lora plan --config @TMP@/c.json)
endforeach()
leanstep_cli_test(lora_cli_diff_number_1e400 lora --rc 2
  --setup "${_cli} lora plan --config ${_qwen} --json > a.json && sed 's/\"lora_rank\":32/\"lora_rank\":1e400/' a.json > b.json"
  --match "lora diff: .*b.json is not valid JSON .*number overflow" --no-match "internal error"
  -- ${_cli} lora diff @TMP@/a.json @TMP@/b.json)
