"""The HF Trainer (and TRL's SFTTrainer) with leanstep.transformers.Callback:
a short LoRA run on a tiny Qwen3-MoE gives the same losses and grad norms as
without it, and everything the callback did is undone when training ends.

Bound: losses and grad norms within 1e-5 relative. fp32 throughout; the
RMSNorms differ from the model's own by a few fp32 ulps (test_transformers.py)
and the grad norm by its summation order (test_torch_clip.py); four steps
of AdamW at lr 1e-2 carry those differences into the losses at ~1e-7."""

import tempfile

import pytest
import torch

import leanstep

tf = pytest.importorskip("transformers")
pytest.importorskip("peft")

import leanstep.torch as lt  # noqa: E402
import leanstep.transformers as lst  # noqa: E402
from leanstep import _torch_clip  # noqa: E402
import hf_models  # noqa: E402

pytestmark = pytest.mark.skipif(not {"rmsnorm", "grad"} <= set(leanstep.areas),
                                reason="rmsnorm or grad not built")

STEPS = 4


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, rows=16, length=12, seed=5):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, hf_models.TINY["vocab_size"], (rows, length), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def arguments(cls=None, **extra):
    cls = cls or tf.TrainingArguments
    return cls(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=STEPS,
               learning_rate=1e-2, max_grad_norm=0.5, logging_steps=1, report_to=[],
               save_strategy="no", use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
               dataloader_num_workers=0, **extra)


def train(callbacks):
    model, _ = hf_models.tiny_model("qwen3_moe", layers=2)
    model = hf_models.lora(model)
    trainer = tf.Trainer(model=model, args=arguments(), train_dataset=TokenDataset(),
                         callbacks=callbacks)
    trainer.train()
    logged = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    return model, logged


def assert_same_run(ours, theirs):
    assert len(ours) == len(theirs) == STEPS
    for (loss, norm), (loss0, norm0) in zip(ours, theirs):
        assert abs(loss - loss0) <= 1e-5 * abs(loss0)
        assert abs(norm - norm0) <= 1e-5 * abs(norm0)
    assert any(norm0 > 0.5 for _, norm0 in theirs)  # clipping took part


@pytest.mark.parametrize("grad_buffer", [False, True])
def test_trainer_lora_run_equals_the_plain_one_and_is_undone(grad_buffer):
    torch_clip = torch.nn.utils.clip_grad_norm_
    _, baseline = train([])
    callback = lst.Callback(grad_buffer=grad_buffer, verbose=False)
    _torch_clip.last_decision.clear()
    model, logged = train([callback])
    assert callback.report.num_swapped == 9  # 2 per layer x 2, q/k norms x 2, final
    assert _torch_clip.last_decision["get_total_norm"]["path"] == "leanstep"
    assert _torch_clip.last_decision["clip_grads_with_norm_"]["path"] == "leanstep"
    assert_same_run(logged, baseline)
    assert not any(isinstance(m, lt.RMSNorm) for m in model.modules())
    assert torch.nn.utils.clip_grad_norm_ is torch_clip
    assert not _torch_clip.installed()
    assert "zero_grad" not in model.__dict__


def test_trl_sft_trainer_takes_the_callback():
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    ids = TokenDataset().ids.tolist()
    data = datasets.Dataset.from_dict({"input_ids": ids})

    def run(callbacks):
        model, _ = hf_models.tiny_model("qwen3_moe", layers=2)
        model = hf_models.lora(model)
        tokenizer = hf_models.word_tokenizer(hf_models.TINY["vocab_size"])
        args = arguments(trl.SFTConfig, dataset_kwargs={"skip_prepare_dataset": True},
                         remove_unused_columns=False)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data,
                                 processing_class=tokenizer, callbacks=callbacks,
                                 data_collator=_collate)
        trainer.train()
        return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]

    callback = lst.Callback(verbose=False)
    assert_same_run(run([callback]), run([]))
    assert callback.report.num_swapped == 9


def _collate(rows):
    ids = torch.tensor([r["input_ids"] for r in rows])
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

