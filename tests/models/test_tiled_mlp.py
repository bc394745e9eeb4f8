"""Tiled MLP (ALST's TiledMLP; ``MLP.tile``, ``ds4sci.kernels.tiled_mlp``): outputs and gradients (input and every
parameter) equal the untiled MLP's, GELU and SwiGLU, fp64 and fp32, for tiles that do not divide T, tiles longer than
T and one-token tiles; bf16 parameter gradients are summed in fp32; no ``[B, T, intermediate]`` activation is saved
for backward; each parameter's gradient is accumulated once per backward (not once per tile); it composes with
activation checkpointing (reentrant and not); a bad tile is named. Training under ZeRO, SP, TP and DeepSpeed's
checkpointing: tests/distributed/test_train_tiled_mlp.py."""
import functools

import pytest
import torch

from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.models.genslm.model import MLP
from ds4sci.models.genslm.model import Block

from activation_checks import SavedBytes

B, T = 2, 13


def _config(mlp: str) -> GenSLMConfig:
    if mlp == "swiglu":
        return GenSLMConfig.preset("llama-debug", vocab_size=11, pad_token_id=3)
    return GenSLMConfig.preset("debug", vocab_size=11, pad_token_id=3)


def _mlp(mlp: str, dtype: torch.dtype) -> MLP:
    torch.manual_seed(0)
    module = MLP(_config(mlp)).to(dtype)
    with torch.no_grad():
        for p in module.parameters():  # fresh random values, biases included (the model starts them at 0)
            p.normal_(0.0, 0.3)
    return module


def _close(a: torch.Tensor, b: torch.Tensor, what: str, eps: float) -> None:
    """``a`` equals ``b`` to ``eps`` relative to ``b``'s largest entry (tiling reorders the sums over tokens)."""
    torch.testing.assert_close(a, b, rtol=eps, atol=eps * b.abs().max().item(), msg=lambda m: f"{what}: {m}")


def _run(module: MLP, x: torch.Tensor, g: torch.Tensor, tile: int):
    """Output, input gradient and parameter gradients of ``module`` at ``tile`` (0: untiled), each backward from
    zeroed gradients."""
    module.tile = tile
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = module(x)
    y.backward(g)
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("tile", [4, 1, 13, 20])  # uneven last tile, one token, exactly T, longer than T
def test_tiled_equals_untiled_outputs_and_gradients(mlp, dtype, tile):
    module = _mlp(mlp, dtype)
    gen = torch.Generator().manual_seed(1)
    h = module.dense_h_to_4h.in_features
    x = torch.randn(B, T, h, generator=gen, dtype=dtype)
    g = torch.randn(B, T, h, generator=gen, dtype=dtype)
    want = _run(module, x, g, 0)
    got = _run(module, x, g, tile)
    eps = 1e-12 if dtype == torch.float64 else 1e-5
    close = functools.partial(_close, eps=eps)
    close(got[0], want[0], "output")
    close(got[1], want[1], "input gradient")
    assert set(got[2]) == set(want[2]) and len(want[2]) == (4 if mlp == "gelu" else 3)  # biases: gelu only
    for name in want[2]:
        close(got[2][name], want[2][name], name)
    with torch.no_grad():  # evaluation runs the tiles too
        close(module(x), want[0], "output without autograd")


def test_bf16_parameter_gradients_are_summed_in_fp32():
    """bf16 parameters: the tiles' gradients are summed in fp32 and rounded once, so each tiled gradient is as close
    to the exact one (fp64 arithmetic on the same bf16 values) as the untiled bf16 GEMM's, which accumulates in fp32
    (measured: within 1.3x; a bf16 running sum over the 128 tiles is 6-13x farther)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 1024, 64, generator=gen).bfloat16()
    g = torch.randn(1, 1024, 64, generator=gen).bfloat16()
    low = _mlp("gelu", torch.bfloat16)
    exact = _run(_mlp("gelu", torch.bfloat16).double(), x.double(), g.double(), 0)[2]
    untiled, tiled = _run(low, x, g, 0)[2], _run(low, x, g, 8)[2]
    for name, want in exact.items():
        err_untiled = (untiled[name].double() - want).abs().max()
        err_tiled = (tiled[name].double() - want).abs().max()
        assert tiled[name].dtype == torch.bfloat16 and err_tiled <= 2 * err_untiled, (name, err_tiled, err_untiled)


def test_no_intermediate_activation_is_saved():
    """The untiled MLP saves its [B, T, intermediate] activations (the up projection and the GELU output); the tiled
    one saves only its input. In the whole model every saved tensor is then smaller than one such activation."""
    module = _mlp("gelu", torch.float32)
    I = module.dense_h_to_4h.out_features
    x = torch.randn(B, T, module.dense_h_to_4h.in_features, requires_grad=True)
    intermediate = B * T * I * 4  # bytes of one fp32 [B, T, intermediate]
    for tile, check in ((0, lambda s: s.total >= 2 * intermediate), (4, lambda s: s.total == x.nbytes)):
        module.tile = tile
        with SavedBytes(module) as saved:
            module(x)
        assert check(saved), (tile, saved.storages, x.nbytes, intermediate)

    torch.manual_seed(0)
    model = GenSLM(_config("gelu"))
    ids = torch.randint(0, 11, (B, 16))
    pos = torch.arange(16).expand(B, 16)
    intermediate = B * 16 * model.config.intermediate_size * 4
    largest = {}
    for tile in (0, 5):
        for block in model.layers:
            block.mlp.tile = tile
        with SavedBytes(model) as saved:
            model(ids, pos)
        largest[tile] = max(saved.storages.values())
    assert largest[0] >= intermediate > largest[5], (largest, intermediate)


def _count_accumulations(module: torch.nn.Module) -> dict:
    counts = {}
    for name, p in module.named_parameters():
        counts[name] = 0
        p.register_post_accumulate_grad_hook(lambda _, n=name: counts.__setitem__(n, counts[n] + 1))
    return counts


def test_each_parameter_gradient_is_accumulated_once_per_backward():
    """What ZeRO's gradient hooks see: one accumulation per parameter per backward, whatever the number of tiles
    (13 tokens in tiles of 2: seven)."""
    module = _mlp("swiglu", torch.float32)
    counts = _count_accumulations(module)
    module.tile = 2
    x = torch.randn(B, T, module.dense_h_to_4h.in_features, requires_grad=True)
    module(x).sum().backward()
    assert counts == {name: 1 for name in counts}, counts


@pytest.mark.parametrize("reentrant", [True, False])
def test_composes_with_activation_checkpointing(reentrant):
    """A checkpointed block whose MLP is tiled: its recomputation runs the tiled MLP again; gradients equal the
    plain block's and each parameter's gradient is accumulated once."""
    cfg = _config("gelu")
    torch.manual_seed(0)
    block = Block(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, cfg.hidden_size, generator=gen)
    pos = torch.arange(T).expand(B, T)
    grads = []
    for tile, wrap in ((0, None), (3, functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=reentrant))):
        block.mlp.tile = tile
        block.zero_grad(set_to_none=True)
        counts = _count_accumulations(block) if wrap else None
        xi = x.clone().requires_grad_()
        y = block(xi, pos, None) if wrap is None else wrap(block, xi, pos, None)
        y.pow(2).sum().backward()
        grads.append([xi.grad] + [p.grad for p in block.parameters()])
    assert counts == {name: 1 for name in counts}, counts
    for i, (got, want) in enumerate(zip(*reversed(grads))):
        _close(got, want, f"gradient {i}", 1e-5)


def test_a_bad_tile_is_named():
    from ds4sci.kernels.tiled_mlp import tiled_mlp

    module = _mlp("gelu", torch.float32)
    x = torch.randn(B, T, module.dense_h_to_4h.in_features)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=rf"tile must be an integer >= 1 \(tokens\), got {bad!r}"):
            tiled_mlp(module.untiled, x, list(module.parameters()), bad)
