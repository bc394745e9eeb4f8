"""A Llama-shaped GenSLM (grouped-query attention with fewer key/value heads than the Ulysses degree in one case,
SwiGLU, RMSNorm, sequential residual, tied embeddings, Llama-3 rotary scaling) under Ulysses 2 and ring 2 gives the
one-process logits and gradients (gloo; the attention core's GQA handling is tested in test_sequence_parallel.py)."""
import torch

from ds4sci.models.genslm import GenSLM, GenSLMConfig, lm_loss
from ds4sci.parallel import ParallelDims
from ds4sci.parallel.groups import build_groups
from ds4sci.parallel.parallelize import parallelize
from ds4sci.sequence import shard_sequence
from ds4sci.spawn import run_workers

S = 32


def _worker(rank, world):
    failures = []
    for degrees in (dict(ulysses=2), dict(ring=2)):
        for kv_heads in (2, 1):  # 1: fewer key/value heads than Ulysses ranks (replicated before the all-to-all)
            label = f"{degrees}, num_kv_heads={kv_heads}"
            config = GenSLMConfig.preset("llama-debug", num_kv_heads=kv_heads, tie_word_embeddings=True,
                                         rotary_scaling_factor=8.0, rotary_original_max_positions=16,
                                         attention_backend="chunked")
            torch.manual_seed(0)
            full = GenSLM(config)
            torch.manual_seed(0)
            model = GenSLM(config)
            groups = build_groups(ParallelDims(dp=1, **degrees))
            parallelize(model, groups)
            gen = torch.Generator().manual_seed(1)
            ids = torch.randint(4, config.vocab_size, (2, S), generator=gen)
            positions = torch.arange(S).expand(2, S)
            ref = full(ids, positions)
            lm_loss(ref, ids, reduction="sum").backward()
            mine = model(shard_sequence(ids, 1, groups.sp_rank, 2, groups.dims.layout),
                         shard_sequence(positions, 1, groups.sp_rank, 2, groups.dims.layout))
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
    return failures


def test_llama_shape_under_ulysses_and_ring_matches_one_process():
    assert run_workers(_worker, 2) == [[], []]
