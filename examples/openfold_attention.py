"""Peak memory of an OpenFold3 Evoformer stack, forward + backward, with and without ds4sci.

Builds OpenFold3's own ``EvoformerStack`` (MSA row attention with pair bias, MSA column attention, outer product
mean, triangle multiplications, triangle attention around both nodes, transitions; AF2 Algorithm 6), runs one
training step (forward, then backward of a scalar loss) twice, each in a fresh subprocess:

- ``default``: OpenFold3's default attention path (``use_deepspeed_evo_attention=False``), which materialises the
  logits ``[*, N, H, S, S]`` of every attention and saves the softmax for backward;
- ``ds4sci``: ``ds4sci.integrations.openfold.enable()`` and ``use_deepspeed_evo_attention=True``, so every attention
  runs ds4sci's kernel in the caller's dtype (no DeepSpeed, no CUTLASS build).

For each it measures

- the peak resident memory of the step above the memory held before it: ``VmHWM - VmRSS`` of the subprocess after
  resetting the high-water mark through ``/proc/self/clear_refs`` (Linux; on CUDA ``max_memory_allocated``);
- the bytes autograd saves for backward (unique storages seen by ``torch.autograd.graph.saved_tensors_hooks``);
- the wall time of the step, and the relative difference of the outputs (real positions) and of the parameter
  gradients vs ``default``.

At the default shape (N_seq=32, N_res=128, 2 blocks, 8 MSA heads, 4 pair heads) the logits dominate: a triangle
attention's softmax alone is N_res * H * N_res^2 * 4 B = 32 MiB, against 1 MiB for the pair representation.

Usage::

    python examples/openfold_attention.py                          # writes runs/openfold_attention/*.json, *.md
    python examples/openfold_attention.py --n-res 64 --n-seq 16    # quicker
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-seq", type=int, default=32, help="MSA depth N_seq (default: %(default)s)")
    p.add_argument("--n-res", type=int, default=128, help="residues N_res (default: %(default)s)")
    p.add_argument("--blocks", type=int, default=2, help="Evoformer blocks (default: %(default)s)")
    p.add_argument("--c-m", type=int, default=32, help="MSA channels (default: %(default)s)")
    p.add_argument("--c-z", type=int, default=16, help="pair channels (default: %(default)s)")
    p.add_argument("--heads-msa", type=int, default=8, help="MSA attention heads (default: %(default)s)")
    p.add_argument("--heads-pair", type=int, default=4, help="triangle attention heads (default: %(default)s)")
    p.add_argument("--c-hidden", type=int, default=8, help="channels per attention head (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="(default: %(default)s)")
    p.add_argument("--backend", default="auto", help="ds4sci kernel backend (default: %(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=2, help="torch threads per run on the CPU (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/openfold_attention"), help="(default: %(default)s)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------
# Worker: one training step in this process
# ----------------------------------------------------------------------------------------------------------


def build_stack(cfg: dict) -> torch.nn.Module:
    from openfold3.core.model.latent.evoformer import EvoformerStack

    torch.manual_seed(cfg["seed"])
    stack = EvoformerStack(
        c_m=cfg["c_m"], c_z=cfg["c_z"], c_hidden_msa_att=cfg["c_hidden"], c_hidden_opm=cfg["c_hidden"],
        c_hidden_mul=cfg["c_z"], c_hidden_pair_att=cfg["c_hidden"], c_s=cfg["c_m"],
        no_heads_msa=cfg["heads_msa"], no_heads_pair=cfg["heads_pair"], no_blocks=cfg["blocks"],
        transition_type="relu", transition_n=4, msa_dropout=0.0, pair_dropout=0.0, no_column_attention=False,
        opm_first=False, fuse_projection_weights=False, blocks_per_ckpt=None, inf=1e9, eps=1e-8,
    )
    # AF2's init zeroes every output projection; random weights make the step (and the comparison) meaningful
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
    return stack.to(cfg["device"], _DTYPES[cfg["dtype"]])


def make_inputs(cfg: dict) -> dict[str, torch.Tensor]:
    """MSA ``m [1, N_seq, N_res, C_m]``, pair ``z [1, N_res, N_res, C_z]``, masks with the last eighth of the
    residues and of the sequences padded."""
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    dtype, device = _DTYPES[cfg["dtype"]], cfg["device"]
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


def step(stack: torch.nn.Module, inputs: dict[str, torch.Tensor], use_ds: bool) -> tuple[torch.Tensor, torch.Tensor]:
    m, z, _ = stack(inputs["m"], inputs["z"], msa_mask=inputs["msa_mask"], pair_mask=inputs["pair_mask"],
                    use_deepspeed_evo_attention=use_ds)
    # a loss over the real (unpadded) positions only, as in training: padded rows of the pair mask have every key
    # masked with a finite -1e9, so their outputs are rounding noise on either path (see DESIGN.md)
    msa_mask, pair_mask = inputs["msa_mask"][..., None], inputs["pair_mask"][..., None]
    loss = (m.float().square() * msa_mask).sum() / msa_mask.sum() + (z.float().square() * pair_mask).sum() / pair_mask.sum()
    loss.backward()
    return m.detach(), z.detach()


def _status_bytes(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(cfg: dict, mode: str, result_path: str) -> None:
    """One mode in this (fresh) process; writes outputs and gradients to ``result_path`` and prints a JSON line."""
    torch.set_num_threads(cfg["threads"])
    use_ds = mode == "ds4sci"
    if use_ds:
        from ds4sci.integrations import openfold as ds4sci_openfold

        ds4sci_openfold.enable(cfg["backend"])
    stack = build_stack(cfg)
    inputs = make_inputs(cfg)
    # warm-up at a small size, so lazily loaded libraries and kernels are not counted
    small = make_inputs(cfg | {"n_seq": 17, "n_res": 17})
    step(stack, small, use_ds)
    stack.zero_grad(set_to_none=True)

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    cuda = cfg["device"].startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # reset VmHWM (peak RSS) to the current RSS
        before = _status_bytes("VmRSS")
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m, z = step(stack, inputs, use_ds)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _status_bytes("VmHWM") - before
    seconds = time.perf_counter() - start
    grads = {n: p.grad.detach().cpu() for n, p in stack.named_parameters() if p.grad is not None}
    torch.save({"m": (m * inputs["msa_mask"][..., None]).cpu(), "z": (z * inputs["pair_mask"][..., None]).cpu(),
                "grads": grads}, result_path)
    print(json.dumps({"peak_bytes": peak, "saved_bytes": sum(saved.values()), "seconds": seconds}))


# ----------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------


def run_mode(cfg: dict, mode: str, result_path: str) -> dict:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from openfold_attention import worker; "
        "worker(json.loads(sys.argv[2]), sys.argv[3], sys.argv[4])"
    )
    here = str(Path(__file__).resolve().parent)
    proc = subprocess.run([sys.executable, "-c", code, here, json.dumps(cfg), mode, result_path],
                          capture_output=True, text=True, check=False, env=os.environ | {"PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def relative_diff(a: dict, b: dict) -> dict[str, float]:
    """max |a - b| / max |b| of each output (real positions) and of all parameter gradients together (some
    gradients are exactly 0 in exact arithmetic, e.g. of a bias that shifts every logit of a softmax equally, so
    a per-tensor ratio would divide rounding noise by rounding noise)."""

    def amax(ts) -> float:
        return max(t.double().abs().max().item() for t in ts)

    assert a["grads"].keys() == b["grads"].keys()
    diff = {name: amax([a[name] - b[name]]) / amax([b[name]]) for name in ("m", "z")}
    names = list(b["grads"])
    diff["param_grads"] = amax([a["grads"][n] - b["grads"][n] for n in names]) / amax([b["grads"][n] for n in names])
    return diff


def markdown(report: dict) -> str:
    cfg, r = report["config"], report["results"]
    mib = 2.0**20
    lines = [
        "# OpenFold3 EvoformerStack, one training step (forward + backward)",
        "",
        f"N_seq={cfg['n_seq']}, N_res={cfg['n_res']}, {cfg['blocks']} blocks, C_m={cfg['c_m']}, C_z={cfg['c_z']}, "
        f"heads {cfg['heads_msa']} (MSA) / {cfg['heads_pair']} (pair) x {cfg['c_hidden']} channels, {cfg['dtype']} on "
        f"{cfg['device']}, ds4sci backend {cfg['backend']!r}. Peak: {report['peak_method']}.",
        "",
        "| path | peak memory of the step (MiB) | saved for backward (MiB) | step time (s) |",
        "| --- | --- | --- | --- |",
    ]
    for mode in ("default", "ds4sci"):
        lines.append(f"| {mode} | {r[mode]['peak_bytes'] / mib:.1f} | {r[mode]['saved_bytes'] / mib:.1f} | "
                     f"{r[mode]['seconds']:.2f} |")
    lines += [
        "",
        f"Peak memory ratio default / ds4sci: **{report['peak_ratio']:.2f}x**; saved-for-backward ratio: "
        f"**{report['saved_ratio']:.2f}x**.",
        f"Relative difference vs default (max |diff| / max |default|): m {report['relative_diff']['m']:.1e}, "
        f"z {report['relative_diff']['z']:.1e}, parameter gradients (all together) "
        f"{report['relative_diff']['param_grads']:.1e}.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"}
    results, outputs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("default", "ds4sci"):
            path = os.path.join(tmp, f"{mode}.pt")
            results[mode] = run_mode(cfg, mode, path)
            outputs[mode] = torch.load(path)
    report = {
        "config": cfg,
        "command": "python examples/openfold_attention.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "peak_method": "torch.cuda.max_memory_allocated" if cfg["device"].startswith("cuda")
        else "peak RSS (VmHWM - VmRSS) of a fresh subprocess per path",
        "results": results,
        "peak_ratio": results["default"]["peak_bytes"] / max(1, results["ds4sci"]["peak_bytes"]),
        "saved_ratio": results["default"]["saved_bytes"] / max(1, results["ds4sci"]["saved_bytes"]),
        "relative_diff": relative_diff(outputs["ds4sci"], outputs["default"]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "openfold_attention.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (args.out / "openfold_attention.md").write_text(text)
    print(text)
    print(f"wrote {args.out / 'openfold_attention.json'} and {args.out / 'openfold_attention.md'}")
    return report


if __name__ == "__main__":
    main()
