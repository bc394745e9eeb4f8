"""``ds4sci bench evoformer-speed`` writes a PNG beside its JSON and Markdown. The command needs a CUDA GPU (its
``--quick`` run and its refusal without one: tests/kernels/test_gpu.py); here the plot is drawn from a report."""
from ds4sci.bench import evoformer_speed


def _record(impl, shape, dtype, ms):
    base = {"impl": impl, "shape": {"name": shape.name, "n": shape.n, "s": shape.s, "h": shape.h, "d": shape.d},
            "dtype": dtype}
    if ms is None:
        return base | {"skipped": "not importable here"}
    return base | {"fwd_ms": ms / 3, "fwd_bwd_ms": ms, "peak_mib": 1.0, "max_abs_diff_vs_ds4sci_torch": 0.0}


def test_plot_writes_a_png(tmp_path):
    shapes = evoformer_speed.QUICK_SHAPES
    results = [_record(impl, shape, dtype, None if impl == "deepspeed" and dtype == "fp32" else 1.0 + i)
               for i, shape in enumerate(shapes) for dtype in ("bf16", "fp32")
               for impl in evoformer_speed.IMPLEMENTATIONS]
    report = {"device": "a GPU", "torch_version": "x", "triton_version": "y", "quick": True, "warmup": 1,
              "repeats": 3, "results": results}
    evoformer_speed.plot(report, tmp_path / "evoformer_speed.png")
    assert (tmp_path / "evoformer_speed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
