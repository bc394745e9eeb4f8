"""Tiled MLP in training (``activation_checkpointing.tiled_mlp``) is exact: under Ulysses 2 with ZeRO-3 (each MLP a
ZeRO-3 leaf module), under TP 2 with ZeRO-2 (whose gradient hook refuses a parameter reduced twice in one step) and
clipping, under Ulysses 2 with ZeRO-3 and DeepSpeed's full checkpointing, under TP 2 with ZeRO-3 (the leaf MLP
holding row-parallel layers) and selective checkpointing, and under ring 2 (zigzag) with ZeRO-3, full checkpointing and
the checkpointed inputs in host memory (``activation_checkpointing.cpu``), training equals single-process training
without it (losses and parameters after three steps, fp32 ~1e-5); and the tiling demonstrably ran: each MLP's output
projection is called once per tile in forward and once more per tile in backward (twice more with full checkpointing,
whose recomputed block runs the tiled MLP again)."""
import math

import pytest

from ds4sci.spawn import run_workers

from test_train_equivalence import CLIP
from test_train_equivalence import ENV
from test_train_equivalence import _baseline
from test_train_equivalence import _compare
from test_train_equivalence import _overrides

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TILE = 5  # divides neither the 16 local tokens (Ulysses 2 of 32) nor the 32 the MLP sees under TP 2 (gathered)
TILED = ["activation_checkpointing.tiled_mlp=true", f"activation_checkpointing.mlp_tile={TILE}"]
FULL = ["activation_checkpointing.mode=full"]
SELECTIVE = ["activation_checkpointing.mode=selective"]
HOST = ["activation_checkpointing.cpu=true"]


def _train_counting_tiles(rank, world, cases):
    """Each case's losses and rank 0's full state, and the calls of every MLP's ``dense_4h_to_h`` in the first step."""
    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    results = []
    for overrides in cases:
        trainer = Trainer(load_config(None, overrides))
        calls = {"n": 0}
        for block in trainer.engine.module.layers:
            block.mlp.dense_4h_to_h.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
        losses = [trainer.train_step().loss]
        first = calls["n"]
        losses += [trainer.train_step().loss for _ in range(trainer.cfg.train.steps - 1)]
        state = {k: v.numpy() for k, v in trainer.full_state_dict(dst=0).items()}
        results.append((losses, state if rank == 0 else None, first))
    return results


def test_tiled_mlp_trains_like_one_process_under_zero3_ulysses_tp_ring_and_checkpointing(tmp_path):
    layers = 2  # the debug preset
    # (label, ZeRO stage, parallel degrees, extra overrides, tokens each MLP sees, MLP runs per step)
    cases = [
        ("ulysses=2 zero=3 tiled", 3, {"ulysses": 2}, TILED, 16, 2),
        ("tp=2 zero=2 tiled, clipped", 2, {}, TILED + ["parallel.tp=2"] + CLIP, 32, 2),
        ("ulysses=2 zero=3 full checkpointing, tiled", 3, {"ulysses": 2}, TILED + FULL, 16, 3),
        ("tp=2 zero=3 selective checkpointing, tiled", 3, {}, TILED + ["parallel.tp=2"] + SELECTIVE, 32, 2),
        ("ring=2 zero=3 full checkpointing in host memory, tiled", 3, {"ring": 2}, TILED + FULL + HOST, 16, 3),
    ]
    cache = [f"data.cache_dir={tmp_path / 'token_cache'}"]  # one token cache for every run (built once)
    overrides = [_overrides(tmp_path / f"c{i}", z, **deg, extra=cache + x)
                 for i, (_, z, deg, x, _, _) in enumerate(cases)]
    got = run_workers(_train_counting_tiles, 2, overrides, env=ENV, timeout=400)[0]
    want = _baseline([_overrides(tmp_path / "b2", 2, extra=cache + CLIP), _overrides(tmp_path / "b3", 3, extra=cache)])
    references = {2: want[0], 3: want[1]}
    for (label, z, _, _, tokens, runs), (losses, state, calls) in zip(cases, got):
        _compare((losses, state), references[z], label)
        assert calls == runs * layers * math.ceil(tokens / TILE), (label, calls)
