"""ds4sci.data: FASTA reading (Biopython), nucleotide/codon tokenizers, datasets for causal genome LMs."""
from ds4sci.data.datasets import (
    PackedDataset,
    RecordDataset,
    WindowDataset,
    collate,
    split_records,
    split_region,
)
from ds4sci.data.fasta import FastaRecord, normalize_sequence, read_fasta
from ds4sci.data.tokenizers import SPECIALS, STOP_CODONS, CodonTokenizer, NucleotideTokenizer, Tokenizer

__all__ = [
    "PackedDataset", "RecordDataset", "WindowDataset", "collate", "split_records",
    "split_region", "FastaRecord", "normalize_sequence", "read_fasta", "SPECIALS", "STOP_CODONS",
    "CodonTokenizer", "NucleotideTokenizer", "Tokenizer",
]
