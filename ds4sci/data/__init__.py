"""ds4sci.data: FASTA reading, nucleotide/codon tokenizers, token caches of FASTA corpora, datasets for causal
genome LMs, labelled data for downstream tasks (:mod:`ds4sci.data.labels`) and their metrics
(:mod:`ds4sci.data.metrics`, imported on its own: it loads scikit-learn).

The token-cache names (:mod:`ds4sci.data.corpus`) are imported on first use, not with the package, so that
``python -m ds4sci.data.corpus`` runs that module as ``__main__`` without a copy already imported by the package
(which Python warns about, and which would hold a second set of its globals).
"""
from ds4sci.data.datasets import PackedDataset
from ds4sci.data.datasets import RecordDataset
from ds4sci.data.datasets import Spans
from ds4sci.data.datasets import WindowDataset
from ds4sci.data.datasets import collate
from ds4sci.data.datasets import split_records
from ds4sci.data.datasets import split_region
from ds4sci.data.datasets import split_spans
from ds4sci.data.fasta import FastaRecord
from ds4sci.data.fasta import normalize_sequence
from ds4sci.data.fasta import read_fasta
from ds4sci.data.labels import LabelError
from ds4sci.data.labels import LabelledData
from ds4sci.data.labels import LabelledRecord
from ds4sci.data.labels import LabelSource
from ds4sci.data.labels import hash_split
from ds4sci.data.labels import read_labelled
from ds4sci.data.tokenizers import SPECIALS
from ds4sci.data.tokenizers import STOP_CODONS
from ds4sci.data.tokenizers import CodonTokenizer
from ds4sci.data.tokenizers import NucleotideTokenizer
from ds4sci.data.tokenizers import Tokenizer
from ds4sci.kernels.lazy import lazy_exports

_CORPUS_NAMES = ("Corpus", "load_datasets", "open_corpus", "resolve_sources")

__all__ = [
    *_CORPUS_NAMES,
    "PackedDataset", "RecordDataset", "Spans", "WindowDataset", "collate", "split_records",
    "split_region", "split_spans", "FastaRecord", "normalize_sequence", "read_fasta", "SPECIALS", "STOP_CODONS",
    "CodonTokenizer", "NucleotideTokenizer", "Tokenizer", "LabelledRecord", "LabelError", "LabelledData", "LabelSource",
    "hash_split", "read_labelled",
]

# ds4sci.data.open_corpus and the other ds4sci.data.corpus names, imported on first use
__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(_CORPUS_NAMES, "corpus"))
