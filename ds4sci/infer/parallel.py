"""Where inference meets process groups: :class:`ShardedForward`, the forward pass every ``ds4sci.infer`` function
runs a batch of windows through, on one process or sequence-parallel across ranks.

One process is the degree-1 case of the same code: ``ShardedForward(model)`` has no groups, every shard is the whole
window and every reduction is the identity. :meth:`ShardedForward.from_world` starts the process group of the launch
:func:`~ds4sci.distributed.launch.resolve_launch` reads (``torchrun``, DeepSpeed's launcher, ``srun``, ``mpiexec``), or
joins one formed before, splits the world into ``dp = world / (ulysses * ring)`` data ranks of ``ulysses * ring``
sequence ranks (:class:`~ds4sci.distributed.dims.ParallelDims`, ``tp = 1``) and makes the model sequence-parallel with
:func:`~ds4sci.parallel.parallelize.parallelize` (DeepSpeed-Ulysses, ring attention or both, USP). Each window is then
read as training reads it (:meth:`ds4sci.train.trainer.Trainer._micro_batch`): labels shifted on the full window, the
window padded at its end to ``dims.sequence_multiple`` (padding is causal attention's future: no real token sees it, and
it is never scored or embedded), tokens, targets and positions sharded together in the layout ``ParallelDims`` chooses
(zigzag with a ring, contiguous without), sums reduced over the sequence group in float64.

``evaluate`` deals windows over the data ranks: window ``i`` to data rank ``i % dp`` (:meth:`share`); ``score``
and ``embed`` deal whole records by token count (:mod:`ds4sci.infer.records`) and read packed batches, any number of
windows per row, through :meth:`read_slots`. :meth:`reduce_data` sums a rank's disjoint part into the full array on
every rank and :meth:`to_writer` brings a record's array to rank 0, the one rank that writes files (:attr:`is_writer`).

On the CPU, a rank whose windows are not split over sequence ranks reads several batches at once (:meth:`map_batches`):
one batch per torch thread, each operator on the thread that called it. Small operators (a hidden size of a few
hundred, a few thousand tokens) use one core well and several poorly, so batches side by side beat one batch spread
over every core (the "throughput streams" of CPU inference servers); every batch runs the same operators on the same
inputs, so its numbers do not change.
"""
from __future__ import annotations

import collections
import datetime
import logging
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ds4sci.data import collate
from ds4sci.distributed.dims import Coords
from ds4sci.distributed.dims import ParallelDims
from ds4sci.distributed.groups import SequenceParallelGroups
from ds4sci.distributed.groups import build_groups
from ds4sci.distributed.launch import resolve_launch
from ds4sci.distributed.nodes import cross_node_error
from ds4sci.kernels.local_reference import PAD_DOC_ID
from ds4sci.models.genslm import IGNORE_INDEX
from ds4sci.models.genslm import shift_labels
from ds4sci.models.genslm import token_loss
from ds4sci.parallel.parallelize import parallelize
from ds4sci.sequence.attention import DistributedAttention
from ds4sci.sequence.sharding import gather_sequence
from ds4sci.sequence.sharding import pad_to_multiple
from ds4sci.sequence.sharding import shard_sequence

__all__ = ["ShardedForward", "inference_device"]

logger = logging.getLogger(__name__)

#: Seconds a collective waits for a peer before it fails (torch's default for gloo).
TIMEOUT_S = 1800.0

#: A window is read at a width padded to a multiple of this many tokens (at most the window length): see
#: :meth:`ShardedForward.read_slots`.
WIDTH_STEP = 16

Batch = TypeVar("Batch")
Result = TypeVar("Result")


def inference_device(spec: str = "auto") -> torch.device:
    """The device a command's model runs on (``--device``): ``auto`` is this process's GPU when CUDA is available
    (``cuda:L``, ``L`` the local rank that :func:`~ds4sci.distributed.launch.resolve_launch` reads from torchrun,
    ``srun`` or ``mpiexec``; 0 alone) and the CPU otherwise; ``cpu``; ``cuda`` (this process's GPU) or ``cuda:N``.
    A GPU is made this process's current device (NCCL needs it before the first collective).

    Raises:
        LaunchError: (a ``ValueError``) the launcher's environment cannot form its group (naming the variable).
        ValueError: an unknown name, or a GPU asked for where CUDA has none (naming the spec and what there is).
    """
    local = resolve_launch().local_rank
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    name, _, index = spec.partition(":")
    if name != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"--device {spec!r}: expected auto, cpu, cuda or cuda:N")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device("cuda", int(index) if index else local)
    if device.index >= count:
        raise ValueError(f"--device {spec}: this machine has {count} CUDA device(s)"
                         + (f" (local rank {local})" if not index else ""))
    torch.cuda.set_device(device)
    return device


#: What each ``[B, T]`` tensor of a batch is padded with (:meth:`ShardedForward._shard`, :func:`width_groups`).
_PAD = {"labels": IGNORE_INDEX, "targets": IGNORE_INDEX, "position_ids": 0, "input_ids": 0, "slots": -1,
        "owned": False, "doc_ids": PAD_DOC_ID}


def width_groups(batch: dict[str, torch.Tensor], row_len: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The rows of a batch of one window per row (:func:`~ds4sci.infer.batching.collate_rows`, ``slots [B, T]``
    -1 at padding) in groups of one width, narrowest first: each row's tokens rounded up to a multiple of
    :data:`WIDTH_STEP`, at most ``row_len`` (when given); each group's ``[b, T]`` tensors cut or padded
    (:data:`_PAD`) to that width."""
    lengths = (batch["slots"] >= 0).sum(1)  # [B] tokens of each row
    widths = -(-lengths // WIDTH_STEP) * WIDTH_STEP
    if row_len is not None:
        widths = torch.minimum(widths, torch.maximum(lengths, torch.tensor(row_len)))
    distinct = sorted(set(widths.tolist()))
    for width in distinct:
        part = batch if len(distinct) == 1 else {k: v[widths == width] for k, v in batch.items()}
        yield {k: pad_to_multiple(v[:, :width], 1, width, _PAD[k]) for k, v in part.items()}  # views at width T


class ShardedForward:
    """A model in eval mode and, across ranks, its sequence-parallel groups: the forward pass of a batch of windows.

    Args:
        model: a :class:`~ds4sci.models.genslm.GenSLM`; with ``groups``, already made sequence-parallel over them
            (what :meth:`from_world` does).
        groups: the process groups (``None``: one process, no parallelism).
        workers: batches :meth:`map_batches` reads at once (``None``: :meth:`batch_workers` chooses).

    A batch (``collate`` of windows: ``input_ids``, ``labels``, ``position_ids`` ``[B, T]``, labels ``-100`` where a
    token is not the window's to score or embed) goes through :meth:`losses` or :meth:`owned_states`, a packed batch
    (:func:`~ds4sci.infer.batching.collate_rows`) through :meth:`read_slots`; every rank of a sequence group must call
    them with the same batch.
    """

    def __init__(self, model, groups: SequenceParallelGroups | None = None, workers: int | None = None):
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.model = model
        self.groups = groups
        self.dims = groups.dims if groups is not None else ParallelDims(dp=1)
        self.device = next(model.parameters()).device
        self.workers = workers

    @classmethod
    def from_world(cls, model, ulysses: int = 1, ring: int = 1, timeout_s: float = TIMEOUT_S) -> ShardedForward:
        """The runner of this launch: one process (``ulysses = ring = 1`` and no launcher), or every process of the
        world, whose process group is started here unless one exists: the launch that
        :func:`~ds4sci.distributed.launch.resolve_launch` reads, exported as ``env://`` variables (nccl when the model
        is on a GPU, else gloo). Collective: every rank calls it.

        Raises:
            LaunchError: (a ``ValueError``) the launcher's environment cannot form the group (naming the variable).
            ValueError: ``ulysses * ring > 1`` in a lone process, a world size that ``ulysses * ring`` does not divide,
                a degree that cannot split the model's heads, or Ulysses groups that would span nodes
                (:func:`~ds4sci.distributed.nodes.cross_node_error`: the ``--ulysses``/``--ring`` that fit), each
                naming the numbers.
        """
        launch = None if dist.is_initialized() else resolve_launch()
        world = dist.get_world_size() if launch is None else launch.world_size
        dims = ParallelDims.for_world(world, ulysses=ulysses, ring=ring)
        dims.check_heads(model.config.num_heads)
        if world == 1:
            return cls(model)
        if launch is not None:
            crossing = cross_node_error(dims, launch.nodes, launch.local_world_size,
                                        option=lambda key, value: f"--{key} {value}")
            if crossing:
                raise ValueError(crossing)
            backend = "nccl" if next(model.parameters()).is_cuda else "gloo"
            launch.export()  # srun's and mpiexec's ranks as env:// reads them
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        groups = build_groups(dims, timeout=datetime.timedelta(seconds=timeout_s))
        parallelize(model, groups, keep_position_table=True)
        for module in model.modules():  # every rank of a sequence group shards the same window: equal shapes
            if isinstance(module, DistributedAttention):
                module.check_shapes = False
        if groups.rank == 0:
            logger.info("reading windows on %d processes: %d data rank(s) of ulysses %d x ring %d (%s layout)", world,
                        dims.dp, dims.ulysses, dims.ring, dims.layout.value)
        return cls(model, groups)

    # ------------------------------------------------------------------------------------------------ the ranks
    @property
    def is_writer(self) -> bool:
        """Rank 0: the one rank that writes outputs and draws progress."""
        return self.groups is None or self.groups.rank == 0

    @property
    def data_rank(self) -> int:
        """This process's data rank, ``0..dims.dp - 1``."""
        return self.groups.dp_rank if self.groups is not None else 0

    @property
    def writes_shards(self) -> bool:
        """Sequence rank 0 of its data rank: the rank that writes the data rank's output shards."""
        return self.groups is None or self.groups.sp_rank == 0

    def barrier(self) -> None:
        """Wait for every rank (nothing on one process)."""
        if self.groups is not None:
            dist.barrier()

    def share(self, n: int) -> range:
        """Indices of ``n`` items this rank's data rank works on: ``i`` with ``i % dp == dp_rank``."""
        return range(self.groups.dp_rank if self.groups is not None else 0, n, self.dims.dp)

    def reduce_data(self, part: np.ndarray) -> np.ndarray:
        """The sum over the data ranks of ``part`` (each filled at its :meth:`share`, zero elsewhere): the whole
        array on every rank (float64 sums; integer arrays stay int64)."""
        if self.groups is None or self.dims.dp == 1:
            return part
        t = torch.from_numpy(np.ascontiguousarray(part)).to(self.device)
        dist.all_reduce(t, group=self.groups.dp)
        return t.cpu().numpy()

    def to_writer(self, state: np.ndarray | None, data_rank: int, shape: tuple[int, ...]) -> np.ndarray | None:
        """An item's array (float32 ``shape``) on the writer: computed there, or sent by sequence rank 0 of the
        data rank ``data_rank`` that computed it (``state``; ``None`` on ranks that did not). Other ranks get None.
        Every rank calls it for every item, in the same order."""
        if self.groups is None:
            return state
        source = self.dims.rank_of(Coords(pp=0, dp=data_rank, ring=0, ulysses=0, tp=0))
        if source == 0:
            return state if self.is_writer else None
        if self.groups.rank == source:
            dist.send(torch.from_numpy(np.ascontiguousarray(state, dtype=np.float32)).to(self.device), dst=0)
        elif self.is_writer:
            received = torch.empty(shape, dtype=torch.float32, device=self.device)
            dist.recv(received, src=source)
            return received.cpu().numpy()
        return None

    def batch_workers(self) -> int:
        """Batches :meth:`map_batches` reads at once: ``workers`` if given; else, on the CPU with no sequence
        parallelism, torch's intra-op threads (``torch.get_num_threads()``: ``OMP_NUM_THREADS`` or the cores), and
        1 on a GPU or across sequence ranks (every rank of a sequence group must run its collectives in one order)."""
        if self.workers is not None:
            return self.workers
        return torch.get_num_threads() if self.device.type == "cpu" and self.dims.sp == 1 else 1

    def map_batches(self, read: Callable[[Batch], Result], batches: Iterable[Batch],
                    planned: int) -> Iterator[tuple[Batch, Result]]:
        """``(batch, read(batch))`` for each of ``batches``, in their order. ``planned``: the batches of the whole job
        (those an interrupted run already read included), which decides how they are read, so a resumed job reads
        its batches as the first run did: with :meth:`batch_workers` ``n > 1`` and at least ``n`` planned, ``n``
        threads call ``read`` on the next batches while the caller takes the results (at most ``n + 1`` batches
        ahead), torch's intra-op threads set to 1 until the last result is taken (restored after, also when the
        caller stops early or ``read`` raises: its exception comes out here); with fewer, one after the other, each
        on every thread."""
        workers = self.batch_workers() if planned >= self.batch_workers() else 1
        if workers == 1:
            for batch in batches:
                yield batch, read(batch)
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        pool = ThreadPoolExecutor(workers, thread_name_prefix="ds4sci-batch")
        try:
            pending = collections.deque()
            for batch in batches:
                pending.append((batch, pool.submit(read, batch)))
                if len(pending) > workers:
                    done, future = pending.popleft()
                    yield done, future.result()
            while pending:
                done, future = pending.popleft()
                yield done, future.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            torch.set_num_threads(threads)

    # ----------------------------------------------------------------------------------------------- the passes
    def _shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's shard of a batch: targets shifted on the full window, every ``[B, T]`` tensor padded at its
        end to a multiple ``T'`` of ``dims.sequence_multiple`` (ignored labels and targets; token 0 at position 0:
        any token, as causal attention keeps it from the real ones) and cut along the sequence -> ``[B, T'/sp]``."""
        d, sp_rank = self.dims, self.groups.sp_rank if self.groups is not None else 0
        batch = {**batch, "targets": shift_labels(batch["labels"])}  # before sharding: a shard's last token has one
        return {k: shard_sequence(pad_to_multiple(batch[k], 1, d.sequence_multiple, value), 1, sp_rank, d.sp,
                                  d.layout).to(self.device)
                for k, value in _PAD.items() if k in batch}

    def _sum_sp(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (float64) summed over the sequence group, each rank's tokens once; on the CPU."""
        if self.groups is not None and self.dims.sp > 1:
            dist.all_reduce(x, group=self.groups.sp)
        return x.cpu()

    @torch.no_grad()
    def losses(self, batch: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
        """Summed next-token loss (nats) ``[B]`` float64 and scored target count ``[B]`` int64 of each window."""
        s = self._shard(batch)
        logits = self.model(s["input_ids"], s["position_ids"])  # [B, T'/sp, V]
        sums = token_loss(logits, s["targets"], "none").double().sum(1)  # [B], 0 where ignored
        counts = (s["targets"] != IGNORE_INDEX).sum(1).double()  # [B]
        both = self._sum_sp(torch.stack([sums, counts]))  # [2, B]
        return both[0].numpy(), both[1].numpy().astype(np.int64)

    def _hidden(self, s: dict[str, torch.Tensor], layer: int | None) -> torch.Tensor:
        """Hidden states of the shard ``[B, T'/sp, hidden]``: block ``layer``'s output, or the final norm's (None)."""
        return self.model(s["input_ids"], s["position_ids"], return_hidden=True, stop_after=layer)

    @torch.no_grad()
    def owned_states(self, batch: dict[str, torch.Tensor], layer: int | None = None) -> list[np.ndarray]:
        """Each window's hidden states at the tokens it owns, in order: ``[owned_b, hidden]`` float32 per window,
        the full window gathered from the sequence group (every rank of it gets them)."""
        s = self._shard(batch)
        hidden = self._hidden(s, layer).float()  # [B, T'/sp, hidden]
        if self.groups is not None:
            hidden = gather_sequence(hidden, 1, self.groups.sp, self.dims.layout)  # [B, T', hidden]
        owned = batch["labels"] != IGNORE_INDEX  # [B, T]
        hidden = hidden[:, : owned.shape[1]].cpu()  # [B, T, hidden]
        return [hidden[b][owned[b]].numpy() for b in range(hidden.shape[0])]

    @torch.no_grad()
    def read_slots(self, batch: dict[str, torch.Tensor], what: str, layer: int | None = None,
                   row_len: int | None = None):
        """What each window (slot) of a packed batch (:func:`~ds4sci.infer.batching.collate_rows`: ``slots [B, T]``,
        ``owned``, ``doc_ids``) gives, ``n`` the number of slots: ``"loss"``, summed next-token loss (nats) ``[n]``
        float64 and scored target count ``[n]`` int64; ``"sum"``, hidden states of ``layer`` summed over the owned
        tokens ``[n, hidden]`` float64; ``"states"``, a list of ``n`` arrays ``[owned, hidden]`` float32 (gathered
        from the sequence group). ``doc_ids`` are passed to attention only when some row holds several windows.

        A batch of one window per row is read in groups of rows of one width, each row's tokens padded to the next
        multiple of :data:`WIDTH_STEP` (at most ``row_len``, the window length, when given): a window's numbers then
        depend on its own length alone, not on the longest row beside it (PyTorch's fused attention on the CPU rounds
        with the padded width; :func:`~ds4sci.kernels.local_attention.select_backend`). Rows of several windows
        (packing) are read as they are.

        Raises:
            ValueError: an unknown ``what``.
        """
        if what not in ("loss", "sum", "states"):
            raise ValueError(f"what must be 'loss', 'sum' or 'states', got {what!r}")
        n = int(batch["slots"].max()) + 1
        packed = n > batch["slots"].shape[0]
        if not packed:
            batch = {k: v for k, v in batch.items() if k != "doc_ids"}
        parts = [self._read_part(part, what, layer, n) for part in
                 ([batch] if packed else width_groups(batch, row_len))]
        if what != "states":
            return tuple(sum(values) for values in zip(*parts)) if what == "loss" else sum(parts)
        states = {k: state for part in parts for k, state in part.items()}
        return [states[k] for k in range(n)]

    def _read_part(self, batch: dict[str, torch.Tensor], what: str, layer: int | None, n: int):
        """:meth:`read_slots` of rows holding some of the ``n`` slots: loss and counts ``[n]``, sums ``[n, hidden]``
        (zero for the slots elsewhere) or ``{slot: states}`` for the slots here."""
        s = self._shard(batch)
        slots = s["slots"].clamp(min=0)  # padding (-1) adds zeros to slot 0
        if what == "loss":
            logits = self.model(s["input_ids"], s["position_ids"], s.get("doc_ids"))  # [B, T'/sp, V]
            each = token_loss(logits, s["targets"], "none").double()  # [B, T'/sp], 0 where ignored
            scored = (s["targets"] != IGNORE_INDEX).double()
            both = torch.zeros(2, n, dtype=torch.float64, device=each.device)
            both[0].index_add_(0, slots.flatten(), each.flatten())
            both[1].index_add_(0, slots.flatten(), scored.flatten())
            both = self._sum_sp(both)
            return both[0].numpy(), both[1].numpy().astype(np.int64)
        hidden = self.model(s["input_ids"], s["position_ids"], s.get("doc_ids"), return_hidden=True,
                            stop_after=layer)  # [B, T'/sp, hidden]
        if what == "sum":
            owned = s["owned"].unsqueeze(-1)  # [B, T'/sp, 1]
            sums = torch.zeros(n, hidden.shape[-1], dtype=torch.float64, device=hidden.device)
            sums.index_add_(0, slots.flatten(), (hidden.double() * owned).flatten(0, 1))
            return self._sum_sp(sums).numpy()
        hidden = hidden.float()
        if self.groups is not None:
            hidden = gather_sequence(hidden, 1, self.groups.sp, self.dims.layout)  # [B, T', hidden]
        hidden = hidden[:, : batch["slots"].shape[1]].cpu()  # [B, T, hidden]
        keep = batch["owned"]
        return {k: hidden[(batch["slots"] == k) & keep].numpy() for k in batch["slots"].unique().tolist() if k >= 0}

    def batches(self, dataset, items, batch_size: int):
        """``(indices, batch)``: the samples ``dataset[i]`` for ``i`` in ``items``, ``batch_size`` at a time, collated
        as they are taken (``ValueError`` at once for a ``batch_size`` below 1)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        items = list(items)
        chosen = (items[start : start + batch_size] for start in range(0, len(items), batch_size))
        return ((some, collate([dataset[i] for i in some])) for some in chosen)
