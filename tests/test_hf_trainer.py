"""HF Trainer builds ``nn.DataParallel`` itself whenever ``n_gpu > 1``: through ``fastdp.install``
it gets FastDataParallel, here on CPU replicas, and trains as the single-device Trainer does.

Private Trainer API used: ``TrainingArguments._n_gpu`` (set after construction) forces
``n_gpu = 2`` or ``4`` on a machine without GPUs, which is what makes Trainer wrap the model in
``nn.DataParallel`` and multiply the batch by ``n_gpu``. Dropout is off so that replicas and the
single-device model compute the same thing.

Losses. GPT-2 normalises by Trainer's ``num_items_in_batch`` (the batch's token count, one row
per GPU); transformers 5's ``compute_loss`` then multiplies the gathered loss by ``n_gpu`` and
``training_step`` takes its ``.mean()``: with DataParallel's ``scalar_outputs="stack"`` that is the
single-device loss whenever every replica runs (uneven chunks included), and ``n_gpu / k`` times
it when a last batch has fewer rows than GPUs and only ``k`` replicas run (Trainer's own DP
arithmetic; DataParallel gives the same); evaluation counts tokens the same way. The BERT
classifier runs as a model without loss kwargs (``Trainer.model_accepts_loss_kwargs = False``,
a public attribute): its loss is a per-sample mean, which DataParallel's ``.mean()`` of
per-replica means reweights when chunks are uneven; ``scalar_outputs="mean"`` makes it the
whole-batch mean, partial batches with fewer replicas than GPUs included.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import fastdp

if os.environ.get("CI") and os.environ.get("FASTDP_ALLOW_NO_TRANSFORMERS") != "1":
    import transformers  # noqa: F401  (CI installs it: these tests must not skip there)
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
)

SAMPLES, SEQ = 15, 8  # 15: last batches of 3 (2 GPUs) and 7 (4): uneven, every replica runs


def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=64,
            n_positions=16,
            n_embd=16,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def bert():
    torch.manual_seed(0)
    return BertForSequenceClassification(
        BertConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=16,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            classifier_dropout=0.0,
        )
    )


def lm_data(n=SAMPLES):
    g = torch.Generator().manual_seed(1)
    return [
        {"input_ids": ids, "labels": ids.clone()}
        for ids in torch.randint(0, 64, (n, SEQ), generator=g)
    ]


def cls_data(n=SAMPLES):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (n, SEQ), generator=g)
    labels = torch.randint(0, 3, (n,), generator=g)
    return [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)]


class Recording(Trainer):
    """Keeps every training step's loss, unrounded (the logs round to 4 digits)."""

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.step_losses.append(loss.item())
        return loss


def train(make, data, tmp_path, n_gpu, per_device=2, epochs=2, loss_kwargs=True):
    args = TrainingArguments(
        output_dir=str(tmp_path / f"out{n_gpu}"),
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device,
        num_train_epochs=epochs,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    if n_gpu:
        args._n_gpu = n_gpu  # private: see the module docstring
    trainer = Recording(model=make(), args=args, train_dataset=data, eval_dataset=data)
    trainer.step_losses = []
    if not loss_kwargs:  # as for a model whose forward takes no num_items_in_batch
        trainer.model_accepts_loss_kwargs = False
    trainer.train()
    return trainer


@pytest.mark.parametrize("n", [2, 4])
def test_gpt2_trains_as_the_single_device_trainer(tmp_path, n):
    data = lm_data()
    with fastdp.install(device_ids=["cpu"] * n):
        dp = train(gpt2, data, tmp_path, n)
    ref = train(gpt2, data, tmp_path, 0, per_device=2 * n)
    assert isinstance(dp.model_wrapped, torch.nn.DataParallel)
    assert isinstance(dp.model_wrapped, fastdp.FastDataParallel)
    assert len(dp.step_losses) == len(ref.step_losses) == 2 * -(-SAMPLES // (2 * n))
    torch.testing.assert_close(dp.step_losses, ref.step_losses, rtol=1e-4, atol=1e-5)
    with fastdp.install(device_ids=["cpu"] * n):
        got = dp.evaluate()["eval_loss"]
    want = ref.evaluate()["eval_loss"]
    assert abs(got - want) < 1e-4 * max(1.0, abs(want))
    dp.save_model(str(tmp_path / "saved"))
    reloaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))
    for (k, a), b in zip(dp.model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), k


def test_gpt2_last_batch_smaller_than_the_gpus_runs_as_with_dataparallel(tmp_path):
    """13 samples, 2 GPUs x 2: the last batch has 1 row, so 1 replica runs and
    num_items_in_batch's second row is dropped (nn.DataParallel's zip; fastdp raised before)."""
    data = lm_data(13)
    with pytest.warns(UserWarning, match=r"kwargs\['num_items_in_batch'\] \(2 rows, 1 used\)"):
        with fastdp.install(device_ids=["cpu"] * 2):
            dp = train(gpt2, data, tmp_path, 2, epochs=1)
    ref = train(gpt2, data, tmp_path, 0, per_device=4, epochs=1)
    torch.testing.assert_close(dp.step_losses[:3], ref.step_losses[:3], rtol=1e-4, atol=1e-5)
    # Trainer multiplies by n_gpu = 2 what one replica computed: see the module docstring
    torch.testing.assert_close(dp.step_losses[3], 2 * ref.step_losses[3], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [2, 4])
def test_bert_classifier_trains_as_the_single_device_trainer(tmp_path, n):
    data = cls_data(13)  # last batches of 1 (2 GPUs: one replica runs) and 5 (4 GPUs: 2, 2, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "mean": no scalar-gather warning
        with fastdp.install(device_ids=["cpu"] * n, scalar_outputs="mean"):
            dp = train(bert, data, tmp_path, n, loss_kwargs=False)
            got = dp.evaluate()["eval_loss"]
    ref = train(bert, data, tmp_path, 0, per_device=2 * n, loss_kwargs=False)
    torch.testing.assert_close(dp.step_losses, ref.step_losses, rtol=1e-4, atol=1e-5)
    want = ref.evaluate()["eval_loss"]
    assert abs(got - want) < 1e-4 * max(1.0, abs(want))


SCRIPT = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2))
ids = torch.randint(0, 64, (5, 8), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": i, "labels": i.clone()} for i in ids]
args = TrainingArguments(output_dir="OUT", per_device_train_batch_size=2, num_train_epochs=1,
                         report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
args._n_gpu = 2  # test only: this machine has no GPUs (see test_hf_trainer.py)
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
print("wrapped:", type(trainer.model_wrapped).__module__, trainer.state.global_step)
"""


def test_python_m_fastdp_run_runs_an_unmodified_trainer_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT).replace("OUT", str(tmp_path / "out")))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastdp.run",
            "--device-ids",
            "cpu,cpu",
            "--scalar-outputs",
            "stack",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrapped: fastdp.install 2" in proc.stdout  # 5 samples, batch 4: a partial batch


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="Trainer wraps with 2+ CUDA devices")
def test_fastdp_run_says_why_an_unchanged_trainer_script_built_no_dataparallel(tmp_path):
    script = tmp_path / "train.py"  # no _n_gpu: Trainer sees this machine's 0 CUDA devices
    script.write_text(
        textwrap.dedent(SCRIPT)
        .replace("OUT", str(tmp_path / "out"))
        .replace("args._n_gpu = 2", "pass")
    )
    proc = subprocess.run(
        [sys.executable, "-m", "fastdp", "run", "--device-ids", "cpu,cpu", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrapped: fastdp.install" not in proc.stdout
    line = [x for x in proc.stderr.splitlines() if x.startswith("fastdp.run:")]
    assert len(line) == 1 and "no nn.DataParallel was built" in line[0], proc.stderr[-3000:]


def test_scalar_outputs_sum_makes_trainer_losses_n_gpu_times_too_large(tmp_path):
    """What docs/libraries.md says of "sum" with Trainer (which multiplies by n_gpu, then takes the
    mean): every step's loss is n_gpu times the single-device loss, where "stack" matches it."""
    data = lm_data(8)  # 2 GPUs x 2 per device: 2 full batches, every replica runs
    with fastdp.install(device_ids=["cpu"] * 2, scalar_outputs="sum"):
        summed = train(gpt2, data, tmp_path, 2, epochs=1)
    ref = train(gpt2, data, tmp_path, 0, per_device=4, epochs=1)
    torch.testing.assert_close(summed.step_losses[0], 2 * ref.step_losses[0], rtol=1e-4, atol=1e-5)
