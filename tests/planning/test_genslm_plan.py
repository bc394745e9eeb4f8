"""``ds4sci plan``: the memory model against what ds4sci really allocates on this machine, the layout
search, ``--max-seq`` and the command's output and one-line errors."""
import json
import subprocess
import sys

import pytest
import torch

from ds4sci import cli
from ds4sci.bench import memory_breakdown
from ds4sci.bench import seq_scaling
from ds4sci.distributed import ParallelDims
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.models.genslm.config import PRESETS
from ds4sci.planning import genslm as plan
from ds4sci.planning import genslm_search as search
from ds4sci.planning.common import STATE_BYTES

from activation_checks import SavedBytes  # tests/ is on sys.path (its conftest.py)


def test_planner_imports_neither_torch_nor_the_benchmarks():
    """The planner is arithmetic on definitions it shares with the code (ParallelDims, ds4sci.planning.costs, the
    model config's methods): importing it and computing a plan pull in no torch (so no torch.distributed) and nothing
    from ds4sci.bench."""
    code = ("import sys, ds4sci.planning.genslm as plan, ds4sci.planning.genslm_search as search\n"
            "from ds4sci.models.genslm.config import GenSLMConfig\n"
            "from ds4sci.distributed import ParallelDims\n"
            "w = plan.Workload(GenSLMConfig.preset('debug'), 4096)\n"
            "assert plan.memory(w, plan.Strategy(ParallelDims(dp=1, ulysses=2))).total > 0\n"
            "assert search.plan(w, plan.Cluster())\n"
            "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('ds4sci.bench')]\n"
            "sys.exit(f'imported {bad}' if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert result.returncode == 0, result.stderr


SMALL = dict(vocab_size=6, hidden_size=64, num_layers=2, num_heads=4, attention_backend="chunked")
# SMALL in Llama's shape: grouped-query attention (2 key/value heads), SwiGLU, RMSNorm, no biases, sequential residual,
# rotary on every head dim
LLAMA = dict(SMALL, num_kv_heads=2, mlp="swiglu", intermediate_size=128, norm="rmsnorm", bias=False,
             parallel_residual=False, rotary_pct=1.0)


def _workload(seq_len, dtype="fp32", **model):
    return plan.Workload(GenSLMConfig(**{**SMALL, **model}), seq_len, dtype=dtype)


@pytest.mark.parametrize("S", [256, 512])
@pytest.mark.parametrize("P", [1, 4])
def test_position_table_equals_memory_breakdown_measurement(S, P):
    """memory-breakdown's configurations (hidden 64, P = 1 and 4): the planner's table term is the bytes ds4sci's
    partitioned table, its gradient and AdamW state really take."""
    w = _workload(S, position_embedding="learned", max_position_embeddings=S)
    predicted = plan.memory(w, plan.Strategy(ParallelDims(dp=1, ulysses=P))).position_table
    assert predicted == memory_breakdown.measure_table(S, 64, P)


@pytest.mark.parametrize("policy", plan.MASKS[1:])
def test_mask_equals_memory_breakdown_measurement(policy):
    w = plan.Workload(**{**vars(_workload(512)), "mask": policy})
    assert plan.memory(w, plan.Strategy()).mask == memory_breakdown.measure_mask(policy, 512)["device"]
    assert plan.memory(_workload(512), plan.Strategy()).mask == 0  # causal: evaluated inside the kernel


def _saved_activation_bytes(config: GenSLMConfig, S: int, checkpointing: str, tile: int = 0,
                            offload: bool = False, loss_tile: int = 0) -> tuple[int, int, int]:
    """Bytes autograd saves in one forward, parameters left out (they are model state), with the MLP tiled over
    ``tile`` tokens (0: untiled); of those, the bytes left on the device after it; and the bytes :class:`HostOffload`
    holds in host memory (``offload``). With ``loss_tile`` the forward also computes the tiled loss (the head with
    targets); without, it stops at the logits."""
    from ds4sci.train.activation_checkpointing import CheckpointedCore
    from ds4sci.train.activation_checkpointing import checkpoint
    from ds4sci.train.activation_offload import HostOffload

    torch.manual_seed(0)
    model = GenSLM(config)
    saved = SavedBytes(model)
    host = HostOffload("cpu")

    def kept(fn, *args):  # DeepSpeed's (reentrant) checkpoint keeps its inputs as attributes, out of the hooks' sight
        for a in args:
            if isinstance(a, torch.Tensor):
                saved.pack(a)
        return (host.checkpoint(checkpoint, fn, *args) if offload else checkpoint(fn, *args))

    for block in model.layers:
        block.mlp.tile = tile
        if checkpointing == "selective":
            block.attention.core = CheckpointedCore(block.attention.core, kept)
    if checkpointing == "full":
        model.checkpoint_fn = kept
    model.embed_out.tile = loss_tile
    targets = {"targets": torch.randint(0, 6, (1, S))} if loss_tile else {}
    with saved:
        model(torch.randint(0, 6, (1, S)), torch.arange(S)[None], **targets)
    return saved.total, saved.on_device, host.offloaded_bytes


SHAPES = {"neox-rotary": SMALL, "neox-learned": dict(SMALL, position_embedding="learned"), "llama-gqa": LLAMA,
          "llama-mqa-tied": dict(LLAMA, num_kv_heads=1, tie_word_embeddings=True)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("checkpointing", ["none", "selective"])
@pytest.mark.parametrize("tile", [0, 96])
def test_activations_equal_saved_tensors(shape, checkpointing, tile):
    """Per layer, the planner's activation bytes are exactly what GenSLM's block saves for backward (a 2-layer minus
    a 1-layer model, so the embedding and the head cancel), for GPT-NeoX's block and for Llama's (grouped- and
    multi-query attention, SwiGLU, RMSNorm, no biases, sequential residual, tied or untied head), with the MLP untiled
    or tiled (96 tokens: the last of the 256 shorter); and the whole activation term, less the fp32 logits and
    log-softmax of a loss the harness does not compute, is what the whole model saves."""
    S = 256
    configs = [GenSLMConfig(**{**SHAPES[shape], "num_layers": L, "max_position_embeddings": S}) for L in (1, 2)]
    saved = [_saved_activation_bytes(c, S, checkpointing, tile)[0] for c in configs]
    w = plan.Workload(configs[1], S, dtype="fp32")
    strategy = plan.Strategy(checkpointing=checkpointing, mlp_tile=tile)
    assert saved[1] - saved[0] == plan.layer_activation_bytes(w, strategy, checkpointing) * S
    assert saved[1] == plan.memory(w, strategy).activations - 8 * SMALL["vocab_size"] * S


@pytest.mark.parametrize("shape", ["neox-rotary", "llama-mqa-tied"])
@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_tiled_loss_activations_equal_saved_tensors(shape, checkpointing):
    """With the tiled loss (96-token tiles, the last of the 256 shorter) the whole model, loss included, saves exactly
    the planner's activation term: no logits, the head keeps the final norm's output and the int64 targets (8 bytes
    per token in place of 8 V); the tiled MLP on as in ALST's rows."""
    S, tile = 256, 96
    config = GenSLMConfig(**{**SHAPES[shape], "max_position_embeddings": S})
    saved = _saved_activation_bytes(config, S, checkpointing, tile, loss_tile=tile)[0]
    w = plan.Workload(config, S, dtype="fp32")
    strategy = plan.Strategy(checkpointing=checkpointing, mlp_tile=tile, loss_tile=tile)
    assert plan.loss_saved_bytes(w, strategy) == 8
    assert saved == plan.memory(w, strategy).activations


@pytest.mark.parametrize("shape", ["neox-rotary", "neox-learned", "llama-gqa"])
@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_host_offload_equals_host_offload_measurement(shape, checkpointing):
    """Host offload of checkpointed inputs (HostOffload through ds4sci's checkpoint, the trainer's path; tiled MLP):
    per layer, what it holds in host memory (``HostOffload.offloaded_bytes``) is the planner's
    :func:`~ds4sci.planning.genslm.offloaded_layer_bytes` (the block input under ``full``; under ``selective`` the query
    heads' copy of grouped-query attention, none otherwise: q, k and v are views of the qkv buffer), the whole of it is
    the planner's ``host_activations``, and what stays on the device (saved for backward, checkpoint inputs included,
    less what went to the host) is the planner's per-layer figure less the offloaded bytes: under ``full`` nothing per
    layer."""
    S, tile = 256, 96
    configs = [GenSLMConfig(**{**SHAPES[shape], "num_layers": L, "max_position_embeddings": S}) for L in (1, 2)]
    runs = [_saved_activation_bytes(c, S, checkpointing, tile, offload=True) for c in configs]
    w = plan.Workload(configs[1], S, dtype="fp32")
    strategy = plan.Strategy(checkpointing=checkpointing, mlp_tile=tile, offload_activations=True)
    offloaded = plan.offloaded_layer_bytes(w, strategy)
    assert runs[1][2] - runs[0][2] == offloaded * S
    assert runs[1][2] == plan.memory(w, strategy).host_activations
    device = [on_device for _, on_device, _ in runs]
    assert all(total - on_device == host for total, on_device, host in runs)
    assert device[1] - device[0] == (plan.layer_activation_bytes(w, strategy, checkpointing) - offloaded) * S
    if checkpointing == "full":
        assert device[1] == device[0] and offloaded == w.model.hidden_size * 4


@pytest.mark.parametrize("name", [*PRESETS, "llama-debug+tied"])
def test_rank_parameters_are_the_models(name):
    """At tp = pp = 1 the planner's per-rank parameters are the model's (meta device: shapes only), for every preset
    (GPT-NeoX's and Llama's: grouped-query attention, SwiGLU, RMSNorm without bias, no biases, tied embeddings counted
    once)."""
    preset, _, tie = name.partition("+")
    config = GenSLMConfig.preset(preset, **({"tie_word_embeddings": tie == "tied"} if tie else {}))
    model = GenSLM(config, device="meta")
    assert plan.rank_params(plan.Workload(config, 1024), plan.Strategy()) == sum(p.numel() for p in model.parameters())


def test_a_tied_head_costs_the_flops_of_an_untied_one():
    """Tying the head to the embedding removes a matrix from the parameter count, not the head's matmul: the step's
    compute is the untied model's, and its 6 N FLOPs per token count the embedding and head matrices twice."""
    w, tied = (plan.Workload(GenSLMConfig.preset("llama-debug", tie_word_embeddings=t), 512) for t in (False, True))
    assert tied.model_params == w.model_params - 69 * 64
    assert plan.step_time(tied, plan.Strategy(), plan.Cluster()).compute_s == \
        plan.step_time(w, plan.Strategy(), plan.Cluster()).compute_s


# fp32 bytes per token of SMALL with rotary (h 64, f 256, 4 heads, rotary_dim 4), counted by hand:
# one layer saves (7 h + 2 f + 2 r) e + (4 + H) 4 = (448 + 512 + 8) 4 + 32 (block input, both norms' outputs, the
# fused qkv buffer rotated in place, the attention output; test_activations_equal_saved_tensors measures this
# figure); outside the layers: token ids 8 + final layer norm input and output 2 h e + 8 + logits and their
# log-softmax 8 V
LAYER_BYTES_PER_TOKEN = 3904
OUTSIDE_BYTES_PER_TOKEN = 8 + 2 * 64 * 4 + 8 + 8 * 6


@pytest.mark.parametrize("pp, grad_accum, in_flight", [
    (2, 1, 1), (2, 2, 2), (2, 5, 2),            # m < pp, m = pp, m > pp
    (4, 1, 1), (4, 2, 2), (4, 4, 4), (4, 6, 4),
])
def test_pipeline_first_stage_holds_min_pp_grad_accum_micro_batches(pp, grad_accum, in_flight):
    """1F1B keeps min(pp, m) micro-batches in flight on the first stage, each with the activations of the stage's
    ceil(L / pp) layers (6 layers: 3 on the first of 2 stages, 2 on the first of 4): the planner's activation term
    against that hand count, S = 256 tokens of one sequence per micro-step, fp32."""
    S = 256
    w = plan.Workload(GenSLMConfig(**{**SMALL, "num_layers": 6}), S, grad_accum=grad_accum, dtype="fp32")
    stage_layers = {2: 3, 4: 2}[pp]
    assert plan.layer_activation_bytes(w, plan.Strategy(), "none") == LAYER_BYTES_PER_TOKEN
    expected = S * (stage_layers * in_flight * LAYER_BYTES_PER_TOKEN + OUTSIDE_BYTES_PER_TOKEN)
    assert plan.memory(w, plan.Strategy(ParallelDims(dp=1, pp=pp))).activations == expected


@pytest.mark.slow
@pytest.mark.distributed
def test_peak_memory_matches_seq_scaling_measurement():
    """seq-scaling's measurement (peak RSS of one forward + backward per rank, Ulysses P = 2, hidden 64, 2 layers,
    S = 4096) against the planner's activations + backward working set + attention workspace + gradients + the
    all-to-all staging (the step's own tensors: no CUDA context, NCCL, DeepSpeed buckets or caching allocator on this
    CPU run). RSS counts what glibc keeps as well; over seq-scaling's recorded runs (hidden 128, S 1K-8K) the error was
    -27 % .. +19 % for P = 1 and Ulysses, -49 % .. -4 % for ring and hybrid at S >= 2K before the ring's forward
    buffers were counted."""
    S, P = 4096, 2
    measured = seq_scaling.measure("ulysses", P, S, {"hidden": 64, "heads": 4, "layers": 2})["peak_bytes_max"]
    terms = plan.memory(_workload(S, rotary_pct=0.25), plan.Strategy(ParallelDims(dp=1, ulysses=P)))
    # the step starts with parameters and optimizer allocated
    predicted = sum(getattr(terms, k) for k in ("activations", "workspace", "attention", "position_table", "mask",
                                                "grads", "a2a_staging"))
    assert abs(predicted - measured) / measured < 0.3, (predicted, measured)


CLUSTER = plan.Cluster(gpus_per_node=4, nodes=2, gpu_mem_gib=2.0, reserve_gib=0.0)


def _debug(seq_len, **kw):
    return plan.Workload(GenSLMConfig.preset("debug", max_position_embeddings=seq_len), seq_len, **kw)


def test_layouts_never_split_heads_they_cannot():
    w = _debug(8192)  # 4 heads on 8 GPUs
    found = search.strategies(w, CLUSTER)
    dims = [s.dims for s in found]
    assert found and all(w.model.num_heads % (d.tp * d.ulysses) == 0 for d in dims)
    assert {d.tp * d.ulysses for d in dims} == {1, 2, 4}
    assert all(d.world_size == 8 and w.seq_len % d.sequence_multiple == 0 for d in dims)
    assert not any(s.dims.pp > 1 and s.zero_stage > 1 for s in found)


def test_strategies_split_the_sequence_as_the_trainer_does():
    """A ring cuts the sequence as the trainer does, into 2 x sp zigzag chunks (ParallelDims' default layout): four
    ring ranks need a multiple of 8, and the longest sequence found is one."""
    fixed = search.Constraints(tp=1, ulysses=1, ring=4, checkpointing="full")
    assert ParallelDims.for_world(CLUSTER.world, ring=4).sequence_multiple == 8
    assert not search.strategies(_debug(8196), CLUSTER, fixed) and search.strategies(_debug(8200), CLUSTER, fixed)
    S = search.max_seq_len(_debug(1), CLUSTER, fixed)
    assert S > 0 and S % 8 == 0 and search.plan(_debug(S), CLUSTER, fixed)


def test_fixed_degrees_are_respected():
    fixed = {"tp": 2, "ring": 2, "zero_stage": 1, "checkpointing": "full"}
    rows = search.plan(_debug(8192), CLUSTER, search.Constraints(**fixed))
    assert rows
    assert all(all(r.strategy.to_dict()[k] == v for k, v in fixed.items()) for r in rows)
    speeds = [r.time.tokens_per_s for r in rows]
    assert speeds == sorted(speeds, reverse=True)


def test_more_memory_per_gpu_is_never_a_shorter_max_seq():
    w = _debug(1)
    fixed = search.Constraints(checkpointing="full", offload="none")
    lengths = [search.max_seq_len(w, plan.Cluster(4, 2, mem, reserve_gib=0.0), fixed) for mem in (0.5, 1.0, 2.0)]
    assert 0 < lengths[0] <= lengths[1] <= lengths[2]


@pytest.mark.parametrize("fixed", [search.Constraints(), search.Constraints(ulysses=2, checkpointing="none")])
def test_max_seq_fits_and_the_next_length_does_not(fixed):
    w = _debug(1)
    S = search.max_seq_len(w, CLUSTER, fixed)
    assert search.plan(w.with_seq_len(S), CLUSTER, fixed)
    budget = search.budget_bytes(CLUSTER)
    for strategy in search.strategies(w, CLUSTER, fixed, split_seq=False):
        q = strategy.dims.sequence_multiple
        assert plan.memory(w.with_seq_len((S // q + 1) * q), strategy, CLUSTER).total > budget, strategy


def test_command_lists_fitting_layouts_fastest_first(tmp_path, capsys):
    argv = ["plan", "--preset", "debug", "--seq-len", "8192", "--gpus-per-node", "4", "--nodes", "2",
            "--gpu-mem-gib", "1", "--reserve-gib", "0", "--set", "model.overrides.position_embedding=learned",
            "--top", "3", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "| # | tp | ulysses | ring | pp | dp | m | zero | offload | ckpt | GiB |" in out
    assert ("| # | params | grads | optim | activ | bwd ws | attn | pos table | mask | buffers | device | total GiB |"
            in out)
    report = json.loads((tmp_path / "plan.json").read_text())
    rows = report["layouts"]
    assert len(rows) == 3 and report["fitting"] >= 3
    assert rows[0]["time"]["tokens_per_s"] >= rows[1]["time"]["tokens_per_s"] >= rows[2]["time"]["tokens_per_s"]
    assert all(r["memory"]["total"] <= 2**30 and r["memory"]["position_table"] > 0 for r in rows)
    assert (tmp_path / "plan.md").read_text() in out


def test_command_max_seq(tmp_path, capsys):
    argv = ["plan", "--preset", "debug", "--gpus-per-node", "4", "--gpu-mem-gib", "1", "--reserve-gib", "0",
            "--checkpointing", "full", "--max-seq", "--top", "1", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "plan.json").read_text())
    S = report["max_seq_len"]
    assert f"Longest sequence that fits: {S} tokens." in capsys.readouterr().out
    assert report["workload"]["seq_len"] == S and report["layouts"][0]["memory"]["total"] <= 2**30


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3"], "--tp=3 = 3 does not divide the 8 GPUs (--nodes=2 x --gpus-per-node=4)"),
    (["--gpus-per-node", "3", "--nodes", "4", "--tp", "2"],
     "--tp=2 must divide the MLP width 256 and either divide --gpus-per-node=3 or span whole nodes"),
    (["--ulysses", "8"], "--tp=1 x --ulysses=8 = 8 must divide the model's 4 heads"),
    (["--ulysses", "4", "--seq-len", "4098"], "--seq-len=4098: no layout of 8 GPUs splits it evenly"),
    (["--pp", "4"], "--pp=4: the model has only 2 layers"),
    (["--zero-stage", "2", "--pp", "2"], "--zero-stage=2: DeepSpeed's pipeline engine (--pp=2)"),
    (["--zero-stage", "1", "--offload", "all"], "--offload=all needs --zero-stage 3, got 1"),
    (["--gpu-mem-gib", "0.3", "--reserve-gib", "0"], "no layout fits --seq-len=4096 in --gpu-mem-gib=0.3"),
    (["--gpu-mem-gib", "0.2"], "--gpu-mem-gib=0.2 must exceed --reserve-gib=0 plus --cuda-context-gib=0.267"),
])
def test_impossible_inputs_one_line(argv, message, capsys):
    base = ["plan", "--preset", "debug", "--gpus-per-node", "4", "--nodes", "2", "--seq-len", "4096"]
    assert cli.main(base + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds4sci plan: error: ") and message in err and err.count("\n") == 1, err


def test_a_fixed_tp_may_span_whole_nodes(tmp_path):
    """A fixed ``--tp`` that is a multiple of a node's GPUs is planned (the published long-sequence GenSLM runs put
    TP over 4 and 8 nodes), its traffic at the inter-node bandwidth; the search itself keeps TP within a node."""
    base = ["plan", "--preset", "debug", "--gpus-per-node", "2", "--nodes", "2", "--seq-len", "4096", "--top", "1",
            "--out", str(tmp_path)]
    assert cli.main(base + ["--tp", "4"]) == 0
    layout = json.loads((tmp_path / "plan.json").read_text())["layouts"][0]
    assert layout["layout"]["tp"] == 4
    assert cli.main(base) == 0
    assert all(row["layout"]["tp"] <= 2 for row in json.loads((tmp_path / "plan.json").read_text())["layouts"])


@pytest.mark.parametrize("preset, overrides", [("debug", {}), ("llama-debug", {}),
                                               ("llama-debug", {"num_kv_heads": 1, "tie_word_embeddings": True})])
def test_rank_params_are_what_a_tensor_parallel_rank_holds(preset, overrides):
    """The planner's parameters per rank (TP 4, no pipeline) are those a TP rank of the parallelized model holds:
    LayerNorm or RMSNorm, biases or none, key/value heads split or shared, a tied head counted once (meta device, no
    processes: splitting draws nothing and sends nothing)."""
    from ds4sci.distributed.groups import SequenceParallelGroups
    from ds4sci.parallel.parallelize import parallelize

    config = GenSLMConfig.preset(preset, **overrides)
    dims = ParallelDims.for_world(4, tp=4)
    groups = SequenceParallelGroups(dims=dims, rank=1, tp=None, ulysses=None, ring=None, sp=None, dp=None, sdp=None,
                                    pp=None)
    model = GenSLM(config, device="meta")
    parallelize(model, groups)
    held = sum(p.numel() for p in model.parameters())
    assert plan.rank_params(plan.Workload(config, 64), plan.Strategy(dims)) == held


def test_tp_comm_of_a_sequential_residual_reduces_each_branch_apart():
    """Llama's sequential residual reduce-scatters the attention and the MLP partial sums apart (the per-layer
    ``megatron-sp`` form, ``10 (tp-1)/tp N h e``; the collectives are counted in
    tests/distributed/test_tensor_parallel.py), where GPT-NeoX's parallel residual shares one
    (``8 (tp-1)/tp N h e``)."""
    strategy = plan.Strategy(ParallelDims(dp=1, tp=2))
    sequential = plan.Workload(GenSLMConfig.preset("llama-debug"), 64)
    parallel = plan.Workload(GenSLMConfig.preset("llama-debug", parallel_residual=True), 64)
    w, e = sequential, STATE_BYTES[sequential.dtype][0]
    extra = w.model.num_layers * w.micro_batch * w.grad_accum * 2 * (1 / 2) * 64 * w.model.hidden_size * e
    assert plan.comm(sequential, strategy).tp - plan.comm(parallel, strategy).tp == pytest.approx(extra)


def test_the_recomputed_layer_keeps_no_first_norm_output_under_full_checkpointing_off_tp():
    """Full checkpointing rebuilds the first norm's output in the qkv projection's backward (``Block.recompute_norm``,
    pinned against a live-tensor count in tests/train/test_activation_checkpointing.py): the recomputed layer's
    figure is one ``h e`` less per local token; not under TP (the projection keeps its region) or other modes."""
    w = _workload(4096)
    full = plan.Strategy(ParallelDims(dp=1), checkpointing="full")
    assert plan.rebuilt_norm_bytes(w, full) == 64 * 4
    assert plan.rebuilt_norm_bytes(w, plan.Strategy(ParallelDims(dp=1), checkpointing="selective")) == 0
    assert plan.rebuilt_norm_bytes(w, plan.Strategy(ParallelDims(dp=1, tp=2), checkpointing="full")) == 0
    per_token = plan.memory(w, full).activations / 4096
    held = 2 * plan.layer_activation_bytes(w, full, "full")
    outside = 8 + 2 * 64 * 4 + 8 + plan.loss_saved_bytes(w, full)  # ids, final norm, loss
    assert per_token == held + plan.layer_activation_bytes(w, full, "none") - 64 * 4 + outside
