"""Units and bytes per element shared by the GenSLM and Evoformer planners."""
from __future__ import annotations

GIB = 2.0**30
MIB = 2.0**20
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
"""bytes per activation element by compute dtype."""
STATE_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12)}
"""bytes per parameter of (parameter, gradient, optimizer state) by training dtype (ZeRO paper's 2 + 2 + K): fp32
keeps AdamW's two moments, bf16 also an fp32 master copy."""
