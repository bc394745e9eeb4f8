"""ds4sci.models.evoformer: Evoformer attention layers (OpenFold-compatible)."""
