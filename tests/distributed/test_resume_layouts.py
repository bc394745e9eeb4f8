"""Resume at another layout: a run saved at one (tp, ulysses, dp, pp, ZeRO stage) continues at another through the
checkpoint's portable state (:mod:`ds4sci.train.checkpoint`) and trains exactly like one uninterrupted process.

One process trains 4 steps uninterrupted (the reference), saving after step 2. Two processes then resume from it
at TP=2 under ZeRO-3, and train 2 steps at one layout, save and resume at another: TP2 ZeRO-3 -> SP2 ZeRO-0,
PP2 ZeRO-0 -> DP2 ZeRO-2 and Ring2 zigzag ZeRO-1 with optimizer offload -> Ulysses2 ZeRO-3 (TP, pipeline, sequence
layout, ZeRO stage, offload and partition count all change). A Llama-shaped model (one key/value head shared by both
TP ranks, head tied to the embedding) has its own one-process reference and resumes at PP2 (the checkpoint's tied
matrix read into both end stages' copies), then saves there (once) and resumes at TP2 (the fused QKV's permuted
shards) and at PP2 again (DeepSpeed's own checkpoint files, the engine's path at an unchanged layout). Each resumed
run's steps 3-4 have its reference's losses and parameters (fp32 rounding). The helpers are those of
``test_train_equivalence``.
"""
import json
from pathlib import Path

import pytest
import torch

from ds4sci.spawn import run_workers

from test_train_equivalence import CLIP
from test_train_equivalence import ENV
from test_train_equivalence import _overrides

pytestmark = pytest.mark.distributed

STEPS = 4
# model overrides by name: the default GPT-NeoX shape; Llama's, with one key/value head and a tied head
MODELS = {"neox": [], "llama": ["model.preset=llama-debug", "model.overrides.num_kv_heads=1",
                                "model.overrides.tie_word_embeddings=true"]}
# (name, model, saved by: (ZeRO stage, overrides) or None for the reference's checkpoint, resumed at: the same)
CASES = [  # between them every ZeRO stage's way of reading and of setting the state (0: the client AdamW's own)
    ("1 zero1 -> tp2 zero3", "neox", None, (3, ["parallel.tp=2"])),
    ("tp2 zero3 -> sp2 zero0", "neox", (3, ["parallel.tp=2"]), (0, ["parallel.ulysses=2"])),
    ("pp2 zero0 -> dp2 zero2", "neox", (0, ["parallel.pp=2"]), (2, ["train.micro_batch_size=1"])),  # 2 samples per step
    # ring zigzag with optimizer offload (masters and moments read from the CPU optimizer), the learned table's
    # shards re-split from the zigzag rows to Ulysses' contiguous ones
    ("ring2 zigzag zero1 offload -> ulysses2 zero3", "neox",
     (1, ["parallel.ring=2", "parallel.layout=zigzag", "zero.offload_optimizer=cpu"]), (3, ["parallel.ulysses=2"])),
    ("llama 1 zero1 -> pp2 zero0 tied", "llama", None, (0, ["parallel.pp=2"])),
    ("llama pp2 zero1 tied -> tp2 zero1 kv head shared", "llama", (1, ["parallel.pp=2"]), (1, ["parallel.tp=2"])),
    # the same layout: DeepSpeed's own files (it saves one copy of the tied matrix and re-ties the two on load)
    ("llama pp2 zero1 tied -> pp2 zero1 tied", "llama", (1, ["parallel.pp=2"]), (1, ["parallel.pp=2"])),
]


def _trainer(out, stage, extra):
    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    cache = [f"data.cache_dir={Path(out).parent / 'token_cache'}"]  # one token cache for every run
    return Trainer(load_config(None, _overrides(out, stage, micro=2, steps=STEPS, extra=[*cache, *CLIP, *extra])))


def _state(trainer, rank):
    full = {k: v.numpy() for k, v in trainer.full_state_dict().items()}
    return full if rank == 0 else None


def _references(rank, world, root):
    """Per model: one process, 4 steps, a checkpoint after step 2: losses, final state, checkpoint folder."""
    from ds4sci.train.checkpoint import save_checkpoint

    out = {}
    for model, extra in MODELS.items():
        t = _trainer(f"{root}/reference_{model}", 1, extra)
        losses = [t.train_step().loss for _ in range(2)]
        path = save_checkpoint(t)
        losses += [t.train_step().loss for _ in range(2)]
        out[model] = losses, _state(t, rank), str(path)
    return out


def _resumes(rank, world, root, references):
    """Per case: the losses of the saving run's first 2 steps (None: the reference saved), the resumed run's step
    after loading, its 2 losses and final state."""
    from ds4sci.train.checkpoint import load_checkpoint
    from ds4sci.train.checkpoint import save_checkpoint

    results = {}
    for i, (name, model, saver, resumer) in enumerate(CASES):
        first, path = None, references[model]
        if saver is not None:
            stage, extra = saver
            t = _trainer(f"{root}/case{i}_save", stage, [*MODELS[model], *extra])
            first = [t.train_step().loss for _ in range(2)]
            path = save_checkpoint(t)
        stage, extra = resumer
        t = _trainer(f"{root}/case{i}_resume", stage, [*MODELS[model], *extra])
        load_checkpoint(t, path)
        at = t.step
        results[name] = first, at, [t.train_step().loss for _ in range(2)], _state(t, rank)
    return results


@pytest.mark.slow
def test_resume_at_another_layout_trains_like_one_process(tmp_path):
    references = run_workers(_references, 1, str(tmp_path), env=ENV, timeout=300)[0]
    for losses, _, reference in references.values():
        assert abs(losses[2] - losses[0]) > 1e-3  # the checkpoint holds trained parameters, not the initial ones
        assert json.loads((Path(reference) / "checkpoint.json").read_text())["portable"]["adam_step"] == 2
    results = run_workers(_resumes, 2, str(tmp_path), {m: r[2] for m, r in references.items()}, env=ENV,
                          timeout=400)[0]
    for (name, model, _, _), (first, at, resumed, got) in zip(CASES, results.values()):
        losses, want, _ = references[model]
        if first is not None:
            torch.testing.assert_close(torch.tensor(first), torch.tensor(losses[:2]), rtol=1e-5, atol=1e-6, msg=name)
        assert at == 2, name
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[2:]), rtol=1e-5, atol=1e-6, msg=name)
        assert set(got) == set(want), name
        for key, value in want.items():
            torch.testing.assert_close(torch.from_numpy(got[key]), torch.from_numpy(value), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=key: f"{name}: {k}: {m}")


def test_a_checkpoint_without_portable_state_resumes_only_at_its_own_layout(tmp_path):
    from ds4sci.train.checkpoint_check import check_checkpoint

    model = {"num_layers": 2}
    saved = {"model": model, "zero.stage": 1, "zero partitions": 1,
             "layout": {"tp": 2, "pp": 1, "dp": 1, "ulysses": 1, "ring": 1}}
    path = tmp_path / "step2"
    path.mkdir()
    (path / "checkpoint.json").write_text(json.dumps({"step": 2, **saved, "files": {}}))
    assert check_checkpoint(path, saved)["step"] == 2  # its own layout: DeepSpeed's engine checkpoint loads
    this_run = {**saved, "zero partitions": 2, "layout": {**saved["layout"], "tp": 1, "ulysses": 2}}
    with pytest.raises(ValueError, match=r"step2 was saved at tp 2 x pp 1 x dp 1 x ulysses 1 x ring 1, ZeRO-1, this "
                                         r"run is tp 1 x pp 1 x dp 1 x ulysses 2 x ring 1, ZeRO-1: parallel.tp: "
                                         r"checkpoint 2, this run 1; zero partitions: checkpoint 1, this run 2; it "
                                         r"holds no portable state"):
        check_checkpoint(path, this_run)
    (path / "checkpoint.json").write_text(json.dumps({"step": 2, **saved, "portable": {}, "files": {}}))
    assert check_checkpoint(path, this_run)["step"] == 2  # with one: accepted, load_checkpoint takes that path
