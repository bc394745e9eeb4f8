"""ds4sci.integrations.openfold.context_parallel: a tiny OpenFold3 EvoformerStack and PairFormerStack trained a few
SGD steps through the switch on 2 ranks, and on a 2 x 2 mesh of 4 (N_res 5, which neither divides) give, on every
rank, the losses
and final parameters of OpenFold3's own single-process stack (fp64, to rounding): the ds4sci blocks hold the OpenFold3
parameters themselves (an optimizer step on them is seen by the next forward) and their gradients are reduced.
In one process (a group of one runs the ds4sci blocks themselves): the switched stacks give OpenFold3's outputs,
hold its parameters (not copies), context_parallel_off restores OpenFold3's forward; a model without a stack is
refused."""
import pytest
import torch
from torch import nn

from ds4sci.spawn import run_workers

pytest.importorskip("openfold3.core.model.latent.pairformer")
from ds4sci.integrations import openfold as ds4sci_openfold  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

COMMON = dict(c_z=6, c_hidden_mul=5, c_hidden_pair_att=4, no_heads_pair=2, no_blocks=2, transition_n=2,
              pair_dropout=0.0, fuse_projection_weights=False, blocks_per_ckpt=None, inf=1e9)
EVO = dict(c_m=8, c_hidden_msa_att=4, c_hidden_opm=3, c_s=7, no_heads_msa=2, transition_type="relu",
           msa_dropout=0.0, no_column_attention=False, opm_first=False, eps=1e-8, **COMMON)
PAIR = dict(c_s=7, c_hidden_pair_bias=4, no_heads_pair_bias=2, transition_type="swiglu", **COMMON)
STEPS = 3


def _stack(kind):
    """A fresh OpenFold3 stack, the same random weights (std 0.1) on every call, fp64, training mode."""
    from openfold3.core.model.latent.evoformer import EvoformerStack
    from openfold3.core.model.latent.pairformer import PairFormerStack

    torch.manual_seed(0)
    stack = (EvoformerStack(**EVO) if kind == "evoformer" else PairFormerStack(**PAIR)).double().train()
    with torch.no_grad():
        for p in stack.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return stack


def _inputs(kind, n_seq=3, n_res=5):
    g = torch.Generator().manual_seed(1)
    x_shape = (1, n_seq, n_res, EVO["c_m"]) if kind == "evoformer" else (1, n_res, PAIR["c_s"])
    x = torch.randn(*x_shape, generator=g, dtype=torch.float64)
    z = torch.randn(1, n_res, n_res, COMMON["c_z"], generator=g, dtype=torch.float64)
    # no masked position: OpenFold3's values there are rounding noise (logits plus -1e9), which a loss over them
    # would compare; the parallel run pads N_res to 6 with masked positions of its own
    return x, z, torch.ones(x_shape[:-1], dtype=torch.float64), torch.ones(z.shape[:-1], dtype=torch.float64)


def _train(stack, inputs):
    """Losses of STEPS SGD steps on the mean square of every output, and the final parameters."""
    optimizer = torch.optim.SGD(stack.parameters(), lr=0.01)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = sum(o.square().mean() for o in stack(*inputs))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in stack.named_parameters()}


def _worker(rank, world, kinds, mesh=None):
    """Each stack's losses and final parameters trained through the switch on this rank."""
    out = {}
    for kind in kinds:
        stack = _stack(kind)
        assert ds4sci_openfold.context_parallel(stack, mesh=mesh, backend="torch") == [type(stack).__name__]
        layout = type(stack.forward.context_parallel).__name__
        assert layout == ("EvoformerContextParallel" if mesh is None else "EvoformerContextParallel2D"), layout
        losses, params = _train(stack, _inputs(kind))
        out[kind] = losses, {n: p.numpy() for n, p in params.items()}  # plain arrays cross processes
    return out


@pytest.fixture(scope="module")
def single_process():
    """OpenFold3's own stacks trained in this process (the reference of every rank of every world), on one thread
    as the workers run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {kind: _train(_stack(kind), _inputs(kind)) for kind in ("evoformer", "pairformer")}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world, mesh", [(2, None), (4, (2, 2))], ids=["axial-2", "mesh-2x2"])
def test_openfold3_stacks_train_through_the_switch_with_single_process_losses(world, mesh, single_process):
    for rank, result in enumerate(run_workers(_worker, world, list(single_process), mesh, timeout=600)):
        for kind, (got, params) in result.items():
            ref, ref_params = single_process[kind]
            assert got == pytest.approx(ref, rel=1e-10, abs=0), f"rank {rank}, {kind}: losses {got} != {ref}"
            error = max(float(abs(params[n] - p.numpy()).max()) for n, p in ref_params.items())
            assert error <= 1e-10, f"rank {rank}, {kind}: final parameters differ by {error}"


def test_switch_matches_openfold3_shares_parameters_and_switches_off():
    for kind in ("evoformer", "pairformer"):
        stack, inputs = _stack(kind).eval(), _inputs(kind)
        ref = stack(*inputs)
        model = nn.Sequential(stack)
        assert ds4sci_openfold.context_parallel(model, backend="torch") == ["0"]
        ours = dict(stack.forward.context_parallel.named_parameters())
        assert all(ours[name] is p for name, p in stack.named_parameters() if name.startswith("blocks.")), \
            "the ds4sci blocks must hold OpenFold3's parameters themselves"
        for got, want in zip(stack(*inputs), ref):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert ds4sci_openfold.context_parallel_off(model) == ["0"]
        assert "forward" not in stack.__dict__


def test_no_stack_is_refused():
    with pytest.raises(ValueError, match="no OpenFold3 EvoformerStack or PairFormerStack in Linear"):
        ds4sci_openfold.context_parallel(nn.Linear(2, 2))
