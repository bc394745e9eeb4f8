"""Outputs written record by record in shards, resumable, merged in input order (``ds4sci score``/``embed --out``).

A job writing ``OUT`` keeps its work in the folder ``OUT.parts/``:

- ``manifest.json``: the job (the SHA-256 of the FASTA file's bytes, :func:`input_digest`, and every option that
  changes a number or which records a rank reads: the process layout among them) and ``merged`` once ``OUT`` is
  complete;
- ``part-D-N.tsv`` / ``.parquet``: chunk ``N`` of data rank ``D``, rows ``(index, ...)`` of the records it read
  (index: the record's place in the input). A chunk is written under a temporary name and renamed when whole
  (:meth:`ShardWriter.flush`, every ``flush_every`` records and at the end), so a job killed at any moment leaves
  only whole chunks, and the records of a chunk are never computed again.

:func:`start_job` (rank 0) makes or checks the folder: a fresh job clears it, ``resume`` keeps it when the job is
the same and refuses it when not, naming each option that differs with both values (a job resumed on another
number of processes would batch its records otherwise: its numbers could differ in the last float32 bit from both
runs'). Each data rank writes its own chunks as it goes (sequence rank 0 of it), each sorted by index;
:func:`merge` (rank 0, once every rank is done) streams them into ``OUT`` in input order, under a temporary name
renamed at the end, so an interrupted merge is done again on resume.
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

__all__ = ["ShardWriter", "done_indices", "input_digest", "merge", "parts_folder", "start_job"]

#: Rows per Parquet row group of the merged file: mean vectors, per-token matrices.
ROW_GROUP = {False: 1024, True: 16}


def parts_folder(out: str | Path) -> Path:
    """``OUT.parts``: the folder of a job's manifest and chunks."""
    return Path(f"{out}.parts")


def input_digest(fasta: str | Path) -> str:
    """SHA-256 of the FASTA file's bytes (hex): the input a resumed job must share."""
    h = hashlib.sha256()
    with open(fasta, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
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


def start_job(out: str | Path, job: dict, resume: bool, is_writer: bool) -> str:
    """Rank 0 (``is_writer``): the parts folder of ``out`` made fresh, or with ``resume`` kept when its manifest
    holds ``job`` (JSON values: the input's digest and the options; made when there is none); other ranks do nothing
    (call :func:`done_indices` after a barrier). Returns ``"merged"`` when a resumed job's ``out`` is already
    complete, else ``"open"``.

    Raises:
        ValueError: ``resume`` and a manifest of another input or options (naming the folder and, for each key that
            differs, its value there and here).
    """
    folder = parts_folder(out)
    if not is_writer:
        return "open"
    if resume and (folder / "manifest.json").exists():
        manifest = _manifest(folder)
        job = json.loads(json.dumps(job))  # as the manifest holds it (tuples are lists)
        before = manifest.get("job", {})
        differ = sorted(k for k in before.keys() | job.keys() if before.get(k) != job.get(k))
        if differ:
            said = ", ".join(f"{k} {json.dumps(before.get(k))} there, {json.dumps(job.get(k))} here" for k in differ)
            raise ValueError(f"--resume: {folder} was written for another input or other options ({said}); remove "
                             f"it or run without --resume")
        if manifest.get("merged") and Path(out).exists():
            return "merged"
        for tmp in folder.glob("*.tmp"):  # a chunk cut short by a kill
            tmp.unlink()
        return "open"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    _write_manifest(folder, {"job": job, "merged": False})
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
        self.rows.sort(key=lambda r: r[0])  # sorted runs, merged as they stream (:func:`merge`)
        if self.kind == "tsv":
            tmp.write_text("".join(f"{i}\t{row}\n" for i, row in self.rows), encoding="utf-8")
        else:
            import pyarrow.parquet as pq

            pq.write_table(_table(self.rows), tmp, row_group_size=ROW_GROUP[True])
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
    the rows without ``index``, in row groups), then mark the manifest merged and remove the chunks. Returns the rows
    written. Streamed: every chunk is sorted by index when written, so the chunks are merged as sorted runs (at most
    :data:`FAN_IN` open at once, in passes through temporary files beyond that), each read a row group at a time;
    no more than a row group of the output and one of each open chunk is in memory.

    Raises:
        ValueError: no chunk of a Parquet job, or a record index found twice (naming it).
    """
    folder, out = parts_folder(out), Path(out)
    chunks = _chunks(folder)
    parquet = out.suffix == ".parquet"
    if parquet and not chunks:
        raise ValueError(f"{folder}: no record written")
    passes = 0
    while len(chunks) > FAN_IN:  # runs of FAN_IN chunks merged into one each, until FAN_IN or fewer are left
        passes += 1
        runs = []
        for g in range(0, len(chunks), FAN_IN):
            runs.append(folder / f"merge-{passes}-{g // FAN_IN:06d}{out.suffix}.tmp")
            _merge_runs(chunks[g : g + FAN_IN], runs[-1], parquet, keep_index=True)
            if passes > 1:
                for c in chunks[g : g + FAN_IN]:
                    c.unlink()
        chunks = runs
    tmp = out.with_name(out.name + ".tmp")
    count = _merge_runs(chunks, tmp, parquet, keep_index=False, header=header)
    os.replace(tmp, out)
    _write_manifest(folder, {**_manifest(folder), "merged": True})
    for c in _chunks(folder) + list(folder.glob("merge-*.tmp")):
        c.unlink()
    return count


#: Chunks merged at once (files open together).
FAN_IN = 256


def _tsv_rows(path: Path):
    """``(index, line)`` of a sorted TSV chunk, line by line (the line with its index and newline)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield int(line.split("\t", 1)[0]), line


def _parquet_rows(path: Path):
    """``(index, (batch, row))`` of a sorted Parquet chunk, a row group's worth of rows at a time."""
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=ROW_GROUP[True]):
        for row, index in enumerate(batch.column(0).to_pylist()):
            yield index, (batch, row)


def _merge_runs(chunks: list[Path], path: Path, parquet: bool, *, keep_index: bool, header: str | None = None) -> int:
    """Merge sorted chunks into ``path`` (with their ``index`` column or without it, the final file); the rows."""
    import heapq

    merged = heapq.merge(*((_parquet_rows if parquet else _tsv_rows)(c) for c in chunks), key=lambda r: r[0])
    last, count = -1, 0
    if not parquet:
        with open(path, "w", encoding="utf-8") as f:
            if header and not keep_index:
                f.write(header + "\n")
            for index, line in merged:
                last, count = _next(last, index), count + 1
                f.write(line if keep_index else line.split("\t", 1)[1])
        return count
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pq.read_schema(chunks[0])
    if not keep_index:
        schema = schema.remove(schema.get_field_index("index"))
    group = ROW_GROUP[pa.types.is_list(schema.field("embedding").type)]
    rows = []
    with pq.ParquetWriter(path, schema) as writer:
        def write():
            table = pa.Table.from_batches([batch.slice(row, 1) for batch, row in rows])
            writer.write_table(table if keep_index else table.drop_columns(["index"]), row_group_size=group)
            rows.clear()

        for index, row in merged:
            last, count = _next(last, index), count + 1
            rows.append(row)
            if len(rows) == group:
                write()
        if rows:
            write()
    return count


def _next(last: int, index: int) -> int:
    """``index`` after ``last`` in the merged order: ``ValueError`` when a record comes twice."""
    if index <= last:
        raise ValueError(f"record {index} was written twice" if index == last else
                         f"record {index} came after record {last}: a chunk not sorted by index")
    return index
