"""ds4sci.io: a GenSLM's weights on disk. :mod:`~ds4sci.io.export` writes and reads ds4sci's consolidated export
(safetensors, config, tokenizer); :mod:`~ds4sci.io.weights` reads any source a model starts from (an export, a
Hugging Face GPT-NeoX directory, a GenSLM checkpoint) and builds the model (:func:`ds4sci.load_model`)."""
