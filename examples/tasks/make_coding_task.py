"""Derive the bundled coding-vs-intergenic tasks from the bundled E. coli K-12 W3110 genome and Prodigal's gene calls.

    python examples/tasks/make_coding_task.py [--out examples/data]

Writes two tables (``id``, ``sequence``, ``label``, ``split``; read them with :func:`ds4sci.data.read_labelled`):

- ``ecoli_coding_windows.tsv`` (kind ``binary``): 256-base windows wholly inside a predicted gene (label 1, either
  strand) or wholly outside every predicted gene (label 0), balanced per split;
- ``ecoli_coding_bases.tsv`` (kind ``token``): 512-base windows centred on a gene's first or last base, one
  ``0``/``1`` per base (1: inside a predicted gene).

Genes: pyrodigal (Prodigal 2.6 in Python) trained on the genome itself (single-genome mode, ``closed=True``: no gene
runs off the record's ends). Splits by genome region, so no test window shares bases with a training one: positions
``[3_500_000, 3_950_000)`` are validation, ``[3_950_000, end)`` test (the held-out region), the rest train; a window
crossing a region boundary is dropped. Ids are ``NC_007779.1:START-END``, 0-based half-open. The windows drawn are
fixed by ``SEED``; the output depends only on the genome, pyrodigal's version (stated in the README) and this file.
Prodigal calls protein-coding genes only: RNA genes (rRNA, tRNA) count as intergenic here.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyrodigal

from ds4sci.data import read_fasta

ROOT = Path(__file__).resolve().parents[2]
GENOME = ROOT / "examples" / "data" / "NC_007779.1_ecoli_K12_W3110.fasta.gz"
SEED = 44
WINDOW, TOKEN_WINDOW = 256, 512
REGIONS = (("train", 0), ("validation", 3_500_000), ("test", 3_950_000))  # split, first base
PER_CLASS = {"train": 250, "validation": 60, "test": 100}  # windows per class and split, at most
TOKEN_WINDOWS = {"train": 80, "validation": 20, "test": 40}


def coding_mask(sequence: str) -> np.ndarray:
    """``[L]`` bool: True at the bases of a gene pyrodigal predicts on either strand."""
    finder = pyrodigal.GeneFinder(closed=True)
    finder.train(sequence)
    mask = np.zeros(len(sequence), dtype=bool)
    for gene in finder.find_genes(sequence):
        mask[gene.begin - 1: gene.end] = True  # pyrodigal: 1-based, inclusive
    return mask


def split_of(start: int, end: int, length: int) -> str | None:
    """The region holding ``[start, end)`` wholly, or None when the window crosses a region boundary."""
    bounds = [first for _, first in REGIONS] + [length]
    for (name, first), last in zip(REGIONS, bounds[1:]):
        if first <= start and end <= last:
            return name
    return None


def runs(mask: np.ndarray, value: bool) -> list[tuple[int, int]]:
    """``[start, end)`` of each maximal run of ``value`` in ``mask``."""
    edges = np.flatnonzero(np.diff(np.concatenate([[False], mask == value, [False]]).astype(np.int8)))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def window_rows(sequence: str, mask: np.ndarray, rng: np.random.Generator) -> list[tuple[str, str, str, str]]:
    """Balanced coding (1) / intergenic (0) windows: one per long-enough run, centred in it, then sampled."""
    candidates: dict[tuple[str, int], list[int]] = {}
    for label in (True, False):
        for start, end in runs(mask, label):
            if end - start >= WINDOW:
                first = (start + end - WINDOW) // 2
                split = split_of(first, first + WINDOW, len(sequence))
                if split is not None:
                    candidates.setdefault((split, int(label)), []).append(first)
    rows = []
    for split, _ in REGIONS:
        count = min(PER_CLASS[split], len(candidates[split, 0]), len(candidates[split, 1]))
        for label in (1, 0):
            for first in sorted(rng.choice(candidates[split, label], size=count, replace=False).tolist()):
                rows.append((f"NC_007779.1:{first}-{first + WINDOW}", sequence[first:first + WINDOW], str(label),
                             split))
    return rows


def token_rows(sequence: str, mask: np.ndarray, rng: np.random.Generator) -> list[tuple[str, str, str, str]]:
    """Per-base windows centred on a gene boundary (a change of ``mask``), sampled per split."""
    boundaries = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    candidates: dict[str, list[int]] = {}
    for b in boundaries.tolist():
        first = b - TOKEN_WINDOW // 2
        split = split_of(first, first + TOKEN_WINDOW, len(sequence)) if first >= 0 else None
        if split is not None:
            candidates.setdefault(split, []).append(first)
    rows, taken = [], np.zeros(len(sequence), dtype=bool)
    for split, _ in REGIONS:
        chosen = []
        for first in rng.permutation(candidates[split]).tolist():
            if len(chosen) < TOKEN_WINDOWS[split] and not taken[first:first + TOKEN_WINDOW].any():  # no overlap
                taken[first:first + TOKEN_WINDOW] = True
                chosen.append(first)
        for first in sorted(chosen):
            labels = "".join("1" if m else "0" for m in mask[first:first + TOKEN_WINDOW])
            rows.append((f"NC_007779.1:{first}-{first + TOKEN_WINDOW}", sequence[first:first + TOKEN_WINDOW], labels,
                         split))
    return rows


def write(path: Path, rows: list[tuple[str, str, str, str]]) -> None:
    with open(path, "w") as handle:
        handle.write("id\tsequence\tlabel\tsplit\n")
        handle.writelines("\t".join(row) + "\n" for row in rows)
    print(f"wrote {len(rows)} rows to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "examples" / "data")
    args = parser.parse_args()
    sequence = next(read_fasta(GENOME)).sequence
    mask = coding_mask(sequence)
    print(f"pyrodigal {pyrodigal.__version__}: {mask.mean():.1%} of the genome inside a predicted gene")
    write(args.out / "ecoli_coding_windows.tsv", window_rows(sequence, mask, np.random.default_rng(SEED)))
    write(args.out / "ecoli_coding_bases.tsv", token_rows(sequence, mask, np.random.default_rng(SEED + 1)))


if __name__ == "__main__":
    main()
