"""Training with tensor parallelism (Megatron-LM with sequence-parallel regions, ``parallel.tp``) equals
single-process training: per-step losses and every parameter after three steps (fp32, ~1e-5) for TP2 under ZeRO
0-3 (ZeRO-Offload of the optimizer at stage 2, of optimizer and parameters at stage 3), TP2 x Ulysses2 and TP2 x
Ring2 (zigzag), with activation checkpointing (full, selective, on the CPU), and the
consolidated export (and validation loss) of an end-to-end ``Trainer.train()`` under TP2 x Ulysses2 equals the
single-process run's. A Llama-shaped model (grouped-query attention, SwiGLU, RMSNorm, no biases; head tied and
untied) trains like one process under Ulysses 2, ring 2, TP 2 and PP 2 (``test_llama_shape_under_every_layout``, issue
26's done-when; the tied head under PP 2 through DeepSpeed's tied layers).

Gradient clipping is active in some cases (the global norm must count the TP-split parameters once per TP rank and
the replicated ones once) and off in others: an active clip rescales every gradient to the threshold, which would
hide a gradient off by one common factor (a wrong loss scale); unclipped cases catch that.

The helpers (config overrides, the per-case worker, the comparison) are those of ``test_train_equivalence``.
"""
import pytest

from ds4sci.spawn import run_workers

from test_train_equivalence import CLIP
from test_train_equivalence import ENV
from test_train_equivalence import _at_stage_0
from test_train_equivalence import _compare
from test_train_equivalence import _overrides
from test_train_equivalence import _train_cases

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TP2 = ["parallel.tp=2"]
FULL, SELECTIVE, CPU = (["activation_checkpointing.mode=full"], ["activation_checkpointing.mode=selective"],
                        ["activation_checkpointing.cpu=true"])
OFFLOAD_OPTIMIZER, OFFLOAD_PARAM = ["zero.offload_optimizer=cpu"], ["zero.offload_param=cpu"]

# Llama's shape (the llama-debug preset: 4 query and 2 key/value heads, SwiGLU, RMSNorm, no biases, sequential
# residual), its head tied to the embedding; LLAMA_KV1_UNTIED: one key/value head (shared by both TP ranks), untied
LLAMA = ["model.preset=llama-debug", "model.overrides.tie_word_embeddings=true"]
LLAMA_KV1_UNTIED = ["model.preset=llama-debug", "model.overrides.num_kv_heads=1"]

# Single-process references, by name: (ZeRO stage, position embedding, clipped, tokenizer, model overrides). A
# parallel case is compared with the reference of its name (activation checkpointing and layouts do not change the
# reference), which runs at ZeRO stage 0 (one process trains alike at every stage: test_train_equivalence's
# _at_stage_0).
REFERENCES = {
    "z0 rotary clip": (0, "rotary", True, "nucleotide", []),
    "z1 learned": (1, "learned", False, "nucleotide", []),
    "z2 rotary clip": (2, "rotary", True, "nucleotide", []),
    "z3 alibi clip": (3, "alibi", True, "nucleotide", []),
    "z3 learned": (3, "learned", False, "nucleotide", []),
    # the end-to-end case: 69 codon ids, padded to 70 over TP2, so the export must cut the padding row off
    "z1 rotary clip codon": (1, "rotary", True, "codon", []),
}
END_TO_END = "z1 rotary clip codon"
# those of test_llama_shape_under_every_layout
LLAMA_REFERENCES = {
    "llama z1 clip": (1, "rotary", True, "nucleotide", LLAMA),
    "llama kv1 untied z1": (1, "rotary", False, "nucleotide", LLAMA_KV1_UNTIED),
    "llama kv1 untied z3 clip": (3, "rotary", True, "nucleotide", LLAMA_KV1_UNTIED),
}


def _case(out_dir, name, ulysses=1, ring=1, extra=()):
    """The overrides of a case of reference ``name``; every case reads one token cache (built once: ~8 s each)."""
    zero, pe, clip, tokenizer, model = {**REFERENCES, **LLAMA_REFERENCES}[name]
    data = [f"data.cache_dir={out_dir.parent / 'token_cache'}", f"data.tokenizer={tokenizer}"]
    return _overrides(out_dir, zero, ulysses=ulysses, ring=ring, pe=pe,
                      extra=[*data, *model, *(CLIP if clip else []), *extra])


def _cases(rank, world, cases):
    """``(overrides, end_to_end)`` cases: three ``train_step`` calls and ``full_state_dict`` (the equivalence
    tests' worker), or ``Trainer.train()`` end to end (evaluation, checkpoint, export), whose rank 0 returns the
    logged losses and the exported ``model.safetensors``, plus the final validation loss. The end-to-end run also
    checks that only the first forward all-gathered the shard shapes (``DistributedAttention.check_shapes``)."""
    from safetensors.torch import load_file

    from ds4sci.sequence import DistributedAttention
    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    results = []
    for overrides, end_to_end in cases:
        if not end_to_end:
            results.append((*_train_cases(rank, world, [overrides])[0], None))
            continue
        cfg = load_config(None, overrides)
        trainer = Trainer(cfg)
        records = trainer.train()
        attentions = [m for m in trainer.engine.module.modules() if isinstance(m, DistributedAttention)]
        assert len(attentions) == (trainer.model_config.num_layers if trainer.dims.sp > 1 else 0)
        assert not any(m.check_shapes for m in attentions), "shape checks left on after the first forward"
        state = load_file(f"{cfg.train.out_dir}/export/model.safetensors") if rank == 0 else {}
        results.append(([r["loss"] for r in records if "loss" in r], {k: v.numpy() for k, v in state.items()},
                        [r["val_loss"] for r in records if "val_loss" in r]))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One folder for every run of this module (their token cache included)."""
    return tmp_path_factory.mktemp("runs")


def one_process(runs, names, end_to_end, case=_case):
    """The single-process runs of reference ``names`` (overrides ``case(out_dir, name)``; ``_cases``' results, by
    name; ``Trainer.train()`` end to end for ``end_to_end``) from one process, at ZeRO stage 0: references equal at
    that stage run once."""
    keys, cases = {}, {}
    for name in names:
        overrides = [o for o in _at_stage_0(case(runs / "ref", name)) if not o.startswith("train.out_dir=")]
        keys[name] = key = tuple(overrides), name == end_to_end
        cases.setdefault(key, ([*overrides, f"train.out_dir={runs / f'ref{len(cases)}'}"], key[1]))
    results = dict(zip(cases, run_workers(_cases, 1, list(cases.values()), env=ENV, timeout=400)[0]))
    return {name: results[key] for name, key in keys.items()}


@pytest.fixture(scope="module")
def references(runs):
    return one_process(runs, [*REFERENCES, *LLAMA_REFERENCES], END_TO_END)


def _check(got, want, label):
    (losses, state, val), (ref_losses, ref_state, ref_val) = got, want
    _compare((losses, state), (ref_losses, ref_state), label)
    if ref_val is not None:
        assert val == pytest.approx(ref_val, rel=1e-5), (label, val, ref_val)


# (reference name, label, extra overrides) of test_tp2_every_zero_stage_and_activation_checkpointing
TP2_CASES = [
    ("z0 rotary clip", "tp=2 zero=0 clipped", []),
    ("z1 learned", "tp=2 zero=1, full checkpointing", FULL),
    ("z2 rotary clip", "tp=2 zero=2 clipped, optimizer offload, selective checkpointing on the CPU",
     OFFLOAD_OPTIMIZER + SELECTIVE + CPU),
    # ZeRO-3 offload computes the gradient norm in its own function (complete_grad_norm_calculation_for_cpu_offload)
    ("z3 alibi clip", "tp=2 zero=3 clipped, optimizer and parameter offload, full checkpointing on the CPU",
     OFFLOAD_OPTIMIZER + OFFLOAD_PARAM + FULL + CPU),
]


def test_tp2_with_ulysses_and_ring_and_the_export(runs, references):
    cases = [
        ("z3 learned", "tp=2 x ulysses=2 zero=3", dict(ulysses=2), False),
        ("z1 learned", "tp=2 x ring=2 zigzag zero=1", dict(ring=2), False),  # zigzag rows of the table
        (END_TO_END, "tp=2 x ulysses=2 zero=1 clipped, Trainer.train() export", dict(ulysses=2), True),
    ]
    got = run_workers(_cases, 4, [(_case(runs / f"sp{i}", name, **deg, extra=TP2), e2e)
                                  for i, (name, _, deg, e2e) in enumerate(cases)], env=ENV, timeout=400)[0]
    for (name, label, _, _), result in zip(cases, got):
        _check(result, references[name], label)


# (reference name, label, parallel degrees, extra overrides) of test_llama_shape_under_every_layout
LLAMA_CASES = [
    ("llama z1 clip", "llama tied ulysses=2 zero=1 clipped", dict(ulysses=2), []),
    ("llama z1 clip", "llama tied ring=2 zigzag zero=1 clipped", dict(ring=2), []),
    # ZeRO-2 against the one-process run (at stage 0, as every reference: the same fp32 masters and steps)
    ("llama z1 clip", "llama tied ulysses=2 zero=2 clipped", dict(ulysses=2), ["zero.stage=2"]),
    ("llama z1 clip", "llama tied tp=2 zero=1 clipped, full checkpointing on the CPU", {}, TP2 + FULL + CPU),
    ("llama z1 clip", "llama tied pp=2 zero=1 clipped", {}, ["parallel.pp=2"]),
    # ZeRO-0's clipping norm (its own function) must count the tied matrix once, not once per end stage
    ("llama z1 clip", "llama tied pp=2 zero=0 clipped", {}, ["parallel.pp=2", "zero.stage=0"]),
    ("llama kv1 untied z1", "llama kv1 untied pp=2 zero=1", {}, ["parallel.pp=2"]),
    ("llama kv1 untied z1", "llama kv1 untied tp=2 zero=1 (the key/value head shared by both TP ranks)", {},
     TP2),
    ("llama kv1 untied z3 clip", "llama kv1 untied tp=2 zero=3 clipped, optimizer and parameter offload, "
     "selective checkpointing", {}, TP2 + OFFLOAD_OPTIMIZER + OFFLOAD_PARAM + SELECTIVE),
    ("llama kv1 untied z3 clip", "llama kv1 untied ulysses=2 zero=3 clipped", dict(ulysses=2), []),
]


@pytest.fixture(scope="module")
def world_2(runs):
    """Rank 0's results of the 2-rank runs (one process group): ``TP2_CASES``, then ``LLAMA_CASES``."""
    cases = [(_case(runs / f"tp{i}", name, extra=TP2 + x), False) for i, (name, _, x) in enumerate(TP2_CASES)]
    cases += [(_case(runs / f"llama{i}", name, **deg, extra=x), False)
              for i, (name, _, deg, x) in enumerate(LLAMA_CASES)]
    got = run_workers(_cases, 2, cases, env=ENV, timeout=600)[0]
    return got[:len(TP2_CASES)], got[len(TP2_CASES):]


def test_tp2_every_zero_stage_and_activation_checkpointing(world_2, references):
    for (name, label, _), result in zip(TP2_CASES, world_2[0]):
        _check(result, references[name], label)


def test_llama_shape_under_every_layout(world_2, references):
    """Issue 26's done-when: a Llama-shaped run (grouped-query attention with fewer key/value heads than query heads,
    SwiGLU, RMSNorm, no biases; head tied and untied) gives the one-process losses and final parameters under
    Ulysses 2, ring 2 (zigzag), TP 2 and PP 2 (DeepSpeed's tied layers for the tied head), across ZeRO 1-3,
    offload and activation checkpointing."""
    for (name, label, _, _), result in zip(LLAMA_CASES, world_2[1]):
        _check(result, references[name], label)
