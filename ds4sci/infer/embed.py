"""One embedding per sequence (``ds4sci embed``).

The embedding is the mean of the final (normalised) hidden states over the record's tokens, each token's state
taken once; records longer than the window are read through the windows ``ds4sci evaluate`` uses
(:func:`ds4sci.infer.evaluate.record_windows`): each token's state comes from the window that owns it, so with
``stride < seq_len`` every token after the first window has at least ``seq_len - stride`` tokens of context. The
windows of every record are batched together; a short window is padded at its end, which causal attention keeps
from the real tokens before it, and padding is left out of the mean.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from ds4sci.data import collate
from ds4sci.infer.evaluate import RecordWindows, record_windows, window_length
from ds4sci.models.genslm import IGNORE_INDEX
from ds4sci.progress import progress_bar


@torch.no_grad()
def embed_records(model, tokenizer, records: Iterable, seq_len: int | None = None, *, stride: int | None = None,
                  batch_size: int = 8, progress: bool = False) -> tuple[list[str], np.ndarray]:
    """The ids of ``records`` (objects with ``id`` and ``sequence``: :func:`ds4sci.data.read_fasta`) and their
    embeddings ``[R, hidden]`` float32: each the mean final hidden state over the record's tokens.

    ``seq_len``: window length (default: the model's context); ``stride``: tokens between window starts (default
    ``seq_len``); ``batch_size``: windows per forward; ``progress``: a bar over the windows, on a terminal only
    (:func:`ds4sci.progress.progress_bar`).

    Raises:
        ValueError: a record with no token (naming it), no record at all, or ``batch_size`` < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    seq_len = window_length(model.config, seq_len)
    ids, chunks, owner = [], [], []  # owner[w]: the record of window w
    for rec in records:
        tokens = tokenizer.encode(rec.sequence)
        if len(tokens) == 0:
            raise ValueError(f"record {rec.id!r}: cannot embed an empty sequence")
        pieces = record_windows(tokens, seq_len, stride)
        chunks += pieces
        owner += [len(ids)] * len(pieces)
        ids.append(rec.id)
    if not ids:
        raise ValueError("no record to embed")
    windows = RecordWindows(chunks, tokenizer)
    totals = torch.zeros(len(ids), model.config.hidden_size, dtype=torch.float64)
    owner = torch.tensor(owner)
    with progress_bar(progress, total=len(chunks), desc="embed", unit="window") as bar:
        for start in range(0, len(chunks), batch_size):
            stop = min(len(chunks), start + batch_size)
            batch = collate([windows[w] for w in range(start, stop)])
            hidden = model(batch["input_ids"], batch["position_ids"], return_hidden=True).double()  # [B, T, hidden]
            owned = (batch["labels"] != IGNORE_INDEX).unsqueeze(-1)  # [B, T, 1]: context and padding are not
            totals.index_add_(0, owner[start:stop], (hidden * owned).sum(1))
            bar.update(stop - start)
    window_tokens = torch.tensor([len(c.ids) - c.owned for c in chunks], dtype=torch.float64)
    record_tokens = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, owner, window_tokens)
    return ids, (totals / record_tokens[:, None]).float().numpy()
