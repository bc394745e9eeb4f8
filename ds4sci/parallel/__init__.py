"""ds4sci.parallel: applying parallelism to models from outside (torchtitan's ``parallelize`` step).

- :mod:`~ds4sci.parallel.tensor_parallel`: Megatron tensor-parallel layers with sequence-parallel regions, a
  vocabulary-parallel embedding, output and cross entropy;
- :mod:`~ds4sci.parallel.genslm_tp`: GenSLM split over a tensor-parallel group (``apply_tensor_parallel``, its
  block and its loss, ``token_loss_for``);
- :mod:`~ds4sci.parallel.parallelize`: ``parallelize``, applying tensor parallelism and the sequence-parallel
  attention of :mod:`ds4sci.sequence` to a GenSLM, and ``materialize_``;
- ``evoformer``: context parallelism of Evoformer and Pairformer blocks.

The degrees, process groups and collectives they build on live in :mod:`ds4sci.distributed`. Import the modules by
name; importing has no side effects (no process group, no environment edits).
"""
