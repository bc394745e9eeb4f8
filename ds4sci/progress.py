"""Progress bars only on a terminal: ``progress_bar(enabled, ...)``, the one rule every ds4sci bar follows.

A bar is drawn when it is ``enabled`` (``train.progress``, no ``--no-progress``) and stderr is a terminal. Output
redirected to a file or a pipe gets no bar frames: training logs one line every ``train.log_every`` steps instead
(:meth:`ds4sci.train.trainer.Trainer.train` reads ``bar.disable``)."""
from __future__ import annotations


def progress_bar(enabled: bool, **kwargs):
    """A ``tqdm`` bar (``kwargs``: ``total``, ``desc``, ``unit``, ...) that is drawn only when ``enabled`` and stderr
    is a terminal (tqdm's ``disable=None``); ``bar.disable`` is true when it is not drawn."""
    from tqdm.auto import tqdm

    return tqdm(disable=None if enabled else True, **kwargs)
