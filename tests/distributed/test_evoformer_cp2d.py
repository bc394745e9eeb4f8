"""ds4sci.evoformer_context_parallel(block, mesh=(2, 2)) (2-D tiles on 4 gloo ranks) against the single process,
per rank: outputs, the gradients of m and z, and every parameter's .grad when every rank computes the same loss on
the full outputs (fp64, to rounding); N_seq and N_res odd; both conventions of the ending-node triangle bias. And no
sub-module (nor the attention kernel) of any rank ever sees a tensor with two dims of N_res or more. A 3 x 3 mesh
(9 ranks) too, where the skews and the ring direction are not their own inverses as on 2 x 2. Fully masked real
rows (a sequence, an MSA column, a pair row and column) in fp64 and fp32 as the single process attends them. Stacks
of 2 blocks (block by block, and tiled between blocks) and Pairformer blocks on 2 x 2 and 3 x 3, where no op
(forward or backward) makes an N_res x N_res tensor but z itself (the pair mask neither: a rank holds its strips)."""
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ds4sci import evoformer_context_parallel
from ds4sci.models.evoformer import EvoformerBlock
from ds4sci.parallel.evoformer import ring
from ds4sci.spawn import run_workers

from test_evoformer_cp import as_numpy  # the single-process references computed once, here, on one thread
from test_evoformer_cp import from_numpy
from test_evoformer_cp import masked_errors
from test_evoformer_cp import masked_references
from test_evoformer_cp import one_thread

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# every channel count below N_res, so that "two dims of N_res or more" means a whole N_res x N_res tensor
KW = dict(c_m=8, c_z=6, c_hidden_msa_att=4, c_hidden_opm=2, c_hidden_mul=5, c_hidden_pair_att=4, no_heads_msa=2,
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


def _run(module, block, m, z, msa_mask, pair_mask, weights):
    """Outputs, input gradients and parameter gradients of ``sum(w_m * m') + sum(w_z * z')``."""
    m, z = m.clone().requires_grad_(), z.clone().requires_grad_()
    block.zero_grad(set_to_none=True)
    out_m, out_z = module(m, z, msa_mask, pair_mask)
    ((out_m * weights[0]).sum() + (out_z * weights[1]).sum()).backward()
    return {"m": out_m.detach(), "z": out_z.detach(), "grad m": m.grad, "grad z": z.grad,
            **{n: p.grad.clone() for n, p in block.named_parameters()}}


def _whole_pair_seen(block, n_res, run):
    """Names of the sub-modules (and the kernel) that ``run()`` gives a tensor with two dims >= ``n_res``."""
    seen = set()

    def check(name, *tensors):
        for t in tensors:
            if isinstance(t, torch.Tensor) and sum(d >= n_res for d in t.shape) >= 2:
                seen.add(name)

    def hook(name):
        return lambda module, args, kwargs, out: check(name, *args, *kwargs.values(),
                                                       *(out if isinstance(out, tuple) else (out,)))

    handles = [mod.register_forward_hook(hook(name), with_kwargs=True) for name, mod in block.named_modules() if name]
    kernel = ring.evoformer_attention_fwd
    ring.evoformer_attention_fwd = lambda *args, **kwargs: (check("kernel", *args), kernel(*args, **kwargs))[1]
    try:
        run()
    finally:
        ring.evoformer_attention_fwd = kernel
        for h in handles:
            h.remove()
    return seen


def _reference(n_seq, n_res, cases):
    """Per case name: the single process's outputs and gradients and its unbatched outputs (numpy arrays); and the
    sub-modules the check sees the single process give its whole pair representation (the last case's block)."""
    references = {}
    with one_thread():
        for name, options in cases:
            block = _block(options)
            inputs = _inputs(n_seq, n_res)
            single = _run(block, block, *inputs)
            with torch.no_grad():  # unbatched inputs (no leading dims)
                single["unbatched m"], single["unbatched z"] = block(*[t[0] for t in inputs[:4]])
            references[name] = as_numpy(single)
        seen = _whole_pair_seen(block, n_res, lambda: _run(block, block, *inputs))
    return references, seen


def _worker(rank, world, p, n_seq, n_res, cases, references):
    errors, seen, param_grads = {}, {}, {}
    for name, options in cases:
        block = _block(options)
        inputs = _inputs(n_seq, n_res)
        single = from_numpy(references[name])
        parallel_block = evoformer_context_parallel(block, mesh=(p, p))
        parallel = {}
        seen[name] = _whole_pair_seen(block, n_res, lambda: parallel.update(_run(parallel_block, block, *inputs)))
        with torch.no_grad():  # unbatched inputs (no leading dims)
            unbatched = [t[0] for t in inputs[:4]]
            parallel["unbatched m"], parallel["unbatched z"] = parallel_block(*unbatched)
        assert single.keys() == parallel.keys()
        errors[name] = {k: (parallel[k] - v).abs().max().item() / max(1.0, v.abs().max().item())
                        for k, v in single.items()}
        param_grads[name] = {n: parallel[n].tolist() for n, _ in block.named_parameters()}  # plain data to return
    return errors, seen, param_grads


CASES = [  # name, block options
    ("default (OpenFold3 ending-node bias)", {}),
    ("openfold convention, opm first, fused", dict(convention="openfold", opm_first=True,
                                                   fuse_projection_weights=True)),
]


@pytest.mark.parametrize("p", [2, 3], ids=["2x2", "3x3"])
def test_2d_mesh_block_equals_single_process_per_rank(p, mesh_runs):
    """One block per case on a 2 x 2 mesh (N_seq 5, N_res 9; both conventions) and a 3 x 3 mesh (N_seq 5, N_res 7)."""
    single_seen, results = mesh_runs(p)["block"]
    assert "pair_stack.tri_mul_out" in single_seen, single_seen  # the check sees the single process's whole pair
    for rank, (_, _, grads) in enumerate(results):  # the parallel runs' parameter gradients: identical on every rank
        for case, per_param in grads.items():
            for name, g in per_param.items():
                assert g == results[0][2][case][name], f"rank {rank}, {case}: {name}.grad differs from rank 0's"
    for rank, (errors, seen, _) in enumerate(results):
        for case, per_tensor in errors.items():
            bad = sorted(((e, k) for k, e in per_tensor.items() if not e <= 1e-12), reverse=True)
            assert not bad, f"rank {rank}, {case}: {len(bad)} tensors differ, the worst {bad[:3]}"
            assert not seen[case], f"rank {rank}, {case}: whole N_res x N_res tensors in {sorted(seen[case])}"


def test_mesh_argument_errors():
    block = _block({})
    for mesh, message in (((2, 3), r"square \(p, p\) of positive ints, got \(2, 3\)"),
                          ((0, 0), r"positive ints, got \(0, 0\)"),
                          ((2, 2), r"mesh=\(2, 2\) needs 4 ranks, the group has 1")):
        with pytest.raises(ValueError, match=message):
            evoformer_context_parallel(block, mesh=mesh)
    m, z, msa_mask, pair_mask, _ = _inputs(3, 4)  # mesh (1, 1) on one process: the block itself
    with torch.no_grad():
        for got, want in zip(evoformer_context_parallel(block, mesh=(1, 1))(m, z, msa_mask, pair_mask),
                             block(m, z, msa_mask, pair_mask)):
            assert torch.equal(got, want)


def _masked_case(dtype, n_seq, n_res):
    """A block in ``dtype`` and its inputs with fully masked real rows: a sequence (MSA row attention), a residue
    column of the MSA (column attention) and a row of the pair mask (triangle attention, starting node; its column
    for the ending node)."""
    block = _block({}).to(dtype)
    m, z, msa_mask, pair_mask, weights = (t.to(dtype) if isinstance(t, torch.Tensor) else [w.to(dtype) for w in t]
                                          for t in _inputs(n_seq, n_res))
    msa_mask[:, 1], msa_mask[:, :, 2], pair_mask[:, 3], pair_mask[:, :, 4] = 0, 0, 0, 0
    return block, (m, z, msa_mask, pair_mask, weights)


def test_2d_fully_masked_rows_equal_single_process(mesh_runs):
    """A real row whose keys are all masked (OpenFold's finite -1e9) attends as the kernel does in one pass over the
    real keys: fp64 to rounding, fp32 to 1e-5 (merging the tiles by row max and row sum kept apart, not by a
    log-sum-exp that loses ``log l`` against 1e9 in fp32; the padding keys at -inf, so no real row sees them)."""
    for rank, errors in enumerate(mesh_runs(2)["masked"][1]):
        for dtype, tol in (("torch.float64", 1e-12), ("torch.float32", 1e-5)):
            assert errors[dtype][0] <= tol, f"rank {rank}, {dtype}: worst {errors[dtype]}"


def _stack():
    """A 2-block Evoformer stack, random weights (std 0.3), fp64, eval mode."""
    from torch import nn

    torch.manual_seed(0)
    stack = nn.ModuleList(EvoformerBlock(**KW, backend="torch") for _ in range(2)).double().eval()
    with torch.no_grad():
        for p in stack.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return stack


def _stack_single(stack):
    """The single-process forward of a stack."""
    def single(m, z, msa_mask, pair_mask):
        for blk in stack:
            m, z = blk(m, z, msa_mask, pair_mask)
        return m, z
    return single


def _stack_worker(rank, world, n_seq, n_res, reference):
    """Per mode (sharded between blocks or block by block): the largest error of a 2-block stack against the
    single process's ``reference`` (outputs, input and parameter gradients), its parameter gradients as bytes, and
    the all-gathers it ran (calls) beside a 1-block stack's."""
    from ds4sci.distributed.comm import CommCounter

    stack = _stack()
    inputs = _inputs(n_seq, n_res)
    want = from_numpy(reference)
    results = {}
    for sharded in (True, False):
        counter = CommCounter()
        got = _run(evoformer_context_parallel(stack, mesh=(2, 2), sharded=sharded, counter=counter), stack, *inputs)
        one = CommCounter()
        _run(evoformer_context_parallel(stack[:1], mesh=(2, 2), sharded=sharded, counter=one), stack[:1], *inputs)
        error = max(((got[k] - v).abs().max().item() / max(1.0, v.abs().max().item()), k) for k, v in want.items())
        results[sharded] = error, {n: got[n].numpy().tobytes() for n, _ in stack.named_parameters()}, \
            (counter.calls["all_gather"], one.calls["all_gather"])
    return results


def _stack_reference(n_seq, n_res):
    """The single process's outputs and gradients of :func:`_stack` (numpy arrays)."""
    with one_thread():
        stack = _stack()
        return as_numpy(_run(_stack_single(stack), stack, *_inputs(n_seq, n_res)))


def test_2d_stack_tiles_between_blocks_equals_single_process(mesh_runs):
    """A 2-block stack on a 2 x 2 mesh, sharded (m and z stay this rank's tiles from the entry to the exit: as many
    all-gathers as one block's, the entry's backward and the exit) and block by block (twice one block's), equals
    the single process (fp64, to rounding); parameter gradients bitwise the same on every rank."""
    results = mesh_runs(2)["stack"][1]
    for rank, per_mode in enumerate(results):
        for sharded, (error, grads, (gathers, one_block)) in per_mode.items():
            assert error[0] <= 1e-12, f"rank {rank}, sharded={sharded}: worst {error}"
            assert grads == results[0][sharded][1], f"rank {rank}, sharded={sharded}: parameter gradients differ"
            assert gathers == (one_block if sharded else 2 * one_block) > 0, (rank, sharded, gathers, one_block)


# every channel count (and product: a SwiGLU transition's 2 n C, the attention's H c; flattened rows come with one)
# below the tests' N_res 7: a tensor with two dims of N_res or more is a whole N_res x N_res one (_WholePairOps)
PAIR_KW = dict(c_s=3, c_z=3, c_hidden_pair_bias=2, no_heads_pair_bias=2, c_hidden_mul=3, c_hidden_pair_att=2,
               no_heads_pair=2, transition_n=1, pair_dropout=0.25)


class _WholePairOps(TorchDispatchMode):
    """Every op's output (forward and backward) with two dims of ``n_res`` or more, as (op, shape), but z itself
    ``[batch, N, N, C_z]`` (each N or its padding N'): the full tensor the call takes and returns, split at the entry
    and gathered at the exit (the API's contract), which every rank holds. The pair mask is not exempt: a rank cuts
    the strips it reads out of the caller's mask, never making the whole ``[batch, N', N']``."""

    def __init__(self, batch, n_res, padded, c_z):
        super().__init__()
        self.n_res, self.seen = n_res, set()
        self.allowed = {(batch, a, b, c_z) for a in (n_res, padded) for b in (n_res, padded)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and sum(d >= self.n_res for d in t.shape) >= 2
                    and tuple(t.shape) not in self.allowed):
                self.seen.add((str(func), tuple(t.shape)))
        return out


def _pairformer_case(n_res):
    """A 2-block Pairformer stack (random weights, std 0.3, fp64, eval mode) and its inputs (s, z, single mask,
    pair mask, loss weights)."""
    from torch import nn

    from ds4sci.models.evoformer import PairformerBlock

    torch.manual_seed(0)
    stack = nn.ModuleList(PairformerBlock(**PAIR_KW, backend="torch") for _ in range(2)).double().eval()
    with torch.no_grad():
        for q in stack.parameters():
            q.copy_(torch.randn_like(q) * 0.3)
    g = torch.Generator().manual_seed(1)
    s = torch.randn(2, n_res, PAIR_KW["c_s"], generator=g, dtype=torch.float64)
    z = torch.randn(2, n_res, n_res, PAIR_KW["c_z"], generator=g, dtype=torch.float64)
    single_mask = (torch.rand(2, n_res, generator=g) > 0.2).double()
    single_mask[..., 0] = 1.0  # every single row sees a key (a fully masked one is meaningless on every path)
    pair_mask = (torch.rand(2, n_res, n_res, generator=g) > 0.2).double()
    weights = [torch.randn(s.shape, generator=g, dtype=torch.float64),
               torch.randn(z.shape, generator=g, dtype=torch.float64)]
    return stack, (s, z, single_mask, pair_mask, weights)


def _pairformer_cases(stack):
    """(name, blocks, sharded): one block; a 2-block stack tiled between blocks."""
    return (("one block", stack[0], False), ("2-block stack, tiled", stack, True))


def _pairformer_single(blocks):
    """The single-process forward of a block or a stack."""
    from torch import nn

    def single(s, z, single_mask, pair_mask):
        for blk in (blocks if isinstance(blocks, nn.ModuleList) else [blocks]):
            s, z = blk(s, z, single_mask, pair_mask)
        return s, z
    return single


def _pairformer_reference(p, n_res):
    """Per case: the single process's outputs and gradients (numpy arrays); and the ops of the 2-block stack's single
    process (forward and backward) that made a whole ``N x N`` tensor other than z (:class:`_WholePairOps`: the
    check sees its bias)."""
    with one_thread():
        stack, inputs = _pairformer_case(n_res)
        references = {name: as_numpy(_run(_pairformer_single(blocks), blocks, *inputs))
                      for name, blocks, _ in _pairformer_cases(stack)}
        with _WholePairOps(2, n_res, -(-n_res // p) * p, PAIR_KW["c_z"]) as ops:
            _run(_pairformer_single(stack), stack, *inputs)
    return references, ops.seen


def _pairformer_worker(rank, world, p, n_res, references):
    """Per case (one block; a 2-block stack tiled between blocks): the largest error against the single process's
    ``references`` (outputs, input and parameter gradients, fp64), the parameter gradients as bytes, and the ops of
    the one-block step (forward and backward) that made a whole ``N x N`` tensor other than z
    (:class:`_WholePairOps`), and per case the bytes of the pair mask's strips this rank holds."""
    stack, inputs = _pairformer_case(n_res)
    results, seen, held = {}, {}, {}
    for name, blocks, sharded in _pairformer_cases(stack):
        want = from_numpy(references[name])
        module = evoformer_context_parallel(blocks, mesh=(p, p), sharded=sharded)
        with _WholePairOps(2, n_res, -(-n_res // p) * p, PAIR_KW["c_z"]) as ops:
            got = _run(module, blocks, *inputs)
        error = max(((got[k] - v).abs().max().item() / max(1.0, v.abs().max().item()), k) for k, v in want.items())
        results[name], seen[name] = (error, {n: got[n].numpy().tobytes() for n, _ in blocks.named_parameters()}), \
            ops.seen
        _, strips, _, tile = module._regions[0]._masks  # the pair mask's row and column strips, this rank's tile
        held[name] = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (*strips, tile)}
                         .values())
    return results, seen, held


@pytest.mark.parametrize("p", [2, 3], ids=["2x2", "3x3"])
def test_2d_pairformer_equals_single_process(p, mesh_runs):
    """Pairformer blocks on a p x p mesh (z tiled, s replicated, its attention from the bias tiles), one block and a
    2-block stack tiled between blocks, N_res 7 (padded to 8 on 2 x 2, to 9 on 3 x 3): outputs, input and parameter
    gradients equal the single process (fp64, to rounding) on every rank, parameter gradients bitwise the same on every
    rank; and no op of any rank, forward or backward, makes a tensor with two dims of N_res or more but z itself, the
    pair mask included (the single process does: its bias ``[*, N, N, H_s]`` and the attention's ``[*, 1, H_s, N, N]``):
    a rank holds of the pair mask its row and column strips only, ``2 N'^2 / p`` per batch element (plan_evoformer's
    term)."""
    single_seen, results = mesh_runs(p)["pairformer"]
    assert any(shape[-1] == PAIR_KW["no_heads_pair_bias"] for _, shape in single_seen), single_seen
    padded = -(-PAIRFORMER_N_RES // p) * p
    for rank, (per_case, seen, held) in enumerate(results):
        for case, (error, grads) in per_case.items():
            assert error[0] <= 1e-12, f"rank {rank}, {case}: worst {error}"
            assert grads == results[0][0][case][1], f"rank {rank}, {case}: parameter gradients differ from rank 0's"
            assert not seen[case], f"rank {rank}, {case}: whole N_res x N_res tensors from {sorted(seen[case])[:4]}"
            # plan_evoformer's 2-D pair mask term: the strips, 2 N'^2 / p per batch element (fp64), the tile a view
            assert held[case] == 2 * 2 * padded * padded // p * 8, (rank, case, held[case])


PAIRFORMER_N_RES = 7  # padded to 8 on 2 x 2, to 9 on 3 x 3
#: Per mesh side p: the shape arguments of each test's part run on the p x p mesh.
_MESH_PARTS = {
    2: {"block": (5, 9, CASES), "masked": (5, 9), "stack": (5, 7), "pairformer": (PAIRFORMER_N_RES,)},
    3: {"block": (5, 7, CASES[:1]), "pairformer": (PAIRFORMER_N_RES,)},
}


def _single_part(name, p, shape):
    """A part's single-process run in this process: (the references its workers take, what its test checks)."""
    if name == "block":
        return _reference(*shape)
    if name == "pairformer":
        return _pairformer_reference(p, *shape)
    references = masked_references(_masked_case, _run, *shape) if name == "masked" else _stack_reference(*shape)
    return references, references


def _mesh_worker(rank, world, p, parts):
    """Every part's worker on this rank of the p x p mesh's one process group, in order: per part, its result."""
    workers = {"block": functools.partial(_worker, rank, world, p),
               "masked": functools.partial(masked_errors, _masked_case, _run,
                                           functools.partial(evoformer_context_parallel, mesh=(2, 2))),
               "stack": functools.partial(_stack_worker, rank, world),
               "pairformer": functools.partial(_pairformer_worker, rank, world, p)}
    return {name: workers[name](*shape, references) for name, (shape, references) in parts.items()}


@pytest.fixture(scope="module")
def mesh_runs():
    """``mesh_runs(p)``: per part of the p x p mesh (:data:`_MESH_PARTS`), what its test checks of the single
    process and every rank's result, the p x p ranks of one process group running every part; run once for the
    module, at its first use."""
    runs = {}

    def get(p):
        if p not in runs:
            single = {name: _single_part(name, p, shape) for name, shape in _MESH_PARTS[p].items()}
            parts = {name: (shape, single[name][0]) for name, shape in _MESH_PARTS[p].items()}
            results = run_workers(_mesh_worker, p * p, p, parts, timeout=600)
            runs[p] = {name: (single[name][1], [r[name] for r in results]) for name in parts}
        return runs[p]
    return get
