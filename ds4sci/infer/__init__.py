"""ds4sci.infer: what a trained GenSLM computes on sequences, as library functions (the ``ds4sci`` commands in
:mod:`ds4sci.commands` call them): :mod:`~ds4sci.infer.evaluate` (loss over windows), :mod:`~ds4sci.infer.score`
(per-record log-likelihoods), :mod:`~ds4sci.infer.generate` (sampling), :mod:`~ds4sci.infer.embed` (embeddings)."""
