"""Pipeline parallelism (``parallel.pp``: DeepSpeed's pipeline engine, 1F1B) trains exactly like one process:
per-step losses and every parameter after three steps (fp32, ~1e-5) for PP2 (end to end through
``Trainer.train()``: validation loss, pipeline checkpoint, consolidated export), PP2 x Ulysses2 with the
sequence-sharded learned position table, TP2 x PP2 with gradient accumulation (these two with activation
checkpointing, selective and full), PP2 x Ring2 (zigzag) with the learned table, PP2 x Ulysses2 with full checkpointing,
the tiled MLP and the checkpointed inputs in host memory, and PP2 x DP2 with ZeRO-Offload of
the optimizer (``zero.offload_optimizer=cpu``). Clipped cases check the global gradient norm across stages
(DeepSpeed's ZeRO-0 clipping alone counts only the first stage's); the unclipped cases with sequence or data ranks
check the loss scale (an active clip would hide a gradient off by a common factor). bf16 under PP2 x Ulysses2 (ZeRO 0
and 1) follows the fp32 single-process run: every parameter's update to 5% of its size.

The pipeline engine's gradient reduction, measured on the start-up check's probe pipeline, is the loss scale's
``pipeline_reduction_factor`` (ZeRO 0-1, accumulation, offload, bf16), and the check refuses a wrong factor.

Also, without processes: DeepSpeed's topology numbers ranks as ``ParallelDims`` does, parameter names map back to
GenSLM's, and a ZeRO stage the pipeline engine refuses is refused at config time.

The helpers (config overrides, the per-case worker, the comparison) are those of ``test_train_equivalence`` and
``test_train_tensor_parallel``.
"""
import itertools
import re
from unittest import mock

import numpy as np
import pytest
import torch

from ds4sci.spawn import run_workers

import test_train_tensor_parallel
from test_train_equivalence import CLIP
from test_train_equivalence import ENV
from test_train_equivalence import _overrides
from test_train_tensor_parallel import _cases
from test_train_tensor_parallel import _check
from test_train_tensor_parallel import one_process

runs = test_train_tensor_parallel.runs  # the module-scoped run folder fixture, shared

PP2 = ["parallel.pp=2"]

# Single-process references, by name: (ZeRO stage, position embedding, clipped); micro-batches of 2. They run at
# ZeRO stage 0 (test_train_tensor_parallel.one_process).
REFERENCES = {"z1 rotary clip": (1, "rotary", True), "z1 learned": (1, "learned", False),
              "z0 alibi clip": (0, "alibi", True)}
END_TO_END = "z1 rotary clip"


def _case(out_dir, name, ulysses=1, ring=1, micro=2, extra=()):
    zero, pe, clip = REFERENCES[name]
    cache = [f"data.cache_dir={out_dir.parent / 'token_cache'}"]  # one token cache for every run
    return _overrides(out_dir, zero, ulysses=ulysses, ring=ring, micro=micro, pe=pe,
                      extra=[*cache, *(CLIP if clip else []), *extra])


@pytest.fixture(scope="module")
def references(runs):
    return one_process(runs, REFERENCES, END_TO_END, _case)


def test_topology_numbers_ranks_like_parallel_dims():
    """The pipeline engine builds its groups from DeepSpeed's topology: rank by rank and group by group it must
    be ParallelDims' layout (pipe = pp, data = sequence x data, model = tp)."""
    from ds4sci.distributed import ParallelDims
    from ds4sci.train.pipeline import pipeline_topology

    for tp, ulysses, ring, dp, pp in itertools.product((1, 2), (1, 2), (1, 2), (1, 3), (2, 3)):
        dims = ParallelDims(dp=dp, ulysses=ulysses, ring=ring, tp=tp, pp=pp)
        topo = pipeline_topology(dims)
        for rank in range(dims.world_size):
            c, t = dims.coords(rank), topo.get_coord(rank)
            assert (t.pipe, t.data, t.model) == (c.pp, c.dp * dims.sp + dims.sp_rank(rank), c.tp), (dims, rank)
        groups = dims.group_ranks()
        for axis, kind in (("pipe", "pp"), ("data", "sdp"), ("model", "tp")):
            assert sorted(topo.get_axis_comm_lists(axis)) == groups[kind], (dims, axis)


def test_parameter_names_map_to_genslm():
    from ds4sci.train.pipeline import genslm_name

    assert genslm_name("0.embed_in.weight", 4) == "embed_in.weight"
    assert genslm_name("3.block.attention.dense.bias", 4) == "layers.2.attention.dense.bias"
    assert genslm_name("5.embed_out.weight", 4) == "embed_out.weight"
    assert genslm_name("tied_modules.embed.embed_in.weight", 4) == "embed_in.weight"  # a tied embedding and head
    assert genslm_name("tied_modules.embed.embed_out.weight", 4) == "embed_out.weight"
    for bad in ("6.embed_out.weight", "2.attention.dense.bias", "embed_in.weight"):
        with pytest.raises(ValueError, match="pipeline layer|block|outside"):
            genslm_name(bad, 4)


@pytest.mark.parametrize("stage", [2, 3])
def test_config_refuses_zero_2_and_3_with_pipeline(stage):
    from ds4sci.train.config import load_config

    with pytest.raises(ValueError, match=rf"zero.stage={stage}: DeepSpeed's pipeline engine \(parallel.pp=2\) "
                                         r"supports ZeRO stage 0 or 1 only"):
        load_config(None, [f"zero.stage={stage}", "parallel.pp=2", "model.overrides.num_layers=2"])


def _printed_while_building(rank, world, overrides):
    """What building a Trainer prints on this rank's stdout."""
    import contextlib
    import io

    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        Trainer(load_config(None, overrides))
    return printed.getvalue()


def _pp2_world(rank, world, quiet, cases):
    """The 2-rank runs (one process group): what building the Trainer of ``quiet`` prints, and ``_cases(cases)``."""
    return _printed_while_building(rank, world, quiet), _cases(rank, world, cases)


@pytest.fixture(scope="module")
def pp2(runs):
    """Every rank's print while building a PP2 Trainer, and rank 0's end-to-end PP2 run."""
    results = run_workers(_pp2_world, 2, _case(runs / "pp-quiet", END_TO_END, extra=PP2),
                          [(_case(runs / "pp", END_TO_END, extra=PP2), True)], env=ENV, timeout=400)
    return [printed for printed, _ in results], results[0][1]


@pytest.mark.distributed
@pytest.mark.slow
def test_pp2_end_to_end(pp2, references):
    _check(pp2[1][0], references[END_TO_END], "pp=2 zero=1 clipped, Trainer.train() export")


@pytest.mark.distributed
def test_pipeline_build_prints_nothing(pp2):
    """DeepSpeed's pipeline prints (its seeds, topology and stage layers, from the start-up check's probe pipeline
    and from the model's) stay out of a run's output: logged at DEBUG (``ds4sci.train.engine.printed_at_debug``)."""
    printed = pp2[0]
    assert printed == ["", ""], printed


def _layouts(runs):
    """(reference name, label, overrides) of the 4-rank layouts of ``test_pp2_with_ulysses_and_tensor_parallelism``."""
    return [
        ("z1 learned", "pp=2 x ulysses=2 zero=1 learned, selective checkpointing",
         _case(runs / "ppu", "z1 learned", ulysses=2, extra=[*PP2, "activation_checkpointing.mode=selective"])),
        ("z0 alibi clip", "tp=2 x pp=2 zero=0 grad_accum=2 clipped, full checkpointing",
         _case(runs / "tppp", "z0 alibi clip", micro=1,
               extra=[*PP2, "parallel.tp=2", "train.grad_accum=2", "activation_checkpointing.mode=full"])),
        # zigzag rows of the learned table on the first stage; unclipped: K = dp * sp must count the ring ranks
        ("z1 learned", "pp=2 x ring=2 zigzag zero=1 learned",
         _case(runs / "ppr", "z1 learned", ring=2, extra=PP2)),
        # the long-sequence switches on a pipeline: full checkpointing, tiled MLP, checkpointed inputs in host memory
        ("z0 alibi clip", "pp=2 x ulysses=2 zero=0 clipped, full checkpointing in host memory, tiled MLP",
         _case(runs / "ppt", "z0 alibi clip", ulysses=2,
               extra=[*PP2, "activation_checkpointing.mode=full", "activation_checkpointing.cpu=true",
                      "activation_checkpointing.tiled_mlp=true", "activation_checkpointing.mlp_tile=5"])),
        # ZeRO-Offload: fp32 master weights, AdamW state and its step on the CPU, partitioned over the data ranks
        ("z1 learned", "pp=2 x dp=2 zero=1 learned, optimizer offload",
         _case(runs / "ppo", "z1 learned", micro=1, extra=[*PP2, "parallel.dp=2", "zero.offload_optimizer=cpu"])),
    ]


# (reference name, label) of the bf16 cases of test_bf16_with_pp2_x_ulysses2_tracks_fp32_single_process
BF16_CASES = [("z0 alibi clip", "bf16 pp=2 x ulysses=2 zero=0 clipped"), ("z1 learned", "bf16 pp=2 x ulysses=2 zero=1")]


def _pp4_world(rank, world, cases, bf16):
    """The 4-rank runs (one process group): ``_pipeline_divisions``, ``_cases(cases)`` and
    ``_pipeline_master_updates(bf16)``."""
    return _pipeline_divisions(rank, world), _cases(rank, world, cases), _pipeline_master_updates(rank, world, bf16)


@pytest.fixture(scope="module")
def pp4(runs):
    """Every rank's results of :func:`_pp4_world` on the layouts of :func:`_layouts` and the ``BF16_CASES``."""
    bf16 = [_case(runs / f"bf{i}", name, ulysses=2, extra=[*PP2, "train.dtype=bf16"])
            for i, (name, _) in enumerate(BF16_CASES)]
    return run_workers(_pp4_world, 4, [(overrides, False) for _, _, overrides in _layouts(runs)], bf16, env=ENV,
                       timeout=600)


@pytest.mark.distributed
@pytest.mark.slow
def test_pp2_with_ulysses_and_tensor_parallelism(runs, pp4, references):
    for (name, label, _), result in zip(_layouts(runs), pp4[0][1]):
        _check(result, references[name], label)


# (settings, expected division): pipeline_reduction_factor (dp * sp) x grad_accum, on 4 ranks with pp=2
PROBES = [(["parallel.ulysses=2", "zero.stage=0"], 2.0),
          (["parallel.ring=2", "zero.stage=1", "train.grad_accum=2"], 4.0),
          (["parallel.dp=2", "zero.stage=1", "zero.offload_optimizer=cpu"], 2.0),
          (["parallel.ulysses=2", "zero.stage=0", "train.dtype=bf16"], 2.0)]


def _pipeline_divisions(rank, world):
    """``measure_pipeline_division`` per setting of ``PROBES``, and the error of ``build_pipeline_engine`` (its
    start-up check, before it reads the model) when ``pipeline_reduction_factor`` is wrong (1 under Ulysses 2)."""
    from ds4sci.distributed.groups import build_groups
    from ds4sci.train import pipeline
    from ds4sci.train.config import load_config
    from ds4sci.train.engine import init_distributed

    init_distributed()
    cpu, measured = torch.device("cpu"), []
    for settings, _ in PROBES:
        cfg = load_config(None, [*PP2, "model.overrides.num_layers=2", *settings])
        measured.append(float(pipeline.measure_pipeline_division(cfg, build_groups(cfg.parallel.dims(world)), cpu)))
    cfg = load_config(None, [*PP2, "model.overrides.num_layers=2", "parallel.ulysses=2", "zero.stage=1"])
    with (mock.patch.object(pipeline, "pipeline_reduction_factor", lambda dims: 1.0),
          pytest.raises(RuntimeError) as refused):
        pipeline.build_pipeline_engine(None, None, cfg, build_groups(cfg.parallel.dims(world)), cpu)
    return measured, str(refused.value)


@pytest.mark.distributed
@pytest.mark.slow
def test_pipeline_gradient_reduction_is_what_deepspeed_measures(pp4):
    """The pipeline engine's measured gradient division is ``pipeline_reduction_factor`` x ``grad_accum`` (on every
    rank of both stages), and the start-up check refuses a wrong factor on every rank, naming DeepSpeed's version and
    both numbers (tests/train/test_loss.py does the same for the non-pipeline engine)."""
    for (measured, error), _, _ in pp4:
        assert measured == [want for _, want in PROBES], measured
        assert error is not None and re.search(r"^DeepSpeed \d+\.\d+\.\d+ reduces gradients differently", error), error
        assert "(pipeline engine, parallel.pp=2, zero.stage=1, dp=1, sp=2, train.grad_accum=1)" in error, error
        assert "divides the summed gradient by 2 " in error, error
        assert "pipeline_reduction_factor x grad_accum = 1." in error, error


def _pipeline_master_updates(rank, world, cases):
    """Like :func:`test_train_equivalence._master_updates`, for the pipeline engine (``tp = 1``): the step losses and
    (rank 0) each parameter's update over the run under GenSLM's names, read from every stage's fp32 master weights
    (``safe_get_full_fp32_param``, collective over the stage's data group) and the position table, and the fp32
    initial values the single-process run starts from (``GenSLM.initial_value``: a function of the seed and name)."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    from ds4sci.train.config import load_config
    from ds4sci.train.init_from import initial_model
    from ds4sci.train.pipeline import genslm_name
    from ds4sci.train.trainer import Trainer

    def masters(trainer):
        layers, groups = trainer.model_config.num_layers, trainer.groups
        local = {genslm_name(n, layers): safe_get_full_fp32_param(p).detach().cpu().clone()
                 for n, p in trainer.engine.module.named_parameters()}
        if trainer.pos_table is not None:
            table = trainer.pos_table.gather().float()  # collective over the SP group
            if groups.coords.pp == 0:
                local["embed_pos.weight"] = table
        parts = [None] * world if rank == 0 else None
        dist.gather_object(local if groups.sdp_rank == 0 else {}, parts, dst=0)  # one sender per stage
        return {k: v for part in parts or () for k, v in part.items()}

    results = []
    for overrides in cases:
        trainer = Trainer(load_config(None, overrides))
        assert trainer.dims.tp == 1 and trainer.cfg.train.dtype == "bf16"
        before = masters(trainer)  # the bf16-rounded initial values: DeepSpeed draws its masters from the bf16 copies
        losses = [trainer.train_step().loss for _ in range(trainer.cfg.train.steps)]
        after = masters(trainer)
        if rank != 0:
            results.append((losses, None, None))
            continue
        model = initial_model(trainer.cfg, trainer.tokenizer, device="meta")  # after training: reseeds the RNG
        results.append((losses, {k: (v - before[k]).numpy() for k, v in after.items()},
                        {k: model.initial_value(k, v.shape).numpy() for k, v in after.items()}))
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_bf16_with_pp2_x_ulysses2_tracks_fp32_single_process(pp4, references):
    """bf16 (DeepSpeed's bf16 mode, fp32 master weights) under PP2 x Ulysses2 at ZeRO-0 (the pipeline engine's
    BF16_Optimizer; clipped) and ZeRO-1 (DeepSpeed's ZeRO-1 optimizer in bf16; unclipped: the loss scale): the losses
    follow the fp32 single-process run to a few percent and every parameter's update (fp32 master weights, position
    table included) is the fp32 run's (final minus initial parameters) to 5% of its size, as
    ``test_bf16_with_sp_tracks_bf16_and_fp32_single_process`` checks under SP alone (measured here: <= 0.8%; an
    update of the wrong scale is off by ~50% and more)."""
    for (name, label), (losses, updates, initial) in zip(BF16_CASES, pp4[0][2]):
        ref_losses, ref_state, _ = references[name]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=5e-2, atol=0,
                                   msg=f"{label} vs fp32 single process")
        assert set(updates) == set(ref_state), label
        for key, final in ref_state.items():
            ref = final - initial[key]
            size = np.linalg.norm(ref)
            assert size > 0, (label, key)  # every parameter moved
            error = np.linalg.norm(updates[key] - ref) / size
            assert error <= 0.05, f"{label}: {key}: update off by {error:.1%} of its size vs fp32 single process"
