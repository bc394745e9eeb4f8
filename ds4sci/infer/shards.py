"""Outputs written record by record in shards, resumable, merged in input order (``ds4sci score``/``embed --out``).

A job writing ``OUT`` keeps its work in the folder ``OUT.parts/``:

- ``manifest.json``: the digest of the job's input (the FASTA file's bytes and every option that changes a
  number, :func:`job_digest`) and ``merged`` once ``OUT`` is complete;
- ``part-D-N.tsv`` / ``.parquet``: chunk ``N`` of data rank ``D``, rows ``(index, ...)`` of the records it read
  (index: the record's place in the input). A chunk is written under a temporary name and renamed when whole
  (:meth:`ShardWriter.flush`, every ``flush_every`` records and at the end), so a job killed at any moment leaves
  only whole chunks, and the records of a chunk are never computed again.

:func:`start_job` (every rank) makes or checks the folder and returns the indices already written: a fresh job
clears it, ``resume`` keeps it when the digest matches (and refuses it when not). Each data rank writes its own
chunks as it goes (sequence rank 0 of it); :func:`merge` (rank 0, once every rank is done) writes ``OUT`` from the
chunks in input order, under a temporary name renamed at the end, so an interrupted merge is done again on resume.
The merged TSV equals an uninterrupted run's byte for byte. Parquet (pyarrow) holds ``id``, ``layer`` and
``embedding`` (a fixed-size list ``[hidden]``, or per token a list of them ``[tokens][hidden]``) in row groups, so
``pyarrow.parquet.ParquetFile(OUT).iter_batches()`` or ``pandas.read_parquet(OUT, columns=[...])`` read it in parts.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

__all__ = ["ShardWriter", "done_indices", "job_digest", "merge", "parts_folder", "start_job"]

#: Rows per Parquet row group of the merged file: mean vectors, per-token matrices.
ROW_GROUP = {False: 1024, True: 16}


def parts_folder(out: str | Path) -> Path:
    """``OUT.parts``: the folder of a job's manifest and chunks."""
    return Path(f"{out}.parts")


def job_digest(fasta: str | Path, options: dict) -> str:
    """SHA-256 of the FASTA file's bytes and ``options`` (JSON, keys sorted): what a resumed job must share."""
    h = hashlib.sha256()
    with open(fasta, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    h.update(json.dumps(options, sort_keys=True).encode())
    return h.hexdigest()


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _write_manifest(folder: Path, manifest: dict) -> None:
    tmp = folder / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, sort_keys=True))
    os.replace(tmp, folder / "manifest.json")


def _chunks(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("part-*") if not p.name.endswith(".tmp"))


def _indices(chunk: Path) -> list[int]:
    if chunk.suffix == ".tsv":
        return [int(line.split("\t", 1)[0]) for line in chunk.read_text(encoding="utf-8").splitlines()]
    import pyarrow.parquet as pq

    return pq.read_table(chunk, columns=["index"]).column("index").to_pylist()


def start_job(out: str | Path, digest: str, resume: bool, is_writer: bool) -> str:
    """Rank 0 (``is_writer``): the parts folder of ``out`` made fresh, or with ``resume`` kept when its manifest
    holds ``digest`` (made when there is none); other ranks do nothing (call :func:`done_indices` after a barrier).
    Returns ``"merged"`` when a resumed job's ``out`` is already complete, else ``"open"``.

    Raises:
        ValueError: ``resume`` and a manifest of another input or options (naming the folder).
    """
    folder = parts_folder(out)
    if not is_writer:
        return "open"
    if resume and (folder / "manifest.json").exists():
        manifest = _manifest(folder)
        if manifest["digest"] != digest:
            raise ValueError(f"--resume: {folder} was written for another input or other options; remove it or "
                             f"run without --resume")
        if manifest.get("merged") and Path(out).exists():
            return "merged"
        for tmp in folder.glob("*.tmp"):  # a chunk cut short by a kill
            tmp.unlink()
        return "open"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    _write_manifest(folder, {"digest": digest, "merged": False})
    return "open"


def done_indices(out: str | Path) -> set[int]:
    """The record indices in the whole chunks of ``out``'s parts folder."""
    return {i for chunk in _chunks(parts_folder(out)) for i in _indices(chunk)}


class ShardWriter:
    """Chunks of one data rank: :meth:`add` a record's row, :meth:`flush` (every ``flush_every`` records and on
    :meth:`close`) writes them as one whole chunk. ``kind``: ``"tsv"`` (a row is its text, tab-separated, no
    newline) or ``"parquet"`` (a row is ``(id, layer, states)``, ``states`` ``[hidden]`` or ``[tokens, hidden]``).
    """

    def __init__(self, out: str | Path, data_rank: int, kind: str, flush_every: int = 256):
        self.folder, self.rank, self.kind, self.flush_every = parts_folder(out), data_rank, kind, flush_every
        taken = [int(p.name.split("-")[2].split(".")[0]) for p in self.folder.glob(f"part-{data_rank}-*")
                 if not p.name.endswith(".tmp")]
        self.next = max(taken, default=-1) + 1
        self.rows: list[tuple[int, object]] = []

    def add(self, index: int, row) -> None:
        self.rows.append((index, row))
        if len(self.rows) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        path = self.folder / f"part-{self.rank}-{self.next:06d}.{self.kind}"
        tmp = path.with_name(path.name + ".tmp")
        if self.kind == "tsv":
            tmp.write_text("".join(f"{i}\t{row}\n" for i, row in self.rows), encoding="utf-8")
        else:
            import pyarrow.parquet as pq

            pq.write_table(_table(self.rows), tmp)
        os.replace(tmp, path)
        self.next += 1
        self.rows = []

    def close(self) -> None:
        self.flush()


def _table(rows: list[tuple[int, tuple]]):
    """A pyarrow table ``index, id, layer, embedding`` of ``(index, (id, layer, states))`` rows."""
    import pyarrow as pa

    states = [np.asarray(s, dtype=np.float32) for _, (_, _, s) in rows]
    hidden = states[0].shape[-1]
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(np.concatenate([s.reshape(-1) for s in states])), hidden)
    if states[0].ndim == 2:
        offsets = np.r_[0, np.cumsum([len(s) for s in states])].astype(np.int32)
        vectors = pa.ListArray.from_arrays(pa.array(offsets), vectors)
    return pa.table({"index": pa.array([i for i, _ in rows], pa.int64()), "id": [r[0] for _, r in rows],
                     "layer": [r[1] for _, r in rows], "embedding": vectors})


def merge(out: str | Path, header: str | None = None) -> int:
    """Write ``out`` from the chunks of its parts folder in input order (TSV: ``header`` then the rows; Parquet:
    the rows without ``index``), then mark the manifest merged and remove the chunks. Returns the rows written.

    Raises:
        ValueError: a record index found twice (naming it).
    """
    folder, out = parts_folder(out), Path(out)
    chunks = _chunks(folder)
    tmp = out.with_name(out.name + ".tmp")
    if out.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        tables = [pq.read_table(c) for c in chunks]
        table = pa.concat_tables(tables) if tables else None
        if table is None:
            raise ValueError(f"{folder}: no record written")
        index = table.column("index").to_numpy()
        order = np.argsort(index, kind="stable")
        _check_once(index[order])
        table = table.take(pa.array(order)).drop_columns(["index"])
        per_token = pa.types.is_list(table.schema.field("embedding").type)
        pq.write_table(table, tmp, row_group_size=ROW_GROUP[per_token])
        count = table.num_rows
    else:
        rows = [(int(i), line) for c in chunks for i, line in
                (text.split("\t", 1) for text in c.read_text(encoding="utf-8").splitlines())]
        rows.sort(key=lambda r: r[0])
        _check_once(np.array([i for i, _ in rows], dtype=np.int64))
        tmp.write_text((header + "\n" if header else "") + "".join(line + "\n" for _, line in rows), encoding="utf-8")
        count = len(rows)
    os.replace(tmp, out)
    _write_manifest(folder, {**_manifest(folder), "merged": True})
    for c in chunks:
        c.unlink()
    return count


def _check_once(index: np.ndarray) -> None:
    twice = index[1:][index[1:] == index[:-1]]
    if len(twice):
        raise ValueError(f"record {int(twice[0])} was written twice")
