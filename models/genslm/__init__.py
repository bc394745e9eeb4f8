"""ds4sci.models.genslm: GenSLM-style GPT for genome sequences."""
