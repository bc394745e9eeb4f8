"""ds4sci.distributed.dims without processes: dims validation, rank coordinates, group layout."""
import pytest

from ds4sci.distributed.dims import Coords
from ds4sci.distributed.dims import Layout
from ds4sci.distributed.dims import ParallelDims


def test_parallel_dims_valid():
    dims = ParallelDims(dp=2, ulysses=2, ring=3)
    assert (dims.sp, dims.world_size, dims.layout) == (6, 12, Layout.ZIGZAG)  # "auto" with a ring
    assert dims.coords(0) == (0, 0, 0, 0, 0)
    assert dims.coords(7) == Coords(pp=0, dp=1, ring=0, ulysses=1, tp=0)  # 7 = 1*6 + 0*2 + 1
    assert dims.coords(11) == Coords(pp=0, dp=1, ring=2, ulysses=1, tp=0)
    assert all(dims.rank_of(dims.coords(r)) == r for r in range(12))
    assert [dims.sp_rank(r) for r in (0, 5, 7, 11)] == [0, 5, 1, 5]  # ring_rank * ulysses + ulysses_rank
    assert ParallelDims.for_world(12, ulysses=2, ring=3) == dims
    zigzag = ParallelDims.for_world(8, ulysses=2, ring=2, layout="auto")
    assert (zigzag.dp, zigzag.layout, zigzag.sequence_multiple) == (2, Layout.ZIGZAG, 8)
    assert ParallelDims(dp=1, ulysses=2, layout="auto").layout is Layout.CONTIGUOUS  # no ring: nothing to balance


def test_parallel_dims_world_mismatch_names_numbers():
    # Invalid: ulysses=2 x ring=2 = 4 does not divide 10 processes
    with pytest.raises(ValueError, match=r"world size 10 is not a multiple of tp=1 x ulysses=2 x ring=2 x pp=1 = 4"):
        ParallelDims.for_world(10, ulysses=2, ring=2)
    with pytest.raises(ValueError, match=r"tp=1 x ulysses=4 = 4 must divide the number of heads 6"):
        ParallelDims(dp=1, ulysses=4).check_heads(6)


@pytest.mark.parametrize("field", ["dp", "ulysses", "ring", "tp", "pp"])
def test_parallel_dims_rejects_non_positive(field):
    kwargs = dict(dp=1, ulysses=1, ring=1, tp=1, pp=1)
    kwargs[field] = 0
    with pytest.raises(ValueError, match=f"{field}=0"):
        ParallelDims(**kwargs)
    with pytest.raises(ValueError, match="world_size=0"):
        ParallelDims.for_world(0)


def test_parallel_dims_rejects_non_int_and_unknown_layout():
    with pytest.raises(TypeError, match="ulysses"):
        ParallelDims(dp=1, ulysses=2.0, ring=1)
    with pytest.raises(TypeError, match="ring"):
        ParallelDims(dp=1, ulysses=1, ring=True)
    with pytest.raises(ValueError, match="layout='striped'"):
        ParallelDims(dp=1, layout="striped")


def test_group_ranks_layout():
    groups = ParallelDims(dp=2, ulysses=2, ring=2).group_ranks()
    assert groups["sp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # contiguous, as DeepSpeed's parallel_state_sp
    assert groups["ulysses"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["ring"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["sdp"] == [list(range(8))]
    # every rank is in exactly one group of each kind
    for kind, lists in groups.items():
        assert sorted(r for ranks in lists for r in ranks) == list(range(8)), kind


def test_group_ranks_usp_order_with_tensor_and_pipeline():
    # TP < Ulysses < Ring < DP < PP, innermost first (USP section 5): TP pairs are neighbours
    dims = ParallelDims(dp=2, ulysses=2, ring=1, tp=2, pp=2)
    assert dims.world_size == 16 and dims.coords(13) == Coords(pp=1, dp=1, ring=0, ulysses=0, tp=1)
    groups = dims.group_ranks()
    assert groups["tp"][:2] == [[0, 1], [2, 3]]
    assert groups["ulysses"][:2] == [[0, 2], [1, 3]]
    assert groups["dp"][:2] == [[0, 4], [1, 5]]
    assert groups["sdp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # ZeRO: one group per tensor and pipeline rank
    assert groups["pp"][:2] == [[0, 8], [1, 9]]
    for kind, lists in groups.items():
        assert sorted(r for ranks in lists for r in ranks) == list(range(16)), kind
    # the sequence x data index of a rank is its place in its sdp group
    for r in range(16):
        c = dims.coords(r)
        sdp = next(g for g in groups["sdp"] if r in g)
        assert sdp.index(r) == c.dp * dims.sp + dims.sp_rank(r)
    assert ParallelDims.for_world(16, ulysses=2, tp=2, pp=2) == dims
    with pytest.raises(ValueError, match=r"tp=2 x ulysses=2 x ring=1 x pp=2 = 8"):
        ParallelDims.for_world(12, ulysses=2, tp=2, pp=2)
    assert dims.sequence_multiple == 4  # 2 sequence shards, each split in 2 by TP's sequence-parallel regions


def test_parallel_dims_check_model_names_the_degree():
    dims = ParallelDims(dp=1, ulysses=2, tp=2, pp=3)
    dims.check_model(num_heads=8, num_layers=3, intermediate_size=256)
    with pytest.raises(ValueError, match=r"tp=2 x ulysses=2 = 4 must divide the number of heads 6"):
        dims.check_model(num_heads=6, num_layers=3, intermediate_size=256)
    with pytest.raises(ValueError, match=r"tp=2 must divide the MLP width intermediate_size=255"):
        dims.check_model(num_heads=8, num_layers=3, intermediate_size=255)
    with pytest.raises(ValueError, match=r"pp=3 pipeline stages need at least 3 layers, the model has 2"):
        dims.check_model(num_heads=8, num_layers=2, intermediate_size=256)
    # key/value heads: tp divides them, or they divide tp (each shared by tp/num_kv_heads ranks)
    dims = ParallelDims(dp=1, tp=4)
    for kv in (1, 2, 4, 8):
        dims.check_model(num_heads=24, num_kv_heads=kv, num_layers=1, intermediate_size=256)
    with pytest.raises(ValueError, match=r"^tp=4 and num_kv_heads=6: one must divide the other"):
        dims.check_model(num_heads=24, num_kv_heads=6, num_layers=1, intermediate_size=256)


def test_stride_is_the_rank_distance_along_an_axis():
    dims = ParallelDims(dp=2, ulysses=2, ring=3, tp=2, pp=2)
    origin = Coords(pp=0, dp=0, ring=0, ulysses=0, tp=0)
    for axis in Coords._fields:
        assert dims.rank_of(origin._replace(**{axis: 1})) == dims.stride(axis), axis
    assert [dims.stride(a) for a in ("tp", "ulysses", "ring", "dp", "pp")] == [1, 2, 4, 12, 24]
    assert dims.sdp == 12 and max(len(g) for g in dims.group_ranks()["sdp"]) == dims.sdp
    with pytest.raises(ValueError, match="axis='sp'"):
        dims.stride("sp")
