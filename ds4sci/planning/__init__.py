"""ds4sci.planning: the planners' arithmetic, torch-free, with typed inputs and results.

:mod:`~ds4sci.planning.genslm` prices one GenSLM layout (memory per GPU by term, bytes sent by group, step time),
:mod:`~ds4sci.planning.genslm_search` lists the layouts that fit and finds the longest sequence,
:mod:`~ds4sci.planning.evoformer` prices an Evoformer or Pairformer trunk, :mod:`~ds4sci.planning.costs` holds the
closed forms the benchmarks measure, :mod:`~ds4sci.planning.common` the units both planners share. The commands
``ds4sci plan`` and ``ds4sci plan-evoformer`` (:mod:`ds4sci.commands.plan`, :mod:`ds4sci.commands.plan_evoformer`)
parse arguments and print; the derivations are in ``docs/explanation/planner.md``.
"""
