"""The bounds of what the analyzer reads, defined once. Each one is checked
before anything it bounds is allocated, decoded or parsed; docs/FORMAT.md
("Limits") states the same numbers."""
from __future__ import annotations

# JSON files (manifest.json, index/part-N.json, bundle.json). A manifest of a
# model with 100,000 parameters is ~20 MiB; nesting beyond what the format
# writes (argument trees are at most 16 containers deep, two JSON levels
# each) would only make the parser recurse until the stack gives out.
MAX_JSON_BYTES = 64 << 20
MAX_JSON_DEPTH = 64

# Ranks of one run: more than torch.distributed jobs reach, and small enough
# that the loader may count over range(world_size).
MAX_WORLD_SIZE = 1 << 20

# One bundle tensor, and a whole bundle's raw tensor bytes: the recorder's
# own default cap on bundle bytes (`max_bundle_bytes`, 64 GiB).
MAX_TENSOR_ELEMENTS = 1 << 36
MAX_BUNDLE_BYTES = 64 << 30
# Everything of tensors.parquet but the raw bytes (names, dtypes, shapes),
# decompressed.
MAX_BUNDLE_INDEX_BYTES = 64 << 20
# Parquet's own framing of the `data` column (length prefixes, levels, page
# headers) on top of the declared raw bytes, per row, and per file.
PARQUET_SLACK_PER_ROW = 64
PARQUET_SLACK_BYTES = 1 << 20

# A rank's status slot (rank=R/status.json): the recorder reserves 4 KiB.
MAX_STATUS_BYTES = 1 << 16
# One row group of a steps or tensors shard, decompressed (Parquet metadata's
# total_byte_size): the recorder's row groups of 65,536 rows take ~20 MiB.
MAX_ROW_GROUP_BYTES = 1 << 30
# One journal file's record batches, decoded (their sizes read from each
# message's metadata before it is decoded): a journal holds at most one
# shard interval of a rank's rows (flush_interval_s, 60 s by default).
MAX_JOURNAL_BYTES = 1 << 32

# Every limit, by the name docs/FORMAT.md uses for it.
LIMITS = {
    "MAX_JSON_BYTES": MAX_JSON_BYTES,
    "MAX_JSON_DEPTH": MAX_JSON_DEPTH,
    "MAX_WORLD_SIZE": MAX_WORLD_SIZE,
    "MAX_TENSOR_ELEMENTS": MAX_TENSOR_ELEMENTS,
    "MAX_BUNDLE_BYTES": MAX_BUNDLE_BYTES,
    "MAX_BUNDLE_INDEX_BYTES": MAX_BUNDLE_INDEX_BYTES,
    "MAX_STATUS_BYTES": MAX_STATUS_BYTES,
    "MAX_ROW_GROUP_BYTES": MAX_ROW_GROUP_BYTES,
    "MAX_JOURNAL_BYTES": MAX_JOURNAL_BYTES,
}
