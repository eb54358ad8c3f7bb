"""Replay bundles: what the recorder holds of recent steps, when it saves
one, and how a bundle directory is written.

- `policy`: `BundlePolicy`, the bundle options (the value users pass);
- `capture`: `BundleCapture`, the training-thread side (hooks' callbacks,
  held steps, weight snapshots), owned by `AmpRecorder`;
- `decisions`: `BundleDecisions`, the writer-thread side (trigger decisions,
  misses, writing a decided bundle), owned by `BundleCapture`;
- `triggers`: when to save, a pure function of each step's summary;
- `held`: what a bundle is made of while held (inventory, captures, pools);
- `directory`: one bundle directory on disk (`tensors.parquet`, `bundle.json`);
- `window`: `WindowCapture`, the counterfactual window (`window_steps`),
  owned by `BundleCapture`: training-thread copies and references, written
  on the writer thread (`windows/step=S/rank=R/`).
"""
