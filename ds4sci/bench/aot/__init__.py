"""The pieces of ``ds4sci bench kernels-aot`` (the command and its report: :mod:`ds4sci.bench.kernels_aot`).

- :mod:`.calls`: the attention calls callers make and the Triton launches each one makes, recorded from the public
  path instead of run;
- :mod:`.specialise`: what Triton's JIT specialises a recorded launch on (signature, constants, alignment);
- :mod:`.variants`: the compiled variants of each ``--set`` (the tile tables' entries, OpenFold's launches);
- :mod:`.compile`: one variant compiled for one target, with its resources and exponent check;
- :mod:`.ptx`: the dataflow check of the PTX (what feeds each ``ex2.approx``);
- :mod:`.ptxas`: the ``ptxas -v`` log (registers, stack, spills) and the ptxas versions Triton runs;
- :mod:`.pool`: the worker processes that compile, started without ``TRITON_INTERPRET``.

Imports run one way: variants imports calls and specialise; compile imports specialise, ptx and ptxas; pool imports
compile; the command imports calls, variants, compile, ptxas and pool. Torch and Triton are imported inside the
functions that need them: importing the command module loads neither.
"""
