"""The window inference reads a model through by default: the sequence length it was trained on.

A model trained on windows of ``data.seq_len`` tokens has never seen a position past them: its context
(``max_position_embeddings``) may be longer (the demo model trains on 256 tokens with a context of 512), and
windows longer than the training length score worse, not better. ``ds4sci train`` records the length in its export
(``config.json``'s ``trained_length``, :func:`ds4sci.io.export.read_trained_length`) and ``ds4sci export-hf`` carries it
over; ``evaluate``, ``score``, ``embed`` and ``score-variants`` default their window to it. A model that records none
(an export written before ds4sci recorded it, a Hugging Face model trained elsewhere, a checkpoint file) falls back to
its context, with one warning naming the fallback.
"""
from __future__ import annotations

import logging
from pathlib import Path

from ds4sci.io.export import read_trained_length

logger = logging.getLogger(__name__)


def default_length(source: str | Path, model_config) -> int:
    """The default window of the model read from ``source`` (tokens): its recorded training length, or (none
    recorded; one warning) its context ``model_config.max_position_embeddings``.

    Raises:
        ValueError: a recorded length that is not a positive integer or exceeds the context (naming both).
    """
    context = model_config.max_position_embeddings
    trained = read_trained_length(source)
    if trained is None:
        logger.warning("%s records no trained_length (written before ds4sci recorded it, or trained elsewhere): "
                       "windows default to the model's context of %d tokens, which may be longer than the sequences "
                       "it was trained on; choose the window with --seq-len / --window", source, context)
        return context
    if trained > context:
        raise ValueError(f"{Path(source) / 'config.json'}: trained_length={trained} exceeds the model's context of "
                         f"{context} tokens")
    return trained
