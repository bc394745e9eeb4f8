"""THE equivalence test: training with sequence parallelism (Ulysses, ring, hybrid; with and without data
parallelism) under every ZeRO stage gives the same per-step losses and final parameters as single-process
training on the same global batches, the sequence-partitioned position table included. The single-process reference
runs at ZeRO stage 0 (the first test ties one process at every stage to a plain PyTorch loop), and the runs of one
world size share one process group (module-scoped fixtures)."""
from pathlib import Path

import numpy as np
import pytest
import torch

from ds4sci.spawn import run_workers

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
GENOME = str(ROOT / "examples" / "data" / "NC_007779.1_ecoli_K12_W3110.fasta.gz")
ENV = {"DS_ACCELERATOR": "cpu"}


def _overrides(out_dir, zero, ulysses=1, ring=1, micro=2, pe="learned", steps=3, extra=()):
    return [
        f"data.fasta={GENOME}", "data.seq_len=32", "data.max_train_tokens=3000", "data.val_fraction=0.001",
        f"model.overrides.position_embedding={pe}", f"parallel.ulysses={ulysses}", f"parallel.ring={ring}",
        f"zero.stage={zero}", f"train.micro_batch_size={micro}", f"train.steps={steps}",
        "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.progress=false",
        f"train.out_dir={out_dir}", "optim.warmup_steps=1", "optim.lr=0.05", "optim.grad_clip=0",
        # A large eps makes AdamW's step ~ lr * g / eps, linear in the gradient: a gradient off by a factor P (the
        # classic SP x ZeRO normalisation bug) changes the result, where plain Adam would normalise it away.
        "optim.eps=1.0",
        *extra,
    ]


def _train_cases(rank, world, cases):
    """Run each case (list of --set overrides) in this process group; return losses and rank 0's full state."""
    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    results = []
    for overrides in cases:
        trainer = Trainer(load_config(None, overrides))
        if trainer.dims.pp > 1:  # the model was built on the meta device: a stage draws only its own layers
            pipe = trainer.engine.module
            local = {id(p) for p in pipe.parameters()}
            others = [p for layer in pipe._layer_specs if isinstance(layer, torch.nn.Module)
                      for p in layer.parameters() if id(p) not in local]
            assert others and all(p.is_meta for p in others) and not any(p.is_meta for p in pipe.parameters())
        losses = [trainer.train_step().loss for _ in range(trainer.cfg.train.steps)]
        state = {k: v.numpy() for k, v in trainer.full_state_dict(dst=0).items()}  # plain arrays cross processes
        assert rank == 0 or state == {}, "full_state_dict(dst=0) kept tensors off rank 0"
        results.append((losses, state if rank == 0 else None))
    return results


def _at_stage_0(overrides):
    """A single-process fp32 run's overrides at ZeRO stage 0: one process trains alike at every stage
    (:func:`test_single_process_trainer_equals_a_plain_pytorch_loop` checks stages 0-3), and stage 0 builds fastest
    (a ZeRO-3 engine costs seconds). bf16 runs keep their stage (their optimizers differ by stage)."""
    if "train.dtype=bf16" in overrides:
        return list(overrides)
    return [o for o in overrides if not o.startswith("zero.stage=")] + ["zero.stage=0"]


def _unique_at_stage_0(cases):
    """``cases`` at ZeRO stage 0 (:func:`_at_stage_0`), those that differ only in ``train.out_dir`` once: the
    distinct runs, and for each case the index of its run."""
    runs, index = {}, []
    for overrides in map(_at_stage_0, cases):
        key = tuple(o for o in overrides if not o.startswith("train.out_dir="))
        index.append(runs.setdefault(key, (len(runs), overrides))[0])
    return [overrides for _, overrides in runs.values()], index


def _baseline(cases):
    """The single-process references of ``cases`` (``_train_cases``'s results, by case) from one process, each run at
    ZeRO stage 0 and cases that differ only in ``train.out_dir`` run once (:func:`_unique_at_stage_0`)."""
    runs, index = _unique_at_stage_0(cases)
    results = run_workers(_train_cases, 1, runs, env=ENV, timeout=300)[0]
    return [results[i] for i in index]


def _compare(got, want, label):
    (losses, state), (ref_losses, ref_state) = got, want
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6, msg=label)
    assert set(state) == set(ref_state), label
    for key in ref_state:
        torch.testing.assert_close(torch.from_numpy(state[key]), torch.from_numpy(ref_state[key]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=key: f"{label}: {k}: {m}")
    # fp32, ~1e-5 relative: rounding differs between layouts; a wrong gradient scale moves parameters by ~lr = 5e-2.
    # The run moved away from initialisation, so equality is not trivial:
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-3, label


def _plain_torch_losses(rank, world, overrides):
    """The reference without DeepSpeed: the GenSLM with its own (unpopped) position table, torch AdamW + the same
    schedule, the mean loss over the real targets of each global batch drawn in the trainer's documented order."""
    import numpy as np

    from ds4sci.data import collate
    from ds4sci.models.genslm import GenSLM
    from ds4sci.models.genslm import lm_loss
    from ds4sci.train.config import load_config
    from ds4sci.train.engine import make_optimizer
    from ds4sci.train.launch import load_data

    cfg = load_config(None, overrides)
    tokenizer, train_ds, *_ = load_data(cfg)
    torch.manual_seed(cfg.train.seed)
    model = GenSLM(cfg.genslm_config(tokenizer.vocab_size, tokenizer.pad_id))
    optimizer, scheduler = make_optimizer(model.parameters(), cfg)
    micro, losses = cfg.train.micro_batch_size, []
    order = np.random.default_rng((cfg.train.seed, 0)).permutation(len(train_ds))  # epoch 0
    for step in range(cfg.train.steps):
        batch = collate([train_ds[int(i)] for i in order[step * micro : (step + 1) * micro]])
        loss = lm_loss(model(batch["input_ids"], batch["position_ids"]), batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_single_process_trainer_equals_a_plain_pytorch_loop(one_process):
    """Anchors the baseline of the tests below: the DeepSpeed engine with the position table kept outside it
    trains exactly like plain PyTorch with the table inside the model, at every ZeRO stage (no clipping; the plain
    loop does not depend on the stage), so that one process at stage 0 is every stage's reference."""
    got, want = one_process["anchor"]
    for zero, result in enumerate(got):
        _compare(result, want, f"trainer zero={zero} vs plain PyTorch")


# Gradient clipping is active with this threshold (the debug model's gradient norm is ~1): the clipped cases check
# the global-norm computations over the sequence x data group as well.
CLIP = ["optim.grad_clip=0.05"]


def _packed(tmp_path) -> list[str]:
    """Overrides for packed records with document masks: 80 random genes of 4-12 bases, so that every 32-token window
    packs several documents (any two fit in one), and a fifth of them for validation."""
    rng = np.random.default_rng(0)
    genes = ["".join(rng.choice(list("ACGT"), int(rng.integers(4, 13)))) for _ in range(80)]
    fasta = tmp_path / "short_genes.fasta"
    fasta.write_text("".join(f">g{i}\n{g}\n" for i, g in enumerate(genes)))
    return [f"data.fasta={fasta}", "data.dataset=packed", "data.val_fraction=0.2"]


def _master_updates(rank, world, cases):
    """Like :func:`_train_cases`, but (rank 0) each parameter's update over the run, read from the fp32 master weights
    (``deepspeed.utils.safe_get_full_fp32_param``; under bf16 the module's copies round away any update below their
    resolution, all of it for layer norm weights near 1) and from the position table's own fp32 weight."""
    from deepspeed.utils import safe_get_full_fp32_param

    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    def masters(trainer):
        state = {n: safe_get_full_fp32_param(p).detach().cpu().clone()
                 for n, p in trainer.engine.module.named_parameters()}
        if trainer.pos_table is not None:
            state["embed_pos.weight"] = trainer.pos_table.gather().float()
        return state

    results = []
    for overrides in cases:
        trainer = Trainer(load_config(None, overrides))
        before = masters(trainer)
        losses = [trainer.train_step().loss for _ in range(trainer.cfg.train.steps)]
        updates = {k: (v - before[k]).numpy() for k, v in masters(trainer).items()}
        results.append((losses, updates if rank == 0 else None))
    return results


def _validation_cases(rank, world, overrides):
    """The trainer's validation loss under SP, and (rank 0) the plain single-model loss over the same samples."""
    from ds4sci.infer.evaluate import evaluate
    from ds4sci.models.genslm import GenSLM
    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    trainer.train_step()
    got = trainer.evaluate()["val_loss"]
    state = trainer.full_state_dict()
    if rank != 0:
        return got, None, len(trainer.val_ds)
    model = GenSLM(trainer.model_config)
    model.load_state_dict(state)
    return got, evaluate(model.eval(), trainer.tokenizer, trainer.val_ds, batch_size=3)["loss"], len(trainer.val_ds)


def _world(rank, world, cases, bf16, validation):
    """One process group's runs: ``_train_cases(cases)``, ``_master_updates(bf16)`` and (when given)
    ``_validation_cases(validation)``."""
    return (_train_cases(rank, world, cases), _master_updates(rank, world, bf16),
            _validation_cases(rank, world, validation) if validation else None)


BF16 = ["train.dtype=bf16"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """One folder for every run of this module."""
    return tmp_path_factory.mktemp("runs")


def _world_2_runs(root):
    """The 2-rank cases of ``test_world_2_sp_every_stage_ring_and_dp`` and their single-process references."""
    stages = [0, 1, 2, 3]
    packed = _packed(root)
    cases = [_overrides(root / f"sp{z}", z, ulysses=2) for z in stages] + [
        _overrides(root / "ring", 3, ring=2),  # zigzag layout: the table's rows are two chunks per rank
        _overrides(root / "dp3", 3, micro=1, pe="rotary"),  # ZeRO-3 over two data-parallel ranks
        _overrides(root / "ga", 2, ulysses=2, micro=1, extra=["train.grad_accum=2", *CLIP]),
        _overrides(root / "rope3", 3, ulysses=2, pe="rotary", extra=CLIP),
        _overrides(root / "packu", 1, ulysses=2, pe="rotary", extra=packed),
        _overrides(root / "packr", 0, ring=2, pe="alibi", extra=[*packed, "parallel.layout=contiguous"]),
    ]
    references = [_overrides(root / f"b{z}", z) for z in stages] + [
        _overrides(root / "bring", 3),
        _overrides(root / "bdp3", 3, micro=2, pe="rotary"),
        _overrides(root / "bga", 2, micro=2, extra=CLIP),
        _overrides(root / "brope3", 3, pe="rotary", extra=CLIP),
        _overrides(root / "bpacku", 1, pe="rotary", extra=packed),
        _overrides(root / "bpackr", 0, pe="alibi", extra=packed),
    ]
    return cases, references


def _world_4_runs(root):
    """The 4-rank cases of ``test_sp2_x_dp2_and_hybrid_ulysses_x_ring`` and their single-process references."""
    cases = [
        _overrides(root / "spdp1", 1, ulysses=2, micro=1, extra=CLIP),
        _overrides(root / "spdp3", 3, ulysses=2, micro=1),
        _overrides(root / "usp", 2, ulysses=2, ring=2, micro=2, pe="alibi"),
        _overrides(root / "usp0", 0, ulysses=2, ring=2, micro=2, extra=CLIP),
    ]
    references = [
        _overrides(root / "b1", 1, micro=2, extra=CLIP),
        _overrides(root / "b3", 3, micro=2),
        _overrides(root / "b2", 2, micro=2, pe="alibi"),
        _overrides(root / "b0", 0, micro=2, extra=CLIP),
    ]
    return cases, references


def _bf16_runs(root):
    """The 2-rank cases of ``test_bf16_with_sp_tracks_bf16_and_fp32_single_process`` and its single-process runs
    (bf16, fp32)."""
    return ([_overrides(root / f"bf{z}", z, ulysses=2, extra=BF16) for z in (1, 2)],
            [_overrides(root / "bbf", 1, extra=BF16), _overrides(root / "bf", 1)])


def _one_process_runs(rank, world, anchor, references, bf16):
    """Every single-process run of this module, in one process: ``_train_cases(anchor)``, the plain PyTorch loop of
    ``anchor[0]``, ``_train_cases(references)`` and ``_master_updates(bf16)``."""
    return (_train_cases(rank, world, anchor), _plain_torch_losses(rank, world, anchor[0]),
            _train_cases(rank, world, references), _master_updates(rank, world, bf16))


@pytest.fixture(scope="module")
def one_process(root):
    """The single-process runs: the anchor's (``"anchor"``: the trainer at ZeRO 0-3 and the plain loop), the
    references of the 2- and 4-rank training cases at ZeRO stage 0 (``"world_2"``, ``"world_4"``; each distinct run
    once) and the bf16 test's (``"bf16"``)."""
    anchor = [_overrides(root / f"plain{zero}", zero, micro=4) for zero in range(4)]
    world_2, world_4 = _world_2_runs(root)[1], _world_4_runs(root)[1]
    runs, index = _unique_at_stage_0(world_2 + world_4)
    got, plain, references, bf16 = run_workers(_one_process_runs, 1, anchor, runs, _bf16_runs(root)[1], env=ENV,
                                               timeout=600)[0]
    references = [references[i] for i in index]
    return {"anchor": (got, plain), "world_2": references[:len(world_2)], "world_4": references[len(world_2):],
            "bf16": bf16}


@pytest.fixture(scope="module")
def world_2(root):
    """Rank 0's 2-rank runs (one process group): the SP-every-stage test's and the bf16 test's."""
    got, bf16, _ = run_workers(_world, 2, _world_2_runs(root)[0], _bf16_runs(root)[0], None, env=ENV,
                               timeout=500)[0]
    return got, bf16


@pytest.mark.slow
def test_world_2_sp_every_stage_ring_and_dp(world_2, one_process):
    """ZeRO 0-3 under Ulysses, ring (zigzag; contiguous), data parallelism, accumulation, rotary under SP with ZeRO-3
    and clipping; packed records with document masks under Ulysses (rotary) and under the contiguous ring (ALiBi)."""
    got, want = world_2[0], one_process["world_2"]
    for z, g, w in zip([0, 1, 2, 3], got, want):
        _compare(g, w, f"ulysses=2 zero={z}")
    _compare(got[4], want[4], "ring=2 zigzag zero=3")
    _compare(got[5], want[5], "dp=2 zero=3 rotary")
    _compare(got[6], want[6], "ulysses=2 zero=2 grad_accum=2 clipped")
    _compare(got[7], want[7], "ulysses=2 zero=3 rotary clipped")
    _compare(got[8], want[8], "ulysses=2 zero=1 rotary, packed records with document masks")
    _compare(got[9], want[9], "ring=2 contiguous zero=0 alibi, packed records with document masks")


@pytest.fixture(scope="module")
def world_4(root):
    """The 4-rank runs (one process group): rank 0's SP x DP and hybrid cases, and every rank's validation result."""
    # 5 validation windows (~150 bases), global micro-batches of 4 (2 per data rank x 2 data ranks, SP=2 inside)
    validation = _overrides(root / "val", 1, ulysses=2, micro=2,
                            extra=["data.val_fraction=0.0000323", "train.eval_batches=8"])
    results = run_workers(_world, 4, _world_4_runs(root)[0], [], validation, env=ENV, timeout=500)
    return results[0][0], [r[2] for r in results]


@pytest.mark.slow
def test_sp2_x_dp2_and_hybrid_ulysses_x_ring(world_4, one_process):
    got, want = world_4[0], one_process["world_4"]
    _compare(got[0], want[0], "sp=2 x dp=2 zero=1 clipped")
    _compare(got[1], want[1], "sp=2 x dp=2 zero=3")
    _compare(got[2], want[2], "ulysses=2 x ring=2 zero=2 alibi")
    _compare(got[3], want[3], "ulysses=2 x ring=2 zero=0 clipped")


@pytest.mark.slow
def test_bf16_with_sp_tracks_bf16_and_fp32_single_process(world_2, one_process):
    """bf16 (DeepSpeed's bf16 mode, fp32 master weights) under Ulysses SP=2 and ZeRO-1/2: the losses follow the bf16
    single-process run (here they agree to ~1e-9; 1e-3 leaves room for layout-dependent rounding) and the fp32 run
    to a few percent; every parameter's update (fp32 master weights, position table included) is the fp32
    single-process run's update to 5% of its size (measured: <= 1.2%; an update of the wrong scale is off by ~50%
    and more, where the parameters themselves differ by ~1e-3 either way)."""
    got, (want_bf16, want_fp32) = world_2[1], one_process["bf16"]
    for (losses, updates), z in zip(got, (1, 2)):
        label = f"bf16 ulysses=2 zero={z}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_bf16[0]), rtol=1e-3, atol=0,
                                   msg=f"{label} vs bf16 single process")
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_fp32[0]), rtol=5e-2, atol=0,
                                   msg=f"{label} vs fp32 single process")
        assert set(updates) == set(want_fp32[1]), label
        for key, ref in want_fp32[1].items():
            size = np.linalg.norm(ref)
            assert size > 0, (label, key)  # every parameter moved
            error = np.linalg.norm(updates[key] - ref) / size
            assert error <= 0.05, f"{label}: {key}: update off by {error:.1%} of its size vs fp32 single process"
    assert abs(want_bf16[0][-1] - want_bf16[0][0]) > 1e-3


@pytest.mark.slow
def test_validation_scores_every_sample_once_under_sp_and_dp(world_4):
    """5 validation windows, global micro-batches of 4 (2 per data rank x 2 data ranks, SP=2 inside): the last
    micro-batch is part padding, and the loss equals the single-model mean over exactly the 5 windows."""
    results = world_4[1]
    got, want, n_val = results[0]
    assert n_val == 5, n_val
    assert all(r[0] == got for r in results)
    assert got == pytest.approx(want, rel=1e-5)
