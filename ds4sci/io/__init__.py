"""ds4sci.io: a GenSLM's weights on disk. :mod:`~ds4sci.io.export` writes and reads ds4sci's consolidated export
(safetensors, config, tokenizer); :mod:`~ds4sci.io.tensors` reads weight files safely and checks a config
against their shapes; :mod:`~ds4sci.io.weights` reads any source a model starts from (an export, a
Hugging Face GPT-NeoX or Llama directory, a GenSLM checkpoint) and builds the model (:func:`ds4sci.load_model`);
:mod:`~ds4sci.io.export_hf` writes any of them as a transformers directory (``ds4sci export-hf``), with the config
key table of :mod:`~ds4sci.io.hf` that reading uses too."""
