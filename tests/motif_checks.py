"""A planted-motif binary task shared by the probe's and the fine-tuned heads' tests (tests/ is on sys.path): a
correct model finds the motif (test AUROC >= 0.95), and shuffled labels say nothing (AUROC near 0.5)."""
import numpy as np

MOTIF = "GGAGGTG"  # the only G's: the background is drawn from A, C, T


def motif_table(path, n=200, length=32, shuffle=False, seed=0):
    """Write ``n`` records to the TSV ``path`` (id, sequence, label, split), half with the motif planted at a random
    place (label 1); the first half train, the rest test. ``shuffle``: labels permuted, so they say nothing about the
    sequences. Returns ``path``."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % 2)  # in no pattern a reordering of the records could keep
    rows = []
    for i, label in enumerate(labels):
        seq = "".join(rng.choice(list("ACT"), length))
        if label:
            at = rng.integers(0, length - len(MOTIF))
            seq = seq[:at] + MOTIF + seq[at + len(MOTIF):]
        rows.append([f"r{i}", seq, int(label), "train" if i < n // 2 else "test"])
    if shuffle:
        permuted = rng.permutation(labels)
        for row, label in zip(rows, permuted):
            row[2] = int(label)
    path.write_text("id\tsequence\tlabel\tsplit\n" + "".join("\t".join(map(str, r)) + "\n" for r in rows))
    return path
