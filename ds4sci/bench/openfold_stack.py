"""``ds4sci bench openfold-stack``: memory of an OpenFold3 ``EvoformerStack`` training step, with and without ds4sci.

Builds OpenFold3's own ``EvoformerStack`` (AF2 Algorithm 6) and runs one training step (forward, then backward of a
scalar loss) on each path, each in a fresh subprocess (:func:`ds4sci.bench.memory.run_in_subprocess`):

- ``default``: OpenFold3's default attention path, which materialises the logits ``[*, N, H, S, S]`` of every
  attention and saves the softmax for backward;
- ``ds4sci``: ``ds4sci.integrations.openfold.enable()`` and ``use_deepspeed_evo_attention=True``, so every attention
  runs ds4sci's kernel in the caller's dtype.

For each it measures (:mod:`ds4sci.bench.memory`) the peak memory of the step above what is held before it, the
bytes saved for backward, the wall time, and the relative difference of the outputs and parameter gradients vs
``default``. Wall times depend on the machine and its load, so the report carries the machine, the date and the load
average at the start and end of each path's run beside each time.

At the default shape (N_seq=32, N_res=128, 2 blocks) the logits dominate: a triangle attention's softmax alone is
N_res * H * N_res^2 * 4 B = 32 MiB, against 1 MiB for the pair representation.

Writes ``openfold_stack.json``, ``.md`` and ``.png`` to ``--out``; ``--quick`` is a smoke test at N_seq=17, N_res=20,
one block. Needs OpenFold3 (``pip install 'ds4sci[openfold]'``); without it the command exits with status 1.
"""
from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from typing import TYPE_CHECKING

from ds4sci.bench.report import MIB
from ds4sci.bench.report import add_int_options
from ds4sci.bench.report import check_positive
from ds4sci.bench.report import command_line
from ds4sci.bench.report import describe_load
from ds4sci.bench.report import describe_machine
from ds4sci.bench.report import load_average
from ds4sci.bench.report import machine
from ds4sci.bench.report import markdown_table
from ds4sci.bench.report import missing_dependency
from ds4sci.bench.report import plural
from ds4sci.bench.report import save_figure
from ds4sci.bench.report import subplots
from ds4sci.bench.report import write_files
from ds4sci.kernels import EvoformerBackend

if TYPE_CHECKING:  # imported where used: ``ds4sci bench openfold-stack --help`` imports no torch
    import torch

logger = logging.getLogger(__name__)

MODES = ("default", "ds4sci")
_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # --dtype -> the torch dtype's name
#: option -> (default, help); ``--dtype``, ``--backend`` and ``--device`` are added separately
_INT_OPTIONS = {
    "n_seq": (32, "MSA depth N_seq"),
    "n_res": (128, "residues N_res"),
    "blocks": (2, "Evoformer blocks"),
    "c_m": (32, "MSA channels"),
    "c_z": (16, "pair channels"),
    "heads_msa": (8, "MSA attention heads"),
    "heads_pair": (4, "triangle attention heads"),
    "c_hidden": (8, "channels per attention head"),
    "threads": (2, "torch threads per run on the CPU"),
    "seed": (0, "seed of the weights and inputs"),
}
_OPENFOLD_STACK = "openfold3.core.model.latent.evoformer"
_QUICK = {"n_seq": 17, "n_res": 20, "blocks": 1}  # above OpenFold's 16-residue fallback to its default path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The shape and run options (``--out`` is added by :mod:`ds4sci.bench`)."""
    add_int_options(parser, _INT_OPTIONS, _QUICK)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="(default: %(default)s)")
    parser.add_argument("--backend", choices=[b.value for b in EvoformerBackend], default="auto",
                        help="ds4sci kernel backend (default: %(default)s)")
    parser.add_argument("--device", help="(default: cuda when it is available, else cpu)")


def default_config(**overrides) -> dict:
    """A run configuration: every option at its default, then ``overrides`` (e.g. ``n_res=64``); a ``device`` of
    None is cuda when it is available, else cpu."""
    import torch

    cfg = {name: default for name, (default, _) in _INT_OPTIONS.items()}
    cfg |= {"dtype": "fp32", "backend": "auto", "device": None}
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise TypeError(f"unknown openfold-stack options {sorted(unknown)}")
    cfg |= overrides
    return cfg | {"device": cfg["device"] or ("cuda" if torch.cuda.is_available() else "cpu")}


# ----------------------------------------------------------------------------------------------------------
# One training step of OpenFold3's EvoformerStack
# ----------------------------------------------------------------------------------------------------------


def build_stack(cfg: dict) -> torch.nn.Module:
    """OpenFold3's ``EvoformerStack`` at ``cfg``'s shape with random weights (AF2's init zeroes every output
    projection, which would make the step and the comparison trivial), on ``cfg``'s device and dtype."""
    import torch
    from openfold3.core.model.latent.evoformer import EvoformerStack

    torch.manual_seed(cfg["seed"])
    stack = EvoformerStack(
        c_m=cfg["c_m"], c_z=cfg["c_z"], c_hidden_msa_att=cfg["c_hidden"], c_hidden_opm=cfg["c_hidden"],
        c_hidden_mul=cfg["c_z"], c_hidden_pair_att=cfg["c_hidden"], c_s=cfg["c_m"],
        no_heads_msa=cfg["heads_msa"], no_heads_pair=cfg["heads_pair"], no_blocks=cfg["blocks"],
        transition_type="relu", transition_n=4, msa_dropout=0.0, pair_dropout=0.0, no_column_attention=False,
        opm_first=False, fuse_projection_weights=False, blocks_per_ckpt=None, inf=1e9, eps=1e-8,
    )
    g = torch.Generator().manual_seed(cfg["seed"])
    with torch.no_grad():
        for name, prm in stack.named_parameters():
            noise = torch.randn(prm.shape, generator=g)
            if prm.ndim == 2:
                prm.copy_(noise / prm.shape[1] ** 0.5)  # variance 1/fan_in
            elif "layer_norm" in name and name.endswith("weight"):
                prm.copy_(1 + 0.1 * noise)
            else:
                prm.copy_(0.1 * noise)
    return stack.to(cfg["device"], getattr(torch, _DTYPES[cfg["dtype"]]))


def make_inputs(cfg: dict) -> dict[str, torch.Tensor]:
    """MSA ``m [1, N_seq, N_res, C_m]``, pair ``z [1, N_res, N_res, C_z]``, masks with the last eighth of the
    residues and of the sequences padded."""
    import torch

    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    dtype, device = getattr(torch, _DTYPES[cfg["dtype"]]), cfg["device"]
    n_seq, n_res = cfg["n_seq"], cfg["n_res"]
    m = torch.randn(1, n_seq, n_res, cfg["c_m"], generator=g)
    z = torch.randn(1, n_res, n_res, cfg["c_z"], generator=g)
    res = torch.ones(1, n_res)
    res[:, n_res - n_res // 8:] = 0
    seq = torch.ones(1, n_seq)
    seq[:, n_seq - n_seq // 8:] = 0
    msa_mask = seq[:, :, None] * res[:, None, :]
    pair_mask = res[:, :, None] * res[:, None, :]
    return {name: t.to(device, dtype) for name, t in
            (("m", m), ("z", z), ("msa_mask", msa_mask), ("pair_mask", pair_mask))}


def step(stack: torch.nn.Module, inputs: dict[str, torch.Tensor],
         use_deepspeed_evo_attention: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of ``stack`` and backward of a loss over the real (unpadded) positions; the detached (m, z).

    Padded rows of the pair mask have every key masked with a finite -1e9, so their outputs are rounding noise on
    either path (see DESIGN.md); the loss, like training, ignores them."""
    m, z, _ = stack(inputs["m"], inputs["z"], msa_mask=inputs["msa_mask"], pair_mask=inputs["pair_mask"],
                    use_deepspeed_evo_attention=use_deepspeed_evo_attention)
    msa_mask, pair_mask = inputs["msa_mask"][..., None], inputs["pair_mask"][..., None]
    loss = ((m.float().square() * msa_mask).sum() / msa_mask.sum()
            + (z.float().square() * pair_mask).sum() / pair_mask.sum())
    loss.backward()
    return m.detach(), z.detach()


def step_outcome(stack: torch.nn.Module, inputs: dict[str, torch.Tensor], m: torch.Tensor,
                 z: torch.Tensor) -> dict:
    """What :func:`relative_diff` compares, on the CPU: m and z at the real positions (padding zeroed) and the
    gradient of every parameter that has one."""
    return {
        "m": (m * inputs["msa_mask"][..., None]).cpu(),
        "z": (z * inputs["pair_mask"][..., None]).cpu(),
        "grads": {n: p.grad.detach().cpu() for n, p in stack.named_parameters() if p.grad is not None},
    }


def relative_diff(a: dict, b: dict) -> dict[str, float]:
    """max |a - b| / max |b| of each output (real positions) and of all parameter gradients together (some
    gradients are exactly 0 in exact arithmetic, e.g. of a bias that shifts every logit of a softmax equally, so
    a per-tensor ratio would divide rounding noise by rounding noise)."""

    def amax(ts) -> float:
        return max(t.double().abs().max().item() for t in ts)

    if a["grads"].keys() != b["grads"].keys():
        raise ValueError(f"different parameters have gradients: {sorted(a['grads'].keys() ^ b['grads'].keys())}")
    diff = {name: amax([a[name] - b[name]]) / amax([b[name]]) for name in ("m", "z")}
    names = list(b["grads"])
    diff["param_grads"] = amax([a["grads"][n] - b["grads"][n] for n in names]) / amax([b["grads"][n] for n in names])
    return diff


def measure_step(cfg: dict, mode: str, outcome_path: str) -> dict:
    """One training step on ``mode``'s path ("default" or "ds4sci") in this process, after a warm-up step at a
    small shape (so lazily loaded libraries and kernels are not counted): its peak memory, the bytes saved for
    backward and its wall time. Saves :func:`step_outcome` to ``outcome_path`` (``torch.save``). Meant to run in a
    fresh process per mode (:func:`compare`), since OpenFold patching is process-global and so is the peak RSS."""
    import torch

    from ds4sci.bench import memory

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    torch.set_num_threads(cfg["threads"])
    use_ds = mode == "ds4sci"
    if use_ds:
        from ds4sci.integrations import openfold as ds4sci_openfold

        ds4sci_openfold.enable(cfg["backend"])
    stack = build_stack(cfg)
    inputs = make_inputs(cfg)
    # warm-up above OpenFold's 16-residue threshold, under which its DeepSpeed path falls back to plain PyTorch
    step(stack, make_inputs(cfg | {"n_seq": 17, "n_res": 17}), use_ds)
    stack.zero_grad(set_to_none=True)
    with memory.PeakMemory(cfg["device"]) as peak:
        start = time.perf_counter()
        with memory.saved_for_backward() as saved:
            m, z = step(stack, inputs, use_ds)
    seconds = time.perf_counter() - start
    torch.save(step_outcome(stack, inputs, m, z), outcome_path)
    return {"peak_bytes": peak.bytes, "saved_bytes": saved.bytes, "seconds": seconds}


# ----------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------


def openfold3_missing() -> str | None:
    """Why OpenFold3's ``EvoformerStack`` cannot be imported here, or None when it can."""
    return missing_dependency(_OPENFOLD_STACK, "ds4sci bench openfold-stack needs OpenFold3 ({err}); install it with "
                              "pip install 'ds4sci[openfold]'")


def compare(cfg: dict) -> dict:
    """Both paths at ``cfg``, each in a fresh subprocess: the report (without ``command``), with the machine and, per
    path, the load average at the start and at the end of its subprocess (``load``: mode -> {"start", "end"})."""
    import torch

    from ds4sci.bench import memory

    results, outcomes, load = {}, {}, {}
    host = machine() | ({"gpu": torch.cuda.get_device_name(cfg["device"])}
                        if torch.device(cfg["device"]).type == "cuda" else {})
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            path = os.path.join(tmp, f"{mode}.pt")
            load[mode] = {"start": load_average()}
            results[mode] = memory.run_in_subprocess(f"{__name__}:measure_step", cfg, mode, path,
                                                     env={"PYTHONWARNINGS": "ignore"})
            load[mode]["end"] = load_average()
            outcomes[mode] = torch.load(path)
            logger.info("openfold-stack %s: peak %.1f MiB, saved %.1f MiB, %.2f s", mode,
                        results[mode]["peak_bytes"] / MIB, results[mode]["saved_bytes"] / MIB, results[mode]["seconds"])
    return {
        "config": cfg,
        "machine": host,
        "load": load,
        "peak_method": memory.peak_method(cfg["device"]),
        "allocator": memory.allocator_settings(),
        "results": results,
        "peak_ratio": results["default"]["peak_bytes"] / max(1, results["ds4sci"]["peak_bytes"]),
        "saved_ratio": results["default"]["saved_bytes"] / max(1, results["ds4sci"]["saved_bytes"]),
        "relative_diff": relative_diff(outcomes["ds4sci"], outcomes["default"]),
    }


def markdown(report: dict) -> str:
    """The Markdown summary of a :func:`compare` report."""
    from ds4sci.bench import memory

    cfg, r = report["config"], report["results"]
    rows = [(mode, f"{r[mode]['peak_bytes'] / MIB:.1f}", f"{r[mode]['saved_bytes'] / MIB:.1f}",
             f"{r[mode]['seconds']:.2f}", describe_load(report["load"][mode]["start"], report["load"][mode]["end"]))
            for mode in MODES]
    host = report["machine"]
    diff = report["relative_diff"]
    lines = [
        "# OpenFold3 EvoformerStack, one training step (forward + backward)",
        "",
        f"N_seq={cfg['n_seq']}, N_res={cfg['n_res']}, {cfg['blocks']} blocks, C_m={cfg['c_m']}, C_z={cfg['c_z']}, "
        f"heads {cfg['heads_msa']} (MSA) / {cfg['heads_pair']} (pair) x {cfg['c_hidden']} channels, {cfg['dtype']} on "
        f"{cfg['device']}, ds4sci backend {cfg['backend']!r}. Peak: {report['peak_method']}. "
        f"{memory.describe_allocator(report['allocator'])}",
        "",
        f"Timed on {describe_machine(host)}" + (f", {host['gpu']}" if "gpu" in host else "") + f" with "
        f"{plural(cfg['threads'], 'torch thread')}; the 1-minute load average (processes running or waiting for one of "
        f"the {plural(host['cores'], 'core')}) at the start and at the end of each path's run is given beside its "
        "time.",
        "",
        *markdown_table(("path", "peak memory of the step (MiB)", "saved for backward (MiB)", "step time (s)",
                         "load average (1 min) start -> end"), rows),
        "",
        f"Peak memory ratio default / ds4sci: **{report['peak_ratio']:.2f}x**; saved-for-backward ratio: "
        f"**{report['saved_ratio']:.2f}x**.",
        f"Relative difference vs default (max |diff| / max |default|): m {diff['m']:.1e}, z {diff['z']:.1e}, "
        f"parameter gradients (all together) {diff['param_grads']:.1e}.",
        "",
    ]
    return "\n".join(lines)


def plot(report: dict, path) -> None:
    """Bars per path: peak memory and bytes saved for backward (MiB, left), step time (s, right)."""
    r = report["results"]
    fig, (mem, secs) = subplots(1, 2, figsize=(9, 4), gridspec_kw={"width_ratios": [2, 1]})
    x = range(len(MODES))
    mem.bar([i - 0.2 for i in x], [r[m]["peak_bytes"] / MIB for m in MODES], 0.4, label="peak of the step")
    mem.bar([i + 0.2 for i in x], [r[m]["saved_bytes"] / MIB for m in MODES], 0.4, label="saved for backward")
    mem.set_xticks(list(x), MODES)
    mem.set_ylabel("MiB")
    mem.legend()
    secs.bar(list(x), [r[m]["seconds"] for m in MODES], 0.5, color="gray")
    load = report["load"]
    secs.set_xticks(list(x), [f"{m}\nload {describe_load(load[m]['start'], load[m]['end'])}" for m in MODES])
    secs.set_ylabel("step time (s)")
    c = report["config"]
    fig.suptitle(f"OpenFold3 EvoformerStack training step: N_seq={c['n_seq']}, N_res={c['n_res']}, {c['blocks']} "
                 f"blocks, {c['dtype']} on {c['device']}, ds4sci backend {c['backend']!r}\n"
                 f"timed on {describe_machine(report['machine'])}", fontsize=9)
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    """``ds4sci bench openfold-stack``: exit status 1, with one error line, when OpenFold3 is not importable."""
    cfg = default_config(**{name: getattr(args, name) for name in default_config()}) | (_QUICK if args.quick else {})
    check_positive(cfg, (name for name in _INT_OPTIONS if name != "seed"))
    missing = openfold3_missing()
    if missing:
        logger.error(missing)
        return 1
    report = {"config": cfg, "command": command_line("openfold-stack", cfg, args.out)} | compare(cfg)
    write_files(args.out, "openfold_stack", report, markdown(report), plot)
    return 0
