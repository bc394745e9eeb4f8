"""GenSLM model: every position-embedding kind, the attention core, GPT-NeoX equivalence, the
sequence-partitioned position table, the key/value cache."""
import math
import re

import numpy as np
import pytest
import torch

from ds4sci.models.genslm import AttentionCore
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.models.genslm import KVCache
from ds4sci.models.genslm import LearnedPositionEmbedding
from ds4sci.models.genslm import alibi_slopes
from ds4sci.models.genslm import from_gpt_neox_state_dict
from ds4sci.models.genslm import lm_loss
from ds4sci.models.genslm import shift_labels
from ds4sci.models.genslm import to_gpt_neox_state_dict
from ds4sci.models.genslm import token_loss


def _inputs(B=2, T=12, V=69, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    return ids, torch.arange(T).expand(B, T).contiguous()


@pytest.mark.parametrize("pe", ["learned", "rotary", "alibi"])
def test_forward_backward_every_position_embedding(pe):
    torch.manual_seed(0)
    model = GenSLM(GenSLMConfig.preset("debug", position_embedding=pe))
    ids, pos = _inputs()
    logits = model(ids, pos)
    assert logits.shape == (2, 12, 69)
    loss = lm_loss(logits, ids)
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(69)) < 0.5
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("pe,kv_heads", [("learned", 4), ("rotary", 4), ("alibi", 4), ("rotary", 2), ("alibi", 1)])
def test_kv_cache_logits_equal_uncached_at_every_step(pe, kv_heads):
    """Prefill 5 tokens, then decode one at a time: every step's logits equal the uncached model's over the whole
    prefix (fp32); the cache holds the num_kv_heads heads only."""
    torch.manual_seed(0)
    cfg = GenSLMConfig.preset("debug", vocab_size=69, max_position_embeddings=32, position_embedding=pe,
                              num_kv_heads=kv_heads)
    model = GenSLM(cfg).eval()
    ids, pos = _inputs(B=2, T=9)
    cache = KVCache(cfg, 2, 9)
    assert cache.layers[0].keys.shape == (2, kv_heads, 9, cfg.head_dim) and len(cache.layers) == cfg.num_layers
    with torch.no_grad():
        for a, b in [(0, 5), (5, 6), (6, 7), (7, 8), (8, 9)]:
            got = model(ids[:, a:b], pos[:, a:b], cache=cache)  # [2, b - a, V]
            torch.testing.assert_close(got, model(ids[:, :b], pos[:, :b])[:, a:], rtol=1e-5, atol=1e-5)
        assert cache.length == 9
        with pytest.raises(ValueError, match=r"cannot append keys \(2, 1, .*\) at position 9"):
            model(ids[:, :1], pos[:, :1], cache=cache)
        with pytest.raises(ValueError, match="KVCache is for decoding.*model.eval"):
            model.train()(ids, pos, cache=KVCache(cfg, 2, 9))


def test_causality_and_positions_are_inputs():
    torch.manual_seed(0)
    model = GenSLM(GenSLMConfig.preset("debug", position_embedding="learned")).double()
    ids, pos = _inputs()
    full = model(ids, pos)
    prefix = model(ids[:, :7], pos[:, :7])
    torch.testing.assert_close(full[:, :7], prefix, rtol=1e-10, atol=1e-10)
    shifted = model(ids, pos + 5)  # a different position input changes the output
    assert (shifted - full).abs().max() > 1e-3


def _naive(q, k, v, q_offset, k_offset, head_offset, q_doc, k_doc, slopes):
    B, Sq, H, D = q.shape
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D)
    qp = torch.arange(q_offset, q_offset + Sq)[:, None]
    kp = torch.arange(k_offset, k_offset + k.shape[1])[None, :]
    if slopes is not None:
        s = s - slopes[head_offset : head_offset + H][:, None, None] * (qp - kp)
    allowed = (kp <= qp)[None, None]
    if q_doc is not None:
        allowed = allowed & (q_doc[:, None, :, None] == k_doc[:, None, None, :])
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, v), lse


@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("offsets", [(0, 0, 0), (6, 0, 2), (0, 6, 1), (3, 3, 0)])
@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_core_matches_naive_formula(alibi, docs, offsets, return_lse, backend):
    torch.manual_seed(1)
    B, Sq, Sk, H, D, Htot = 2, 6, 6, 2, 8, 4
    q_off, k_off, h_off = offsets
    q, k, v = (torch.randn(B, n, H, D, dtype=torch.float64) for n in (Sq, Sk, Sk))
    q_doc = k_doc = None
    if docs:
        q_doc = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
        k_doc = torch.tensor([[0, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0]])
    core = AttentionCore(Htot, alibi=alibi, backend=backend).double()
    got = core(q, k, v, q_offset=q_off, k_offset=k_off, head_offset=h_off, q_doc=q_doc, k_doc=k_doc,
               return_lse=return_lse)
    want, want_lse = _naive(q, k, v, q_off, k_off, h_off, q_doc, k_doc, alibi_slopes(Htot).double() if alibi else None)
    out = got[0] if return_lse else got
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    if return_lse:
        torch.testing.assert_close(got[1], want_lse, rtol=1e-10, atol=1e-10)
        assert got[1].requires_grad is False or got[1].grad_fn is not None


def test_core_grads_flow_through_lse():
    q, k, v = (torch.randn(1, 4, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    core = AttentionCore(2)
    assert torch.autograd.gradcheck(lambda a, b, c: core(a, b, c, return_lse=True)[1].sum() + core(a, b, c).sum(),
                                    (q, k, v))


def test_model_attention_saves_nothing_s_by_s():
    """The default core (memory_efficient_attention) keeps no [B, H, T, T] tensor for backward in an ALiBi model
    with packed documents; the "sdpa" oracle core does, and both give the same logits and gradients."""
    torch.manual_seed(0)
    cfg = GenSLMConfig.preset("debug", position_embedding="alibi", num_layers=1)
    B, T = 2, 128
    ids, pos = _inputs(B=B, T=T)
    doc = (torch.arange(T) // 50).expand(B, T)
    results = {}
    for backend in ("auto", "sdpa"):
        torch.manual_seed(0)
        model = GenSLM(GenSLMConfig(**{**cfg.to_dict(), "attention_backend": backend})).double()
        assert model.layers[0].attention.core.backend == backend
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(ids, pos, doc)
        grads = torch.autograd.grad(lm_loss(logits, ids), list(model.parameters()))
        results[backend] = (max(sizes), logits, grads)
    old_logits = B * cfg.num_heads * T * T
    assert results["sdpa"][0] >= old_logits and results["auto"][0] < old_logits, {k: v[0] for k, v in results.items()}
    torch.testing.assert_close(results["auto"][1], results["sdpa"][1], rtol=1e-10, atol=1e-10)
    for a, b in zip(results["auto"][2], results["sdpa"][2]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_alibi_slopes_follow_the_paper():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    s6 = alibi_slopes(6)
    torch.testing.assert_close(s6[:4], torch.tensor([2.0 ** (-2 * (i + 1)) for i in range(4)]))
    torch.testing.assert_close(s6[4:], torch.tensor([2.0 ** -1, 2.0 ** -3]))


def test_gpt_neox_logits_equivalence_and_export():
    import transformers  # the dev extra installs it

    from ds4sci.models.genslm import config_from_gpt_neox

    hf_cfg = transformers.GPTNeoXConfig(
        vocab_size=69, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
        max_position_embeddings=128, rotary_pct=0.25, use_parallel_residual=True, hidden_act="gelu",
        tie_word_embeddings=False, attention_dropout=0.0, hidden_dropout=0.0,
    )
    torch.manual_seed(0)
    hf = transformers.GPTNeoXForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():  # non-trivial values everywhere (biases and norms too)
            p.add_(0.05 * torch.randn_like(p))
    model = GenSLM(config_from_gpt_neox(hf_cfg)).eval()
    model.load_state_dict(from_gpt_neox_state_dict(hf.state_dict()), strict=True)
    ids, pos = _inputs(T=20)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = model(ids, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    head_key = "lm_head.weight" if "lm_head.weight" in hf.state_dict() else "embed_out.weight"
    exported = to_gpt_neox_state_dict(model, head_key=head_key)
    hf_params = {k: v for k, v in hf.state_dict().items() if k in exported}
    assert set(exported) == set(hf_params) == {k for k, _ in hf.named_parameters()}
    for key, value in exported.items():
        assert torch.equal(value, hf_params[key]), key


def _zigzag_rows(S, P, r):
    c = S // (2 * P)
    return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * P - 1 - r) * c, (2 * P - r) * c)])


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_sharded_position_table_equals_unsharded_rows(P, layout):
    S, hidden = 32, 8
    torch.manual_seed(3)
    full = LearnedPositionEmbedding(S, hidden)
    after_full = torch.rand(3)
    shards = []
    for r in range(P):
        rows = torch.arange(r * S // P, (r + 1) * S // P) if layout == "contiguous" else _zigzag_rows(S, P, r)
        torch.manual_seed(3)
        shard = LearnedPositionEmbedding(S, hidden).shard_(rows)
        torch.testing.assert_close(torch.rand(3), after_full)  # identical RNG consumption
        assert shard.weight.shape == (S // P, hidden) and shard.weight.ds4sci_sequence_sharded
        torch.testing.assert_close(shard.weight, full.weight[rows])
        pos = rows[torch.randperm(rows.numel())].reshape(2, -1)
        torch.testing.assert_close(shard(pos), full(pos))
        other = torch.tensor([[int(torch.isin(torch.arange(S), rows, invert=True).nonzero()[0])]])
        with pytest.raises(ValueError, match="not held by this sequence shard"):
            shard(other)
        shards.append((shard.rows, shard.weight))
    torch.testing.assert_close(LearnedPositionEmbedding.assemble_full_table(shards, S), full.weight.detach())
    with pytest.raises(ValueError, match="exactly once"):
        LearnedPositionEmbedding.assemble_full_table(shards[:1], S)
    fresh = LearnedPositionEmbedding(S, hidden).shard_(shards[0][0])
    fresh.load_full_table_(full.weight.detach())
    torch.testing.assert_close(fresh.weight, shards[0][1])


def test_position_table_bad_inputs():
    emb = LearnedPositionEmbedding(16, 4)
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        emb(torch.tensor([[3, 16]]))
    with pytest.raises(TypeError, match="integer"):
        emb(torch.tensor([[1.0]]))
    with pytest.raises(ValueError, match="unique"):
        emb.shard_(torch.tensor([1, 1]))


def test_losses_and_label_shift():
    logits = torch.randn(1, 4, 5)
    labels = torch.tensor([[1, 2, -100, 4]])
    torch.testing.assert_close(shift_labels(labels), torch.tensor([[2, -100, 4, -100]]))
    want = torch.nn.functional.cross_entropy(logits[0, [0, 2]], torch.tensor([2, 4]))
    torch.testing.assert_close(lm_loss(logits, labels), want)
    torch.testing.assert_close(token_loss(logits, shift_labels(labels), "sum"), 2 * want)


def test_presets_parameter_counts():
    c = GenSLMConfig.preset("25M")
    assert sum(p.numel() for p in GenSLM(c).parameters()) == c.num_parameters() == 25_290_752  # GenSLM's 25M
    for name in ["debug", "250M", "2.5B", "25B"]:
        cfg = GenSLMConfig.preset(name, position_embedding="learned")
        with torch.device("meta"):  # shapes only, nothing allocated
            model = GenSLM(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters(), name


@pytest.mark.parametrize("position", ["learned", "rotary"])
def test_block_and_position_table_parameter_counts(position):
    """The pieces the planner counts per rank: one block, and the learned table (none for rotary)."""
    cfg = GenSLMConfig.preset("debug", position_embedding=position, intermediate_size=96)
    with torch.device("meta"):
        model = GenSLM(cfg)
    assert sum(p.numel() for p in model.layers[0].parameters()) == cfg.block_parameters()
    table = sum(p.numel() for n, p in model.named_parameters() if n.startswith("embed_pos."))
    assert table == cfg.position_table_parameters() == (512 * 64 if position == "learned" else 0)


def test_config_and_model_errors():
    with pytest.raises(ValueError, match="not divisible"):
        GenSLMConfig(hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="pad_token_id=3 is outside the vocabulary of 3"):
        GenSLMConfig(vocab_size=3)
    with pytest.raises(ValueError, match="position_embedding"):
        GenSLMConfig(position_embedding="sinusoid")
    with pytest.raises(ValueError, match="attention_backend='math': unknown backend 'math'"):
        GenSLMConfig(attention_backend="math")
    with pytest.raises(ValueError, match="unknown backend 'math'"):
        AttentionCore(4, backend="math")
    with pytest.raises(ValueError, match="unknown preset"):
        GenSLMConfig.preset("1T")
    with pytest.raises(ValueError, match="unknown GenSLMConfig field"):
        GenSLMConfig.from_dict({"hidden": 3})
    model = GenSLM(GenSLMConfig.preset("debug"))
    ids, pos = _inputs()
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model(ids, pos[:, :3])
    with pytest.raises(ValueError, match="token ids"):
        model(ids + 100, pos)


@pytest.mark.parametrize("field, value, why", [
    ("num_layers", 2.0, "expected an integer, got float"),  # a whole float is no integer either
    ("num_layers", 2.5, "expected an integer, got float"),
    ("num_heads", True, "expected an integer, got bool"),
    ("hidden_size", "64", "expected an integer, got str"),
    ("vocab_size", 0, "must be >= 1"),
    ("max_position_embeddings", -5, "must be >= 1"),
    ("intermediate_size", -1, "must be >= 0"),
    ("pad_token_id", -1, "must be >= 0"),
    ("layer_norm_eps", float("nan"), r"must be a finite number in \(0, inf\)"),
    ("layer_norm_eps", 0.0, r"must be a finite number in \(0, inf\)"),
    ("rotary_base", float("inf"), r"must be a finite number in \(0, inf\)"),
    ("rotary_pct", 1.5, r"must be a finite number in \[0, 1\]"),
    ("dropout", -0.1, r"must be a finite number in \[0, 1\]"),
    ("init_std", float("-inf"), r"must be a finite number in \[0, inf\)"),
    ("layer_norm_eps", "1e-5", "expected a number, got str"),
    ("activation", "relu", r"expected one of \('gelu', 'gelu_tanh'\)"),
    ("position_embedding", 1, "expected a string, got int"),
])
def test_every_field_is_checked_for_type_and_range(field, value, why):
    with pytest.raises(ValueError, match=rf"^{field}={re.escape(repr(value))}: {why}$"):
        GenSLMConfig.from_dict({"hidden_size": 64, "num_heads": 4, field: value})


def test_numbers_are_normalised_to_the_fields_types():
    """An int where a real goes (YAML's ``rotary_base: 500``) and numpy scalars become plain floats and ints."""
    cfg = GenSLMConfig(rotary_base=500, num_layers=np.int64(3), dropout=np.float32(0.5))
    assert (cfg.rotary_base, cfg.num_layers, cfg.dropout) == (500.0, 3, 0.5)
    assert [type(v) for v in (cfg.rotary_base, cfg.num_layers, cfg.dropout)] == [float, int, float]


def test_initial_values_are_per_name_and_rows_can_be_drawn_alone():
    """GenSLM.initial_value: the model's parameters are exactly it (one RNG draw seeds them all), a meta-built model
    consumes the RNG the same way, and any rows of a matrix drawn alone (crossing row blocks) equal the full draw's."""
    cfg = GenSLMConfig(vocab_size=11, hidden_size=8, num_layers=1, num_heads=2, intermediate_size=12,
                       max_position_embeddings=10, position_embedding="learned")
    torch.manual_seed(3)
    model = GenSLM(cfg)
    after = torch.rand(3)
    torch.manual_seed(3)
    meta = GenSLM(cfg, device="meta")
    assert torch.equal(torch.rand(3), after) and meta.init_seed == model.init_seed
    for name, p in model.named_parameters():
        assert torch.equal(p, model.initial_value(name, p.shape)), name
    model.INIT_ROWS = 4  # blocks of 4 rows: [0..3] [4..7] [8, 9]
    full = model.initial_value("embed_pos.weight", (10, 8))
    rows = torch.tensor([9, 0, 4, 3, 8])
    assert torch.equal(model.initial_value("embed_pos.weight", (10, 8), rows=rows), full[rows])
    assert not torch.equal(full[:4], full[4:8])
    assert not torch.equal(full, model.initial_value("embed_in.weight", (10, 8)))
    assert abs(float(full.std()) - cfg.init_std) < 0.01
