"""Exact resume: 4 steps straight vs 2 steps + checkpoint + resume for 2 (same losses, same parameters), and a
resume at another sequence-parallel degree (the full position table is saved and re-split on load)."""
from pathlib import Path

import pytest
import torch

from ds4sci.spawn import run_workers

from test_train_equivalence import ENV
from test_train_equivalence import _overrides

pytestmark = pytest.mark.distributed


def _resume_cases(rank, world, out):
    from ds4sci.train.checkpoint import load_checkpoint
    from ds4sci.train.checkpoint import save_checkpoint
    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    def run(name, ulysses, micro, steps, resume=None, save=False):
        trainer = Trainer(load_config(None, _overrides(Path(out) / name, 1, ulysses=ulysses, micro=micro, steps=4,
                                                       extra=["optim.grad_clip=0.05"])))
        if resume is not None:
            load_checkpoint(trainer, resume)
        losses = [trainer.train_step().loss for _ in range(steps)]
        path = save_checkpoint(trainer) if save else None
        state = {k: v.numpy() for k, v in trainer.full_state_dict().items()}
        return losses, state if rank == 0 else None, path, trainer.step

    straight = run("straight", ulysses=2, micro=2, steps=4)
    first = run("first", ulysses=2, micro=2, steps=2, save=True)
    same_sp = run("same_sp", ulysses=2, micro=2, steps=2, resume=first[2])
    # SP=2 x DP=1 -> SP=1 x DP=2 with half the micro-batch per rank: the same global batches
    other_sp = run("other_sp", ulysses=1, micro=1, steps=2, resume=first[2])
    return straight, first, same_sp, other_sp


@pytest.mark.slow
def test_resume_is_exact_and_works_at_another_sp_degree(tmp_path):
    straight, first, same_sp, other_sp = run_workers(_resume_cases, 2, str(tmp_path), env=ENV, timeout=300)[0]
    assert first[0] == straight[0][:2]
    assert same_sp[3] == 4 and other_sp[3] == 4  # the step counter came back from the checkpoint
    assert same_sp[0] == straight[0][2:]  # bitwise: same layout, same reductions
    for key, value in straight[1].items():
        torch.testing.assert_close(torch.from_numpy(same_sp[1][key]), torch.from_numpy(value), rtol=0, atol=0,
                                   msg=lambda m, k=key: f"same SP resume: {k}: {m}")
    torch.testing.assert_close(torch.tensor(other_sp[0]), torch.tensor(straight[0][2:]), rtol=1e-5, atol=1e-6)
    for key, value in straight[1].items():
        torch.testing.assert_close(torch.from_numpy(other_sp[1][key]), torch.from_numpy(value), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=key: f"SP=2 -> SP=1 resume: {k}: {m}")
    # the resumed steps did learn (a resume that restored nothing would start from the initial parameters)
    assert straight[0][3] < straight[0][0] - 1e-3
