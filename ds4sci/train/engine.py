"""DeepSpeed set-up: process-group initialisation, the engine config, AdamW with warmup + cosine decay, and the
engine over the sequence x data group (ZeRO 0-3, ZeRO-Offload / ZeRO-Infinity, fp32 or bf16), and the one-line
errors a run stops with when a write fails or another rank dies or hangs.

Offload (``zero.offload_optimizer`` / ``zero.offload_param``) goes through DeepSpeed's own config
(``zero_optimization.offload_*``). The engine is handed torch AdamW, also under offload
(``zero_force_ds_cpu_optimizer`` false), so offloaded runs give torch AdamW's results: they match single-process
training to fp32 rounding (``tests/distributed/test_train_offload_checkpointing.py``); DeepSpeedCPUAdam would be
faster for large models, at the cost of results that are no longer torch AdamW's. Offloading does not change how
gradients are reduced, so :func:`ds4sci.train.loss.grad_reduction_factor` holds unchanged. What DeepSpeed would
ignore or fail on late is refused before the run starts: nvme optimizer offload below ZeRO-3 (DeepSpeed treats it
as cpu) by the config, NVMe without DeepSpeed's ``async_io`` op by :func:`check_offload_support`.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import io
import logging
import math
import os
import re
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ds4sci.distributed.groups import DeepSpeedMPU
from ds4sci.distributed.groups import SequenceParallelGroups
from ds4sci.distributed.launch import Launch
from ds4sci.distributed.launch import LaunchError
from ds4sci.distributed.launch import resolve_launch
from ds4sci.train.config import Config
from ds4sci.train.sanity import check_gradient_reduction

logger = logging.getLogger(__name__)


def init_distributed(timeout_s: float = 1800.0) -> Launch:
    """Initialise torch.distributed through DeepSpeed (nccl on CUDA, gloo on the CPU), for the launch that
    :func:`~ds4sci.distributed.launch.resolve_launch` reads (torchrun, DeepSpeed's launcher, ``srun``, ``mpiexec``,
    or a lone process), and return it.

    The resolved rank, world and rendezvous address are exported as ``env://`` variables before DeepSpeed reads them,
    so ``srun`` and ``mpiexec`` processes form one group; a lone process gets a world of one whose store listens on
    a port the system picks (``MASTER_PORT=0``). A process group created before (e.g. by a test harness) is kept,
    with its own timeout.

    ``timeout_s`` (``train.timeout_s``) bounds every collective of the default group: on gloo a rank whose peer
    died fails at once ("Connection reset by peer"), one whose peer hangs after ``timeout_s`` ("Timed out waiting
    ...ms"); on nccl, the watchdog aborts the process after ``timeout_s``. The groups built on top need the same
    bound passed to them (:func:`ds4sci.distributed.groups.build_groups`): ``new_group`` does not inherit it.

    Raises:
        LaunchError: the launcher's environment cannot form the group (one line naming the variable).
    """
    import deepspeed

    _without_shm_op()
    if dist.is_initialized():  # DeepSpeed still needs its communication backend on top of the existing group
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank() % max(1, torch.cuda.device_count())))
        with printed_at_debug():
            deepspeed.init_distributed(dist_backend=dist.get_backend())
        try:
            launch = resolve_launch()
            if launch.world_size == dist.get_world_size():
                return launch
        except LaunchError:
            pass
        local = int(os.environ["LOCAL_RANK"])  # a group formed without a launcher: its processes, on this machine
        return Launch("process group", dist.get_rank(), dist.get_world_size(), local, dist.get_world_size(), 1, "", 0)
    # Port 0 (a lone process): the store binds whatever port is free, with no window for another process to take a
    # port probed beforehand (a probed port was once taken by another test before the store could listen on it).
    launch = resolve_launch()
    launch.export()
    backend, timeout = "nccl" if torch.cuda.is_available() else "gloo", datetime.timedelta(seconds=timeout_s)
    _init_restarted_torchrun_worker(launch, backend, timeout)
    with printed_at_debug():
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    return launch


def _init_restarted_torchrun_worker(launch: Launch, backend: str, timeout: datetime.timedelta) -> None:
    """A worker that torchrun started again (``TORCHELASTIC_RESTART_COUNT`` > 0) joins its default group through the
    agent's store under a prefix of its own attempt. torch's ``env://`` store for torchrun workers adds none, on the
    grounds that each rendezvous round makes a new store; the static rendezvous (``--master-port`` without
    ``--rdzv-backend``) keeps one store across restarts, so gloo read the dead attempt's addresses from it and failed
    with "Connection refused". A first attempt is left to ``env://``."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"ds4sci/attempt_{restart}", store), rank=launch.rank,
                            world_size=launch.world_size, timeout=timeout)


def _without_shm_op() -> None:
    """Keep DeepSpeed's CPU backend from building its shared-memory all-reduce: on the CPU,
    ``deepspeed.init_distributed`` JIT-compiles that C++ op (a minute or more), and only DeepSpeed's inference
    all-reduce calls it; ds4sci's collectives are torch.distributed's. DeepSpeed reads
    ``deepspeed.ops.__compatible_ops__`` to decide, a dict it keeps once built. On CUDA nothing is changed."""
    if not torch.cuda.is_available():
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def initialize_deepspeed(**kwargs):
    """``deepspeed.initialize(**kwargs)`` with ``TORCHDYNAMO_DISABLE=1`` while it runs (the variable restored after).

    DeepSpeed's ZeRO optimizer check imports its Muon optimizer, whose ``torch.compile`` decorators import
    TorchInductor at that import: seconds of CPU in every rank's start-up, for an optimizer ds4sci never uses. With
    the variable set those decorators are no-ops; ds4sci compiles nothing inside ``deepspeed.initialize``. The fact
    is pinned by ``tests/train/test_engine_start.py``."""
    import deepspeed

    before = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        return deepspeed.initialize(**kwargs)
    finally:
        if before is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = before


@contextlib.contextmanager
def printed_at_debug():
    """What Python code prints to stdout inside becomes one DEBUG log line (DeepSpeed's start-up prints there)."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        if printed.getvalue().strip():
            logger.debug("%s", printed.getvalue().strip())


_LOST_PEER = re.compile(r"timed out|connection (reset|closed)|broken pipe", re.IGNORECASE)


def collective_error(err: RuntimeError, where: str, timeout_s: float) -> OSError | None:
    r"""The one-line error for a collective that failed because another rank died (gloo: "Connection reset by
    peer", at once) or hangs (gloo: "Timed out waiting ...", after ``train.timeout_s``); ``None`` for any other
    error. ``TimeoutError`` / ``ConnectionError`` are ``OSError``\ s: ``ds4sci train`` prints them as one line and
    exits with status 2."""
    if not (isinstance(err, dist.DistError) or _LOST_PEER.search(str(err))):
        return None
    cause = str(err).splitlines()[0]
    if "timed out" in cause.lower():
        return TimeoutError(f"{where}: another rank did not join a collective within train.timeout_s={timeout_s:g} s "
                            f"(it hangs or died); every rank stops ({cause})")
    return ConnectionError(f"{where}: another rank left a collective (it died?); every rank stops instead of waiting "
                           f"(a hang is bounded by train.timeout_s={timeout_s:g} s) ({cause})")


@contextlib.contextmanager
def one_line_errors(caught: type[BaseException], convert: Callable[[BaseException], BaseException | None]):
    """Inside, an error of type ``caught`` that ``convert`` turns into a one-line error is raised as that error
    (chained to the original); ``convert`` returning ``None`` lets the original through unchanged."""
    try:
        yield
    except caught as err:
        error = convert(err)
        if error is None:
            raise
        raise error from err


def bounded_collectives(where: str, timeout_s: float):
    """Inside, a collective that fails because another rank died or hangs raises the one-line error of
    :func:`collective_error` naming ``where`` (the phase, with the path it writes where it writes one)."""
    return one_line_errors(RuntimeError, lambda err: collective_error(err, where, timeout_s))


def write_error(where: str, path, err: BaseException) -> OSError | None:
    """The one-line error for a file that could not be written: ``WHERE: cannot write PATH: REASON``; ``None`` when
    ``err`` is no failed write. REASON is the operating system's ("No space left on device [Errno 28]"), found
    beneath the error of a writer that wraps it (torch.save's "unexpected pos"); PATH the file the error names (a
    copy's or a rename's destination), else ``path``."""
    cause = err
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__context__
    if cause is not None and cause.strerror:
        reason, path = f"{cause.strerror} [Errno {cause.errno}]", cause.filename2 or cause.filename or path
    elif "I/O error" in str(err):  # safetensors' writer: "Error while serializing: I/O error: ... (os error 28)"
        reason = str(err).splitlines()[0]
    else:
        return None
    return OSError(f"{where}: cannot write {path}: {reason}")


def writing(where: str, path):
    """Inside, a failed write raises the one-line error of :func:`write_error` (``path``: what is written inside).
    For code that writes without collectives: a collective's failure is :func:`bounded_collectives`'."""
    return one_line_errors(Exception, lambda err: write_error(where, path, err))


def set_deterministic() -> None:
    """``train.deterministic``: the same job on the same machine gives bitwise-identical losses and parameters.

    Seeds are always set (``train.seed``; the data order has its own seeded generator). This adds what is needed
    beyond them (PyTorch's "Reproducibility" notes): deterministic kernels or an error for an op that has none,
    no cuDNN autotuning (it may pick a different algorithm per run), and cuBLAS's fixed workspace (read when cuBLAS
    starts: set before the first CUDA matmul). On the CPU with gloo, runs are bitwise reproducible without it.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def lr_lambda(cfg: Config):
    """``step -> factor of optim.lr``: linear warmup over ``warmup_steps`` then cosine decay to ``min_lr`` at
    ``train.steps`` (flat at ``min_lr`` afterwards)."""
    o, steps = cfg.optim, cfg.train.steps

    def factor(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        progress = min(1.0, (step - o.warmup_steps) / max(1, steps - o.warmup_steps))
        return (o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))) / o.lr

    return factor


def make_optimizer(params, cfg: Config) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with ``cfg.optim`` and its warmup/decay schedule (stepped once per optimizer step)."""
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def deepspeed_config(cfg: Config, sp: int) -> dict:
    """The DeepSpeed config dict of a training config (``sp``: sequence-parallel degree)."""
    t, z = cfg.train, cfg.zero
    zero: dict = {"stage": z.stage}
    if z.stage == 3:
        # Pinned: with reduce_scatter off, ZeRO-3 sums small gradient buckets over the sequence ranks but averages
        # large ones, which no loss scale can undo (see ds4sci.train.loss.grad_reduction_factor).
        zero["reduce_scatter"] = True
    offload = False
    for key in ("offload_optimizer", "offload_param"):
        device = getattr(z, key)
        if device != "none":
            zero[key] = {"device": device, "pin_memory": z.pin_memory,
                         **({"nvme_path": z.nvme_path} if device == "nvme" else {})}
            offload = True
    ds = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "zero_optimization": zero,
        "gradient_clipping": cfg.optim.grad_clip,
        "bf16": {"enabled": t.dtype == "bf16"},
        "sequence_parallel_size": sp,
        "zero_allow_untested_optimizer": True,  # torch AdamW: tested here by the equivalence tests
        "steps_per_print": 10**9,  # the trainer logs
    }
    if offload:
        # The engine is handed torch AdamW (make_optimizer); DeepSpeed refuses a client optimizer under offload
        # unless told otherwise. It then runs torch AdamW on the CPU copies: exact, slower than DeepSpeedCPUAdam.
        ds["zero_force_ds_cpu_optimizer"] = False
    return ds


def check_offload_support(cfg: Config) -> None:
    """Refuse an offload this machine cannot run, before DeepSpeed tries: NVMe offload needs DeepSpeed's
    ``async_io`` op (libaio) and an existing ``zero.nvme_path`` folder.

    Raises:
        ValueError: naming the ``zero.*`` key and what is missing (a config this machine cannot run: one line from
            the command line).
    """
    z = cfg.zero
    nvme = [f"zero.{k}=nvme" for k in ("offload_optimizer", "offload_param") if getattr(z, k) == "nvme"]
    if not nvme:
        return
    if not os.path.isdir(z.nvme_path):
        raise ValueError(f"{', '.join(nvme)}: zero.nvme_path={z.nvme_path!r} is not an existing folder")
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise ValueError(f"{', '.join(nvme)}: NVMe offload needs DeepSpeed's async_io op, which cannot be built "
                         f"here (it needs libaio: apt install libaio-dev); use cpu offload instead")


def build_engine(model: nn.Module, cfg: Config, groups: SequenceParallelGroups, device: torch.device,
                 materialize: Callable[[nn.Module], object] | None = None):
    """``deepspeed.initialize`` over the sequence x data group of ``groups`` (via the mpu adapter), after checking
    on a one-element probe built the same way that DeepSpeed reduces gradients as the loss scale assumes
    (:func:`ds4sci.train.sanity.check_gradient_reduction`; before the model's engine, so that a mismatch fails fast
    and the model's engine is built as if the probe had not been).

    Every parameter of ``model`` must be replicated across that group (DeepSpeed broadcasts them from its first
    rank and reduces/partitions over it): keep sequence-sharded parameters out of ``model``.

    ``materialize(part)``: draws the meta parameters of a submodule (:func:`ds4sci.parallel.parallelize.materialize_`).
    Under ZeRO-3 it is called block by block (``model.layers``), each block partitioned before the next is drawn, then
    on the rest, so a rank holds at most one block whole beside its partitions; otherwise once on the whole model.
    """
    sharded = [n for n, p in model.named_parameters() if getattr(p, "ds4sci_sequence_sharded", False)]
    if sharded:
        raise ValueError(f"sequence-sharded parameters {sharded} cannot go into the DeepSpeed engine")
    initialize = functools.partial(_initialize, cfg=cfg, groups=groups, device=device)
    check_gradient_reduction(initialize, cfg, groups, device)
    return initialize(model, materialize=materialize)


def _initialize(model: nn.Module, cfg: Config, groups: SequenceParallelGroups, device: torch.device,
                materialize: Callable[[nn.Module], object] | None = None):
    """The engine of ``model`` on ``device`` with ``cfg``'s DeepSpeed config and optimizer (``materialize``: see
    :func:`build_engine`)."""
    import deepspeed

    ds_config = deepspeed_config(cfg, groups.dims.sp)
    if cfg.zero.stage == 3:
        # DeepSpeed 0.19 converts a plain module for ZeRO-3 over mpu.get_data_parallel_group(), the data ranks
        # WITHOUT the sequence ranks, so gradients are never reduced over the sequence shards (measured: every
        # rank kept its local gradient). Converting here, over the sequence x data group, gives the partitioning
        # the engine's ZeRO-3 optimizer assumes. Part by part: zero.Init moves each parameter to the device,
        # broadcasts it from the group's first rank and keeps this rank's partition; converted ones are skipped.
        for part in [*getattr(model, "layers", ()), model]:
            if materialize is not None:
                materialize(part)
            deepspeed.zero.Init(module=part, data_parallel_group=groups.sdp, config_dict_or_path=ds_config)
        for module in model.modules():  # buffers (ALiBi slopes, position slots) follow the parameters
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
    else:
        if materialize is not None:
            materialize(model)
        model.to(device)
    optimizer, scheduler = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
    engine, _, _, _ = initialize_deepspeed(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
                                           mpu=DeepSpeedMPU(groups), dist_init_required=False)
    return engine
