"""ds4sci.evoformer_context_parallel (1-D axial) against the single process, per rank: outputs, the gradients of m
and z, and every parameter's .grad, when every rank computes the same loss on the full outputs (fp64, to rounding).
N_seq and N_res that the group size does not divide; 2 and 3 ranks; every block option; OpenFold's convention."""
import pytest
import torch

from ds4sci import evoformer_context_parallel
from ds4sci.models.evoformer import EvoformerBlock
from ds4sci.spawn import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

KW = dict(c_m=8, c_z=6, c_hidden_msa_att=4, c_hidden_opm=3, c_hidden_mul=5, c_hidden_pair_att=4, no_heads_msa=2,
          no_heads_pair=2, transition_n=2, msa_dropout=0.15, pair_dropout=0.25)


def _block(options):
    torch.manual_seed(0)
    block = EvoformerBlock(**KW, backend="torch", **options).double().eval()
    with torch.no_grad():  # no zero-initialised output projection: every sub-module changes the result
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return block


def _inputs(n_seq, n_res):
    g = torch.Generator().manual_seed(1)
    m = torch.randn(2, n_seq, n_res, KW["c_m"], generator=g, dtype=torch.float64)
    z = torch.randn(2, n_res, n_res, KW["c_z"], generator=g, dtype=torch.float64)
    msa_mask = (torch.rand(2, n_seq, n_res, generator=g) > 0.2).double()
    pair_mask = (torch.rand(2, n_res, n_res, generator=g) > 0.2).double()
    weights = [torch.randn(2, n_seq, n_res, KW["c_m"], generator=g, dtype=torch.float64),
               torch.randn(2, n_res, n_res, KW["c_z"], generator=g, dtype=torch.float64)]
    return m, z, msa_mask, pair_mask, weights


def _run(module, block, m, z, msa_mask, pair_mask, weights, chunk_size=None):
    """Outputs, input gradients and parameter gradients of ``sum(w_m * m') + sum(w_z * z')``."""
    m, z = m.clone().requires_grad_(), z.clone().requires_grad_()
    block.zero_grad(set_to_none=True)
    out_m, out_z = module(m, z, msa_mask, pair_mask, chunk_size)
    ((out_m * weights[0]).sum() + (out_z * weights[1]).sum()).backward()
    return {"m": out_m.detach(), "z": out_z.detach(), "grad m": m.grad, "grad z": z.grad,
            **{n: p.grad.clone() for n, p in block.named_parameters()}}


def _worker(rank, world, cases):
    errors = {}
    for name, options, n_seq, n_res, chunk_size in cases:
        block = _block(options)
        inputs = _inputs(n_seq, n_res)
        single = _run(block, block, *inputs)
        parallel = _run(evoformer_context_parallel(block), block, *inputs, chunk_size)
        assert single.keys() == parallel.keys()
        errors[name] = {k: (parallel[k] - v).abs().max().item() / max(1.0, v.abs().max().item())
                        for k, v in single.items()}
    return errors


CASES = [  # name, block options, N_seq, N_res, chunk_size of the parallel run
    ("default, uneven", {}, 5, 7, None),
    ("opm first, fused, no column attention", dict(opm_first=True, fuse_projection_weights=True,
                                                   no_column_attention=True), 4, 6, None),
    ("swiglu, chunked", dict(transition_type="swiglu"), 3, 5, 2),
    ("openfold convention", dict(convention="openfold"), 5, 7, None),
]


@pytest.mark.parametrize("world", [2, 3])
def test_axial_block_equals_single_process_per_rank(world):
    results = run_workers(_worker, world, CASES if world == 2 else CASES[:1], timeout=600)
    for rank, errors in enumerate(results):
        for case, per_tensor in errors.items():
            bad = sorted(((e, k) for k, e in per_tensor.items() if not e <= 1e-12), reverse=True)
            assert not bad, f"rank {rank}, {case}: {len(bad)} tensors differ, the worst {bad[:3]}"
