"""ds4sci.evoformer_context_parallel (1-D axial) against the single process, per rank: outputs, the gradients of the
two representations, and every parameter's .grad, when every rank computes the same loss on the full outputs (fp64,
to rounding); the parameter gradients bitwise the same on every rank. Evoformer and Pairformer blocks and stacks
(block by block, and sharded between blocks); N_seq and N_res that the group size does not divide (at 4 ranks with
N_res 5, a rank holding only padding); 2, 3 and 4 ranks; every Evoformer option; OpenFold's convention."""
import contextlib

import pytest
import torch
from torch import nn

from ds4sci import evoformer_context_parallel
from ds4sci.models.evoformer import EvoformerBlock
from ds4sci.models.evoformer import PairformerBlock
from ds4sci.spawn import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

KW = dict(c_m=8, c_z=6, c_hidden_msa_att=4, c_hidden_opm=3, c_hidden_mul=5, c_hidden_pair_att=4, no_heads_msa=2,
          no_heads_pair=2, transition_n=2, msa_dropout=0.15, pair_dropout=0.25)
PAIR_KW = dict(c_s=7, c_z=6, c_hidden_pair_bias=4, no_heads_pair_bias=2, c_hidden_mul=5, c_hidden_pair_att=4,
               no_heads_pair=2, transition_n=2, pair_dropout=0.25)


def _blocks(kind, options, n_blocks):
    """A block (``n_blocks`` 1) or an ``nn.ModuleList`` stack, random weights (std 0.3), fp64, eval mode."""
    torch.manual_seed(0)
    make = (lambda: EvoformerBlock(**KW, backend="torch", **options)) if kind == "evoformer" else \
        (lambda: PairformerBlock(**PAIR_KW, backend="torch", **options))
    stack = nn.ModuleList(make() for _ in range(n_blocks)).double().eval()
    with torch.no_grad():  # no zero-initialised output projection: every sub-module changes the result
        for p in stack.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return stack[0] if n_blocks == 1 else stack


def _inputs(kind, n_seq, n_res):
    """(x, z, x_mask, pair_mask, loss weights of the two outputs): x is m (Evoformer) or s (Pairformer)."""
    g = torch.Generator().manual_seed(1)
    x_shape = (2, n_seq, n_res, KW["c_m"]) if kind == "evoformer" else (2, n_res, PAIR_KW["c_s"])
    x = torch.randn(*x_shape, generator=g, dtype=torch.float64)
    z = torch.randn(2, n_res, n_res, KW["c_z"], generator=g, dtype=torch.float64)
    x_mask = (torch.rand(*x_shape[:-1], generator=g) > 0.2).double()
    if kind == "pairformer":
        x_mask[..., 0] = 1.0  # a fully masked single row is padding whose values are rounding noise on every path
    pair_mask = (torch.rand(2, n_res, n_res, generator=g) > 0.2).double()
    weights = [torch.randn(x.shape, generator=g, dtype=torch.float64),
               torch.randn(z.shape, generator=g, dtype=torch.float64)]
    return x, z, x_mask, pair_mask, weights


def _single(blocks):
    """The single-process forward of a block or stack."""
    if not isinstance(blocks, nn.ModuleList):
        return blocks

    def run(x, z, x_mask, pair_mask, chunk_size=None):
        for block in blocks:
            x, z = block(x, z, x_mask, pair_mask, chunk_size)
        return x, z
    return run


def _run(module, blocks, x, z, x_mask, pair_mask, weights, chunk_size=None):
    """Outputs, input gradients and parameter gradients of ``sum(w_x * x') + sum(w_z * z')``."""
    x, z = x.clone().requires_grad_(), z.clone().requires_grad_()
    blocks.zero_grad(set_to_none=True)
    out_x, out_z = module(x, z, x_mask, pair_mask, chunk_size)
    ((out_x * weights[0]).sum() + (out_z * weights[1]).sum()).backward()
    return {"x": out_x.detach(), "z": out_z.detach(), "grad x": x.grad, "grad z": z.grad,
            **{n: p.grad.clone() for n, p in blocks.named_parameters()}}


@contextlib.contextmanager
def one_thread():
    """This process on one thread, as the workers run: the single-process references are computed once here (not
    on every rank of every world) and passed to the workers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def as_numpy(results):
    """``_run``'s tensors as numpy arrays: plain data for the workers' arguments."""
    return {k: v.numpy() for k, v in results.items()}


def from_numpy(arrays):
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def _reference(cases):
    """Per case name: the single process's outputs and gradients (``_run``), as numpy arrays."""
    refs = {}
    with one_thread():
        for name, kind, options, n_blocks, _, n_seq, n_res, _ in cases:
            blocks = _blocks(kind, options, n_blocks)
            refs[name] = as_numpy(_run(_single(blocks), blocks, *_inputs(kind, n_seq, n_res)))
    return refs


def _worker(rank, world, cases, references):
    errors, grads = {}, {}
    for name, kind, options, n_blocks, sharded, n_seq, n_res, chunk_size in cases:
        blocks = _blocks(kind, options, n_blocks)
        inputs = _inputs(kind, n_seq, n_res)
        single = from_numpy(references[name])
        parallel = _run(evoformer_context_parallel(blocks, sharded=sharded), blocks, *inputs, chunk_size)
        assert single.keys() == parallel.keys()
        errors[name] = {k: (parallel[k] - v).abs().max().item() / max(1.0, v.abs().max().item())
                        for k, v in single.items()}
        grads[name] = {n: p.grad.numpy().tobytes() for n, p in blocks.named_parameters()}  # bits, not shared memory
    return errors, grads


CASES = [  # name, kind, block options, blocks, sharded, N_seq, N_res, chunk_size of the parallel run
    ("evoformer, uneven", "evoformer", {}, 1, False, 5, 7, None),
    ("evoformer, opm first, fused, no column attention", "evoformer",
     dict(opm_first=True, fuse_projection_weights=True, no_column_attention=True), 1, False, 4, 6, None),
    ("evoformer, swiglu, chunked", "evoformer", dict(transition_type="swiglu"), 1, False, 3, 5, 2),
    ("evoformer, openfold convention", "evoformer", dict(convention="openfold"), 1, False, 5, 7, None),
    ("pairformer, uneven", "pairformer", {}, 1, False, None, 7, None),
    ("pairformer, fused, chunked", "pairformer", dict(fuse_projection_weights=True), 1, False, None, 6, 2),
    ("evoformer stack, block by block", "evoformer", {}, 2, False, 5, 7, None),
    ("evoformer stack, sharded", "evoformer", dict(opm_first=True), 3, True, 5, 7, None),
    ("pairformer stack, sharded", "pairformer", {}, 3, True, None, 5, None),
]
SMALL = [CASES[0], CASES[4], CASES[7], CASES[8]]


def _group_worker(rank, world, cases, references, masked):
    """One process group's runs: :func:`_worker`'s, and (when ``masked`` holds its references) the fully masked rows'
    :func:`masked_errors` of the 5 x 7 block of :func:`_masked_case`."""
    return _worker(rank, world, cases, references), masked and masked_errors(
        _masked_case, _run, evoformer_context_parallel, 5, 7, masked)


@pytest.fixture(scope="module")
def groups():
    """``groups(world)``: every rank's results of ``world`` ranks' one process group, run once for the module at its
    first use: the axial cases (every case on 2 ranks, :data:`SMALL` on 3 and 4) and, on 2 ranks, the fully masked
    rows' (:func:`_group_worker`)."""
    references, runs = {}, {}

    def get(world):
        if world not in runs:
            if not references:
                references.update(_reference(CASES))
            cases = CASES if world == 2 else SMALL
            masked = masked_references(_masked_case, _run, 5, 7) if world == 2 else None
            runs[world] = run_workers(_group_worker, world, cases, {name: references[name] for name, *_ in cases},
                                      masked, timeout=600)
        return runs[world]
    return get


@pytest.mark.parametrize("world", [2, 3, 4])
def test_axial_equals_single_process_per_rank(world, groups):
    results = [axial for axial, _ in groups(world)]
    for rank, (errors, grads) in enumerate(results):
        for case, per_tensor in errors.items():
            bad = sorted(((e, k) for k, e in per_tensor.items() if not e <= 1e-12), reverse=True)
            assert not bad, f"rank {rank}, {case}: {len(bad)} tensors differ, the worst {bad[:3]}"
            differ = [n for n, g in grads[case].items() if g != results[0][1][case][n]]
            assert not differ, f"rank {rank}, {case}: parameter gradients differ from rank 0's: {differ[:3]}"


def _masked_case(dtype, n_seq, n_res):
    """An Evoformer block in ``dtype`` and its inputs with fully masked real rows: a sequence, an MSA column, a pair
    row and a pair column."""
    block = _blocks("evoformer", {}, 1).to(dtype)
    m, z, msa_mask, pair_mask, weights = _inputs("evoformer", n_seq, n_res)
    m, z, msa_mask, pair_mask = (t.to(dtype) for t in (m, z, msa_mask, pair_mask))
    weights = [w.to(dtype) for w in weights]
    msa_mask[:, 1], msa_mask[:, :, 2], pair_mask[:, 3], pair_mask[:, :, 4] = 0, 0, 0, 0
    return block, (m, z, msa_mask, pair_mask, weights)


def masked_errors(case, run, wrap, n_seq, n_res, references):
    """Per dtype (fp64, fp32): the largest error relative to the single process's ``references`` over outputs, input
    and parameter gradients, with its name, of the block of ``case(dtype, n_seq, n_res)`` wrapped by ``wrap(block)``
    and run by ``run(module, block, *inputs)`` (this file's and the 2-D file's fully masked rows)."""
    errors = {}
    for dtype in (torch.float64, torch.float32):
        block, inputs = case(dtype, n_seq, n_res)
        got = run(wrap(block), block, *inputs)
        errors[str(dtype)] = max(((got[k] - v).abs().max().item() / max(1.0, v.abs().max().item()), k)
                                 for k, v in from_numpy(references[str(dtype)]).items())
    return errors


def masked_references(case, run, n_seq, n_res):
    """Per dtype: the single process's outputs and gradients (numpy arrays, one thread) for :func:`masked_errors`."""
    with one_thread():
        return {str(dtype): as_numpy(run(block, block, *inputs))
                for dtype in (torch.float64, torch.float32) for block, inputs in [case(dtype, n_seq, n_res)]}


def test_axial_fully_masked_rows_equal_single_process(groups):
    """A real row whose keys are all masked (OpenFold's finite -1e9) with N_seq and N_res padded: the padding keys
    are at -inf, so it attends over its real keys as the single process does (fp64 to rounding, fp32 to 1e-5)."""
    for rank, (_, errors) in enumerate(groups(2)):
        for dtype, tol in (("torch.float64", 1e-12), ("torch.float32", 1e-5)):
            assert errors[dtype][0] <= tol, f"rank {rank}, {dtype}: worst {errors[dtype]}"


def test_not_a_block_or_a_mixed_stack_is_refused_by_name():
    from torch import nn

    from ds4sci import evoformer_context_parallel

    for bad in (nn.Linear(2, 2), [], [nn.Linear(2, 2)]):
        with pytest.raises(TypeError, match="expected a ds4sci EvoformerBlock or PairformerBlock"):
            evoformer_context_parallel(bad)
