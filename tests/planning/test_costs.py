"""ds4sci.planning.costs: the closed forms the planner composes (measured against by ds4sci bench comm-volume and
memory-breakdown)."""
from ds4sci.planning.costs import layer_comm_bytes


def test_closed_forms_ulysses_flat_ring_and_megatron_grow():
    per_rank = {s: [layer_comm_bytes(s, P, 1024 * P, 64, 4) for P in (2, 4, 8, 16)]
                for s in ("ulysses", "ring", "megatron-sp")}
    u = per_rank["ulysses"]
    assert max(u) / min(u) < 1.9 and u[-1] / u[-2] < 1.08  # bounded by 8 N0 h, approached from below
    assert all(b > a * 1.8 for a, b in zip(per_rank["ring"], per_rank["ring"][1:]))
    assert all(b > a * 1.8 for a, b in zip(per_rank["megatron-sp"], per_rank["megatron-sp"][1:]))


def test_mask_policies_cover_the_planners():
    from ds4sci.planning.costs import MASK_POLICIES
    from ds4sci.planning.costs import mask_bytes
    from ds4sci.planning.genslm import MASKS

    assert set(MASKS) - {"none"} <= set(MASK_POLICIES)  # the planner's "none": causal inside the kernel, no mask
    assert [mask_bytes(p, 8)["device"] for p in MASK_POLICIES] == [256, 64, 64, 64]
