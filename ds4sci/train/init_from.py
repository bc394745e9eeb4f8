"""``model.init_from``: the model a run starts from, fresh or holding existing weights (fine-tuning). The sources
(a ds4sci export, a Hugging Face GPT-NeoX or Llama directory, a GenSLM checkpoint) are read by
:mod:`ds4sci.io.weights`."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ds4sci.data import Tokenizer
from ds4sci.io.weights import check_weights
from ds4sci.io.weights import load_into
from ds4sci.io.weights import load_weights
from ds4sci.models.genslm import GenSLM

if TYPE_CHECKING:
    from ds4sci.train.config import Config


def check_tokenizer(kind: str | None, tokenizer: Tokenizer, source: str) -> None:
    """``tokenizer`` (the run's) is the one the source's ids mean."""
    if kind is not None and kind != tokenizer.kind:
        raise ValueError(f"{source}: the weights are for the {kind} tokenizer but data.tokenizer={tokenizer.kind!r}; "
                         f"set data.tokenizer={kind}")


def initial_model(cfg: Config, tokenizer: Tokenizer, device: torch.device | str | None = None) -> GenSLM:
    """The single-device GenSLM a run starts from, initialised with ``train.seed``: fresh, shaped by
    ``model.preset``, or, with ``model.init_from``, holding its weights and shaped by its config (``model.preset``
    unused; for a checkpoint that keeps no config, the preset). ``model.overrides`` apply on top either way and
    ``cfg.genslm_config`` checks the result against the run.

    ``device="meta"`` (the trainer's path): parameters without storage, drawn after parallelization by
    :func:`ds4sci.parallel.parallelize.materialize_`, so no rank ever holds the whole model; with ``model.init_from``
    the source's weights (memory-mapped where the format allows) are checked against the model and kept as
    :attr:`GenSLM.init_source`, from which each rank copies only its pieces."""
    state = base = None
    source = f"model.init_from={cfg.model.init_from}"
    if cfg.model.init_from:
        try:
            state, base, kind = load_weights(cfg.model.init_from)
        except (OSError, ValueError) as err:
            raise type(err)(f"model.init_from: {err}") from None
        check_tokenizer(kind, tokenizer, source)
    config = cfg.genslm_config(tokenizer.vocab_size, tokenizer.pad_id, base=base)
    torch.manual_seed(cfg.train.seed)
    model = GenSLM(config, device=device)
    if state is not None:
        if model.embed_in.weight.is_meta:
            check_weights(model, state, source)
            model.init_source = state
        else:
            load_into(model, state, source)
    return model
