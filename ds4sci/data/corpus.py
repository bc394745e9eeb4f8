"""A FASTA corpus (many files, directories, glob patterns) tokenized once into a memory-mapped token cache.

Sources (:func:`resolve_sources`): each entry of ``data.fasta`` is a file, a directory (every FASTA file below it,
recursively) or a glob pattern (``*``, ``?``, ``[...]``, ``**``); FASTA files are ``.fa .fna .fasta .ffn``, each
optionally ``.gz``. The order is the entries' order, files sorted by path inside a directory or pattern, each file
once. An entry that names nothing raises ``FileNotFoundError`` naming it.

Cache (:func:`open_corpus`): ``<cache_dir>/<key>/`` holds

- ``tokens.bin``: every record's token ids back to back (uint8), mapped read-only with ``np.memmap``;
- ``offsets.bin``: int64 ``[R + 1]``, record ``r`` is ``tokens[offsets[r]:offsets[r + 1]]``;
- ``id_hash.bin``: uint64 ``[R]``, :func:`ds4sci.data.datasets.record_hash` of each id (the record split);
- ``record_file.bin`` / ``record_line.bin``: uint32 / int64 ``[R]``, the source file index and header line of each
  record (for messages, and ``split: files``); ``ids.txt``: one record id per line;
- ``meta.json``: format version, key, tokenizer signature, IUPAC policy, sources (path, size, SHA-256), counts.

``key`` is the SHA-256 of the format version, every source file's size and content SHA-256 (in order), the
tokenizer's signature (kind, vocabulary, codon partial policy) and the IUPAC policy: a cache whose sources or
tokenization differ has another key, so it is never found, let alone reused. A cache directory whose files do not
agree with its ``meta.json`` (sizes, counts, key) is deleted and rebuilt. Building writes into a temporary
directory next to the cache and renames it into place at the end, so a killed build leaves no cache (only a
``.<key>.tmp.<host>.<pid>`` directory, removed by the next build on that host once its process is gone).

Under ``torch.distributed`` global rank 0 hashes the sources and builds once for every node that sees ``cache_dir``
as it does (shared storage); where a node does not (a node-local ``$TMPDIR`` or ``/local/scratch``: rank 0's marker
is missing there, :func:`ds4sci.distributed.storage.nodes_seeing`), that node's first process builds its own copy,
once per node. The other ranks wait in an all-gather of the builds (each builder's cache path or error; any error is
re-raised on every rank) and map their node's files. A large corpus is best built once beforehand
(``python -m ds4sci.data.corpus FASTA... --cache-dir DIR``), since the other ranks' wait counts against the
process group's timeout.

Records: a record with no sequence, or one shorter than one token (fewer than 3 bases for codons), is skipped with a
warning naming file, record and line. Duplicate ids are kept (each record is a sample) with one warning that names
the first duplicate's two places; a record split sends every record sharing an id to the same side, so a record
repeated in two files never leaks from training into validation. A file split (``split: files``) sends every record
of a source file to the side of the file's basename hash (:func:`ds4sci.data.datasets.file_hash`); the names are
those of the sources as resolved now (the key holds contents only, so ``meta.json``'s paths are the first
builder's), and which records came from which file is ``record_file.bin``.

Memory while building is one record plus O(records) numbers (offsets, hashes), never the corpus.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
from array import array
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np

from ds4sci.data.datasets import PackedDataset
from ds4sci.data.datasets import RecordDataset
from ds4sci.data.datasets import Spans
from ds4sci.data.datasets import WindowDataset
from ds4sci.data.datasets import record_hash
from ds4sci.data.datasets import split_spans
from ds4sci.data.fasta import IUPAC_POLICIES
from ds4sci.data.fasta import iter_raw_records
from ds4sci.data.tokenizers import Tokenizer
from ds4sci.distributed.launch import Launch
from ds4sci.distributed.nodes import node_of
from ds4sci.distributed.storage import nodes_seeing
from ds4sci.progress import progress_bar

logger = logging.getLogger(__name__)

FASTA_SUFFIXES = (".fa", ".fna", ".fasta", ".ffn")
FORMAT_VERSION = 1
_CHUNK = 3 << 20  # bases tokenized at a time (a multiple of 3 keeps the codon frame)


def _is_fasta_name(path: str) -> bool:
    name = path[:-3] if path.endswith(".gz") else path
    return name.lower().endswith(FASTA_SUFFIXES)


def resolve_sources(spec: str | os.PathLike | list) -> list[str]:
    """The FASTA files named by ``spec`` (a path, directory or glob, or a list of them), absolute, in order.

    Raises:
        FileNotFoundError: an entry matches no file (the message names the entry).
        ValueError: ``spec`` is empty.
    """
    entries = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not entries:
        raise ValueError("no FASTA source given")
    files: list[str] = []
    for entry in entries:
        entry = os.path.expanduser(os.fspath(entry))
        if os.path.isdir(entry):
            found = sorted(p for p in glob.glob(os.path.join(glob.escape(entry), "**", "*"), recursive=True)
                           if os.path.isfile(p) and _is_fasta_name(p))
            what = f"directory {entry!r} holds no FASTA file ({', '.join(FASTA_SUFFIXES)}, optionally .gz)"
        elif glob.has_magic(entry):
            found = sorted(p for p in glob.glob(entry, recursive=True) if os.path.isfile(p))
            what = f"pattern {entry!r} matches no file"
        elif os.path.isfile(entry):
            found, what = [entry], ""
        else:
            found, what = [], f"{entry!r}: no such file or directory"
        if not found:
            raise FileNotFoundError(what)
        files.extend(os.path.abspath(p) for p in found)
    return list(dict.fromkeys(files))  # each file once, first place kept


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def cache_key(sources: list[dict], tokenizer: Tokenizer, iupac: str) -> str:
    """The key of the cache of ``sources`` (dicts with ``size`` and ``sha256``) under this tokenization."""
    data = {"format": FORMAT_VERSION, "sources": [[s["size"], s["sha256"]] for s in sources],
            "tokenizer": tokenizer.signature(), "iupac": iupac}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:32]


def _token_dtype(tokenizer: Tokenizer) -> np.dtype:
    return np.dtype(np.uint8 if tokenizer.vocab_size <= 256 else np.uint16)


@dataclass(frozen=True)
class Corpus:
    """An opened token cache: every array is a read-only memory map."""

    root: Path
    meta: dict
    tokens: np.ndarray  # [N] token ids
    offsets: np.ndarray  # [R + 1] int64
    id_hash: np.ndarray  # [R] uint64
    paths: tuple[str, ...] = ()  # the source files as resolved by open_corpus; () -> meta.json's (the builder's)

    @property
    def spans(self) -> Spans:
        return Spans(self.tokens, np.stack([self.offsets[:-1], self.offsets[1:]], axis=1))

    def split(self, val_fraction: float, policy: str = "auto") -> tuple[Spans, Spans]:
        """``(train, val)`` spans: see :func:`ds4sci.data.datasets.split_spans`."""
        if policy != "files":
            return split_spans(self.spans, self.id_hash, val_fraction, policy)
        record_file = np.memmap(self.root / "record_file.bin", dtype=np.uint32, mode="r")
        paths = self.paths or tuple(s["path"] for s in self.meta["sources"])
        return split_spans(self.spans, self.id_hash, val_fraction, policy, record_file=record_file, files=paths)

    def record_id(self, r: int) -> str:
        with open(self.root / "ids.txt", encoding="utf-8") as f:
            return next(islice(f, r, None)).rstrip("\n")

    def where(self, r: int) -> str:
        """``file: record 'id' (line L)`` of record ``r``, for messages."""
        f = int(np.memmap(self.root / "record_file.bin", dtype=np.uint32, mode="r")[r])
        line = int(np.memmap(self.root / "record_line.bin", dtype=np.int64, mode="r")[r])
        return f"{self.meta['sources'][f]['path']}: record {self.record_id(r)!r} (line {line})"

    @staticmethod
    def open(root: str | os.PathLike, key: str | None = None) -> "Corpus":
        """Map the cache at ``root``; ``ValueError`` if its files do not agree with its ``meta.json`` (or ``key``)."""
        root = Path(root)
        try:
            meta = json.loads((root / "meta.json").read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{root}: no readable meta.json ({err})") from None
        n, r = meta.get("n_tokens"), meta.get("n_records")
        dtype = np.dtype(meta.get("dtype", "uint8"))
        expect = {"tokens.bin": n * dtype.itemsize, "offsets.bin": (r + 1) * 8, "id_hash.bin": r * 8,
                  "record_file.bin": r * 4, "record_line.bin": r * 8}
        if meta.get("format") != FORMAT_VERSION or (key is not None and meta.get("key") != key):
            raise ValueError(f"{root}: format/key {meta.get('format')}/{meta.get('key')} != "
                             f"{FORMAT_VERSION}/{key}")
        for name, size in expect.items():
            have = (root / name).stat().st_size if (root / name).exists() else None
            if have != size:
                raise ValueError(f"{root}/{name}: {have} bytes, meta.json says {size}")
        offsets = np.memmap(root / "offsets.bin", dtype=np.int64, mode="r")
        if offsets[0] != 0 or offsets[-1] != n or (r and np.any(np.diff(offsets) <= 0)):
            raise ValueError(f"{root}/offsets.bin: not increasing from 0 to {n}")
        tokens = np.memmap(root / "tokens.bin", dtype=dtype, mode="r") if n else np.zeros(0, dtype)
        id_hash = np.memmap(root / "id_hash.bin", dtype=np.uint64, mode="r") if r else np.zeros(0, np.uint64)
        return Corpus(root, meta, tokens, offsets, id_hash)


class _Writer:
    """Appends arrays to a raw binary file through a small buffer."""

    def __init__(self, path: Path, typecode: str):
        self.f, self.buf, self.typecode = open(path, "wb"), array(typecode), typecode

    def append(self, value: int) -> None:
        self.buf.append(value)
        if len(self.buf) >= 1 << 16:
            self.flush()

    def flush(self) -> None:
        self.buf.tofile(self.f)
        self.buf = array(self.typecode)

    def close(self) -> None:
        self.flush()
        self.f.close()


def _remove_stale_builds(cache_dir: Path, key: str) -> None:
    host = socket.gethostname()
    for tmp in cache_dir.glob(f".{key}.tmp.{host}.*"):
        try:
            os.kill(int(tmp.name.rsplit(".", 1)[1]), 0)
        except ProcessLookupError:  # its builder is gone: a killed build
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, PermissionError):
            pass


def build_cache(files: list[str], sources: list[dict], tokenizer: Tokenizer, iupac: str, cache_dir: str | os.PathLike,
                key: str, *, progress: bool = False) -> Path:
    """Tokenize ``files`` into ``<cache_dir>/<key>`` (atomically: temporary directory, then rename); ``progress``: a
    bar over the bytes read, on a terminal only (:func:`ds4sci.progress.progress_bar`)."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(cache_dir, key)
    final = cache_dir / key
    tmp = cache_dir / f".{key}.tmp.{socket.gethostname()}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    dtype = _token_dtype(tokenizer)
    try:
        bar = progress_bar(progress, total=sum(s["size"] for s in sources), unit="B", unit_scale=True,
                           desc=f"tokenizing {len(files)} FASTA file(s)")
        tokens = open(tmp / "tokens.bin", "wb")
        offsets, hashes = _Writer(tmp / "offsets.bin", "q"), _Writer(tmp / "id_hash.bin", "Q")
        rec_file, rec_line = _Writer(tmp / "record_file.bin", "I"), _Writer(tmp / "record_line.bin", "q")
        ids = open(tmp / "ids.txt", "w", encoding="utf-8")
        n_tokens, n_records, skipped, done = 0, 0, 0, 0
        offsets.append(0)
        for f, path in enumerate(files):
            def moved(pos: int, base=done) -> None:
                bar.update(base + pos - bar.n)

            kept = 0
            for rec in iter_raw_records(path, iupac=iupac, progress=moved):
                n = 0
                for c in range(0, len(rec.sequence), _CHUNK):
                    ids_chunk = tokenizer.encode(rec.sequence[c : c + _CHUNK])
                    tokens.write(ids_chunk.astype(dtype).tobytes())
                    n += len(ids_chunk)
                if n == 0:
                    skipped += 1
                    logger.warning("%s: record %r (line %d) is shorter than one %s token (%d bases); skipped",
                                   path, rec.id, rec.line, tokenizer.kind, len(rec.sequence))
                    continue
                n_tokens += n
                n_records += 1
                kept += 1
                offsets.append(n_tokens)
                hashes.append(record_hash(rec.id))
                rec_file.append(f)
                rec_line.append(rec.line)
                ids.write(rec.id + "\n")
            sources[f]["records"] = kept
            done += sources[f]["size"]
            bar.update(done - bar.n)
        bar.close()
        for w in (offsets, hashes, rec_file, rec_line):
            w.close()
        tokens.close()
        ids.close()
        if n_records == 0:
            raise ValueError(f"{', '.join(files[:3])}{' ...' if len(files) > 3 else ''}: no record of at least one "
                             f"{tokenizer.kind} token ({skipped} too short)")
        meta = {"format": FORMAT_VERSION, "key": key, "tokenizer": tokenizer.signature(), "iupac": iupac,
                "dtype": dtype.name, "n_tokens": n_tokens, "n_records": n_records, "skipped_short": skipped,
                "sources": sources}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        _warn_duplicates(Corpus.open(tmp, key))
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same cache first: keep theirs
            if not (final / "meta.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing partial left behind
        raise
    return final


def _warn_duplicates(corpus: Corpus) -> None:
    h = np.asarray(corpus.id_hash)
    order = np.argsort(h, kind="stable")
    same = np.flatnonzero(h[order][1:] == h[order][:-1])  # [D] positions in sorted order of repeated ids
    if same.size:
        later = order[same + 1]  # stable sort: the later record of each repeated pair
        j = int(np.argmin(later))  # name the first repeat in corpus order, with its earlier twin
        a, b = int(order[same[j]]), int(later[j])
        logger.warning("%d record(s) repeat an earlier record id, e.g. %s and %s; all are kept, and records sharing an "
                       "id fall on the same side of a record split", same.size, corpus.where(a), corpus.where(b))


def _prepare(fasta, tokenizer: Tokenizer, iupac: str, cache_dir: str | os.PathLike,
             progress: bool) -> tuple[Path, list[str]]:
    """Rank-0 work: resolve, hash, then open a matching cache or build one; returns its directory and the sources."""
    if iupac not in IUPAC_POLICIES:
        raise ValueError(f"iupac must be one of {IUPAC_POLICIES}, got {iupac!r}")
    files = resolve_sources(fasta)
    sources = [{"path": p, "size": os.path.getsize(p), "sha256": _sha256(p)} for p in files]
    key = cache_key(sources, tokenizer, iupac)
    root = Path(cache_dir) / key
    if root.exists():
        try:
            Corpus.open(root, key)
            logger.info("token cache %s: reused", root)
            return root, files
        except (OSError, ValueError) as err:
            logger.warning("token cache %s does not match its meta.json (%s); rebuilding", root, err)
            shutil.rmtree(root, ignore_errors=True)
    logger.info("token cache %s: building from %d file(s)", root, len(files))
    return build_cache(files, sources, tokenizer, iupac, cache_dir, key, progress=progress), files


def _distributed():
    """``torch.distributed`` when a process group of more than one rank is up, else ``None``."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def open_corpus(fasta, tokenizer: Tokenizer, *, cache_dir: str | os.PathLike, iupac: str = "n",
                progress: bool = False, launch: Launch | None = None) -> Corpus:
    """The token cache of ``fasta`` (see :func:`resolve_sources`), built on first use (see the module docstring).

    Under ``torch.distributed`` every rank must call this. ``launch`` (this process's place: rank, local rank, local
    world size) lets each node's first process check whether it sees ``cache_dir`` as rank 0 does: rank 0 builds for
    the nodes that do, the first process of each node that does not builds its own, and the others wait and map
    their node's. Without ``launch``, or where rank 0 cannot write into ``cache_dir`` (a read-only cache built
    beforehand), every rank is taken to see rank 0's ``cache_dir``.
    ``progress``: a bar while the cache is built, on a terminal only.

    Raises:
        ValueError / OSError: bad input (named by the builder and raised on every rank), or a rank that cannot map its
            builder's cache or was given another tokenizer or iupac policy.
    """
    dist = _distributed()
    if dist is None:
        root, files = _prepare(fasta, tokenizer, iupac, cache_dir, progress)
        return dataclasses.replace(Corpus.open(root), paths=tuple(files))
    if launch is not None:
        node, first = node_of(launch.rank, launch.local_world_size), launch.local_rank == 0
    else:
        node, first = 0, dist.get_rank() == 0
    try:
        shared = launch is None or {v.node: v.sees for v in nodes_seeing(cache_dir, launch)}[node]
    except OSError:  # on every rank: rank 0 cannot write there (a read-only cache built beforehand), so it is shared
        shared = True
    mine = None  # this rank's build: ("ok", (root, files)) or (error class name, message)
    if dist.get_rank() == 0 or (first and not shared):
        try:
            root, files = _prepare(fasta, tokenizer, iupac, cache_dir, progress)
            mine = ("ok", (str(root), files))
        except (OSError, ValueError) as err:  # every rank raises the same user error, none hangs
            mine = (type(err).__name__, str(err))
        except BaseException as err:
            failed = ("RuntimeError", f"rank {dist.get_rank()} failed to build the token cache: "
                                      f"{type(err).__name__}: {err}")
            dist.all_gather_object([None] * dist.get_world_size(), (node, failed))
            raise
    builds: list = [None] * dist.get_world_size()  # (node, build) of every rank; build None: it waited
    dist.all_gather_object(builds, (node, mine))
    result = builds[0][1] if shared else next(b for n, b in builds if n == node and b is not None)
    if result[0] == "ok":  # another builder's error stops this rank too
        result = next((b for _, b in builds if b is not None and b[0] != "ok"), result)
    status, value = result
    if status != "ok":
        exc = {"FileNotFoundError": FileNotFoundError, "IsADirectoryError": IsADirectoryError,
               "ValueError": ValueError}.get(status, RuntimeError)
        raise exc(value)
    value, files = value
    try:
        corpus = dataclasses.replace(Corpus.open(value), paths=tuple(files))
    except (OSError, ValueError) as err:
        raise ValueError(f"rank {dist.get_rank()}: cannot map the token cache built at {value} ({err}); "
                         f"data.cache_dir must be on a file system every rank of a node sees") from None
    if corpus.meta["tokenizer"] != tokenizer.signature() or corpus.meta["iupac"] != iupac:
        raise ValueError(f"rank {dist.get_rank()}: the token cache at {value} was built with another tokenizer "
                         f"or iupac policy than this rank's (ranks disagree on the data config)")
    return corpus


def load_datasets(corpus: Corpus, tokenizer: Tokenizer, *, dataset: str, seq_len: int, stride: int = 0,
                  val_fraction: float, split: str = "auto", max_train_tokens: int = 0,
                  reverse_complement: float = 0.0, seed: int = 0):
    """Training and validation datasets of ``corpus``: ``dataset`` is ``windows``, ``records`` or ``packed``."""
    train, val = corpus.split(val_fraction, split)
    if max_train_tokens:
        train = train.head(max_train_tokens)
    T = seq_len
    if dataset == "windows":
        return (WindowDataset(train, tokenizer, T, stride or T, reverse_complement=reverse_complement, seed=seed),
                WindowDataset(val, tokenizer, T, T))
    if dataset == "records":
        return RecordDataset(train, tokenizer, T), RecordDataset(val, tokenizer, T)
    if dataset == "packed":
        return PackedDataset(train, tokenizer, T), PackedDataset(val, tokenizer, T)
    raise ValueError(f"dataset must be windows, records or packed, got {dataset!r}")


def main(argv: list[str] | None = None) -> int:
    """``python -m ds4sci.data.corpus FASTA... --cache-dir DIR``: build (or check) a token cache in one process."""
    parser = argparse.ArgumentParser(prog="python -m ds4sci.data.corpus", description=main.__doc__)
    parser.add_argument("fasta", nargs="+", help="FASTA files, directories or glob patterns")
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("--tokenizer", default="nucleotide", choices=["nucleotide", "codon"])
    parser.add_argument("--iupac", default="n", choices=list(IUPAC_POLICIES))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        corpus = open_corpus(args.fasta, Tokenizer.from_name(args.tokenizer), cache_dir=args.cache_dir,
                             iupac=args.iupac, progress=True)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{corpus.root}: {corpus.meta['n_records']} records, {corpus.meta['n_tokens']} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
