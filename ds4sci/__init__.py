"""ds4sci: Evoformer attention kernels and long-context genome language models.

Kept free of heavy imports (no deepspeed, no torch.distributed) so that ``ds4sci.kernels`` and
``ds4sci.models`` import fast and alone.
"""

__version__ = "0.1.0"
