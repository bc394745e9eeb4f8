"""The planner's communication and step-time terms against hand counts, one term per test: each assertion is the
closed form written out from what the ranks send, so a changed factor in ``comm`` or ``step_time`` fails here."""
import itertools

import pytest

from ds4sci.distributed import ParallelDims
from ds4sci.models.genslm.config import GenSLMConfig
from ds4sci.planning.costs import layer_comm_bytes
from ds4sci.planning.costs import tp_forward_comm_bytes
from ds4sci.planning.genslm import Cluster
from ds4sci.planning.genslm import Strategy
from ds4sci.planning.genslm import Workload
from ds4sci.planning.genslm import comm
from ds4sci.planning.genslm import rank_params
from ds4sci.planning.genslm import step_time

S, B, M = 4096, 2, 3  # tokens per sequence, sequences per micro-step, micro-steps per optimizer step


def _workload(dtype: str = "bf16", **model) -> Workload:
    config = GenSLMConfig.preset("debug", **{"num_heads": 8, "max_position_embeddings": S, **model})
    return Workload(config, S, micro_batch=B, grad_accum=M, dtype=dtype)


@pytest.mark.parametrize("tp, ulysses, ring", [(2, 2, 1), (2, 1, 2), (2, 2, 2), (1, 2, 1), (4, 1, 1)])
def test_pipeline_p2p_bytes_are_the_local_tokens_s_over_sp_tp(tp, ulysses, ring):
    """Between two stages a rank sends the activations of its own tokens, ``B S / (sp tp)`` of them (tensor
    parallelism's sequence regions divide the sequence-parallel shard again), ``h e`` bytes each, per micro-step:
    with ``sp > 1`` and ``tp > 1`` the bytes fall as ``1 / (sp tp)``, not ``1 / sp``."""
    w = _workload()
    h, e = w.model.hidden_size, 2
    dims = ParallelDims(dp=1, tp=tp, ulysses=ulysses, ring=ring, pp=2)
    local_tokens = B * S / (ulysses * ring * tp)
    assert comm(w, Strategy(dims)).pp == M * local_tokens * h * e
    alone = comm(w, Strategy(ParallelDims(dp=1, pp=2))).pp
    assert comm(w, Strategy(dims)).pp * ulysses * ring * tp == alone


def test_a_middle_stage_sends_both_ways():
    """With ``pp > 2`` the most loaded rank is a middle stage: activations forward and gradients back, twice a
    two-stage pipeline's end stage."""
    w = _workload()
    two = comm(w, Strategy(ParallelDims(dp=1, pp=2))).pp
    assert two == M * B * S * w.model.hidden_size * 2
    assert comm(w, Strategy(ParallelDims(dp=1, pp=4))).pp == 2 * two


@pytest.mark.parametrize("stage, gathers", [(0, 0), (1, 1), (2, 1), (3, 2)])
def test_zero_sends_the_gradient_all_reduce_and_its_parameter_all_gathers(stage, gathers):
    """Over ``sdp`` ranks: the ring all-reduce of the gradients, ``2 (sdp-1)/sdp phi g``; stages 1 and 2 then
    all-gather the updated partitions, ``(sdp-1)/sdp phi p``; stage 3 gathers the parameters for forward and again
    for backward instead, twice that."""
    w = _workload("fp32")
    strategy = Strategy(ParallelDims(dp=2, ulysses=2), zero_stage=stage)
    phi, sdp = rank_params(w, strategy), 4
    assert comm(w, strategy).dp == pytest.approx(2 * (sdp - 1) / sdp * phi * 4 + gathers * (sdp - 1) / sdp * phi * 4,
                                                 rel=1e-12)


def test_checkpointing_resends_the_forwards_collectives():
    """Recomputation reruns the forward's collectives: sequence-parallel traffic x 1.5 under ``selective`` and
    ``full`` (the forward's half of forward + backward), and under ``full`` the tensor-parallel forward's once more
    per layer."""
    w = _workload()
    dims = ParallelDims(dp=1, tp=2, ulysses=2, ring=2)
    plain, selective, full = (comm(w, Strategy(dims, checkpointing=c)) for c in ("none", "selective", "full"))
    assert selective.ulysses == full.ulysses == 1.5 * plain.ulysses > 0
    assert selective.ring == full.ring == 1.5 * plain.ring > 0
    assert selective.tp == plain.tp
    layers = w.model.num_layers * B * M
    again = tp_forward_comm_bytes("tp-sp", 2, S / 4, w.model.hidden_size, 2)
    assert full.tp == pytest.approx(plain.tp + layers * again, rel=1e-12)


def test_ulysses_and_ring_bytes_are_the_closed_forms_on_the_local_shapes():
    """Ulysses moves ``S / ring`` tokens of ``h / tp`` channels per layer; the ring passes ``S`` tokens of
    ``h / (tp ulysses)`` channels on (multi-head attention: ``kv = h``)."""
    w = _workload()
    h, layers = w.model.hidden_size, w.model.num_layers * B * M
    c = comm(w, Strategy(ParallelDims(dp=1, tp=2, ulysses=2, ring=2)))
    assert c.ulysses == layers * layer_comm_bytes("ulysses", 2, S / 2, h / 2, 2)
    assert c.ring == layers * layer_comm_bytes("ring", 2, S, h / 4, 2)


def test_a_group_is_intra_node_only_when_its_span_fits_in_a_node():
    """A group of degree ``d`` along an axis of stride ``i`` (the product of the inner degrees) lies in one node
    when ``i d`` divides the node's GPUs: on nodes of 4, TP 2 (stride 1) is intra-node, Ulysses 4 above it (stride
    2, span 8) and ZeRO's group are not, so each is timed at its own bandwidth."""
    w = _workload()
    cluster = Cluster(gpus_per_node=4, nodes=2, intra_gbps=100.0, inter_gbps=10.0)
    strategy = Strategy(ParallelDims(dp=1, tp=2, ulysses=4), zero_stage=1)
    c, t = comm(w, strategy), step_time(w, strategy, cluster)
    assert c.tp > 0 and c.ulysses > 0 and c.dp > 0
    assert t.comm_s == pytest.approx(c.tp / 100e9 + c.ulysses / 10e9 + c.dp / 10e9, rel=1e-12)


def test_the_planner_times_a_group_intra_node_exactly_when_its_ranks_share_a_node():
    """The planner and the trainer use one rank-to-node mapping: each group's bandwidth is intra-node exactly when
    every group of its kind, as :meth:`ParallelDims.group_ranks` lists the ranks, lies in one block of
    ``gpus_per_node`` consecutive ranks (ZeRO's traffic: the sequence x data group), nodes of 6 with tp 4 included."""
    w = _workload()
    checked = 0
    for tp, ulysses, ring, dp, pp in itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 3), (1, 2, 3), (1, 2)):
        dims = ParallelDims(dp=dp, ulysses=ulysses, ring=ring, tp=tp, pp=pp)
        if dims.world_size > 24:
            continue
        strategy = Strategy(dims, zero_stage=1)
        c, kinds = comm(w, strategy), dims.group_ranks()
        for per_node in (n for n in range(1, dims.world_size + 1) if dims.world_size % n == 0):
            cluster = Cluster(gpus_per_node=per_node, nodes=dims.world_size // per_node, intra_gbps=100.0,
                              inter_gbps=10.0)
            expected = 0.0
            for group, kind in (("tp", "tp"), ("ulysses", "ulysses"), ("ring", "ring"), ("pp", "pp"), ("dp", "sdp")):
                inside = all(len({rank // per_node for rank in ranks}) == 1 for ranks in kinds[kind])
                expected += getattr(c, group) / ((100.0 if inside else 10.0) * 1e9)
            assert step_time(w, strategy, cluster).comm_s == pytest.approx(expected, rel=1e-12), (dims, per_node)
            checked += 1
    assert checked > 300


def test_the_pipeline_bubble_is_pp_minus_one_over_m_plus_pp_minus_one():
    """1F1B idles ``(pp - 1) / (m + pp - 1)`` of a step; compute is stretched by ``1 / (1 - bubble)``."""
    w, cluster = _workload(), Cluster()
    flat = step_time(w, Strategy(ParallelDims(dp=8)), cluster)
    piped = step_time(w, Strategy(ParallelDims(dp=2, pp=4)), cluster)
    assert piped.bubble == 3 / (M + 3)
    assert piped.compute_s * (1 - piped.bubble) == pytest.approx(flat.compute_s * 2 / 8, rel=1e-12)
