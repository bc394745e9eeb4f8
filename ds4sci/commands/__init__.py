"""ds4sci.commands: the ``ds4sci`` subcommands of training and of the trained model (``train``, ``evaluate``,
``generate``, ``embed``, ``score``), each a module with ``add_arguments(parser)`` and ``run(args) -> int`` that parses
arguments and calls the library (:mod:`ds4sci.train`, :mod:`ds4sci.infer`, :mod:`ds4sci.io`); the entry point is
:mod:`ds4sci.cli`. Library imports stay inside ``run`` so ``ds4sci COMMAND --help`` imports no torch."""
