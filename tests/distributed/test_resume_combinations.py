"""Resume under ZeRO-2 and ZeRO-3 (partitioned optimizer state; ZeRO-3 partitioned parameters too), from sequence
parallelism 1 to 2: a run at SP=1 x DP=2 trains 2 steps, saves (public save_checkpoint) and trains a third; a run at
SP=2 x DP=1 with the same global batches loads that checkpoint (public load_checkpoint) and trains the third step:
the same loss and parameters (the learned position table is split anew over the sequence ranks)."""
from pathlib import Path

import pytest
import torch

from ds4sci.spawn import run_workers
from test_train_equivalence import CLIP, ENV, _overrides

pytestmark = pytest.mark.distributed


def _resume_at_sp2(rank, world, out, stage):
    from ds4sci.train.checkpoint import load_checkpoint, save_checkpoint
    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    def trainer(name, ulysses, micro):
        return Trainer(load_config(None, _overrides(Path(out) / name, stage, ulysses=ulysses, micro=micro, extra=CLIP)))

    def state(t):
        full = {k: v.numpy() for k, v in t.full_state_dict().items()}
        return full if rank == 0 else None

    sp1 = trainer("sp1", ulysses=1, micro=1)
    losses = [sp1.train_step().loss for _ in range(2)]
    path = save_checkpoint(sp1)
    losses.append(sp1.train_step().loss)
    sp2 = trainer("sp2", ulysses=2, micro=2)
    load_checkpoint(sp2, path)
    resumed_at = sp2.step
    resumed = sp2.train_step().loss
    return losses, state(sp1), resumed_at, resumed, state(sp2)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_resume_from_sp1_to_sp2(tmp_path, stage):
    losses, want, resumed_at, resumed, got = run_workers(_resume_at_sp2, 2, str(tmp_path), stage, env=ENV,
                                                         timeout=300)[0]
    assert resumed_at == 2
    assert resumed == pytest.approx(losses[2], rel=1e-5, abs=1e-6)
    assert abs(losses[2] - losses[0]) > 1e-3  # the checkpoint holds trained parameters, not the initial ones
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(torch.from_numpy(got[key]), torch.from_numpy(value), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=key: f"ZeRO-{stage} SP=1 -> SP=2 resume: {k}: {m}")
