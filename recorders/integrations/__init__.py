"""Attach `AmpRecorder` to training frameworks that own the loop.

- `recorders.integrations.transformers.AmpPostmortemCallback`: Hugging Face
  `Trainer(callbacks=[...])` (needs the `hf` extra).
- `recorders.integrations.lightning.AmpPostmortemCallback`: Lightning
  `Trainer(callbacks=[...])` (needs the `lightning` extra).
- Accelerate needs no glue: `AmpRecorder` takes the prepared model, the
  `AcceleratedOptimizer` and `accelerator.scaler` as they are.

Each module imports its framework when it is imported, and nothing in the
core imports these modules: the core stays torch, numpy and pyarrow only.
"""
