"""Labelled records as fine-tuning inputs (ds4sci.data.task_records): padding and masks, per-base labels as
per-codon ones, float labels, the filler of a partial batch, and the refusal of a record longer than data.seq_len."""
import math

import numpy as np
import pytest
import torch

from ds4sci.data import CodonTokenizer
from ds4sci.data import NucleotideTokenizer
from ds4sci.data.task_records import TaskRecords
from ds4sci.data.task_records import token_labels
from ds4sci.data.task_records import unlabelled


def test_codon_labels_are_the_majority_of_their_bases():
    bases = np.array([0, 0, 1, 1, 1, 0, 2, 2, 1, 1, 0, 2, 1])  # 4 codons and a partial one
    assert token_labels(bases, 3).tolist() == [0, 1, 2, 0]  # the last codon's tie (1, 0, 2): the smallest class
    assert token_labels(bases, 1).tolist() == bases.tolist()


def test_padding_masks_and_labels():
    tok = CodonTokenizer()
    ds = TaskRecords([("a", "ATGAAACCC", np.array([1, 1, 1, 0, 0, 0, 1, 1, 0])), ("b", "ATG", np.array([0, 1, 0]))],
                     tok, seq_len=4, kind="token")
    item = ds[0]
    assert item["input_ids"].tolist()[:3] == tok.encode("ATGAAACCC").tolist() and item["input_ids"][3] == tok.pad_id
    assert item["mask"].tolist() == [True, True, True, False]
    assert item["labels"].tolist() == [1, 0, 1, -100]
    assert ds[1]["labels"].tolist() == [0, -100, -100, -100]
    reg = TaskRecords([("r", "ACGT", (1.5, -2.0))], NucleotideTokenizer(), 8, "regression")
    assert reg[0]["labels"].dtype == torch.float32 and reg[0]["labels"].tolist() == [1.5, -2.0]
    assert all(math.isnan(v) for v in unlabelled(reg[0])["labels"].tolist())
    assert unlabelled(ds[0])["labels"].eq(-100).all()


def test_a_record_longer_than_seq_len_is_named():
    with pytest.raises(ValueError, match=r"record 'long': 9 tokens; a fine-tuning record needs 1 to data.seq_len=8"):
        TaskRecords([("ok", "ACGT", 1), ("long", "ACGTACGTA", 0)], NucleotideTokenizer(), 8, "binary")
