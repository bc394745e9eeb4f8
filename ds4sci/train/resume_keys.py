"""The config keys a resumed run may change (:data:`MAY_CHANGE`), in a module without torch so ``ds4sci train
--help`` can state the rule without importing what enforces it (:mod:`ds4sci.train.run_dir`)."""

# Keys a resumed run may change: its length, cadences and console, where things are written, and how the same
# computation is laid out (parallel degrees, the split of the same global batch, and recomputation).
MAY_CHANGE = ("train.steps", "train.log_every", "train.eval_every", "train.save_every", "train.progress",
              "train.out_dir", "data.cache_dir", "train.micro_batch_size", "train.grad_accum", "train.timeout_s",
              "train.nonfinite", "train.deterministic", "parallel.*", "zero.*", "activation_checkpointing.*")
