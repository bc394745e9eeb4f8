"""Activation checkpointing applied from outside GenSLM keeps parameter and state-dict names (exports,
checkpoints); the model's hook recomputes blocks exactly. DeepSpeed's own recomputation under SP, ZeRO and dropout
is proven in tests/distributed/test_train_offload_checkpointing.py."""
import functools
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.train.activation_checkpointing import CheckpointedCore
from ds4sci.train.activation_checkpointing import apply_activation_checkpointing
from ds4sci.train.config import ActivationCheckpointingConfig


def _model():
    torch.manual_seed(0)
    return GenSLM(GenSLMConfig.preset("debug", vocab_size=11, pad_token_id=3))


def test_selective_wrapper_keeps_every_name():
    model = _model()
    names, keys = [n for n, _ in model.named_parameters()], list(model.state_dict())
    for block in model.layers:
        block.attention.core = CheckpointedCore(block.attention.core)
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys


def test_selective_wrapper_refuses_a_core_with_parameters():
    with pytest.raises(ValueError, match=r"parameterless attention cores; Linear has .*\['weight', 'bias'"):
        CheckpointedCore(nn.Linear(2, 2))


def test_model_checkpoint_hook_recomputes_blocks_exactly_and_only_in_training():
    ids = torch.randint(0, 11, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    grads = []
    for hook in (None, functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)):
        model = _model()
        model.checkpoint_fn = hook
        calls = []
        for block in model.layers:
            block.register_forward_pre_hook(lambda *_: calls.append(1))  # recomputation may stop early
        model(ids, pos).float().pow(2).mean().backward()
        assert len(calls) == len(model.layers) * (1 if hook is None else 2)  # recomputed in backward
        grads.append([p.grad for p in model.parameters()])
        calls.clear()
        with torch.no_grad():
            model.eval()(ids, pos)
        assert len(calls) == len(model.layers)  # evaluation: the plain path
    for g, ref in zip(*grads):
        torch.testing.assert_close(g, ref, rtol=0, atol=0)


def test_tiled_mlp_is_set_on_every_block_as_a_zero3_leaf_and_keeps_every_name():
    """``tiled_mlp`` (any mode; here without checkpointing): every block's MLP tiles with ``mlp_tile`` and is a ZeRO-3
    leaf module (its parameters gathered once for all tiles); names unchanged; a bad tile is named."""
    from deepspeed.utils import z3_leaf_module

    model = _model()
    names, keys = [n for n, _ in model.named_parameters()], list(model.state_dict())
    apply_activation_checkpointing(model, ActivationCheckpointingConfig(tiled_mlp=True, mlp_tile=7))
    assert [b.mlp.tile for b in model.layers] == [7] * len(model.layers)
    assert all(z3_leaf_module(b.mlp) for b in model.layers) and not z3_leaf_module(model.layers[0])
    assert model.checkpoint_fn is None
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    plain = _model()
    apply_activation_checkpointing(plain, ActivationCheckpointingConfig(mlp_tile=7))  # tiled_mlp off: untouched
    assert [b.mlp.tile for b in plain.layers] == [0] * len(plain.layers)
    for bad in (0, -3, True):
        with pytest.raises(ValueError, match=rf"activation_checkpointing.mlp_tile={bad!r}: must be an integer >= 1"):
            apply_activation_checkpointing(plain, ActivationCheckpointingConfig(tiled_mlp=True, mlp_tile=bad))


LLAMA = dict(mlp="swiglu", intermediate_size=128, norm="rmsnorm", bias=False, parallel_residual=False, rotary_pct=1.0)


def _block(S: int, hidden: int = 64, heads: int = 4, tile: int = 64, **extra):
    torch.manual_seed(0)
    config = GenSLMConfig(vocab_size=6, hidden_size=hidden, num_layers=1, num_heads=heads, max_position_embeddings=S,
                          attention_backend="chunked", **extra)
    block = GenSLM(config).layers[0].train()
    block.mlp.tile = tile
    return block


@pytest.mark.parametrize("extra", [{}, LLAMA], ids=["gpt-neox", "llama"])
def test_full_checkpointing_frees_the_output_and_rebuilds_the_first_norm_exactly(extra):
    """DeepSpeed's checkpoint of a block with the first norm rebuilt in backward (``recompute_norm``, set by full
    checkpointing) and its recomputed output freed when its backward starts: the input's and every parameter's
    gradients bitwise those of the plain block."""
    from ds4sci.train.activation_checkpointing import checkpoint

    S = 96
    x0, g = torch.randn(2, S, 64), torch.randn(2, S, 64)
    pos = torch.arange(S).expand(2, S)
    grads = []
    for recompute in (False, True):
        block = _block(S, **extra)
        x = x0.clone().requires_grad_()
        if recompute:
            block.recompute_norm = True
            out = checkpoint(block, x, pos, None)
        else:
            out = block(x, pos, None)
        out.backward(g)
        grads.append([x.grad] + [p.grad for p in block.parameters()])
    for got, want in zip(*grads):
        assert torch.equal(got, want)


class _Resident(TorchDispatchMode):
    """The peak of the bytes held by the storages of the tensors torch's ops return inside the mode, each storage
    (by identity, not by address) counted once at its size at that moment, so a storage freed in place
    (``resize_(0)``, as the checkpoint does with its recomputed output) stops counting; storages of ``ignore``
    (tensors made before) are left out."""

    def __init__(self, ignore):
        super().__init__()
        self.ignore = {t.untyped_storage()._cdata for t in ignore}
        self.tensors: list[weakref.ref] = []
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tensors += [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        alive = [t for t in (ref() for ref in self.tensors) if t is not None]
        self.tensors = [weakref.ref(t) for t in alive]
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in alive}
        self.peak = max(self.peak, sum(n for key, n in storages.items() if key not in self.ignore))
        return out


def _checkpointed_peak(S: int) -> int:
    """Peak bytes of the tensors alive in one checkpointed GPT-NeoX block's forward + backward (hidden 128, 8 heads,
    MLP tiles of 256 tokens, DeepSpeed's checkpoint, ``recompute_norm``), the block input left out; the incoming
    gradient counted."""
    from ds4sci.train.activation_checkpointing import checkpoint

    block = _block(S, hidden=128, heads=8, tile=256)
    block.recompute_norm = True
    x = torch.randn(1, S, 128, requires_grad=True)
    with _Resident([x]) as live:
        out = checkpoint(block, x, torch.arange(S)[None], None)
        out.backward(torch.randn_like(out))
    return live.peak


def test_checkpointed_block_backward_peaks_below_ten_and_a_half_hidden_vectors_per_token():
    """Issue #28's working set, one block's share: per token (the slope over S, so the attention's chunk-sized
    blocks drop out), the peak of a checkpointed block's forward + backward above its input, the incoming gradient
    included, is 10 hidden vectors plus the attention's log-sum-exp, the rotary tables and the norms' statistics
    (10.28 measured; in the attention's backward: the fused qkv buffer, dq, dk, dv, the output's gradient into the
    attention, the block input's gradients and the caller's block output). It was 13.28 before the checkpoint freed
    its recomputed output when its backward starts and the first norm's output was rebuilt in backward (12.28 with
    either one alone), and 11.28 while the attention kept its output through its backward (the chunked backward
    reads it only for ``rowsum(dO * O)``; ``recompute_saved`` hands saved tensors over once, so it is freed there)."""
    per_token = (_checkpointed_peak(1024) - _checkpointed_peak(512)) / 512 / (128 * 4)
    assert 10 < per_token < 10.5, per_token


def test_recompute_saved_hands_each_saved_tensor_over_once():
    """Inside ``recompute_saved`` a saved tensor is let go once backward has read it (so a backward done with it can
    free it): a second backward through the same graph is refused in one message, not run on a missing tensor; the
    recomputed tensor's recipe and the first backward's gradients are unchanged."""
    from ds4sci.kernels.recompute import recompute_saved

    x = torch.randn(5, 3, requires_grad=True)
    w = torch.randn(3, 3, requires_grad=True)
    normed = torch.nn.functional.layer_norm(x, (3,))
    with recompute_saved(normed, lambda: torch.nn.functional.layer_norm(x, (3,))):
        y = (normed @ w).tanh()
    y.sum().backward(retain_graph=True)
    want = torch.autograd.grad(((torch.nn.functional.layer_norm(x, (3,)) @ w).tanh()).sum(), (x, w))
    torch.testing.assert_close((x.grad, w.grad), want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="recompute_saved: a tensor saved for backward was read twice"):
        y.sum().backward()
