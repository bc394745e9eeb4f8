"""Which GenSLM layouts fit a cluster, fastest first, and the longest sequence some layout fits.

The search behind ``ds4sci plan``: every :class:`~ds4sci.planning.genslm.Strategy` on all the cluster's GPUs that
splits the model and the sequence evenly and honours the user's :class:`Constraints`, priced by
:mod:`ds4sci.planning.genslm`; :func:`plan` keeps those within the GPU's memory as :class:`LayoutPlan` rows,
:func:`max_seq_len` bisects the sequence length per layout.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from dataclasses import replace

from ds4sci.distributed.dims import ParallelDims
from ds4sci.distributed.nodes import inside_node
from ds4sci.planning.common import GIB
from ds4sci.planning.genslm import CHECKPOINTING
from ds4sci.planning.genslm import OFFLOADS
from ds4sci.planning.genslm import Cluster
from ds4sci.planning.genslm import Comm
from ds4sci.planning.genslm import Memory
from ds4sci.planning.genslm import StepTime
from ds4sci.planning.genslm import Strategy
from ds4sci.planning.genslm import Workload
from ds4sci.planning.genslm import comm
from ds4sci.planning.genslm import memory
from ds4sci.planning.genslm import step_time


@dataclass(frozen=True)
class Constraints:
    """The choices the user fixed; None: searched. The tiled MLP and loss (tokens per tile) and host offload of
    checkpointed inputs are switched on when given, never searched."""

    tp: int | None = None
    ulysses: int | None = None
    ring: int | None = None
    pp: int | None = None
    dp: int | None = None
    zero_stage: int | None = None
    offload: str | None = None
    checkpointing: str | None = None
    mlp_tile: int | None = None
    loss_tile: int | None = None
    offload_activations: bool | None = None

    def degrees(self) -> dict[str, int]:
        """The fixed parallel degrees by axis name (tp, ulysses, ring, pp, dp), in that order."""
        return {a: v for a in ("tp", "ulysses", "ring", "pp", "dp") if (v := getattr(self, a)) is not None}


@dataclass(frozen=True)
class LayoutPlan:
    """One fitting layout: the strategy, the micro-batches per optimizer step it runs (``grad_accum``), and its
    memory, communication and step time."""

    strategy: Strategy
    grad_accum: int
    memory: Memory
    comm: Comm
    time: StepTime


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def strategies(w: Workload, cluster: Cluster, fixed: Constraints = Constraints(),
               split_seq: bool = True) -> list[Strategy]:
    """Every strategy on all ``cluster.world`` GPUs that splits the model (and ``w.seq_len`` if ``split_seq``) evenly
    and respects ``fixed``: degrees the model admits
    (:meth:`~ds4sci.distributed.dims.ParallelDims.check_model`: ``tp * ulysses`` divides the heads, ``tp`` the MLP
    width, ``pp <= layers``), tensor-parallel groups inside a node (:func:`~ds4sci.distributed.nodes.inside_node`; a
    fixed ``tp`` may span nodes), ZeRO 2/3 only without pipeline parallelism (DeepSpeed's pipeline engine), optimizer
    offload with ZeRO >= 1 and parameter offload with ZeRO 3; host offload of checkpointed inputs with checkpointing
    only."""
    world, m = cluster.world, w.model
    out = []
    for tp, u, r, pp in itertools.product(*([v] if (v := getattr(fixed, a)) else _divisors(world)
                                            for a in ("tp", "ulysses", "ring", "pp"))):
        try:
            dims = ParallelDims.for_world(world, ulysses=u, ring=r, tp=tp, pp=pp)
            dims.check_model(num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, num_layers=m.num_layers,
                             intermediate_size=m.intermediate_size)
        except ValueError:  # these degrees do not split the GPUs or the model
            continue
        if (fixed.dp is not None and fixed.dp != dims.dp) or (fixed.tp is None and
                                                              not inside_node(dims, "tp", cluster.gpus_per_node)):
            continue
        if split_seq and w.seq_len % dims.sequence_multiple:
            continue
        for z, off, ck in itertools.product(range(4) if fixed.zero_stage is None else [fixed.zero_stage],
                                            OFFLOADS if fixed.offload is None else [fixed.offload],
                                            CHECKPOINTING if fixed.checkpointing is None else [fixed.checkpointing]):
            if (pp > 1 and z > 1) or (off == "optimizer" and z < 1) or (off == "all" and z != 3):
                continue
            if fixed.offload_activations and ck == "none":
                continue
            out.append(Strategy(dims, z, off, ck, fixed.mlp_tile or 0, bool(fixed.offload_activations),
                                fixed.loss_tile or 0))
    return out


def budget_bytes(cluster: Cluster) -> float:
    """The GPU's memory: every term, the user's reserve included, is in :class:`Memory`'s total."""
    return cluster.gpu_mem_gib * GIB


def filled(w: Workload, strategy: Strategy) -> Workload:
    """``w`` with at least ``pp`` micro-batches per step, so that 1F1B fills the pipeline (``--max-seq`` without
    ``--grad-accum``): the first stage then holds ``pp`` micro-batches' activations and the bubble is
    ``(pp - 1) / (2 pp - 1)``."""
    return replace(w, grad_accum=max(w.grad_accum, strategy.dims.pp))


def plan(w: Workload, cluster: Cluster, fixed: Constraints = Constraints(),
         fill_pipeline: bool = False) -> list[LayoutPlan]:
    """The fitting layouts at ``w.seq_len``, fastest first (micro-batches per step: :func:`filled`'s with
    ``fill_pipeline``)."""
    budget = budget_bytes(cluster)
    rows = []
    for strategy in strategies(w, cluster, fixed):
        ws = filled(w, strategy) if fill_pipeline else w
        mem = memory(ws, strategy, cluster)
        if mem.total <= budget:
            rows.append(LayoutPlan(strategy, ws.grad_accum, mem, comm(ws, strategy), step_time(ws, strategy, cluster)))
    rows.sort(key=lambda r: -r.time.tokens_per_s)
    return rows


def max_seq_len(w: Workload, cluster: Cluster, fixed: Constraints = Constraints(), limit: int = 1 << 34,
                fill_pipeline: bool = False) -> int:
    """The longest S (up to ``limit``) at which some layout fits: per layout (with ``fill_pipeline``, at
    :func:`filled`'s micro-batches), the largest multiple of its
    :attr:`~ds4sci.distributed.dims.ParallelDims.sequence_multiple` within the budget (memory grows with S), then the
    maximum; 0 if none."""
    budget = budget_bytes(cluster)
    best = 0
    for strategy in strategies(w, cluster, fixed, split_seq=False):
        ws = filled(w, strategy) if fill_pipeline else w
        q = strategy.dims.sequence_multiple

        def fits(n: int) -> bool:
            return memory(ws.with_seq_len(n * q), strategy, cluster).total <= budget

        if not fits(1):
            continue
        lo, hi = 1, 2  # multiples of q: lo fits, hi is the first tried that may not
        while hi * q <= limit and fits(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        best = max(best, min(lo * q, limit))
    return best

