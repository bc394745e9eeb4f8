"""Resume under ZeRO-2 and ZeRO-3 (partitioned optimizer state; ZeRO-3 partitioned parameters too), from sequence
parallelism 1 to 2: a run at SP=1 x DP=2 trains 2 steps, saves (public save_checkpoint) and trains a third; a run at
SP=2 x DP=1 with the same global batches loads that checkpoint (public load_checkpoint) and trains the third step:
the same loss and parameters (the learned position table is split anew over the sequence ranks)."""
from pathlib import Path

import pytest
import torch

from ds4sci.spawn import run_workers

from test_train_equivalence import CLIP
from test_train_equivalence import ENV
from test_train_equivalence import _overrides

pytestmark = pytest.mark.distributed

STAGES = (2, 3)


def _resume_at_sp2(rank, world, out):
    """Per ZeRO stage: the SP=1 run's 3 losses and final state, and the SP=2 run's step after loading, its loss and
    final state (one process group for both stages: the start-up of a process costs more than the runs)."""
    from ds4sci.train.checkpoint import load_checkpoint
    from ds4sci.train.checkpoint import save_checkpoint
    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    def trainer(stage, ulysses, micro):
        overrides = _overrides(Path(out) / f"zero{stage}_sp{ulysses}", stage, ulysses=ulysses, micro=micro, extra=CLIP)
        return Trainer(load_config(None, overrides))

    def state(t):
        full = {k: v.numpy() for k, v in t.full_state_dict().items()}
        return full if rank == 0 else None

    results = {}
    for stage in STAGES:
        sp1 = trainer(stage, ulysses=1, micro=1)
        losses = [sp1.train_step().loss for _ in range(2)]
        path = save_checkpoint(sp1)
        losses.append(sp1.train_step().loss)
        sp2 = trainer(stage, ulysses=2, micro=2)
        load_checkpoint(sp2, path)
        resumed_at = sp2.step
        results[stage] = losses, state(sp1), resumed_at, sp2.train_step().loss, state(sp2)
    return results


@pytest.mark.slow
def test_resume_from_sp1_to_sp2_under_zero_2_and_3(tmp_path):
    for stage, (losses, want, resumed_at, resumed, got) in run_workers(_resume_at_sp2, 2, str(tmp_path), env=ENV,
                                                                        timeout=300)[0].items():
        assert resumed_at == 2, stage
        assert resumed == pytest.approx(losses[2], rel=1e-5, abs=1e-6), stage
        assert abs(losses[2] - losses[0]) > 1e-3, stage  # the checkpoint holds trained parameters, not the initial ones
        assert set(got) == set(want), stage
        for key, value in want.items():
            torch.testing.assert_close(torch.from_numpy(got[key]), torch.from_numpy(value), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=key: f"ZeRO-{stage} SP=1 -> SP=2 resume: {k}: {m}")
