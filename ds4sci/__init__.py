"""ds4sci: Evoformer attention kernels and long-context genome language models.

Kept free of heavy imports (no deepspeed, no torch.distributed) so that ``ds4sci.kernels`` and
``ds4sci.models`` import fast and alone.
"""

__version__ = "0.1.0"


def load_model(path, device="cpu"):
    """``(model, config, tokenizer)`` from a ds4sci export (``OUT_DIR/export``), a Hugging Face
    ``GPTNeoXForCausalLM`` directory or a GenSLM / Lightning checkpoint file that keeps its config
    (:mod:`ds4sci.io.weights`); loading runs no pickled code.

    ``model`` is a :class:`ds4sci.models.genslm.GenSLM` in eval mode on ``device``:
    ``model(input_ids [B, T] int64, position_ids [B, T] int64)`` returns next-token logits ``[B, T, vocab]``
    (``return_hidden=True``: the final hidden states ``[B, T, hidden]``). ``config`` is its
    :class:`~ds4sci.models.genslm.GenSLMConfig`; ``tokenizer.encode(str) -> ids [T]`` and ``decode`` are the
    ids the model was trained on (``"codon"``: GenSLM's 69-word vocabulary, or ``"nucleotide"``).
    """
    from ds4sci.io.weights import load_model as _load_model

    return _load_model(path, device)


def evoformer_context_parallel(block_or_stack, group=None, mesh=None, *, sharded=False, counter=None):
    """``block_or_stack`` (a :class:`ds4sci.models.evoformer.EvoformerBlock` or
    :class:`~ds4sci.models.evoformer.PairformerBlock`, or a sequence of blocks of one kind) run across the ranks of
    ``group`` (default: the default process group) by axial context parallelism, or, with ``mesh=(p, p)``, one
    Evoformer block by 2-D tiles on a p x p mesh of them; the block's call signature and single-process semantics in
    outputs and gradients; ``sharded``: an axial stack keeps m and z split between its blocks
    (:mod:`ds4sci.parallel.evoformer`)."""
    from ds4sci.parallel.evoformer import evoformer_context_parallel as _cp

    return _cp(block_or_stack, group, mesh, sharded=sharded, counter=counter)
