"""Tiled loss in training (``activation_checkpointing.tiled_loss``) is exact: in one process, under Ulysses 2 and
under ring 2 (zigzag shards) with ZeRO-3 (the head's weight gathered for the tiled forward and again for its
recomputation), under TP 2 with a tied vocabulary-parallel head (each tile's cross entropy all-reduced over TP) and
under PP 2 with a tied head (the last stage's copy; :class:`~ds4sci.train.pipeline.PipelineLoss` calls it), training
equals training without it (losses and every parameter after three steps, fp32 ~1e-5); and the tiling demonstrably
ran: the per-tile cross entropy is called once per tile in forward and once more per tile in backward."""
import math

import pytest

from ds4sci.spawn import run_workers

from test_train_equivalence import ENV
from test_train_equivalence import _compare
from test_train_equivalence import _overrides
from test_train_equivalence import _unique_at_stage_0

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TILE = 5  # divides neither the 16 local tokens (Ulysses or ring 2 of 32) nor the 32 of a TP or pipeline rank
TILED = ["activation_checkpointing.tiled_loss=true", f"activation_checkpointing.loss_tile={TILE}"]
LLAMA_TIED = ["model.preset=llama-debug", "model.overrides.tie_word_embeddings=true"]


def _train_counting_tiles(rank, world, cases):
    """Each case's losses, rank 0's full state, and the most per-tile cross-entropy calls of any rank in step 1."""
    import torch
    import torch.distributed as dist

    import ds4sci.models.genslm.model as genslm_model
    import ds4sci.parallel.tensor_parallel as tensor_parallel
    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    calls = {"n": 0}
    for module, name in ((genslm_model, "token_loss"), (tensor_parallel, "vocab_parallel_token_loss")):
        def counted(*args, _fn=getattr(module, name), **kwargs):
            calls["n"] += 1
            return _fn(*args, **kwargs)
        setattr(module, name, counted)
    results = []
    for overrides in cases:
        trainer = Trainer(load_config(None, overrides))
        calls["n"] = 0
        losses = [trainer.train_step().loss]
        first = torch.tensor(calls["n"])
        dist.all_reduce(first, op=dist.ReduceOp.MAX)
        losses += [trainer.train_step().loss for _ in range(trainer.cfg.train.steps - 1)]
        state = {k: v.numpy() for k, v in trainer.full_state_dict(dst=0).items()}
        results.append((losses, state if rank == 0 else None, int(first)))
    return results


def test_tiled_loss_trains_like_untiled_in_one_process_and_under_zero3_ulysses_ring_tp_and_pp(tmp_path):
    cache = [f"data.cache_dir={tmp_path / 'token_cache'}"]  # one token cache for every run (built once)
    base = {"z3": _overrides(tmp_path / "b3", 3, extra=cache),
            "z1 tied": _overrides(tmp_path / "b1", 1, pe="rotary", extra=cache + LLAMA_TIED)}
    # (label, reference, workers' overrides, tokens each rank's head sees)
    single = ("one process, z1 tied, tiled", "z1 tied",
              _overrides(tmp_path / "s", 1, pe="rotary", extra=cache + LLAMA_TIED + TILED), 32)
    cases = [
        ("ulysses=2 zero=3 tiled", "z3", _overrides(tmp_path / "u", 3, ulysses=2, extra=cache + TILED), 16),
        ("ring=2 zero=3 tiled", "z3", _overrides(tmp_path / "r", 3, ring=2, extra=cache + TILED), 16),
        ("tp=2 zero=1 tied vocab-parallel head, tiled", "z1 tied",
         _overrides(tmp_path / "t", 1, pe="rotary", extra=cache + LLAMA_TIED + TILED + ["parallel.tp=2"]), 32),
        ("pp=2 zero=1 tied, tiled", "z1 tied",
         _overrides(tmp_path / "p", 1, pe="rotary", extra=cache + LLAMA_TIED + TILED + ["parallel.pp=2"]), 32),
    ]
    # the untiled references at ZeRO stage 0 (test_train_equivalence.py ties one process at every stage to a plain
    # PyTorch loop), the one-process tiled case at its own stage
    runs, index = _unique_at_stage_0(list(base.values()))
    one = run_workers(_train_counting_tiles, 1, [*runs, single[2]], env=ENV, timeout=400)[0]
    references = {name: one[i] for name, i in zip(base, index)}

    def check(case, result):
        (label, ref, _, tokens), (losses, state, calls) = case, result
        _compare((losses, state), references[ref][:2], label)
        assert calls == 2 * math.ceil(tokens / TILE), (label, calls)  # one micro-batch: forward + recomputation

    check(single, one[-1])
    for case, result in zip(cases, run_workers(_train_counting_tiles, 2, [c[2] for c in cases], env=ENV,
                                               timeout=400)[0]):
        check(case, result)
