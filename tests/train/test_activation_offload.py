"""ds4sci.train.activation_offload.HostOffload around DeepSpeed's checkpoint, in one process on the CPU: gradients
equal the run without offload, every checkpointed block input is released from the "device" between forward and
backward (the copies on a CPU-only machine are clones), and backward refills the inputs of block k before block k
recomputes and starts fetching block k-1's then. Training with ``activation_checkpointing.cpu`` under sequence and
tensor parallelism, ZeRO and dropout: tests/distributed/test_train_offload_checkpointing.py."""
import functools

import torch

from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.train.activation_checkpointing import CheckpointedCore
from ds4sci.train.activation_checkpointing import checkpoint
from ds4sci.train.activation_offload import HostOffload

B, T = 2, 16


def _model(layers=4, **config):
    torch.manual_seed(0)
    return GenSLM(GenSLMConfig.preset("debug", vocab_size=11, pad_token_id=3, num_layers=layers, **config))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 11, (B, T), generator=g), torch.arange(T).expand(B, T)


def _grads(model):
    ids, pos = _batch()
    model(ids, pos).float().pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_full_checkpointing_with_host_offload_is_exact_and_releases_every_block_input():
    reference = _grads(_model())
    model = _model()
    offload = HostOffload("cpu")
    model.checkpoint_fn = functools.partial(offload.checkpoint, checkpoint)
    events, order = [], []  # order: the offloaded entries, one per block, in forward order

    def offload_(tensors, original=offload._offload):
        order.append(original(tensors))
        return order[-1]

    def fetch(entry, original=offload._fetch):
        events.append(("fetch", order.index(entry)))
        original(entry)

    offload._offload, offload._fetch = offload_, fetch
    for k, block in enumerate(model.layers):
        block.register_forward_pre_hook(lambda *_, k=k: events.append(("run", k)))
    ids, pos = _batch()
    loss = model(ids, pos).float().pow(2).mean()
    hidden = model.config.hidden_size
    assert offload.offloaded_bytes == len(model.layers) * B * T * hidden * 4  # one [B, T, hidden] fp32 per block
    assert all(entry.tensors[0].untyped_storage().nbytes() == 0 for entry in offload._pending)  # released
    loss.backward()
    assert offload.offloaded_bytes == 0 and not offload._pending
    # block k's input is back before block k recomputes, and block k-1's fetch starts before that recompute
    last = len(model.layers) - 1
    forward = [("run", k) for k in range(last + 1)]
    backward = [("fetch", last)] + [e for k in range(last, 0, -1) for e in (("fetch", k - 1), ("run", k))]
    assert events == forward + backward + [("run", 0)]
    for g, ref in zip([p.grad for p in model.parameters()], reference):
        torch.testing.assert_close(g, ref, rtol=0, atol=0)


def test_selective_checkpointing_offloads_owned_inputs_and_keeps_views():
    """Grouped-query attention over 2 key/value heads: the core's q is a copy out of the fused qkv buffer (offloaded),
    k and v are views of it (kept; without that copy, as for multi-head attention, nothing is offloaded)."""
    reference = _grads(_model(layers=2, num_kv_heads=2))
    model = _model(layers=2, num_kv_heads=2)
    offload = HostOffload("cpu")
    for block in model.layers:
        block.attention.core = CheckpointedCore(block.attention.core, functools.partial(offload.checkpoint, checkpoint))
    ids, pos = _batch()
    loss = model(ids, pos).float().pow(2).mean()
    assert len(offload._pending) == 2 and offload.offloaded_bytes == 2 * B * T * model.config.hidden_size * 4
    for entry in offload._pending:  # only whole storages were released: q, not the buffer k and v are views of
        assert len(entry.tensors) == 1 and all(t.untyped_storage().nbytes() == 0 for t in entry.tensors)
    loss.backward()
    assert not offload._pending
    for g, ref in zip([p.grad for p in model.parameters()], reference):
        torch.testing.assert_close(g, ref, rtol=0, atol=0)


def test_a_view_is_never_released():
    offload = HostOffload("cpu")
    base = torch.randn(4, 6, requires_grad=True) * 1.0
    view = base[:, :3]  # a view of a larger storage: releasing it would take base's other columns too
    own = torch.randn(4, 3, requires_grad=True) * 1.0
    out = offload.checkpoint(checkpoint, lambda a, b: (a * b).sin(), view, own)
    assert [e.tensors for e in offload._pending] == [[own]]
    assert base.untyped_storage().nbytes() == 4 * 6 * 4 and own.untyped_storage().nbytes() == 0
    out.sum().backward()
    assert own.untyped_storage().nbytes() == 4 * 3 * 4 and not offload._pending


def test_evaluation_offloads_nothing():
    model = _model(layers=2)
    offload = HostOffload("cpu")
    model.checkpoint_fn = functools.partial(offload.checkpoint, checkpoint)
    ids, pos = _batch()
    with torch.no_grad():
        model(ids, pos)  # in training mode without gradients: the checkpoint runs, nothing needs keeping
    assert not offload._pending
