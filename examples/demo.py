"""`make demo`: the toolkit's main job on the bundled E. coli genome.

Grows with the toolkit; see README's status table for what it runs today.
"""
import gzip
import sys
from collections import Counter
from pathlib import Path

from Bio import SeqIO

from ds4sci.info import collect

GENOME = Path(__file__).resolve().parent / "data" / "NC_007779.1_ecoli_K12_W3110.fasta.gz"


def main() -> int:
    for key, value in collect().items():
        print(f"{key:>22}: {value}")
    with gzip.open(GENOME, "rt") as handle:
        for record in SeqIO.parse(handle, "fasta"):
            counts = Counter(str(record.seq))
            gc = (counts["G"] + counts["C"]) / len(record)
            print(f"{record.id}: {len(record):,} nt, GC {gc:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
