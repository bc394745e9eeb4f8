"""ds4sci.evoformer_context_parallel called as the wrapped block is, by its own argument names: Evoformer blocks
``(m, z, msa_mask=, pair_mask=, chunk_size=)``, Pairformer blocks ``(s, z, single_mask=, pair_mask=, chunk_size=)``,
blocks and stacks, axial (2 gloo ranks) and on a 2 x 2 mesh: outputs, input gradients and parameter gradients
bitwise those of the positional call and, to fp64 rounding, the single process's. A name the block does not take
is the block's own TypeError."""
import pytest
import torch
from torch import nn

from ds4sci import evoformer_context_parallel
from ds4sci.models.evoformer import EvoformerBlock
from ds4sci.models.evoformer import PairformerBlock
from ds4sci.spawn import run_workers

from test_evoformer_cp import as_numpy  # the single-process references computed once, here, on one thread
from test_evoformer_cp import from_numpy
from test_evoformer_cp import one_thread

EVO = dict(c_m=8, c_z=6, c_hidden_msa_att=4, c_hidden_opm=3, c_hidden_mul=5, c_hidden_pair_att=4, no_heads_msa=2,
           no_heads_pair=2, transition_n=2, msa_dropout=0.15, pair_dropout=0.25)
PAIR = dict(c_s=7, c_z=6, c_hidden_pair_bias=4, no_heads_pair_bias=2, c_hidden_mul=5, c_hidden_pair_att=4,
            no_heads_pair=2, transition_n=2, pair_dropout=0.25)


def _blocks(kind: str, n_blocks: int):
    """A block (``n_blocks`` 1) or an ``nn.ModuleList`` stack, random weights, fp64, eval mode."""
    torch.manual_seed(0)
    make = (lambda: EvoformerBlock(**EVO, backend="torch")) if kind == "evoformer" else \
        (lambda: PairformerBlock(**PAIR, backend="torch"))
    stack = nn.ModuleList(make() for _ in range(n_blocks)).double().eval()
    with torch.no_grad():  # no zero-initialised output projection
        for p in stack.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return stack[0] if n_blocks == 1 else stack


def _inputs(kind: str, n_seq: int = 3, n_res: int = 5) -> dict:
    """The block's keyword arguments: m (Evoformer) or s (Pairformer), z and their masks."""
    g = torch.Generator().manual_seed(1)
    x_shape = (1, n_seq, n_res, EVO["c_m"]) if kind == "evoformer" else (1, n_res, PAIR["c_s"])
    x = torch.randn(*x_shape, generator=g, dtype=torch.float64)
    z = torch.randn(1, n_res, n_res, EVO["c_z"], generator=g, dtype=torch.float64)
    x_mask = (torch.rand(*x_shape[:-1], generator=g) > 0.2).double()
    x_mask[..., 0] = 1.0  # no fully masked row: they are padding, rounding noise on every path
    pair_mask = (torch.rand(1, n_res, n_res, generator=g) > 0.2).double()
    if kind == "evoformer":
        return dict(m=x, z=z, msa_mask=x_mask, pair_mask=pair_mask)
    return dict(s=x, z=z, single_mask=x_mask, pair_mask=pair_mask)


def _single(blocks):
    """The single-process forward of a block or stack, with the block's keywords."""
    if not isinstance(blocks, nn.ModuleList):
        return blocks

    def run(*args, **kwargs):
        for block in blocks:
            args, kwargs = block(*args, **kwargs), {k: v for k, v in kwargs.items() if k not in ("m", "s", "z")}
        return args
    return run


def _run(module, blocks, inputs: dict, by_name: bool) -> dict:
    """Outputs, input gradients and parameter gradients of the sum of both outputs, called by name or by position
    (the first two by position, the rest by name, when ``by_name``)."""
    leaves = {k: v.clone().requires_grad_() if k in ("m", "s", "z") else v for k, v in inputs.items()}
    blocks.zero_grad(set_to_none=True)
    values = list(leaves.values())
    if by_name == "mixed":
        out = module(*values[:2], **dict(list(leaves.items())[2:]), chunk_size=None)
    else:
        out = module(**leaves) if by_name else module(*values)
    (out[0].sum() + (out[1] * 0.5).sum()).backward()
    return {"x": out[0].detach(), "z": out[1].detach(), "grad x": values[0].grad, "grad z": values[1].grad,
            **{n: p.grad.clone() for n, p in blocks.named_parameters()}}


def _singles(cases) -> dict:
    """Per (kind, blocks) of ``cases``: the single process's outputs and gradients called by name (numpy arrays),
    computed once, here, on one thread (as the workers run), and passed to the workers."""
    singles = {}
    with one_thread():
        for kind, n_blocks, *_ in cases:
            if (kind, n_blocks) not in singles:
                blocks = _blocks(kind, n_blocks)
                singles[kind, n_blocks] = as_numpy(_run(_single(blocks), blocks, _inputs(kind), True))
    return singles


def _worker(rank, world, cases, singles):
    """Per case: the largest difference of the keyword call to the positional call and to the single process
    (``singles``: :func:`_singles`)."""
    diffs = {}
    for kind, n_blocks, sharded, mesh in cases:
        blocks, inputs = _blocks(kind, n_blocks), _inputs(kind)
        module = evoformer_context_parallel(blocks, mesh=mesh, sharded=sharded)
        positional = _run(module, blocks, inputs, False)
        single = from_numpy(singles[kind, n_blocks])
        for by_name in (True, "mixed"):
            named = _run(module, blocks, inputs, by_name)
            diffs[f"{kind} x{n_blocks} sharded={sharded} mesh={mesh} by_name={by_name}"] = (
                max((named[k] - v).abs().max().item() for k, v in positional.items()),
                max((named[k] - v).abs().max().item() for k, v in single.items()))
    return diffs


def _check(results):
    for rank, diffs in enumerate(results):
        for case, (to_positional, to_single) in diffs.items():
            assert to_positional == 0, f"rank {rank}, {case}: differs from the positional call by {to_positional}"
            assert to_single <= 1e-12, f"rank {rank}, {case}: differs from the single process by {to_single}"


@pytest.mark.distributed
@pytest.mark.slow
def test_axial_called_by_the_blocks_own_names():
    cases = [("evoformer", 1, False, None), ("pairformer", 1, False, None), ("evoformer", 2, True, None),
             ("pairformer", 2, False, None)]
    _check(run_workers(_worker, 2, cases, _singles(cases), timeout=600))


@pytest.mark.distributed
@pytest.mark.slow
def test_2d_mesh_called_by_the_blocks_own_names():
    cases = [("evoformer", 1, False, (2, 2)), ("pairformer", 2, True, (2, 2))]
    _check(run_workers(_worker, 4, cases, _singles(cases), timeout=600))


def test_one_process_by_name_and_a_name_the_block_does_not_take():
    """A group of one runs the blocks themselves; called by name as they are; ``x_mask`` (the old wrapper's name for
    both masks) is refused as the block refuses it."""
    cases = [("evoformer", 1, False, None), ("pairformer", 2, True, None)]
    _check([_worker(0, 1, cases, _singles(cases))])
    for kind in ("evoformer", "pairformer"):
        blocks, inputs = _blocks(kind, 1), _inputs(kind)
        x, z, x_mask, pair_mask = inputs.values()
        for call in (blocks, evoformer_context_parallel(blocks)):
            with pytest.raises(TypeError, match="x_mask"):
                call(x, z, x_mask=x_mask, pair_mask=pair_mask)
