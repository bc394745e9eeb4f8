"""The loss curve a run draws at its end (``loss.png``): training loss and validation bits per base by step."""
from __future__ import annotations

import json
from pathlib import Path

#: Up to this many points a curve of :func:`plot_metrics` is drawn with markers (validation always is).
FEW_POINTS = 20


def plot_metrics(metrics_path: Path, png_path: Path) -> None:
    """Loss curve (training loss and validation bits per base) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_bits_per_base"]) for r in rows if "val_bits_per_base" in r]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    if train:  # markers while there are few points: one point alone draws no line
        ax[0].plot(*zip(*train), marker="o" if len(train) <= FEW_POINTS else None, label="train loss (nats/token)")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("loss")
    ax[0].legend()
    if val:
        ax[1].plot(*zip(*val), marker="o", label="validation")
    ax[1].axhline(2.0, color="gray", linestyle="--", label="uniform (2 bits/base)")
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("bits per base")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
