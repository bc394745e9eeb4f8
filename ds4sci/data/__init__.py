"""ds4sci.data: FASTA reading, nucleotide/codon tokenizers, token caches of FASTA corpora, datasets for causal
genome LMs."""
from ds4sci.data.corpus import Corpus, load_datasets, open_corpus, resolve_sources
from ds4sci.data.datasets import (
    PackedDataset,
    RecordDataset,
    Spans,
    WindowDataset,
    collate,
    split_records,
    split_region,
    split_spans,
)
from ds4sci.data.fasta import FastaRecord, normalize_sequence, read_fasta
from ds4sci.data.tokenizers import SPECIALS, STOP_CODONS, CodonTokenizer, NucleotideTokenizer, Tokenizer

__all__ = [
    "Corpus", "load_datasets", "open_corpus", "resolve_sources",
    "PackedDataset", "RecordDataset", "Spans", "WindowDataset", "collate", "split_records",
    "split_region", "split_spans", "FastaRecord", "normalize_sequence", "read_fasta", "SPECIALS", "STOP_CODONS",
    "CodonTokenizer", "NucleotideTokenizer", "Tokenizer",
]
