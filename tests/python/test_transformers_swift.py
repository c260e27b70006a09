"""leanstep.transformers.swift against the REAL ms-swift (transformers backend,
``swift sft``): the plugin file registers the "leanstep" callback (idempotent,
a foreign entry refused), and a short ``swift sft`` LoRA run of a tiny local
Qwen3-MoE (saved here with a word-level tokenizer: no download) gives the same
losses and grad norms with ``--callbacks leanstep`` as without (1e-5 relative,
the bound of test_transformers_trainer.py), with its norms swapped."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import types

import pytest
import torch

import leanstep

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("swift")

import leanstep.transformers.swift as lts  # noqa: E402
import hf_models  # noqa: E402
from helpers import UndoImportPatches  # noqa: E402

pytestmark = pytest.mark.skipif(not {"rmsnorm", "grad"} <= set(leanstep.areas),
                                reason="rmsnorm or grad not built")

ROOT = pathlib.Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "examples" / "swift" / "leanstep_hf_plugin.py"


@pytest.fixture
def swift_callbacks_map():
    """ms-swift's callbacks_map, imported here with its process-wide patches of
    Transformers and PEFT undone afterwards (helpers.UndoImportPatches)."""
    with UndoImportPatches():
        from swift.callbacks import callbacks_map

        yield callbacks_map


def test_register_is_idempotent_and_refuses_a_foreign_entry(swift_callbacks_map):
    callbacks_map = swift_callbacks_map
    had = dict(callbacks_map)
    try:
        callbacks_map.pop(lts.NAME, None)
        assert lts.register() is lts.SwiftCallback
        assert lts.register() is lts.SwiftCallback
        assert sorted(callbacks_map) == sorted(list(had.keys() - {lts.NAME}) + [lts.NAME])
        args = types.SimpleNamespace(callbacks=[lts.NAME])
        callback = callbacks_map[lts.NAME](args, None)  # as ms-swift builds it
        assert callback.report is None and callback.trainer is None
        callbacks_map[lts.NAME] = type("Other", (), {})
        with pytest.raises(RuntimeError, match="already holds 'leanstep'"):
            lts.register()
    finally:
        callbacks_map.clear()
        callbacks_map.update(had)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_qwen3_moe")
    model, _ = hf_models.tiny_model("qwen3_moe", layers=2)
    words = 120
    tokenizer = hf_models.word_tokenizer(
        words, ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "user", "assistant", "system"],
        pad_token="<|endoftext|>", eos_token="<|im_end|>")
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
        "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rows = [{"messages": [
        {"role": "user", "content": " ".join(f"t{(i * 7 + j) % words}" for j in range(6))},
        {"role": "assistant", "content": " ".join(f"t{(i * 3 + j) % words}" for j in range(5))}]}
        for i in range(16)]
    (folder / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return folder


def start_swift_sft(folder, out, *extra):
    """``swift sft`` started in a process group of its own (one thread): the caller runs
    two side by side (most of each is ms-swift's start-up) and reads each with
    :func:`finish_swift_sft`. The group: ms-swift's command runs the job in a child."""
    command = [str(pathlib.Path(sys.executable).parent / "swift"), "sft", "--model", str(folder),
               "--model_type", "qwen3_moe", "--template", "qwen3", "--dataset",
               str(folder / "data.jsonl"), "--tuner_type", "lora", "--target_modules", "q_proj",
               "v_proj", "--max_steps", "3", "--per_device_train_batch_size", "4",
               "--logging_steps", "1", "--save_strategy", "no", "--output_dir", str(out),
               "--report_to", "none", "--dataloader_num_workers", "0", "--max_grad_norm", "0.5",
               "--torch_dtype", "float32", "--use_hf", "true", "--seed", "0",
               # A local model: no hub query (it retries, with back-off, where there is
               # no network).
               "--check_model", "false", *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            start_new_session=True), out


def stop_swift_sft(run):
    """Kills a job's whole process group (ms-swift's command and the job it started)."""
    if run.poll() is None:
        try:
            os.killpg(run.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    run.communicate(timeout=60)


def finish_swift_sft(started):
    """(loss, grad_norm) of each logged step, and the run's output."""
    run, out = started
    try:
        stdout, stderr = run.communicate(timeout=300)
    except BaseException:
        stop_swift_sft(run)
        raise
    assert run.returncode == 0, stderr[-3000:]
    (log,) = out.glob("v*/logging.jsonl")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r], stdout + stderr


def test_swift_sft_with_the_plugin_equals_the_plain_run(tiny_model_dir, tmp_path):
    plain = start_swift_sft(tiny_model_dir, tmp_path / "plain")
    try:
        ours, output = finish_swift_sft(start_swift_sft(
            tiny_model_dir, tmp_path / "leanstep", "--external_plugins", str(PLUGIN),
            "--callbacks", lts.NAME))
    except BaseException:
        stop_swift_sft(plain[0])
        raise
    baseline, _ = finish_swift_sft(plain)
    assert "leanstep.transformers: 9 RMSNorm modules swapped" in output
    assert len(ours) == len(baseline) == 3
    for (loss, norm), (loss0, norm0) in zip(ours, baseline):
        assert abs(loss - loss0) <= 1e-5 * abs(loss0)
        assert abs(norm - norm0) <= 1e-5 * abs(norm0)
    assert torch.tensor([n for _, n in baseline]).gt(0.5).any()  # clipping took part
