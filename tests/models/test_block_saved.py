"""What one GenSLM block saves for backward, pinned per token (issue #28: under full checkpointing this is the
recomputed block's share of the working set), and the in-place rotary of the fused qkv buffer that keeps it there
(``apply_rotary_qkv_``): bitwise the out-of-place rotation's outputs and gradients."""
import pytest
import torch

from ds4sci.kernels.rotary import apply_rotary_qkv_
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.models.genslm.position import rotary_cos_sin

from activation_checks import SavedBytes

H, HIDDEN = 4, 64
SHAPES = {
    # GPT-NeoX (parallel residual, LayerNorm, rotary on 25% of each head): the block input, both norms' outputs, the
    # fused qkv buffer (q, k and v views of it, rotated in place), the attention output
    "gpt-neox": (dict(), 7),
    # Llama with one key/value head per query head (sequential residual, RMSNorm, SwiGLU, rotary on every dim): the
    # block input, both norms' normalized inputs and outputs, the second norm's input, the qkv buffer, the output
    "llama-mha": (dict(mlp="swiglu", intermediate_size=128, norm="rmsnorm", bias=False, parallel_residual=False,
                       rotary_pct=1.0), 10),
}


def _saved_bytes(config: GenSLMConfig, S: int) -> int:
    """Bytes one block's forward (tiled MLP, 64-token tiles) saves for backward, parameters left out: what a
    checkpointed block's recomputation saves."""
    torch.manual_seed(0)
    block = GenSLM(config).layers[0]
    block.mlp.tile = 64
    x = torch.randn(1, S, HIDDEN, requires_grad=True)
    with SavedBytes(block) as saved:
        block(x, torch.arange(S)[None], None)
    return saved.total


@pytest.mark.parametrize("shape", SHAPES)
def test_block_saves_whole_hidden_vectors_per_token(shape):
    """Per token, fp32: exactly ``vectors`` hidden vectors, plus the rotary tables (cos and sin, ``2 r``), the norms'
    fp32 statistics and the attention's log-sum-exp (``4`` bytes per head): no rotated copies of q and k."""
    extra, vectors = SHAPES[shape]
    config = GenSLMConfig(vocab_size=6, hidden_size=HIDDEN, num_layers=1, num_heads=H, max_position_embeddings=512,
                          attention_backend="chunked", **extra)
    stats = 2 * (1 if config.norm == "rmsnorm" else 2)  # fp32 per norm: rstd, and the mean for LayerNorm
    per_token = (_saved_bytes(config, 512) - _saved_bytes(config, 256)) / 256
    assert per_token == (vectors * HIDDEN + 2 * config.rotary_dim) * 4 + (stats + H) * 4


def _rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``r`` dims of ``x [B, T, heads, D]``, out of place (GPT-NeoX's half-split form)."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    return torch.cat((x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin, x_pass), dim=-1)


@pytest.mark.parametrize("Hkv, rotary_dim", [(4, 4), (2, 16), (1, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tables", ["rope", "any"])
def test_in_place_rotary_is_bitwise_the_out_of_place_one(Hkv, rotary_dim, dtype, tables):
    """Multi-head, grouped- and multi-query layouts, part or all of each head rotated: the rotated q and k, the
    untouched v, and the gradient of the projection's output are bitwise those of rotating copies of q and k, with
    RoPE's tables and with any tables (halves that differ)."""
    B, T, D, g = 2, 9, 16, H // Hkv
    cos, sin = rotary_cos_sin(torch.arange(T).expand(B, T) + 5, rotary_dim, 10000.0, dtype)
    if tables == "any":
        cos, sin = torch.randn_like(cos), torch.randn_like(sin)
    base = torch.randn(B, T, Hkv * (g + 2) * D, dtype=dtype)
    grads = [torch.randn(B, T, Hkv, n * D, dtype=dtype) for n in (g, 1, 1)]

    def split(qkv):
        return qkv.view(B, T, Hkv, (g + 2) * D).split((g * D, D, D), dim=-1)

    ref_in = base.clone().requires_grad_()
    q, k, v = split(ref_in)
    rot = lambda t, n: _rotate_reference(t.reshape(B, T, Hkv * n, D), cos, sin).view(B, T, Hkv, n * D)  # noqa: E731
    ref = (rot(q, g), rot(k, 1), v)
    torch.autograd.backward(ref, grads)

    new_in = base.clone().requires_grad_()
    out = split(apply_rotary_qkv_(new_in * 1, cos, sin, g, D))  # * 1: the projection's output, not a leaf
    torch.autograd.backward(out, grads)

    for a, b, name in zip(out, ref, "qkv"):
        assert torch.equal(a, b), name
    assert torch.equal(new_in.grad, ref_in.grad)


@pytest.mark.parametrize("qkv_shape, table_shape, message", [
    ((2, 5, 3 * 16 + 1), (2, 5, 1, 16), "qkv must be a contiguous"),
    ((3 * 16,), (1, 16), "qkv must be a contiguous"),
    ((10, 3 * 16), (10, 2, 16), "cos and sin must be"),
    ((2, 5, 3 * 16), (2, 4, 1, 16), "cos and sin must be"),
    ((2, 5, 3 * 16), (2, 5, 1, 15), "cos and sin must be"),
    ((2, 5, 3 * 16), (2, 5, 1, 32), "cos and sin must be"),
])
def test_in_place_rotary_names_a_bad_shape(qkv_shape, table_shape, message):
    """apply_rotary_qkv_ refuses a qkv or table shape that does not fit its layout in one message naming the shapes
    (g = 1, D = 16), instead of failing inside a view or rotating the wrong dims."""
    with pytest.raises(ValueError, match=message):
        apply_rotary_qkv_(torch.zeros(qkv_shape), torch.ones(table_shape), torch.zeros(table_shape), 1, 16)


def test_in_place_rotary_refuses_a_non_contiguous_qkv():
    qkv = torch.zeros(5, 2, 48).transpose(0, 1)  # [2, 5, 48], not contiguous
    with pytest.raises(ValueError, match="contiguous=False"):
        apply_rotary_qkv_(qkv, torch.ones(2, 5, 1, 16), torch.zeros(2, 5, 1, 16), 1, 16)


def _graph_nodes(t: torch.Tensor) -> set[str]:
    """Names of every autograd node behind ``t``."""
    seen, stack, names = set(), [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(f for f, _ in node.next_functions)
    return names


@pytest.mark.parametrize("shape", SHAPES)
def test_in_place_rotary_acts_on_the_projection_output_not_a_view(shape):
    """The attention rotates the projection's own output (a linear layer on the folded tokens), so autograd records
    the rotary Function itself, not a ``CopySlices`` around a view, whose backward clones the whole 3-hidden-vector
    gradient buffer (issue #28: that moment peaked as high as the attention's backward)."""
    config = GenSLMConfig(vocab_size=6, hidden_size=HIDDEN, num_layers=1, num_heads=H, max_position_embeddings=64,
                          attention_backend="chunked", **SHAPES[shape][0])
    block = GenSLM(config).layers[0]
    out = block(torch.randn(2, 16, HIDDEN, requires_grad=True), torch.arange(16).expand(2, 16), None)
    nodes = _graph_nodes(out)
    assert "_RotaryQKVBackward" in nodes and "CopySlices" not in nodes, sorted(nodes)
