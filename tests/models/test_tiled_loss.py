"""Tiled loss (ALST's tiled loss; ``OutputHead.tile``, ``ds4sci.kernels.tiled_loss``): the summed loss and the
gradients of the final hidden states and of the head weight equal the untiled head + cross entropy's, fp64 and fp32,
for tiles that do not divide T, tiles longer than T, one-token tiles and a tile whose targets are all ignored, with a
tied head (the embedding's weight, both uses' gradients summed); bf16 gradients are as close to exact as the untiled
ones; no tensor with a vocabulary-sized dim over the sequence is saved for backward; each parameter's gradient is
accumulated once per backward; a bad tile is named. Training under ZeRO-3, Ulysses and TP:
tests/distributed/test_train_tiled_loss.py."""
import functools

import pytest
import torch

from ds4sci.models.genslm import IGNORE_INDEX
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.models.genslm import token_loss
from ds4sci.models.genslm.model import OutputHead

B, T, H, V = 2, 13, 8, 11


def _close(a: torch.Tensor, b: torch.Tensor, what: str, eps: float) -> None:
    """``a`` equals ``b`` to ``eps`` relative to ``b``'s largest entry (tiling reorders the sums over tokens)."""
    torch.testing.assert_close(a, b, rtol=eps, atol=eps * b.abs().max().item(), msg=lambda m: f"{what}: {m}")


def _inputs(dtype: torch.dtype, seed: int = 1):
    """A head with fresh random weights, hidden states and targets: some ignored, tokens 4..7 all ignored (one whole
    tile at tile 4)."""
    gen = torch.Generator().manual_seed(seed)
    head = OutputHead(H, V).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=gen, dtype=dtype))
    x = torch.randn(B, T, H, generator=gen, dtype=dtype)
    targets = torch.randint(0, V, (B, T), generator=gen)
    targets[:, 4:8] = IGNORE_INDEX
    targets[1, 11] = IGNORE_INDEX
    return head, x, targets


def _run(head: OutputHead, x: torch.Tensor, targets: torch.Tensor, tile: int):
    """Loss sum, hidden-state gradient and weight gradient at ``tile`` (0: the untiled head and ``token_loss``)."""
    head.tile = tile
    head.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    loss = head(x, targets) if tile else token_loss(head(x), targets, "sum")
    loss.backward()
    return loss.detach(), x.grad, head.weight.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("tile", [4, 1, 13, 20])  # uneven last tile (and an all-ignored one), one token, T, > T
def test_tiled_equals_untiled_loss_and_gradients(dtype, tile):
    head, x, targets = _inputs(dtype)
    want, got = _run(head, x, targets, 0), _run(head, x, targets, tile)
    eps = 1e-12 if dtype == torch.float64 else 1e-5
    for what, g, w in zip(("loss", "hidden-state gradient", "head weight gradient"), got, want):
        _close(g, w, what, eps)
    assert got[0].dtype == want[0].dtype == torch.float32  # token_loss's log-softmax is fp32 (also for fp64 logits)
    with torch.no_grad():  # evaluation runs the tiles too
        _close(head(x, targets), want[0], "loss without autograd", eps)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tied_head_equals_untiled(dtype):
    """A tied GenSLM (``embed_out.weight is embed_in.weight``): loss and every parameter's gradient, the shared one
    summing the embedding's and the head's uses."""
    cfg = GenSLMConfig.preset("debug", vocab_size=V, pad_token_id=3, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = GenSLM(cfg).to(dtype)
    assert model.embed_out.weight is model.embed_in.weight
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (B, T), generator=gen)
    pos = torch.arange(T).expand(B, T)
    targets = torch.randint(0, V, (B, T), generator=gen)
    targets[:, :3] = IGNORE_INDEX
    results = []
    for tile in (0, 5):
        model.embed_out.tile = tile
        model.zero_grad(set_to_none=True)
        loss = model(ids, pos, targets=targets) if tile else token_loss(model(ids, pos), targets, "sum")
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    eps = 1e-12 if dtype == torch.float64 else 1e-5
    _close(got, want, "loss", eps)
    assert "embed_in.weight" in want_grads and "embed_out.weight" not in want_grads  # one parameter
    for name in want_grads:
        _close(got_grads[name], want_grads[name], name, eps)


def test_bf16_gradients_are_as_close_as_untiled():
    """bf16 head and hidden states: the weight gradient is summed over the tiles in fp32 and rounded once, so the
    tiled gradients are as close to the exact ones (fp64 arithmetic on the same bf16 values) as the untiled bf16
    head's (within 2x), and the loss is fp32."""
    head, x, targets = _inputs(torch.bfloat16, seed=2)
    x = torch.randn(1, 512, H, generator=torch.Generator().manual_seed(5)).bfloat16()
    targets = torch.randint(0, V, (1, 512), generator=torch.Generator().manual_seed(6))
    ref = OutputHead(H, V).double()
    with torch.no_grad():
        ref.weight.copy_(head.weight.double())
    exact = _run(ref, x.double(), targets, 0)
    untiled, tiled = _run(head, x, targets, 0), _run(head, x, targets, 8)
    assert tiled[0].dtype == torch.float32
    for i, what in enumerate(("loss", "hidden-state gradient", "head weight gradient")):
        err_untiled = (untiled[i].double() - exact[i]).abs().max()
        err_tiled = (tiled[i].double() - exact[i]).abs().max()
        assert err_tiled <= 2 * err_untiled + 1e-6 * exact[i].abs().max(), (what, err_tiled, err_untiled)
    assert tiled[2].dtype == torch.bfloat16


class SavedShapes:
    """The shapes of the tensors autograd saves for backward while active, parameters left out."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.shapes = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in self.params:
            self.shapes.append(tuple(t.shape))
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def _holds_logits(shape: tuple, tokens: int) -> bool:
    """A vocabulary-sized dim together with ``tokens`` tokens (in one dim or as ``B x T``)."""
    return V in shape and (tokens in shape or B * tokens in shape or (B in shape and T in shape))


def test_no_vocabulary_sized_tensor_of_the_sequence_is_saved():
    """Untiled, the head and the loss save ``[B*T, V]`` tensors (the fp32 logits, their log-softmax); tiled, only the
    hidden states ``[B, T, H]`` and the targets ``[B, T]`` are saved."""
    head, x, targets = _inputs(torch.float32)
    x.requires_grad_()
    saved = {}
    for tile in (0, 4):
        head.tile = tile
        with SavedShapes(head.parameters()) as s:
            head(x, targets) if tile else token_loss(head(x), targets, "sum")
        saved[tile] = s.shapes
    assert any(_holds_logits(shape, T) for shape in saved[0]), saved[0]
    assert sorted(saved[4]) == sorted([(B, T, H), (B, T)]), saved[4]


def test_each_parameter_gradient_is_accumulated_once_per_backward():
    """What ZeRO's gradient hooks see: one accumulation of the head weight per backward (13 tokens in tiles of 2:
    seven)."""
    head, x, targets = _inputs(torch.float32)
    counts = {"n": 0}
    head.weight.register_post_accumulate_grad_hook(lambda _: counts.__setitem__("n", counts["n"] + 1))
    head.tile = 2
    head(x.requires_grad_(), targets).backward()
    assert counts["n"] == 1


def test_a_bad_tile_is_named():
    from ds4sci.kernels.tiled_loss import tiled_loss
    from ds4sci.train.activation_checkpointing import apply_tiled_loss

    head, x, targets = _inputs(torch.float32)
    loss_fn = functools.partial(token_loss, reduction="none")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=rf"tile must be an integer >= 1 \(tokens\), got {bad!r}"):
            tiled_loss(head, loss_fn, x, targets, [head.weight], bad)
        with pytest.raises(ValueError, match=rf"activation_checkpointing.loss_tile={bad!r}: must be an integer >= 1"):
            apply_tiled_loss(GenSLM(GenSLMConfig.preset("debug", vocab_size=V, pad_token_id=3)), bad)
    with pytest.raises(ValueError, match="a loss needs a tile"):
        OutputHead(H, V)(x, targets)
