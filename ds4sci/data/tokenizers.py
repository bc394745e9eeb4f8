"""Nucleotide and codon tokenizers, vectorised with byte lookup tables.

``CodonTokenizer`` uses the ids of GenSLM's 69-word codon vocabulary (Zvyagin et al. 2022, GenSLMs;
``codon_wordlevel_69vocab.json``): ids 0-4 are ``[UNK] [CLS] [SEP] [PAD] [MASK]``, then the 64 codons in
GenSLM's order (``_GENSLM_CODONS`` below), so ds4sci data and GenSLM checkpoints line up. A codon holding any
base other than A/C/G/T (``N``, an IUPAC code) maps to ``[UNK]``. A trailing partial codon (length not a
multiple of 3) is dropped by default (GenSLM's k-mer grouping turns it into an out-of-vocabulary word, i.e.
``[UNK]``, which carries no information), or rejected with ``partial="error"``.

``NucleotideTokenizer`` has one token per base: the same five specials, then ``A C G T N``; other letters map to
``[UNK]``.
"""
from __future__ import annotations

import json
import os
from typing import ClassVar

import numpy as np

SPECIALS = ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]")

# GenSLM's codon_wordlevel_69vocab.json order (ids 5..68); tests/data checks it against
# examples/data/genslm_codon_vocab_69.tsv.
_GENSLM_CODONS = (
    "GGC GCC ATC GAC GAA ATG GTG CTG GTC GCG GAT AAA GGT AAG GAG ACC AAC GTT ATT GCA CTC CGC GCT CAG CCG TTC "
    "GTA TCG GGA AAT TAC CTT TTG ACG TCC GGG AGC CCC ACA ACT TCT TTA CGT TAT CAA CGG TTT CAC CCT CCA TGG ATA "
    "TCA TGC AGT AGA CAT TGT CTA AGG TAA CGA TGA TAG"
).split()
STOP_CODONS = ("TAA", "TAG", "TGA")

_BASE_INDEX = np.full(256, 4, dtype=np.int64)  # 4 = not A/C/G/T
for _i, _b in enumerate(b"ACGT"):
    _BASE_INDEX[_b] = _i
    _BASE_INDEX[ord(chr(_b).lower())] = _i


def _ascii(seq: str | bytes) -> bytes:
    return seq if isinstance(seq, (bytes, bytearray, memoryview)) else seq.encode("ascii")


class Tokenizer:
    """Common interface: ``encode``/``decode``, special ids, ``save``/``load`` (JSON)."""

    kind: ClassVar[str]
    bases_per_token: ClassVar[int]

    def __init__(self, vocab: list[str]):
        self.vocab = list(vocab)
        self.token_to_id = {tok: i for i, tok in enumerate(self.vocab)}
        self.unk_id, self.cls_id, self.sep_id, self.pad_id, self.mask_id = (self.token_to_id[s] for s in SPECIALS)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self.token_to_id[s] for s in SPECIALS)

    def encode(self, seq: str | bytes) -> np.ndarray:
        """``seq`` (str, or ASCII bytes) -> token ids ``[L]`` (int64)."""
        raise NotImplementedError

    def decode(self, ids, *, skip_special: bool = True) -> str:
        """Token ids -> a nucleotide string; specials are dropped (or kept in brackets)."""
        out = []
        for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            if i in self.special_ids and skip_special:
                continue
            out.append(self.vocab[i])
        return "".join(out)

    def signature(self) -> dict:
        """Everything that decides the ids ``encode`` returns (what a token cache is keyed by)."""
        return {"kind": self.kind, "vocab": self.vocab}

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"kind": self.kind, "vocab": self.vocab}, f, indent=1)

    @staticmethod
    def load(path: str | os.PathLike) -> "Tokenizer":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        tok = Tokenizer.from_name(data.get("kind", "?"))
        if data.get("vocab") != tok.vocab:
            raise ValueError(f"{path}: vocabulary differs from ds4sci's {tok.kind} tokenizer")
        return tok

    @staticmethod
    def from_name(name: str) -> "Tokenizer":
        """``"nucleotide"`` or ``"codon"``."""
        kinds = {"nucleotide": NucleotideTokenizer, "codon": CodonTokenizer}
        if name not in kinds:
            raise ValueError(f"unknown tokenizer {name!r}; expected one of {sorted(kinds)}")
        return kinds[name]()


class NucleotideTokenizer(Tokenizer):
    """One token per base: ``[UNK]=0 [CLS]=1 [SEP]=2 [PAD]=3 [MASK]=4 A=5 C=6 G=7 T=8 N=9``."""

    kind = "nucleotide"
    bases_per_token = 1

    def __init__(self):
        super().__init__(list(SPECIALS) + list("ACGTN"))
        self._table = np.full(256, self.unk_id, dtype=np.int64)
        for base in "ACGTN":
            self._table[ord(base)] = self._table[ord(base.lower())] = self.token_to_id[base]
        comp = {"A": "T", "C": "G", "G": "C", "T": "A", "N": "N"}
        self._complement = np.arange(self.vocab_size, dtype=np.int64)
        for base, other in comp.items():
            self._complement[self.token_to_id[base]] = self.token_to_id[other]

    def encode(self, seq: str | bytes) -> np.ndarray:
        return self._table[np.frombuffer(_ascii(seq), dtype=np.uint8)]

    def reverse_complement(self, ids: np.ndarray) -> np.ndarray:
        """Token ids of the reverse complement (specials map to themselves)."""
        return self._complement[np.asarray(ids)[::-1]]


class CodonTokenizer(Tokenizer):
    """GenSLM's 69-word codon vocabulary; ``partial`` is ``"drop"`` (default) or ``"error"``."""

    kind = "codon"
    bases_per_token = 3

    def __init__(self, partial: str = "drop"):
        if partial not in ("drop", "error"):
            raise ValueError(f"partial must be 'drop' or 'error', got {partial!r}")
        self.partial = partial
        super().__init__(list(SPECIALS) + list(_GENSLM_CODONS))
        # codon code 16*b0 + 4*b1 + b2 (b in A,C,G,T = 0..3) -> GenSLM id; code 64 = contains another base.
        self._table = np.full(65, self.unk_id, dtype=np.int64)
        for codon in _GENSLM_CODONS:
            b = [int(_BASE_INDEX[ord(c)]) for c in codon]
            self._table[16 * b[0] + 4 * b[1] + b[2]] = self.token_to_id[codon]
        self.stop_ids = frozenset(self.token_to_id[c] for c in STOP_CODONS)

    def signature(self) -> dict:
        return {**super().signature(), "partial": self.partial}

    def encode(self, seq: str | bytes) -> np.ndarray:
        seq = _ascii(seq)
        rest = len(seq) % 3
        if rest and self.partial == "error":
            raise ValueError(f"sequence length {len(seq)} is not a multiple of 3 (trailing {seq[-rest:].decode()!r})")
        idx = _BASE_INDEX[np.frombuffer(seq[: len(seq) - rest], dtype=np.uint8)].reshape(-1, 3)
        code = idx[:, 0] * 16 + idx[:, 1] * 4 + idx[:, 2]  # [L/3]
        code[(idx == 4).any(axis=1)] = 64
        return self._table[code]


__all__ = ["Tokenizer", "NucleotideTokenizer", "CodonTokenizer", "SPECIALS", "STOP_CODONS"]
