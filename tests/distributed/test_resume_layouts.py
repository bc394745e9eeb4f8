"""Resume at another layout: a run saved at one (tp, ulysses, dp, pp, ZeRO stage) continues at another through the
checkpoint's portable state (:mod:`ds4sci.train.checkpoint`) and trains exactly like one uninterrupted process.

One process trains 4 steps uninterrupted (the reference), saving after step 2. Two processes then resume from it
at TP=2 (1 -> TP2), and train 2 steps at one layout, save and resume at another: TP2 ZeRO-1 -> SP2 ZeRO-1 and
PP2 ZeRO-1 -> DP2 ZeRO-2 (pipeline, ZeRO stage and partition count all change). Each resumed run's steps 3-4 have
the reference's losses and parameters (fp32 rounding). The helpers are those of ``test_train_equivalence``.
"""
import json
from pathlib import Path

import pytest
import torch

from ds4sci.spawn import run_workers
from test_train_equivalence import CLIP, ENV, _overrides

pytestmark = pytest.mark.distributed

STEPS = 4
# (name, saved by: (ZeRO stage, overrides) or None for the reference's checkpoint, resumed at: the same)
CASES = [
    ("1 -> tp2", None, (1, ["parallel.tp=2"])),
    ("tp2 -> sp2", (1, ["parallel.tp=2"]), (1, ["parallel.ulysses=2"])),
    ("pp2 -> dp2 zero2", (1, ["parallel.pp=2"]), (2, ["train.micro_batch_size=1"])),  # 2 samples per step still
]


def _trainer(out, stage, extra):
    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    cache = [f"data.cache_dir={Path(out).parent / 'token_cache'}"]  # one token cache for every run
    return Trainer(load_config(None, _overrides(out, stage, micro=2, steps=STEPS, extra=[*cache, *CLIP, *extra])))


def _state(trainer, rank):
    full = {k: v.numpy() for k, v in trainer.full_state_dict().items()}
    return full if rank == 0 else None


def _reference(rank, world, out):
    """One process, 4 steps, a checkpoint after step 2: losses, final state, checkpoint folder."""
    from ds4sci.train.checkpoint import save_checkpoint

    t = _trainer(out, 1, [])
    losses = [t.train_step().loss for _ in range(2)]
    path = save_checkpoint(t)
    losses += [t.train_step().loss for _ in range(2)]
    return losses, _state(t, rank), str(path)


def _resumes(rank, world, root, reference):
    """Per case: the losses of the saving run's first 2 steps (None: the reference saved), the resumed run's step
    after loading, its 2 losses and final state."""
    from ds4sci.train.checkpoint import load_checkpoint, save_checkpoint

    results = {}
    for i, (name, saver, resumer) in enumerate(CASES):
        first, path = None, reference
        if saver is not None:
            t = _trainer(f"{root}/case{i}_save", *saver)
            first = [t.train_step().loss for _ in range(2)]
            path = save_checkpoint(t)
        t = _trainer(f"{root}/case{i}_resume", *resumer)
        load_checkpoint(t, path)
        at = t.step
        results[name] = first, at, [t.train_step().loss for _ in range(2)], _state(t, rank)
    return results


@pytest.mark.slow
def test_resume_at_another_layout_trains_like_one_process(tmp_path):
    losses, want, reference = run_workers(_reference, 1, str(tmp_path / "reference"), env=ENV, timeout=300)[0]
    assert abs(losses[2] - losses[0]) > 1e-3  # the checkpoint holds trained parameters, not the initial ones
    assert json.loads((Path(reference) / "checkpoint.json").read_text())["portable"]["adam_step"] == 2
    results = run_workers(_resumes, 2, str(tmp_path), reference, env=ENV, timeout=300)[0]
    for name, (first, at, resumed, got) in results.items():
        if first is not None:
            torch.testing.assert_close(torch.tensor(first), torch.tensor(losses[:2]), rtol=1e-5, atol=1e-6, msg=name)
        assert at == 2, name
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[2:]), rtol=1e-5, atol=1e-6, msg=name)
        assert set(got) == set(want), name
        for key, value in want.items():
            torch.testing.assert_close(torch.from_numpy(got[key]), torch.from_numpy(value), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=key: f"{name}: {k}: {m}")
