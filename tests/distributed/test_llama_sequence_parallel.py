"""A Llama-shaped GenSLM (grouped-query attention with fewer key/value heads than the Ulysses degree in one case,
SwiGLU, RMSNorm, sequential residual, tied embeddings, Llama-3 rotary scaling) under Ulysses 2 and ring 2 gives the
one-process logits and gradients (gloo; the attention core's GQA handling is tested in test_sequence_parallel.py),
and saves and sends what ``ds4sci plan`` predicts."""
import torch

from ds4sci.distributed import ParallelDims
from ds4sci.distributed.comm import CommCounter
from ds4sci.distributed.groups import build_groups
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.models.genslm import lm_loss
from ds4sci.parallel.parallelize import parallelize
from ds4sci.planning import genslm as plan
from ds4sci.sequence import shard_sequence
from ds4sci.spawn import run_workers

from activation_checks import SavedBytes  # tests/ is on sys.path (its conftest.py)

S = 32


def _config(kv_heads: int) -> GenSLMConfig:
    return GenSLMConfig.preset("llama-debug", num_kv_heads=kv_heads, tie_word_embeddings=True,
                               rotary_scaling_factor=8.0, rotary_original_max_positions=16, attention_backend="chunked")


def _worker(rank, world):
    """Failures, and per layout and key/value head count the bytes this rank saved in the forward and sent (by
    collective kind) in the forward and backward."""
    failures, measured = [], []
    for degrees in (dict(ulysses=2), dict(ring=2)):
        for kv_heads in (2, 1):  # 1: fewer key/value heads than Ulysses ranks (replicated before the all-to-all)
            label = f"{degrees}, num_kv_heads={kv_heads}"
            config = _config(kv_heads)
            torch.manual_seed(0)
            full = GenSLM(config)
            torch.manual_seed(0)
            model = GenSLM(config)
            groups = build_groups(ParallelDims(dp=1, **degrees))
            counter = CommCounter()
            parallelize(model, groups, counter=counter)
            gen = torch.Generator().manual_seed(1)
            ids = torch.randint(4, config.vocab_size, (2, S), generator=gen)
            positions = torch.arange(S).expand(2, S)
            ref = full(ids, positions)
            lm_loss(ref, ids, reduction="sum").backward()
            # clone: a contiguous shard is a view, and the embedding would save the whole batch's ids' storage
            local_ids = shard_sequence(ids, 1, groups.sp_rank, 2, groups.dims.layout).clone()
            with SavedBytes(model) as saved:
                mine = model(local_ids, shard_sequence(positions, 1, groups.sp_rank, 2, groups.dims.layout))
            want = shard_sequence(ref, 1, groups.sp_rank, 2, groups.dims.layout)
            if not torch.allclose(mine, want, rtol=1e-5, atol=1e-5):
                failures.append(f"{label}: logits differ by {(mine - want).abs().max():.2e}")
            # the gradient of the summed loss over the gathered logits: each rank's share, summed over ranks
            targets = shard_sequence(torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100), 1, groups.sp_rank, 2,
                                     groups.dims.layout)
            torch.nn.functional.cross_entropy(mine.reshape(-1, mine.shape[-1]), targets.reshape(-1),
                                              ignore_index=-100, reduction="sum").backward()
            for (name, p), q in zip(model.named_parameters(), full.parameters()):
                grad = p.grad.clone()
                torch.distributed.all_reduce(grad)
                if not torch.allclose(grad, q.grad, rtol=1e-4, atol=1e-5):
                    failures.append(f"{label}: gradient of {name} differs by {(grad - q.grad).abs().max():.2e}")
                    break
            measured.append((degrees, kv_heads, saved.total, dict(counter.bytes_sent)))
    return failures, measured


def test_llama_shape_under_ulysses_and_ring_matches_one_process():
    """... and for each layout and key/value head count (1: replicated to the Ulysses degree before the all-to-all),
    every rank saves the planner's activation bytes (less the logits' 8 V bytes per token, the loss being computed
    outside the count) and sends its per-layer Ulysses all-to-all and ring key/value bytes (all_gather: the shape
    check, outside the planner)."""
    results = run_workers(_worker, 2)
    assert [failures for failures, _ in results] == [[], []]
    for _, measured in results:
        for degrees, kv_heads, saved, sent in measured:
            config = _config(kv_heads)
            w = plan.Workload(config, S, micro_batch=2, dtype="fp32")
            strategy = plan.Strategy(ParallelDims(dp=1, **degrees))
            logits = 8 * config.vocab_size * 2 * S // 2  # fp32 logits and log-softmax of the local tokens
            assert saved == plan.memory(w, strategy).activations - logits, (degrees, kv_heads)
            comm = plan.comm(w, strategy)
            assert {k: v for k, v in sent.items() if k != "all_gather"} == {
                k: b for k, b in (("all_to_all", comm.ulysses), ("p2p", comm.ring)) if b}, (degrees, kv_heads)
