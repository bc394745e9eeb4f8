"""Tensor parallelism (Megatron-LM with sequence-parallel regions) composed with Ulysses and ring, on gloo.

Recipe: every rank builds the single-device GenSLM and a second copy with the same seed, runs the reference on the full
batch (fp32), applies :func:`~ds4sci.parallel.parallelize.parallelize` to the copy, feeds it this rank's SP shard and
compares the loss (summed over SP), the log-softmax of the logits (gathered over the vocabulary and the sequence) and
EVERY parameter gradient (consolidated over TP, summed over SP as the engine would) with the reference. Cases of one
world size share one spawn; each failure names its case. Llama-shaped cases (``_llama``) cover key/value heads split
over TP and shared by 2 or 4 TP ranks, SwiGLU, RMSNorm, no biases, the sequential residual and a tied head.
"""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint

from ds4sci.distributed import ParallelDims
from ds4sci.distributed.comm import CommCounter
from ds4sci.distributed.groups import build_groups
from ds4sci.models.genslm import IGNORE_INDEX
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.models.genslm import shift_labels
from ds4sci.models.genslm import token_loss
from ds4sci.parallel.genslm_tp import token_loss_for
from ds4sci.parallel.parallelize import materialize_
from ds4sci.parallel.parallelize import parallelize
from ds4sci.parallel.tensor_parallel import gather_vocab
from ds4sci.parallel.tensor_parallel import tensor_parallel_plan
from ds4sci.planning import genslm as planner
from ds4sci.planning.costs import tp_forward_comm_bytes
from ds4sci.sequence import gather_sequence
from ds4sci.sequence import shard_sequence
from ds4sci.spawn import run_workers
from ds4sci.train.consolidate import gather_tensor_parallel
from ds4sci.train.consolidate import load_full_state_dict
from ds4sci.train.consolidate import shard_tensor_parallel

from activation_checks import SavedBytes  # tests/ is on sys.path (its conftest.py)

RTOL, ATOL = 1e-5, 1e-6


def _config(**overrides) -> GenSLMConfig:
    base = dict(vocab_size=69, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=40,
                max_position_embeddings=64, position_embedding="rotary", rotary_pct=0.5)
    base.update(overrides)
    return GenSLMConfig(**base)


def _llama(**overrides) -> GenSLMConfig:
    """Llama's shape: grouped-query attention, SwiGLU, RMSNorm, no biases, sequential residual, Llama-3.1's rotary
    scaling on every head dim (its wavelength bands inside the tiny head), tied head (``tie_word_embeddings=False``
    unties it)."""
    base = dict(num_kv_heads=2, mlp="swiglu", norm="rmsnorm", bias=False, parallel_residual=False, rotary_pct=1.0,
                rotary_scaling_factor=8.0, rotary_original_max_positions=32, tie_word_embeddings=True)
    base.update(overrides)
    return _config(**base)


def _model(cfg: GenSLMConfig, seed: int) -> GenSLM:
    torch.manual_seed(seed)
    return GenSLM(cfg)


def _draw_vectors(model: GenSLM, seed: int) -> GenSLM:
    """Norm weights and biases drawn around their initial 1 and 0: a block's two norms then differ, so a matmul
    reading the wrong normalised region (or a bias left out) changes the result."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def _batch(cfg: GenSLMConfig, B: int, S: int, seed: int, docs: bool):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    pos = torch.arange(S).expand(B, S).contiguous()
    targets = shift_labels(ids)
    targets[torch.rand(B, S, generator=gen) < 0.2] = IGNORE_INDEX  # some ignored targets
    doc = (torch.rand(B, S, generator=gen) < 0.2).long().cumsum(1) if docs else None
    return ids, pos, targets, doc


def check_model(label, groups, cfg, *, S, B=2, docs=False, seed=0):
    """One forward and backward of the parallel model against the single-device one."""
    dims = groups.dims
    ids, pos, targets, doc = _batch(cfg, B, S, seed + 1, docs)
    ref = _draw_vectors(_model(cfg, seed), seed)
    ref_logits = ref(ids, pos, doc)
    ref_loss = token_loss(ref_logits, targets, "sum")
    ref_loss.backward()

    model = _draw_vectors(_model(cfg, seed), seed)
    table = parallelize(model, groups)
    assert set(model.state_dict()) | ({"embed_pos.weight"} if table else set()) == set(ref.state_dict()), label

    def shard(x):
        return None if x is None else shard_sequence(x, 1, groups.sp_rank, dims.sp, dims.layout)

    pe = table(shard(pos)) if table is not None else None
    logits = model(shard(ids), shard(pos), shard(doc), position_embeds=pe)
    assert logits.shape == (B, S // dims.sp, -(-cfg.vocab_size // dims.tp)), (label, tuple(logits.shape))
    loss = token_loss_for(groups)(logits, shard(targets), "sum")
    loss.backward()

    def close(actual, expected, what):
        # fp32 sums taken in another order (TP/SP partial sums, another CPU's matmul blocking) differ by about
        # eps x the size of the summands, not of the result: a bias gradient of 0.05 summed from terms near 1 moves
        # by ~1e-6. So the absolute tolerance scales with the tensor's largest element.
        atol = ATOL * max(1.0, expected.abs().max().item())
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=atol,
                                   msg=lambda m: f"[{label}] rank {dist.get_rank()} {what}: {m}")

    total = loss.detach().clone()
    dist.all_reduce(total, group=groups.sp)
    close(total, ref_loss.detach(), "loss (summed over SP)")
    full_logits = gather_sequence(gather_vocab(logits.detach(), groups.tp, cfg.vocab_size), 1, groups.sp, dims.layout)
    close(F.log_softmax(full_logits, -1), F.log_softmax(ref_logits.detach(), -1), "log-softmax")

    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None for g in grads.values()), (label, [n for n, g in grads.items() if g is None])
    full = gather_tensor_parallel(grads, groups, tensor_parallel_plan(model))
    ref_grads = dict(ref.named_parameters())
    for name, g in full.items():
        g = g.clone()
        dist.all_reduce(g, group=groups.sp)  # each SP rank's gradient covers its tokens: the engine sums them
        close(g, ref_grads[name].grad, f"grad {name}")
    if table is not None:
        close(table.weight.grad, ref.embed_pos.weight.grad[table.rows], "grad embed_pos.weight (this SP shard's rows)")
    return model


def check_saved_bytes(label, groups, config, *, S, B=2, tile=0):
    """Bytes one layer saves for backward per local token (a 2-layer minus a 1-layer model; the TP rank holds ``B S /
    tp`` tokens) are the planner's: the column-parallel matmuls save this rank's sequence regions of their inputs
    (``h`` per token each), not the gathered ``[B, S, h]`` (``tp h``); with the MLP tiled over ``tile`` tokens the
    tiled function saves the gathered input (``tp h``) and no ``[B, S, intermediate / tp]`` activation."""
    from ds4sci.train.activation_checkpointing import apply_tiled_mlp

    saved = []
    for layers in (1, 2):
        model = _model(config(num_layers=layers, attention_backend="chunked"), 0)
        parallelize(model, groups)
        if tile:
            apply_tiled_mlp(model, tile)
        ids, pos, _, _ = _batch(model.config, B, S, 0, False)
        with SavedBytes(model) as counted:
            model(ids, pos)
        saved.append(counted.total)
    w = planner.Workload(model.config, S, micro_batch=B, dtype="fp32")
    per_token = planner.layer_activation_bytes(w, planner.Strategy(groups.dims, mlp_tile=tile), "none")
    assert (saved[1] - saved[0]) / (B * S // groups.dims.tp) == per_token, (label, saved, per_token)
    return per_token


def check_tiled_loss_saved_bytes(label, groups, config, *, S, B=2, tile=5):
    """The tiled loss on the vocabulary-parallel head saves, per local token, the planner's
    :func:`~ds4sci.planning.genslm.loss_saved_bytes` more than the head alone computing logits: the SP shard's int64
    targets (``8 tp``) and the gathered final-norm output (``tp h e``) in place of this rank's region (``h e``), which
    the head's column-parallel matmul saves untiled; and no logits. (The untiled head also saves its padded-column mask,
    ``V_pad / tp`` booleans for the ``-inf`` fill; the tiled one keeps none.)"""
    from ds4sci.train.activation_checkpointing import apply_tiled_loss

    saved = []
    for loss_tile in (0, tile):
        model = _model(config(num_layers=1, attention_backend="chunked"), 0)
        parallelize(model, groups)
        ids, pos, targets, _ = _batch(model.config, B, S, 0, False)
        if loss_tile:
            apply_tiled_loss(model, loss_tile)
        with SavedBytes(model) as counted:
            model(ids, pos, **({"targets": targets} if loss_tile else {}))
        saved.append(counted.total)
    w = planner.Workload(model.config, S, micro_batch=B, dtype="fp32")
    per_token = planner.loss_saved_bytes(w, planner.Strategy(groups.dims, loss_tile=tile))
    assert per_token == 8 * 2 + model.config.hidden_size * 4, (label, per_token)  # tp = 2, fp32
    mask = model.embed_out.padding.numel() if bool(model.embed_out.padding.any()) else 0  # bool: a byte each
    assert (saved[1] - saved[0] + mask) / (B * S // groups.dims.tp) == per_token, (label, saved, mask, per_token)


def check_materialize(label, groups, cfg, seed=0):
    """A model built on the meta device, parallelized and materialized (the trainer's path: no rank ever holds the
    whole model) equals the whole model built and parallelized: every piece bitwise, the parameter marks, the
    position table's rows, and the global RNG stream after construction (dropout)."""
    ref = _model(cfg, seed)
    after_ref = torch.rand(4)
    ref_table = parallelize(ref, groups)
    torch.manual_seed(seed)
    meta = GenSLM(cfg, device="meta")
    assert torch.equal(torch.rand(4), after_ref), label
    assert all(p.is_meta for p in meta.parameters()), label
    table = parallelize(meta, groups)
    drawn = materialize_(meta, table, groups)
    ref_params = dict(ref.named_parameters())
    assert drawn == sum(p.numel() for p in ref_params.values()) + (ref_table.weight.numel() if ref_table else 0), label
    for name, p in meta.named_parameters():
        expected = ref_params[name]
        assert torch.equal(p, expected) and p.requires_grad, (label, name)
        assert vars(p).keys() == vars(expected).keys(), (label, name, vars(p).keys(), vars(expected).keys())
    if ref_table is not None:
        assert torch.equal(table.weight, ref_table.weight) and torch.equal(table.rows, ref_table.rows), label
        assert table.weight.ds4sci_sequence_sharded == ref_table.weight.ds4sci_sequence_sharded, label
    # fine-tuning: the pieces are copied from init_source (another model's weights, in bf16) instead of drawn
    source = _model(cfg, seed + 100)
    state = {k: v.to(torch.bfloat16) for k, v in source.state_dict().items()}
    source.load_state_dict(state)  # the values the bf16 source holds
    source_table = parallelize(source, groups)
    meta = GenSLM(cfg, device="meta")
    meta.init_source = state
    table = parallelize(meta, groups)
    materialize_(meta, table, groups)
    source_params = dict(source.named_parameters())
    assert all(torch.equal(p, source_params[n]) for n, p in meta.named_parameters()), label
    assert source_table is None or torch.equal(table.weight, source_table.weight), label


def _expect_value_error(label, match, fn):
    try:
        fn()
    except ValueError as err:
        assert match in str(err), f"[{label}] error message {str(err)!r} lacks {match!r}"
        return
    raise AssertionError(f"[{label}] no ValueError")


# ---------------------------------------------------------------------------- world size 2: TP2
def _worker_tp2(rank, world):
    groups = build_groups(ParallelDims(dp=1, tp=2))
    check_model("TP2 rotary docs", groups, _config(), S=12, docs=True)
    check_model("TP2 alibi", groups, _config(position_embedding="alibi"), S=10, seed=1)
    check_model("TP2 learned B=1", groups, _config(position_embedding="learned"), S=8, B=1, seed=2)
    # the two-branch reduce-scatter of active dropout (p so small that dropout is the identity in fp32)
    check_model("TP2 dropout path", groups, _config(dropout=1e-12), S=6, seed=3)
    # Llama shapes: one key/value head per rank (tied head); one head shared by both ranks (untied)
    check_model("TP2 llama kv2 tied", groups, _llama(), S=8, docs=True, seed=8)
    check_model("TP2 llama kv1 shared untied", groups, _llama(num_kv_heads=1, tie_word_embeddings=False), S=6, seed=9)
    # saved activations per layer and local token: the planner's, the single device's but for the rotary tables of
    # the gathered positions (2 rotary_dim (tp - 1) fp32 values more) and, for the Llama shape's 2 key/value heads,
    # the query heads' copy one device makes (h fp32 values) and a rank holding one key/value head does not
    for label, config, q_copy in (("TP2 neox", _config, 0), ("TP2 llama kv2", _llama, 1)):
        per_token = check_saved_bytes(label, groups, config, S=16)
        one = planner.layer_activation_bytes(planner.Workload(config(), 16, dtype="fp32"), planner.Strategy(), "none")
        expected = one + (2 * config().rotary_dim * (2 - 1) - q_copy * config().hidden_size) * 4
        assert per_token == expected, (label, per_token, one)
        check_tiled_loss_saved_bytes(label, groups, config, S=16)

    # communication: forward = 1 all-reduce (embedding), L reduce-scatters, L + 1 all-gathers; nothing else
    cfg = _config(num_layers=3)
    counter = CommCounter()
    model = _model(cfg, 0)
    parallelize(model, groups, counter=counter)
    B, S, h = 2, 8, cfg.hidden_size
    ids, pos, _, _ = _batch(cfg, B, S, 0, False)
    logits = model(ids, pos)
    assert dict(counter.calls) == {"all_reduce": 1, "reduce_scatter": 3, "all_gather": 4}, counter
    assert counter.bytes_sent["reduce_scatter"] == 3 * B * S * h * 4 // 2, counter  # half of [B, S, h] leaves
    counter.reset()
    logits.sum().backward()  # backward: the dual collectives (the embedding split's is an all-gather), the
    # re-gather of each block's two normalised regions and of the final norm's (one all-gather each for the weight
    # gradients: Megatron-LM's saving of the region only) plus gradient all-reduces of the 4 LayerNorm parameters per
    # block and the final LayerNorm's 2
    assert counter.calls["reduce_scatter"] == 4 and counter.calls["all_gather"] == 4 + 3 + 1, counter
    assert counter.bytes_sent["all_gather"] == (3 + 3 * 2 + 1 + 1) * B * S * h * 4 // 2, counter  # halves sent
    assert counter.calls["all_reduce"] == 3 * 4 + 2, counter
    # Llama (sequential residual, RMSNorm, one key/value head shared by both ranks): per block an all-gather and a
    # reduce-scatter per branch, plus the all-gather of the shared head's projection rows; backward the duals, the
    # re-gather of each branch's region (and of the final norm's) and the gradient all-reduce of RMSNorm's one
    # weight per norm (the planner's megatron-sp form: 10 (tp-1)/tp N h)
    counter = CommCounter()
    llama = _model(_llama(num_layers=3, num_kv_heads=1), 0)
    parallelize(llama, groups, counter=counter)
    logits = llama(ids, pos)
    assert dict(counter.calls) == {"all_reduce": 1, "reduce_scatter": 6, "all_gather": 7 + 3}, counter
    assert counter.bytes_sent["reduce_scatter"] == 6 * B * S * h * 4 // 2, counter
    counter.reset()
    logits.sum().backward()
    assert dict(counter.calls) == {"reduce_scatter": 7 + 3, "all_gather": 6 + 1 + 6 + 1, "all_reduce": 3 * 2 + 1}, \
        counter

    # full activation checkpointing (a reentrant recomputation, as DeepSpeed's) sends each layer's forward
    # collectives once more (ds4sci.planning.costs.tp_forward_comm_bytes) and its backward still re-gathers the regions
    sent = []
    for recompute in (False, True):
        counter = CommCounter()
        recomputed = _model(cfg, 0)
        parallelize(recomputed, groups, counter=counter)
        if recompute:
            recomputed.checkpoint_fn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
        recomputed(ids, pos).sum().backward()
        sent.append(counter.bytes_sent["all_gather"] + counter.bytes_sent["reduce_scatter"])
    assert sent[1] - sent[0] == 3 * tp_forward_comm_bytes("tp-sp", 2, B * S, h, 4), sent

    # consolidation round trip: the TP model's pieces are the single-device model's; full -> TP -> full
    ref = _model(cfg, 5)
    gathered = gather_tensor_parallel(_parallel(cfg, 5, groups), groups)
    assert gathered.keys() == ref.state_dict().keys()
    assert all(torch.equal(a, ref.state_dict()[k]) for k, a in gathered.items())
    full = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}
    load_full_state_dict(model, full, groups)
    back = gather_tensor_parallel(model, groups)
    assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)
    plan = tensor_parallel_plan(model)
    assert plan["embed_in.weight"].padded == 70 and plan["embed_in.weight"].size == 69
    assert {p.ds4sci_tp_dim for n, p in model.named_parameters() if n.endswith("dense.weight")} == {1}
    shards = [shard_tensor_parallel(full, plan, r, 2) for r in range(2)]
    assert torch.equal(shards[1]["embed_out.weight"][-1], torch.zeros(h))  # the padded vocabulary row
    marked = {n for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)}
    assert marked == set(plan) and "layers.0.input_layernorm.weight" not in marked
    assert "layers.0.attention.dense.bias" not in marked and "layers.0.attention.dense.weight" in marked

    # errors name the bad value
    _expect_value_error("heads", "must divide the number of heads 3",
                        lambda: parallelize(_model(_config(hidden_size=24, num_heads=3), 0), groups))
    _expect_value_error("mlp", "intermediate_size=41",
                        lambda: parallelize(_model(_config(intermediate_size=41), 0), groups))
    model = _parallel(_config(), 0, groups)
    ids, pos, _, _ = _batch(_config(), 1, 9, 0, False)
    _expect_value_error("sequence", "has 9 tokens, not divisible by tp=2", lambda: model(ids, pos))
    # a column-parallel layer called on anything but its block's gathered region (here: outside any block)
    _expect_value_error("region", "got an input of shape (1, 4, 32), not the block's last gathered region",
                        lambda: model.layers[0].mlp(torch.zeros(1, 4, 32)))
    logits = torch.zeros(1, 4, 3)  # a vocabulary of 6 over two ranks
    _expect_value_error("targets", "targets must be in [0, 6) or -100, got range [0, 7]",
                        lambda: token_loss_for(groups)(logits, torch.tensor([[0, 7, IGNORE_INDEX, 2]])))
    return True


def _parallel(cfg, seed, groups):
    model = _model(cfg, seed)
    parallelize(model, groups)
    return model


def _parts(rank, world, parts):
    """``fn(rank, world, *args)`` for each ``(fn, args)`` of ``parts``, in order, on this process group."""
    return [fn(rank, world, *args) for fn, args in parts]


@pytest.fixture(scope="module")
def world_2():
    """Every rank's results of the 2-rank workers (one process group): model checks, tiled saved bytes, losses."""
    return run_workers(_parts, 2, [(_worker_tp2, ()), (_worker_tiled_saved_bytes, ()), (_worker_loss_reductions, ())])


@pytest.mark.distributed
def test_tensor_parallel_world_2(world_2):
    assert [r[0] for r in world_2] == [True, True]


def _worker_tiled_saved_bytes(rank, world):
    groups = build_groups(ParallelDims(dp=1, tp=2))
    for label, config in (("TP2 neox tiled", _config), ("TP2 llama kv2 tiled", _llama)):
        untiled = check_saved_bytes(label, groups, config, S=16)
        tiled = check_saved_bytes(label, groups, config, S=16, tile=5)
        c = config()
        # the MLP's intermediate activations leave; its gathered input replaces this rank's region of it; with the
        # parallel residual it keeps the whole buffer of the one all-gather of both norms' outputs, and the region
        # stays (a slot of the stacked regions the attention saves)
        mlp = (4 if c.mlp == "swiglu" else 2) * c.intermediate_size  # [B, S, f / tp] per B S / tp local tokens
        added = 2 * 2 * c.hidden_size if c.parallel_residual else (2 - 1) * c.hidden_size
        assert untiled - tiled == (mlp - added) * 4, (label, untiled, tiled)
    return True


def test_tiled_mlp_saved_bytes_tp2(world_2):
    """Under TP 2 the tiled MLP saves what the planner says (``Strategy.mlp_tile``): the gathered MLP input in place of
    this rank's region and of the column-parallel layer's ``[B, S, intermediate / tp]`` outputs; with GPT-NeoX's
    parallel residual that input is a view of the one all-gather buffer of both norms' outputs, kept whole, beside
    the region."""
    assert [r[1] for r in world_2] == [True, True]


# ---------------------------------------------------------------------------- the loss's "mean" reduction, TP2
def _worker_loss_reductions(rank, world):
    """The vocabulary-parallel loss under TP2, "mean", "sum" and "none" (per token, the tiled loss's), values and logit
    gradients, against ``F.cross_entropy(ignore_index=-100)`` in fp64 on the full logits: "mean" divides by the 7
    valid targets of 12 (dividing by all 12 would be 7/12 of the reference); "none" is back-propagated with distinct
    weights per token."""
    groups = build_groups(ParallelDims(dp=1, tp=2))
    V = 10  # 5 columns per TP rank
    gen = torch.Generator().manual_seed(11)
    full = torch.randn(2, 6, V, generator=gen) * 3
    targets = torch.randint(0, V, (2, 6), generator=gen)
    ignored = torch.tensor([[1, 0, 0, 1, 0, 0], [0, 1, 1, 0, 0, 1]], dtype=torch.bool)
    targets[ignored] = IGNORE_INDEX
    assert int((~ignored).sum()) == 7
    # both ranks' columns hold targets: the target logit comes from the other rank for some rows
    assert {int(t) // (V // 2) for t in targets[~ignored]} == {0, 1}, targets
    cols = slice(rank * V // 2, (rank + 1) * V // 2)
    weights = torch.arange(1.0, 13.0).view(2, 6)  # per-token gradient weights for "none"
    for reduction in ("mean", "sum", "none"):
        ref_logits = full.double().requires_grad_()
        ref = F.cross_entropy(ref_logits.reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                              reduction=reduction)
        ref = ref.view(2, 6) if reduction == "none" else ref
        (ref * weights.double() if reduction == "none" else ref).sum().backward()
        mine = full[..., cols].clone().requires_grad_()
        loss = token_loss_for(groups)(mine, targets, reduction)
        (loss * weights if reduction == "none" else loss).sum().backward()
        assert loss.shape == ref.shape, (reduction, loss.shape)
        torch.testing.assert_close(loss.double(), ref.detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"[{reduction}] {m}")
        torch.testing.assert_close(mine.grad.double(), ref_logits.grad[..., cols], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"[{reduction}] logit gradient: {m}")
    _expect_value_error("avg", "reduction must be 'mean', 'sum' or 'none', got 'avg'",
                        lambda: token_loss_for(groups)(full[..., cols], targets, "avg"))
    return True


@pytest.mark.distributed
def test_vocab_parallel_loss_mean_and_sum_against_cross_entropy_tp2(world_2):
    assert [r[2] for r in world_2] == [True, True]


# ---------------------------------------------------------------------------- world size 4
def _worker_four(rank, world):
    # TP2 x Ulysses2: heads split over TP then Ulysses (ALiBi offsets of both)
    g = build_groups(ParallelDims(dp=1, tp=2, ulysses=2))
    check_model("TP2xU2 alibi docs", g, _config(position_embedding="alibi"), S=16, docs=True)
    check_model("TP2xU2 rotary", g, _config(num_heads=8, hidden_size=64, intermediate_size=24), S=8, seed=1)
    # a TP rank's one key/value head is shared by both Ulysses ranks
    check_model("TP2xU2 llama kv2", g, _llama(), S=8, seed=10)
    # TP2 x Ring2, zigzag (the learned table is sharded over its max_positions: the trainer's window length)
    g = build_groups(ParallelDims(dp=1, tp=2, ring=2, layout="zigzag"))
    check_model("TP2xR2 zigzag learned docs", g, _config(position_embedding="learned", max_position_embeddings=16),
                S=16, docs=True, seed=2)
    check_model("TP2xR2 zigzag alibi", g, _config(position_embedding="alibi"), S=8, seed=3)
    check_model("TP2xR2 zigzag llama kv1", g, _llama(num_kv_heads=1), S=8, docs=True, seed=11)
    # TP4: vocabulary 69 -> 72 (15 real columns on TP rank 3); vocabulary 5 -> 8 (TP rank 3 holds only padding)
    g = build_groups(ParallelDims(dp=1, tp=4))
    check_model("TP4 rotary docs vocab 69", g, _config(), S=8, docs=True, seed=4)
    check_model("TP4 alibi vocab 5", g, _config(vocab_size=5, pad_token_id=3, position_embedding="alibi"), S=4, seed=5)
    check_materialize("TP4 meta vocab 69", g, _config(), seed=6)
    check_model("TP4 llama kv2 shared by 2 tied", g, _llama(), S=8, seed=12)
    check_model("TP4 llama kv1 shared by 4", g, _llama(num_kv_heads=1, tie_word_embeddings=False), S=4, seed=13)
    check_materialize("TP4 meta llama kv2 tied", g, _llama(), seed=14)
    _expect_value_error("TP4 heads", "tp=4 x ulysses=1 = 4 must divide the number of heads 6",
                        lambda: parallelize(_model(_config(hidden_size=24, num_heads=6), 0), g))
    _expect_value_error("TP4 kv heads", "tp=4 and num_kv_heads=6: one must divide the other",
                        lambda: parallelize(_model(_config(hidden_size=48, num_heads=12, num_kv_heads=6), 0), g))
    g = build_groups(ParallelDims(dp=1, tp=2, ring=2, layout="zigzag"))
    check_materialize("TP2xR2 meta learned", g, _config(position_embedding="learned", max_position_embeddings=16), 7)
    return True


@pytest.fixture(scope="module")
def world_4():
    """Every rank's results of the 4-rank workers (one process group): model checks, the engine at ZeRO 2 and 3."""
    return run_workers(_parts, 4, [(_worker_four, ()), (_worker_engine, (2,)), (_worker_engine, (3,))],
                       env={"DS_ACCELERATOR": "cpu"}, timeout=400)


@pytest.mark.distributed
def test_tensor_parallel_world_4(world_4):
    assert [r[0] for r in world_4] == [True] * 4


# ---------------------------------------------------------------------------- world size 8: TP2 x Ulysses2 x Ring2
def _worker_eight(rank, world):
    # all three axes at once: heads split over TP then Ulysses (ALiBi offset tp_rank*H/2 + ulysses_rank*H/4), the
    # Ulysses all-to-all regroups zigzag chunks into ring chunks, the ring passes K/V blocks; S is a multiple of
    # tp * 2 * sp = 16, every rank's logits are [B, S/sp, V/tp] with sp = ulysses * ring = 4
    g = build_groups(ParallelDims(dp=1, tp=2, ulysses=2, ring=2, layout="zigzag"))
    assert (g.dims.sp, g.dims.tp, g.dims.sequence_multiple) == (4, 2, 16), g.dims
    check_model("TP2xU2xR2 zigzag rotary docs", g, _config(num_heads=8, hidden_size=64, intermediate_size=24),
                S=16, docs=True, seed=6)
    check_model("TP2xU2xR2 zigzag alibi", g, _config(num_heads=8, position_embedding="alibi"), S=32, B=1, seed=7)
    return True


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_world_8_ulysses_ring():
    assert run_workers(_worker_eight, 8, timeout=240) == [True] * 8


# ---------------------------------------------------------------------------- DeepSpeed engine, TP2 x DP2
def _worker_engine(rank, world, stage):
    """One SGD step (lr 1) with active gradient clipping through deepspeed.initialize(mpu=DeepSpeedMPU) equals the
    single-device step: the gradient norm counts TP-split parameters (``tensor_model_parallel``) on every TP rank and
    replicated ones once, and ZeRO-3 gathers every parameter around its own module's forward."""
    import os

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed

    from ds4sci.distributed.groups import DeepSpeedMPU
    from ds4sci.train.engine import init_distributed
    from ds4sci.train.loss import grad_reduction_factor

    init_distributed()
    groups = build_groups(ParallelDims(dp=2, tp=2))
    cfg, clip = _config(), 1e-3
    ids, pos, tgt, _ = _batch(cfg, 4, 8, 0, False)
    count = (tgt != IGNORE_INDEX).sum()
    ref = _model(cfg, 0)
    (token_loss(ref(ids, pos), tgt, "sum") / count).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    assert norm > 10 * clip, norm  # clipping is active
    with torch.no_grad():
        for p in ref.parameters():
            p -= p.grad
    model = _model(cfg, 0)
    parallelize(model, groups)
    plan = tensor_parallel_plan(model)
    zero = {"stage": stage, **({"reduce_scatter": True} if stage == 3 else {})}
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero, "gradient_clipping": clip,
          "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    if stage == 3:
        deepspeed.zero.Init(module=model, data_parallel_group=groups.sdp, config_dict_or_path=ds)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=ds,
                                      mpu=DeepSpeedMPU(groups), dist_init_required=False)
    mine = slice(2 * groups.dp_rank, 2 * groups.dp_rank + 2)
    loss = token_loss_for(groups)(engine(ids[mine], pos[mine]), tgt[mine], "sum")
    engine.backward(loss / count * grad_reduction_factor(stage, 2, 1))
    engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    full = gather_tensor_parallel(state, groups, plan)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"ZeRO-{stage} {name}: {m}")
    return True


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_tensor_parallel_deepspeed_engine(stage, world_4):
    assert [r[stage - 1] for r in world_4] == [True] * 4
