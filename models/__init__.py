"""ds4sci.models: single-device nn.Modules (GenSLM, Evoformer attention layers)."""
