"""What a run checks and reads before its trainer is built: the launch (:func:`current_launch`), everything about the
config that can be known before any work (:func:`check_launch`: so a run that cannot start stops before its run folder
is touched, and before its process group forms), the accumulation that keeps ``train.global_batch_size`` at this
launch's data-parallel degree (:func:`fit_global_batch`), and the tokenizer and datasets (:func:`load_data`)."""
from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.distributed as dist

from ds4sci.data import Tokenizer
from ds4sci.distributed import ParallelDims
from ds4sci.distributed.launch import Launch
from ds4sci.distributed.launch import resolve_launch
from ds4sci.distributed.nodes import cross_node_error
from ds4sci.train.config import Config
from ds4sci.train.config import DataConfig
from ds4sci.train.engine import check_offload_support

logger = logging.getLogger(__name__)


def current_launch() -> Launch:
    """This launch, before the trainer's process group forms: the launcher's
    (:func:`~ds4sci.distributed.launch.resolve_launch`; a lone process alone), or, in a process group formed before
    (a test harness), that group's processes on one node.

    Raises:
        LaunchError: the launcher's environment cannot form the group (one line naming the variable).
    """
    if dist.is_initialized():
        world = dist.get_world_size()
        return Launch("process group", dist.get_rank(), world, dist.get_rank(), world, 1, "", 0)
    return resolve_launch()


def check_launch(cfg: Config, launch: Launch) -> ParallelDims:
    """Everything about ``cfg`` that can be known before any work, checked before any: the parallel degrees against
    the launch's processes, tensor- and Ulysses-parallel groups inside a node
    (:func:`~ds4sci.distributed.nodes.cross_node_error`; with ``parallel.allow_cross_node`` rank 0 warns instead),
    an offload this machine can run (:func:`~ds4sci.train.engine.check_offload_support`) and FASTA files that
    ``data.fasta`` names. So a run that cannot start stops before its process group forms, before the run folder is
    touched (``--overwrite`` deletes in it) and before the token cache is built.

    Returns:
        the run's :class:`~ds4sci.distributed.ParallelDims`.
    Raises:
        ValueError / FileNotFoundError: one line naming the key and the value.
    """
    from ds4sci.data.corpus import resolve_sources

    dims = cfg.parallel.dims(launch.world_size)
    allowed = cfg.parallel.allow_cross_node
    crossing = cross_node_error(dims, launch.nodes, launch.local_world_size,
                                force="" if allowed else "or set parallel.allow_cross_node=true")
    if crossing and not allowed:
        raise ValueError(f"parallel: {crossing}")
    if crossing and launch.rank == 0:
        logger.warning("parallel: %s; going on (parallel.allow_cross_node=true)", crossing)
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


def fit_global_batch(cfg: Config, dims: ParallelDims) -> Config:
    """``cfg`` with ``train.grad_accum`` set so that ``micro_batch_size x dp x grad_accum`` is
    ``train.global_batch_size`` at ``dims.dp``; ``cfg`` itself when that key is 0 (unset). One command line then
    trains at one global batch on any process count that divides it: a torchrun restart on fewer nodes continues
    the run (``--resume auto``) with the samples per step it saved with.

    Raises:
        ValueError: the global batch is not a multiple of micro_batch_size x dp (naming the three numbers).
    """
    t = cfg.train
    if t.global_batch_size == 0:
        return cfg
    per_micro_step = t.micro_batch_size * dims.dp
    if t.global_batch_size % per_micro_step:
        raise ValueError(f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size="
                         f"{t.micro_batch_size} x dp={dims.dp} (the sequences of one micro-step on this launch): set "
                         f"a micro-batch that divides global_batch_size / dp")
    return dataclasses.replace(cfg, train=dataclasses.replace(t, grad_accum=t.global_batch_size // per_micro_step))


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
