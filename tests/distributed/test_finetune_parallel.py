"""Fine-tuning (``ds4sci train`` with a ``task:`` section, :class:`ds4sci.train.finetune.FineTuner`) across
processes: a LoRA + attention-pooled head under Ulysses 2 and ring 2, and LoRA under ZeRO-3 and ZeRO-0 at dp 2,
each give one process's losses, adapter and head weights (fp32), as does LoRA under full activation checkpointing;
the tokens logged per step (tokens/s) are the batch's real tokens, each counted once; a run stopped at a checkpoint
and resumed continues with the uninterrupted losses, and its end writes metrics.json (test split) and the task
export. One process group per world size, every case in it."""
import json
import random
from pathlib import Path

import pytest
import torch

from ds4sci.spawn import run_workers

pytestmark = pytest.mark.distributed
ENV = {"DS_ACCELERATOR": "cpu"}
STEPS = 3


def _labelled(path: Path) -> Path:
    """A planted-motif binary task: records of 32 random bases, class 1 holding GGGGGG somewhere; given splits."""
    rng = random.Random(0)
    rows = ["id\tsequence\tlabel\tsplit"]
    for i in range(48):
        seq = [rng.choice("ACGT") for _ in range(32 - i % 5)]  # uneven lengths: padding in every batch
        if i % 2:
            at = rng.randrange(0, len(seq) - 6)
            seq[at:at + 6] = "GGGGGG"
        rows.append(f"r{i}\t{''.join(seq)}\t{i % 2}\t{'train' if i < 32 else 'validation' if i < 40 else 'test'}")
    path.write_text("\n".join(rows) + "\n")
    return path


def _sets(out, data, *extra, micro=4, steps=STEPS):
    return ["task.kind=binary", f"task.data={data}", "task.pooling=attention", "task.lora_targets=[attention,mlp]",
            "task.lora_r=4", "data.seq_len=32", f"train.micro_batch_size={micro}", f"train.steps={steps}",
            "train.log_every=1", "train.eval_every=0", "train.progress=false", f"train.out_dir={out}",
            "optim.lr=0.01", "optim.min_lr=0.01", "optim.warmup_steps=0", "optim.grad_clip=0",
            # AdamW's step ~ lr * g / eps: linear in the gradient, so a gradient off by a factor shows
            "optim.eps=1.0", *extra]


def _trained(trainer):
    """The adapters and the head, whole, fp32 (collective; rank 0's)."""
    return {k: v.numpy() for k, v in trainer.full_state_dict().items() if ".lora_" in k or k.startswith("head.")}


def _steps(trainer, n=STEPS):
    """``n`` training steps: their losses and (logged) tokens."""
    results = [trainer.train_step() for _ in range(n)]
    return [r.loss for r in results], [r.tokens for r in results]


def _cases(rank, world, tmp, data):
    from ds4sci.train.checkpoint import load_checkpoint
    from ds4sci.train.config import load_config
    from ds4sci.train.finetune import FineTuner

    out = {}
    if world == 1:
        straight = FineTuner(load_config(None, _sets(f"{tmp}/straight", data)))
        out["straight"] = _steps(straight), _trained(straight)
        checkpointed = FineTuner(load_config(None, _sets(f"{tmp}/checkpointed", data,
                                                         "activation_checkpointing.mode=full")))
        out["checkpointed"] = _steps(checkpointed), _trained(checkpointed)
        first = FineTuner(load_config(None, _sets(f"{tmp}/first", data, steps=1)))
        out["first"] = [r["loss"] for r in first.train() if "loss" in r]  # 1 step, checkpoint, test, export
        resumed = FineTuner(load_config(None, _sets(f"{tmp}/resumed", data)))
        load_checkpoint(resumed, f"{tmp}/first/checkpoints/step1")
        out["resumed"] = _steps(resumed, STEPS - 1)[0], _trained(resumed)
        return out
    for name, extra, micro in [("ulysses", ["parallel.ulysses=2"], 4), ("ring", ["parallel.ring=2"], 4),
                               ("zero0", ["zero.stage=0"], 2), ("zero3", ["zero.stage=3"], 2)]:
        trainer = FineTuner(load_config(None, _sets(f"{tmp}/{name}", data, *extra, micro=micro)))
        out[name] = _steps(trainer), _trained(trainer)
    return out


@pytest.mark.slow
def test_finetune_layouts_resume_and_outputs(tmp_path):
    data = str(_labelled(tmp_path / "motif.tsv"))
    one = run_workers(_cases, 1, str(tmp_path), data, env=ENV, timeout=400)[0]
    two = run_workers(_cases, 2, str(tmp_path), data, env=ENV, timeout=400)[0]
    (losses, tokens), state = one["straight"]
    assert all(4 * 28 <= n <= 4 * 32 for n in tokens), tokens  # 4 records of 28-32 bases a step: tokens, not records
    assert len(state) == 2 * 4 * 2 + 3  # lora_A, lora_B of 4 modules x 2 layers; pool weight, bias; score
    assert all(abs(v).max() > 1e-4 for k, v in state.items() if ".lora_B" in k)  # trained: B starts at zero
    assert len(set(losses)) == STEPS
    for name in ("ulysses", "ring", "zero0", "zero3"):
        (got_losses, got_tokens), got_state = two[name]
        assert got_tokens == tokens, name  # each token of a sharded or data-parallel batch counted once
        torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n} losses: {m}")
        for key, value in state.items():
            torch.testing.assert_close(torch.from_numpy(got_state[key]), torch.from_numpy(value), rtol=1e-4,
                                       atol=1e-6, msg=lambda m, n=name, k=key: f"{n}: {k}: {m}")
    (got_losses, _), got_state = one["checkpointed"]  # LoRA under full activation checkpointing: the same run
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), rtol=1e-6, atol=1e-7)
    for key, value in state.items():
        torch.testing.assert_close(torch.from_numpy(got_state[key]), torch.from_numpy(value), rtol=1e-5, atol=1e-7,
                                   msg=lambda m, k=key: f"checkpointed: {k}: {m}")
    assert one["first"] == losses[:1]
    torch.testing.assert_close(torch.tensor(one["resumed"][0]), torch.tensor(losses[1:]), rtol=0, atol=0)
    for key, value in state.items():
        torch.testing.assert_close(torch.from_numpy(one["resumed"][1][key]), torch.from_numpy(value), rtol=0, atol=0)
    metrics = json.loads((tmp_path / "first" / "metrics.json").read_text())
    assert metrics["test"]["n"] == 8 and 0 <= metrics["test"]["auroc"] <= 1 and metrics["method"] == "lora"
    assert metrics["trainable_parameters"] < metrics["parameters"] / 5
    export = tmp_path / "first" / "export"
    assert {p.name for p in export.iterdir()} == {"task.json", "head.safetensors", "adapter_model.safetensors"}
