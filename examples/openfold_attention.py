"""Run OpenFold3's Evoformer attention on ds4sci's kernels, and check that a training step agrees.

OpenFold3 sends every Evoformer attention to DeepSpeed's kernel when a module is called with
``use_deepspeed_evo_attention=True``. ``ds4sci.integrations.openfold.enable()`` (or the ``enabled()`` context manager
below) points that path at ds4sci's kernel instead: no DeepSpeed, no CUTLASS build, fp32 stays fp32.

This script builds OpenFold3's ``EvoformerStack`` (through ``ds4sci.bench.openfold_stack``), runs one training step on
OpenFold3's default path and one with ds4sci, and prints how far outputs and parameter gradients differ. For the
memory of the same step on both paths (peak, saved for backward), each in a fresh process::

    ds4sci bench openfold-stack --n-res 256 --out runs/bench

Usage: ``python examples/openfold_attention.py [--n-res 64] [--n-seq 16] [--backend auto]``
"""
import argparse

from ds4sci.bench import openfold_stack
from ds4sci.integrations import openfold as ds4sci_openfold


def main(argv=None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-res", type=int, default=64, help="residues (default: %(default)s)")
    p.add_argument("--n-seq", type=int, default=16, help="MSA depth (default: %(default)s)")
    p.add_argument("--backend", default="auto", help="ds4sci kernel backend (default: %(default)s)")
    args = p.parse_args(argv)

    cfg = openfold_stack.default_config(n_res=args.n_res, n_seq=args.n_seq, backend=args.backend)
    stack = openfold_stack.build_stack(cfg)  # OpenFold3's own EvoformerStack, random weights
    inputs = openfold_stack.make_inputs(cfg)

    m, z = openfold_stack.step(stack, inputs, use_deepspeed_evo_attention=False)  # OpenFold3's default path
    default = openfold_stack.step_outcome(stack, inputs, m, z)
    stack.zero_grad(set_to_none=True)
    with ds4sci_openfold.enabled(backend=args.backend):  # OpenFold3's DeepSpeed path now runs ds4sci
        m, z = openfold_stack.step(stack, inputs, use_deepspeed_evo_attention=True)
    ds4sci = openfold_stack.step_outcome(stack, inputs, m, z)

    diff = openfold_stack.relative_diff(ds4sci, default)
    print(f"OpenFold3 EvoformerStack, N_seq={cfg['n_seq']}, N_res={cfg['n_res']}, {cfg['dtype']} on {cfg['device']}: "
          f"ds4sci ({args.backend}) vs OpenFold3's default path, max |diff| / max |default|: "
          + ", ".join(f"{name} {value:.1e}" for name, value in diff.items()))
    return diff


if __name__ == "__main__":
    main()
