"""ds4sci.distributed.nodes without processes: the rank-to-node mapping against a brute force over the actual group
rank lists, the layout that keeps tensor and Ulysses groups inside a node, and the one-line refusal."""
import functools
import itertools

import pytest

from ds4sci.distributed.dims import ParallelDims
from ds4sci.distributed.nodes import cross_node_error
from ds4sci.distributed.nodes import describe_nodes
from ds4sci.distributed.nodes import inside_node
from ds4sci.distributed.nodes import node_of
from ds4sci.distributed.nodes import node_safe_dims


def _brute_inside(groups: list[list[int]], per_node: int) -> bool:
    """Every group, a list of global ranks, on one node (ranks placed node by node)."""
    return all(len({rank // per_node for rank in group}) == 1 for group in groups)


@functools.cache
def _group_ranks(dims: ParallelDims) -> dict[str, list[list[int]]]:
    return dims.group_ranks()


def _layouts():
    """Every layout of up to 24 ranks with degrees 1..4 (ring, dp 1..3, pp 1..2), with its group rank lists."""
    for tp, ulysses, ring, dp, pp in itertools.product((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3), (1, 2, 3), (1, 2)):
        dims = ParallelDims(dp=dp, ulysses=ulysses, ring=ring, tp=tp, pp=pp)
        if dims.world_size <= 24:
            yield dims, _group_ranks(dims)


def test_inside_node_agrees_with_the_group_rank_lists_for_every_kind_and_node_size():
    """Every kind of group, every node size from 1 to the world + 1 (nodes of 6 with tp 4, a last node part full)."""
    checked = 0
    for dims, kinds in _layouts():
        for per_node, (kind, groups) in itertools.product(range(1, dims.world_size + 2), kinds.items()):
            assert inside_node(dims, kind, per_node) == _brute_inside(groups, per_node), (dims, kind, per_node)
            checked += 1
    assert checked > 5000


def test_a_node_size_that_is_not_a_multiple_of_the_group_still_splits_a_group():
    """6 per node with tp=4: the group of ranks 4..7 has ranks on nodes 0 and 1, though 6 >= 4; a node of 8 or one
    node of 6 holding the whole world keeps every group."""
    dims = ParallelDims(dp=3, tp=4)
    assert [node_of(r, 6) for r in range(4, 8)] == [0, 0, 1, 1]
    assert not inside_node(dims, "tp", 6) and inside_node(dims, "tp", 4) and inside_node(dims, "tp", 12)
    assert inside_node(ParallelDims(dp=1, ulysses=2, tp=3), "ulysses", 6)  # one node: 6 ranks on 6
    assert not inside_node(ParallelDims(dp=2, ulysses=2, tp=3), "ulysses", 4)
    assert inside_node(dims, "dp", 6) is False and inside_node(dims, "pp", 1)  # degree 1: a group of one rank
    with pytest.raises(ValueError, match="kind='mesh' is not one of"):
        inside_node(dims, "mesh", 4)
    with pytest.raises(ValueError, match="per_node=0 must be >= 1"):
        inside_node(dims, "tp", 0)


def test_node_safe_dims_keep_tensor_and_ulysses_inside_on_the_same_world():
    for dims, kinds in _layouts():
        for per_node in range(1, dims.world_size + 2):
            safe = node_safe_dims(dims, per_node)
            assert (safe.world_size, safe.pp) == (dims.world_size, dims.pp), (dims, per_node)
            safe_kinds = _group_ranks(safe)
            assert _brute_inside(safe_kinds["tp"], per_node) and _brute_inside(safe_kinds["ulysses"], per_node)
            assert dims.tp % safe.tp == 0 and dims.ulysses % safe.ulysses == 0  # what split the heads still does
            tp_inside = _brute_inside(kinds["tp"], per_node)
            if tp_inside and _brute_inside(kinds["ulysses"], per_node):
                assert safe == dims
            elif tp_inside:  # only Ulysses moves, to the ring
                assert (safe.tp, safe.dp, safe.sp) == (dims.tp, dims.dp, dims.sp) and safe.ulysses < dims.ulysses


def test_the_refusal_names_the_dims_the_nodes_and_a_layout_that_fits():
    two_nodes = ParallelDims(dp=1, ulysses=2)
    assert cross_node_error(two_nodes, 2, 1, force="or set parallel.allow_cross_node=true") == (
        "ulysses=2 groups would span nodes on 2 node(s) x 1 process(es) per node; parallel.ulysses=1 parallel.ring=2 "
        "keeps them inside a node on the same 2 processes, or set parallel.allow_cross_node=true")
    tp_inside = ParallelDims(dp=1, ulysses=2, tp=4)  # 8 ranks on 2 nodes of 4: tp stays, Ulysses moves
    assert cross_node_error(tp_inside, 2, 4) == (
        "ulysses=2 groups would span nodes on 2 node(s) x 4 process(es) per node; parallel.ulysses=1 parallel.ring=2 "
        "keeps them inside a node on the same 8 processes")
    wide = ParallelDims(dp=3, tp=4, ulysses=2)  # 24 ranks, nodes of 6: tp 4 spans nodes, so does tp x ulysses
    message = cross_node_error(wide, 4, 6, option=lambda key, value: f"--{key} {value}")
    assert message.startswith("tp=4 and ulysses=2 groups would span nodes on 4 node(s) x 6 process(es) per node; "
                              "--tp 2 --ulysses 1 --ring 2 --dp 6 keeps them inside"), message
    assert cross_node_error(ParallelDims(dp=2, ulysses=4, ring=2), 2, 8) is None  # the ring may span nodes
    assert cross_node_error(ParallelDims(dp=4, tp=2), 8, 1).startswith(
        "tp=2 groups would span nodes on 8 node(s) x 1 process(es) per node; parallel.tp=1 parallel.dp=8 keeps")


def test_describe_nodes_names_each_dimension_above_one():
    dims = ParallelDims(dp=2, ulysses=2, tp=2)
    assert describe_nodes(dims, 2) == "tp 2 inside a node, ulysses 2 across nodes, dp 2 across nodes"
    assert describe_nodes(dims, 8) == "tp 2 inside a node, ulysses 2 inside a node, dp 2 inside a node"
    assert describe_nodes(ParallelDims(dp=1), 1) == "no parallel dimension"
