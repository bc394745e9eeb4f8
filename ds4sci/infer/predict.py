"""Predictions of a fine-tuned task model (:func:`ds4sci.io.task_model.load_task_model`) for records: one row per
record (class probabilities, multi-label probabilities or regression values in the targets' units) or, for a token
task, one row per token (its first base's position in the record and its class probabilities). Records are batched
right-padded with a real-token mask, so a record's prediction does not depend on its batch."""
from __future__ import annotations

import csv
from collections.abc import Iterable
from collections.abc import Iterator
from pathlib import Path

import torch

from ds4sci.data import Tokenizer
from ds4sci.models.genslm import GenSLMForTask


def read_table_records(path: str | Path) -> Iterator[tuple[str, str]]:
    """``(id, sequence)`` of each row of a TSV (or CSV, when the header has no tab) with ``id`` and ``sequence``
    columns.

    Raises:
        ValueError: a missing column (naming the file).
    """
    with open(path, newline="", encoding="utf-8") as f:
        header = f.readline()
        f.seek(0)
        reader = csv.DictReader(f, delimiter="\t" if "\t" in header else ",")
        missing = [c for c in ("id", "sequence") if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: the header needs columns id and sequence; missing {', '.join(missing)}")
        for row in reader:
            yield row["id"], row["sequence"].strip().upper()


def output_names(model: GenSLMForTask) -> list[str]:
    """The value columns: ``p_CLASS`` per class (or label) of a classifier, the target names of a regression."""
    spec = model.spec
    names = list(spec.labels) or [str(i) for i in range(spec.num_labels)]
    return names if spec.kind == "regression" else [f"p_{n}" for n in names]


@torch.no_grad()
def predict_records(model: GenSLMForTask, tokenizer: Tokenizer, records: Iterable[tuple[str, str]],
                    batch_size: int = 8) -> Iterator[dict]:
    """Rows ``{"id", "length", "values": [num_labels]}`` per record, or for a token task per token
    ``{"id", "position", "values"}`` (``position``: the 0-based index of the token's first base).

    Raises:
        ValueError: a record with no token, or longer than the model's ``max_position_embeddings``.
    """
    device = next(model.parameters()).device
    limit = model.model.config.max_position_embeddings
    batch: list[tuple[str, str, torch.Tensor]] = []

    def run() -> Iterator[dict]:
        T = max(len(ids) for _, _, ids in batch)  # tokens of the longest record of the batch
        input_ids = torch.full((len(batch), T), tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros(len(batch), T, dtype=torch.bool)
        for i, (_, _, ids) in enumerate(batch):
            input_ids[i, : len(ids)], mask[i, : len(ids)] = ids, True
        pos = torch.arange(T).expand(len(batch), T)
        values = model.spec.predictions(model(input_ids.to(device), pos.to(device), mask.to(device))).cpu()
        for i, (rid, seq, ids) in enumerate(batch):
            if model.spec.per_token:
                for t in range(len(ids)):
                    yield {"id": rid, "position": t * tokenizer.bases_per_token, "values": values[i, t].tolist()}
            else:
                yield {"id": rid, "length": len(seq), "values": values[i].tolist()}

    for rid, seq in records:
        ids = torch.from_numpy(tokenizer.encode(seq))
        if not 0 < len(ids) <= limit:
            raise ValueError(f"record {rid!r}: {len(ids)} tokens; the model reads 1 to {limit}")
        batch.append((rid, seq, ids))
        if len(batch) == batch_size:
            yield from run()
            batch = []
    if batch:
        yield from run()
