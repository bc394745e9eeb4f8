"""One run of ``ds4sci bench genslm-attention-memory`` (:mod:`ds4sci.bench.genslm_attention_memory`), in its own
subprocess: one GenSLM attention layer, its inputs for a mode and a sequence length, and :func:`measure`, the peak
memory, bytes saved for backward and wall time of its forward and backward. Apart from the benchmark's options and
report, so that building the parser imports no torch."""
from __future__ import annotations

import resource
import time

import torch

from ds4sci.bench import memory
from ds4sci.bench.genslm_attention_memory import DTYPES
from ds4sci.bench.genslm_attention_memory import PATHS

WARMUP_SEQ_LEN = 512  # S of the untimed first step (at most S/4 of the measured one)


def _dtype(cfg: dict) -> torch.dtype:
    return getattr(torch, DTYPES[cfg["dtype"]])


def build_layer(cfg: dict, mode: str, path: str) -> torch.nn.Module:
    """One GenSLM attention layer for ``mode`` on ``path``, weights drawn from ``cfg['seed']`` (the same on both
    paths), on ``cfg``'s device and dtype."""
    from ds4sci.models.genslm.config import GenSLMConfig
    from ds4sci.models.genslm.model import Attention

    position = "alibi" if mode == "alibi" else cfg["position"]
    config = GenSLMConfig(hidden_size=cfg["hidden"], num_heads=cfg["heads"], num_layers=1,
                          position_embedding=position, attention_backend=PATHS[path])
    torch.manual_seed(cfg["seed"])
    return Attention(config).to(cfg["device"], _dtype(cfg))


def document_lengths(seq_len: int, doc_len: int, seed: int) -> list[int]:
    """Lengths of the packed documents of a window of ``seq_len`` tokens: uniform in ``[doc_len/2, 3*doc_len/2]``
    (at least 1), the last one cut to fill the window exactly."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = max(1, doc_len // 2), max(1, 3 * doc_len // 2)
    lengths, total = [], 0
    while total < seq_len:
        n = min(int(torch.randint(lo, hi + 1, (1,), generator=g)), seq_len - total)
        lengths.append(n)
        total += n
    return lengths


def make_inputs(cfg: dict, mode: str, seq_len: int) -> dict:
    """x ``[B, S, hidden]`` (requires grad, as from a previous layer), position_ids ``[B, S]`` and, in the
    documents mode, doc_ids ``[B, S]`` (positions restart at 0 in every document)."""
    B, device = cfg["batch"], cfg["device"]
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    x = torch.randn(B, seq_len, cfg["hidden"], generator=g).to(device, _dtype(cfg)).requires_grad_(True)
    if mode == "documents":
        lengths = document_lengths(seq_len, cfg["doc_len"], cfg["seed"])
        doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # [S]
        position_ids = torch.cat([torch.arange(n) for n in lengths])  # [S], restarting per document
        return {"x": x, "position_ids": position_ids.expand(B, -1).to(device),
                "doc_ids": doc_ids.expand(B, -1).to(device)}
    return {"x": x, "position_ids": torch.arange(seq_len).expand(B, -1).to(device), "doc_ids": None}


def step(layer: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """Forward and the backward of the scalar loss ``mean(out^2)``; the loss, detached."""
    out = layer(inputs["x"], inputs["position_ids"], inputs["doc_ids"])  # [B, S, hidden]
    loss = out.float().square().mean()
    loss.backward()
    return loss.detach()


def cap_address_space(limit_bytes: int) -> None:
    """Cap this process's address space at what it maps now plus ``limit_bytes`` (a run over the limit then fails
    to allocate rather than exhausting the machine's memory)."""
    cap = memory.proc_status_bytes("VmSize") + limit_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def measure(cfg: dict, mode: str, path: str, seq_len: int) -> dict:
    """One forward+backward of ``mode`` on ``path`` at ``seq_len`` in this process, after a warm-up at a small S:
    its peak memory above what the layer and inputs hold, the bytes saved for backward and the wall time. Meant to
    run in a fresh process per run (:func:`ds4sci.bench.memory.run_in_subprocess`)."""
    from ds4sci.kernels.local_attention import select_backend

    torch.set_num_threads(cfg["threads"])
    layer = build_layer(cfg, mode, path)
    # loads lazily imported kernels; at a smaller S, so that the allocator keeps no block of the measured size
    step(layer, make_inputs(cfg, mode, max(1, min(WARMUP_SEQ_LEN, seq_len // 4))))
    layer.zero_grad(set_to_none=True)
    inputs = make_inputs(cfg, mode, seq_len)
    # [1, S, H, D], one row stored and expanded: what select_backend looks at (its rule reads the query length)
    probe = torch.empty(1, 1, cfg["heads"], cfg["hidden"] // cfg["heads"], device=cfg["device"],
                        dtype=_dtype(cfg)).expand(1, seq_len, -1, -1)
    slopes = layer.core.slopes if mode == "alibi" else None
    kernel = "sdpa" if path == "before" else select_backend(probe, probe, probe, causal=True,
                                                            q_doc=inputs["doc_ids"], alibi_slopes=slopes)
    on_cuda = torch.device(cfg["device"]).type == "cuda"
    if not on_cuda:
        cap_address_space(cfg["memory_limit_bytes"])
    with memory.PeakMemory(cfg["device"]) as peak:
        start = time.perf_counter()
        with memory.saved_for_backward() as saved:
            step(layer, inputs)
        if on_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return {"peak_bytes": peak.bytes, "saved_bytes": saved.bytes, "seconds": seconds, "kernel": kernel}
