"""Reading a run: the analyzer's load layer, the one place that opens a
run's files. It imports only the vocabulary (`errors`, `names`) and the run
format (`recorders.format`); the analyses and everything above read runs
through it.

- `loader` (`load_run`, `Run`): manifests, versions, ranks, the steps table
  and the tensors scanned through an engine (`engines/`);
- the files a run holds: `shards` (rank directories, shard footers),
  `index` (per-shard indexes), `journal` (what a killed job left),
  `step_table`, `step_series`, `step_facts` (the steps, whole or reduced),
  `shard_rows` (sharded parameters' rows merged), `tail` (what a running
  job wrote since the last look);
- saved steps and windows: `bundle`, `bundle_dirs`, `shard_bundle`,
  `array_bundle` (Keras and Flax), `window`;
- where a run is: `store` (local directories and object stores);
- `files/`: the gate every file passes (bounds, safe opening, one pydantic
  model per file kind).
"""
