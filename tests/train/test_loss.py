"""SP-aware loss: global-mean normalisation per ZeRO stage against DeepSpeed's measured gradient reduction, the
start-up check of that reduction, targets shifted before sharding."""
import re
from unittest import mock

import pytest
import torch

from ds4sci.models.genslm import IGNORE_INDEX
from ds4sci.models.genslm import lm_loss
from ds4sci.models.genslm import shift_labels
from ds4sci.models.genslm import token_loss
from ds4sci.sequence import shard_sequence
from ds4sci.spawn import run_workers
from ds4sci.train.loss import global_target_count
from ds4sci.train.loss import grad_reduction_factor
from ds4sci.train.loss import scaled_shard_loss

STAGES = (0, 1, 2, 3)
DEGREES = ((1, 2), (2, 1))  # (dp, sp) of a world of 2: sum-vs-mean over the sequence ranks and over the data ranks


def _measure_deepspeed(rank, world):
    """DeepSpeed's own gradient reduction on this group of 2, per ZeRO stage, as SP=2 and as DP=2 (and with 2
    accumulation steps at stage 2): ``{(stage, dp, sp, grad_accum): division}``, and the start-up check's error when
    the loss scale is wrong (ZeRO-3 under SP=2 scaled by the factor of stages 0-2, ``dp = 1``)."""
    import functools

    from ds4sci.distributed.groups import build_groups
    from ds4sci.train import sanity
    from ds4sci.train.config import load_config
    from ds4sci.train.engine import _initialize
    from ds4sci.train.engine import init_distributed

    init_distributed()
    from deepspeed.comm import comm

    built_shm_op = comm.cdb.shm_comm_op is not None
    cpu, measured = torch.device("cpu"), {}
    for dp, sp in DEGREES:
        for stage in STAGES:
            for accum in (1, 2) if stage == 2 else (1,):
                cfg = load_config(None, [f"parallel.ulysses={sp}", f"zero.stage={stage}", f"train.grad_accum={accum}"])
                groups = build_groups(cfg.parallel.dims(world))
                initialize = functools.partial(_initialize, cfg=cfg, groups=groups, device=cpu)
                measured[stage, dp, sp, accum] = float(sanity.measure_division(initialize, groups, accum, cpu))
    cfg = load_config(None, ["parallel.ulysses=2", "zero.stage=3"])
    groups = build_groups(cfg.parallel.dims(world))
    initialize = functools.partial(_initialize, cfg=cfg, groups=groups, device=cpu)
    with (mock.patch.object(sanity, "grad_reduction_factor", lambda *args, **kwargs: 1.0),
          pytest.raises(RuntimeError) as refused):
        sanity.check_gradient_reduction(initialize, cfg, groups, cpu)
    return measured, str(refused.value), built_shm_op


@pytest.fixture(scope="module")
def deepspeed_division():
    """``{(stage, dp, sp, grad_accum): what DeepSpeed divides the group's summed gradient by}``, measured; the
    start-up check's errors; whether each rank's DeepSpeed built its shared-memory op."""
    (measured, error, shm), (measured_1, error_1, shm_1) = run_workers(
        _measure_deepspeed, 2, env={"DS_ACCELERATOR": "cpu"}, timeout=300)
    assert measured == measured_1  # every rank saw the same reduced gradient
    return measured, (error, error_1), (shm, shm_1)


@pytest.mark.slow
@pytest.mark.distributed
def test_grad_reduction_factor_is_what_deepspeed_measures(deepspeed_division):
    """The factor the loss is scaled by equals the division DeepSpeed applies (and engine.backward's division by the
    accumulation steps), measured on a 2-process group: not a restatement of the constants."""
    measured, errors, _ = deepspeed_division
    for (stage, dp, sp, accum), division in measured.items():
        assert division == pytest.approx(grad_reduction_factor(stage, dp, sp) * accum, rel=1e-6), (stage, dp, sp, accum)
    # the start-up check refuses a wrong factor on every rank, naming DeepSpeed's version and both numbers
    for error in errors:
        assert error is not None and re.search(r"^DeepSpeed \d+\.\d+\.\d+ reduces gradients differently", error), error
        assert "zero.stage=3, dp=1, sp=2" in error and "divides the summed gradient by 2 " in error, error
        assert "grad_reduction_factor x grad_accum = 1." in error, error


@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_starts_on_the_cpu_without_compiling_its_shared_memory_op(deepspeed_division):
    """engine.init_distributed keeps DeepSpeed from JIT-compiling its CPU shared-memory all-reduce (a minute of C++
    per virtual environment that ds4sci never calls)."""
    assert deepspeed_division[2] == (False, False)


def test_grad_reduction_factor_refuses_bad_arguments():
    with pytest.raises(ValueError, match="ZeRO stage must be 0, 1, 2 or 3, got 4"):
        grad_reduction_factor(4, 1, 1)
    with pytest.raises(ValueError, match="sp=0"):
        grad_reduction_factor(1, 1, 0)


@pytest.mark.parametrize("layout, world", [("contiguous", 2), ("contiguous", 4), ("zigzag", 2)])
def test_shift_before_sharding_keeps_every_target(layout, world):
    torch.manual_seed(0)
    B, T, V = 3, 16, 7  # batch, window, vocabulary
    logits = torch.randn(B, T, V, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T))
    labels[1, 11:] = IGNORE_INDEX  # padding at the end of a short record
    full = lm_loss(logits, labels, "sum")
    targets = shift_labels(labels)  # [B, T]: targets[:, t] = labels[:, t + 1]
    shards = [(shard_sequence(logits, 1, r, world, layout), shard_sequence(targets, 1, r, world, layout))
              for r in range(world)]
    torch.testing.assert_close(sum(token_loss(lg, tg, "sum") for lg, tg in shards), full)
    assert sum(int((tg != IGNORE_INDEX).sum()) for _, tg in shards) == int((labels[:, 1:] != IGNORE_INDEX).sum())
    # Shifting inside each shard instead loses the target of every shard's last token (it lives on the next shard):
    naive = sum(lm_loss(lg, shard_sequence(labels, 1, r, world, layout), "sum") for r, (lg, _) in enumerate(shards))
    assert not torch.allclose(naive, full)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("dp, sp", DEGREES)
def test_scaled_shard_loss_under_deepspeeds_reduction_gives_the_global_mean_gradient(deepspeed_division, stage, dp, sp):
    """Ranks of a dp x sp grid each hold a sequence shard of their data rank's samples and back-propagate
    scaled_shard_loss; the group's summed gradient divided by what DeepSpeed MEASURABLY divides it by (not a model
    of DeepSpeed) must be the gradient of the global mean loss."""
    torch.manual_seed(1)
    B, T, H, V = 2, 8, 4, 5  # per-rank batch, window, hidden, vocabulary
    w = torch.randn(H, V, dtype=torch.float64, requires_grad=True)
    x = torch.randn(dp, B, T, H, dtype=torch.float64)
    targets = torch.randint(0, V, (dp, B, T))
    targets[0, 0, 5:] = IGNORE_INDEX  # ranks hold different numbers of real targets
    (ref,) = torch.autograd.grad(token_loss(x.reshape(dp * B, T, H) @ w, targets.reshape(dp * B, T)), w)

    count = global_target_count([targets])  # what the group's all-reduce of the per-rank counts gives
    factor = grad_reduction_factor(stage, dp, sp)
    grads = torch.zeros(dp, sp, H, V, dtype=torch.float64)
    for d in range(dp):
        for s in range(sp):
            logits = shard_sequence(x[d], 1, s, sp) @ w
            local_sum = token_loss(logits, shard_sequence(targets[d], 1, s, sp), "sum")
            (grads[d, s],) = torch.autograd.grad(scaled_shard_loss(local_sum, count, factor), w)
    measured = deepspeed_division[0]
    torch.testing.assert_close(grads.sum(dim=(0, 1)) / measured[stage, dp, sp, 1], ref)


def test_global_target_count_and_empty_batches():
    targets = [torch.tensor([[1, 2, IGNORE_INDEX]]), torch.tensor([[IGNORE_INDEX, 0, 4]])]
    count = global_target_count(targets)  # one process: no reduction
    assert count.dtype == torch.float64 and float(count) == 4
    with pytest.raises(ValueError, match="no real target"):
        scaled_shard_loss(torch.tensor(0.0), torch.tensor(0.0, dtype=torch.float64), 1.0)
