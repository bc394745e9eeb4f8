"""What a run checks and reads before its trainer is built: the launch's world size, everything about the config
that can be known before any work (:func:`check_launch`: so a run that cannot start stops before its run folder is
touched), and the tokenizer and datasets (:func:`load_data`)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ds4sci.data import Tokenizer
from ds4sci.distributed import ParallelDims
from ds4sci.distributed.launch import Launch
from ds4sci.distributed.launch import resolve_launch
from ds4sci.train.config import Config
from ds4sci.train.config import DataConfig
from ds4sci.train.engine import check_offload_support


def launch_world_size() -> int:
    """The number of processes of this launch: the process group's size, else the launcher's
    (:func:`~ds4sci.distributed.launch.resolve_launch`; 1 in a lone process)."""
    return dist.get_world_size() if dist.is_initialized() else resolve_launch().world_size


def check_launch(cfg: Config, world_size: int) -> ParallelDims:
    """Everything about ``cfg`` that can be known before any work, checked before any: the parallel degrees against
    ``world_size`` processes, an offload this machine can run (:func:`~ds4sci.train.engine.check_offload_support`)
    and FASTA files that ``data.fasta`` names. So a run that cannot start stops before the run folder is touched
    (``--overwrite`` deletes in it) and before the token cache is built.

    Returns:
        the run's :class:`~ds4sci.distributed.ParallelDims`.
    Raises:
        ValueError / FileNotFoundError: one line naming the key and the value.
    """
    from ds4sci.data.corpus import resolve_sources

    dims = cfg.parallel.dims(world_size)
    check_offload_support(cfg)
    try:
        resolve_sources(cfg.data.fasta)
    except FileNotFoundError as err:
        if cfg.data.fasta == DataConfig().fasta:  # no config, no --set data.fasta: the bundled genome is missing
            raise FileNotFoundError(f"data.fasta: {err}: the default data is the E. coli genome of a ds4sci source "
                                    f"checkout, absent from this installation; pass a YAML config (such as "
                                    f"examples/configs/demo_ecoli_sp2.yaml) or --set data.fasta=FILE (ds4sci train "
                                    f"--print-config lists every key)") from None
        raise FileNotFoundError(f"data.fasta: {err} (a relative path in a config file is read from its folder; one "
                                f"given with --set, from the working directory)") from None
    return dims


def load_data(cfg: Config, launch: Launch | None = None) -> tuple[Tokenizer, torch.utils.data.Dataset,
                                                                   torch.utils.data.Dataset, str]:
    """Tokenizer, training and validation datasets for ``cfg.data``, read from the token cache of ``data.fasta``
    (built on first use by rank 0, or by each node's first process where ``launch``'s nodes do not share
    ``data.cache_dir``; :mod:`ds4sci.data.corpus`), and a line naming the split ``data.split`` chose
    (:func:`ds4sci.data.datasets.describe_split`). Every rank must call it."""
    from ds4sci.data.corpus import load_datasets
    from ds4sci.data.corpus import open_corpus
    from ds4sci.data.datasets import describe_split

    d = cfg.data
    tok = Tokenizer.from_name(d.tokenizer)
    cache_dir = d.cache_dir or os.path.join(cfg.train.out_dir, "token_cache")
    corpus = open_corpus(d.fasta, tok, cache_dir=cache_dir, iupac=d.iupac, progress=cfg.train.progress,
                         launch=launch)
    train, val = load_datasets(corpus, tok, dataset=d.dataset, seq_len=d.seq_len, stride=d.stride,
                               val_fraction=d.val_fraction, split=d.split, max_train_tokens=d.max_train_tokens,
                               reverse_complement=d.reverse_complement, seed=cfg.train.seed)
    return tok, train, val, describe_split(corpus.id_hash, d.val_fraction, d.split)
