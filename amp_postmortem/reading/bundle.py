"""Replay bundles, as the analyzer sees them (the contract between the bundle
loader and the replay). `load_bundle(path)` validates and reads one bundle
written by `recorders.bundle`; nothing here unpickles anything: tensors are
rebuilt from raw bytes, metadata from JSON, and no class named in a bundle
is ever imported.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import torch

from recorders.format import json_checksum, schema
from recorders.format.tensors import decode_tree, itemsize, parse_dtype, tensor_from_bytes

from .bundle_dirs import list_bundles  # noqa: F401  (part of this module's API)
from ..errors import BundleError, PostmortemError
from .files import limits
from .files.models import BundleMeta, validate
from .files.safe import Damaged, numbered_dirs, open_regular, parse_json, rank_of, read_bytes, shown, step_of


@dataclass
class Bundle:
    path: str
    step: int
    rank: int
    params: dict            # name -> torch.Tensor, as used by the step's forward
    buffers: dict           # name -> torch.Tensor
    inputs: list            # per micro-batch: (args: tuple, kwargs: dict), nested containers rebuilt
    grad_outputs: list      # per micro-batch: list of Tensor|None, d(loss)/d(output_i) UNSCALED,
                            # one per floating model output requiring grad, in iter_tensors order
    loss: float | None      # loss value of the step (mean over micro-batches as recorded)
    loss_scale: float | None  # loss scale in force during the step's backward (None without scaler)
    autocast: dict          # {"enabled": bool, "device_type": "cuda"|"cpu"|None, "dtype": "float16"|...}
    precision_flags: dict   # {"allow_tf32_matmul", "allow_tf32_cudnn", "fp16_reduced_precision_reduction",
                            #  "bf16_reduced_precision_reduction", "deterministic_algorithms", ...}
    scaler: dict | None     # {"scale", "growth_tracker", "growth_factor", "backoff_factor", "growth_interval", ...}
    rng: dict               # {"cpu": uint8 Tensor, "cuda": [uint8 Tensor, ...]}
    model_class: str        # "package.module.ClassName"
    optimizer: dict | None  # {"class": ..., "defaults": {...}, "param_groups": [...]}
    env: dict               # {"torch_version", "device_type", "device_name", "package_version", ...}
    reason: str             # which trigger saved it: "nonfinite_loss", "nonfinite_tensor", "skipped", "scale_low", "request", "step_list"
    meta: dict = field(default_factory=dict)  # the whole bundle.json
    # Additions (defaults keep older constructors working):
    grad_outputs_raw: list = field(default_factory=list)  # as they travelled: SCALED by loss_scale
                                                          # when a scaler was enabled, in their own dtype
    micro_batch_rng: list = field(default_factory=list)   # per micro-batch: {"cpu": ..., "cuda": [...]}
    extra_buffers: dict = field(default_factory=dict)     # non-persistent buffers (not in state_dict())
    reasons: list = field(default_factory=list)           # every reason that fired at this step
    shard_ranks: list = field(default_factory=list)       # a sharded job's: the ranks whose shards
                                                          # made `params` whole (empty: not sharded)
    optimizer_state: list = field(default_factory=list)   # [(param name, key, Tensor or plain value)]
                                                          # (since 1.2; `optimizer.state_exact` says
                                                          # whether it is the one the step's update used)

    @property
    def micro_batches(self) -> int:
        return len(self.inputs)

    @property
    def exact(self) -> bool:
        """True when weights, buffers and inputs are known to be those the
        step's forward used (see FORMAT.md, "Replay bundles")."""
        m = self.meta
        return bool(m["params"]["exact"] and m["buffers"]["exact"] and m["inputs_exact"])

    def state_dict(self) -> dict:
        """Parameters and buffers by qualified name, for `load_state_dict(strict=True)`."""
        return {**self.params, **self.buffers}

    def nonfinite_params(self) -> list:
        """The names of the floating parameters holding a NaN/Inf, in the
        bundle's order (a tied parameter under its first name)."""
        seen, out = set(), []
        for name, t in self.params.items():
            if id(t) not in seen:
                seen.add(id(t))
                if t.is_floating_point() and not bool(t.isfinite().all()):
                    out.append(name)
        return out


def find_bundle(run_dir, step: int, rank: int | None = None) -> Path:
    """The bundle directory of `step` (and `rank`; default: the lowest rank
    that saved one) in a run directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise BundleError(f"run directory not found: {run_dir}")
    found = list_bundles(run_dir)
    if not found:
        raise BundleError(f"no replay bundles in {run_dir} (nothing under {schema.BUNDLES_DIR}/)")
    at_step = [(r, p) for s, r, p in found if s == int(step)]
    if not at_step:
        steps = ", ".join(str(s) for s in sorted({s for s, _, _ in found}))
        raise BundleError(f"no bundle for step {step} in {run_dir} (bundles exist for steps: {steps})")
    if rank is None:
        return at_step[0][1]
    for r, p in at_step:
        if r == int(rank):
            return p
    ranks = ", ".join(str(r) for r, _ in at_step)
    raise BundleError(f"no bundle for step {step} rank {rank} in {run_dir} (ranks with one: {ranks})")


def load_bundle(path, step: int | None = None, rank: int | None = None) -> Bundle:
    """Validate and read a bundle: `path` is the bundle directory (or its
    bundle.json), or a run directory together with `step` (and `rank`).
    Raises BundleError for a missing, truncated, tampered or newer bundle."""
    path = Path(path)
    if step is not None:
        path = find_bundle(path, step, rank)
    if path.name == schema.BUNDLE_MANIFEST_FILE and path.is_file():
        path = path.parent
    if not path.exists():
        raise BundleError(f"bundle not found: {path}")
    meta_path = path / schema.BUNDLE_MANIFEST_FILE
    if not (meta_path.is_file() or os.path.lexists(meta_path)):  # a FIFO or link: refused when read
        if (path / schema.BUNDLES_DIR).is_dir() or (path / schema.MANIFEST_FILE).is_file():
            raise BundleError(f"{path} is a run directory: pass step= (and rank=) or a bundle directory")
        raise BundleError(f"not a replay bundle: {meta_path} is missing")
    meta, tensors = _read_checked(path, meta_path)
    try:
        bundle = _assemble(path, meta, tensors)
        if meta["params"].get("placements"):
            bundle = _made_whole(path, bundle, tensors)
        return bundle
    except BundleError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise BundleError(f"malformed bundle {path}: {type(exc).__name__}: {exc}") from None


def _read_checked(path: Path, meta_path: Path) -> tuple[dict, dict]:
    """bundle.json and the tensors of one bundle directory, every check done."""
    meta = _read_meta(meta_path, path)
    _check_place(path, meta_path, meta)
    _check_files(path, meta)
    return meta, _read_tensors(path / schema.BUNDLE_TENSORS_FILE, path)


def _made_whole(path: Path, bundle: Bundle, tensors: dict) -> Bundle:
    """A sharded job's bundle with its parameters reassembled from every
    rank's bundle of the same step (`shard_bundle.reassemble`): the rest
    (inputs, output gradients, RNG, loss) stays this rank's."""
    from .shard_bundle import reassemble
    meta, step, rank = bundle.meta, bundle.step, bundle.rank
    world = meta.get("world_size")
    if path.parent.parent.name != schema.BUNDLES_DIR or not isinstance(world, int) or world < 1:
        raise BundleError(f"{path}: a sharded job's bundle holds rank {rank}'s shards only: replay it in its "
                          f"run directory, beside every rank's bundle of step {step}")
    step_dir = path.parent
    # The step's rank directories as listed (canonical names, no links).
    present = dict(numbered_dirs(step_dir, rank_of, step_dir.parent.parent, BundleError))
    others = {r: d for r, d in sorted(present.items()) if r != rank and r < world}
    missing = [r for r in range(world) if r != rank and r not in present]
    if missing:
        ranks = ", ".join(str(r) for r in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise BundleError(f"step {step}: no bundle of rank{'s' if len(missing) > 1 else ''} {ranks} "
                          f"(a sharded job's replay needs every rank's shards, world_size {world}; "
                          f"found under {shown(step_dir)})")
    ranks = {rank: (meta, tensors)}
    for r, p in others.items():
        ranks[r] = _read_checked(p, p / schema.BUNDLE_MANIFEST_FILE)
    for r, (m, _) in sorted(ranks.items()):
        if m.get("run_id") != meta.get("run_id") or m.get("world_size") != world:
            raise BundleError(f"step {step}: rank {r}'s bundle is of another run or world size "
                              f"(run_id {m.get('run_id')!r}, world_size {m.get('world_size')!r}; rank {rank}'s: "
                              f"{meta.get('run_id')!r}, {world!r})")
    names, aliases, exact = [], {}, True
    pieces: dict[str, list] = {}
    unplaced: dict[str, torch.Tensor] = {}
    for r, (m, t) in sorted(ranks.items()):
        placements = m["params"].get("placements") or {}
        get = tensor_lookup(t, step_dir / f"rank={r}", schema.BUNDLE_MANIFEST_FILE)
        exact = exact and bool(m["params"]["exact"])
        aliases.update(m["params"].get("aliases") or {})
        for n in m["params"]["names"]:
            if n not in pieces and n not in unplaced:
                names.append(n)
            if n in placements:
                pieces.setdefault(n, []).append((r, get("param", n), placements[n]))
            elif r == rank or n not in unplaced:
                unplaced[n] = get("param", n)  # replicated: this rank's copy
    both = sorted(set(pieces) & set(unplaced))
    if both:
        raise BundleError(f"step {step}: parameter {both[0]!r} is placed as a shard on some ranks and "
                          f"whole on others")
    params = {n: reassemble(n, pieces[n], step) if n in pieces else unplaced[n] for n in names}
    for alias, target in aliases.items():
        if target in params:
            params[alias] = params[target]
    bundle.params = params
    bundle.optimizer_state = _whole_optimizer_state(step_dir, step, rank, ranks)
    bundle.meta = dict(meta, params=dict(meta["params"], names=names, aliases=aliases, exact=exact))
    bundle.shard_ranks = sorted(ranks)
    return bundle


def _whole_optimizer_state(step_dir: Path, step: int, rank: int, ranks: dict) -> list:
    """Each (parameter, key) of the ranks' optimizer states once: a placed
    tensor reassembled like its parameter, anything else this rank's (or
    the lowest rank's that has it)."""
    from .shard_bundle import reassemble
    order, pieces, unplaced = [], {}, {}
    for r, (m, t) in sorted(ranks.items(), key=lambda kv: (kv[0] != rank, kv[0])):
        get = tensor_lookup(t, step_dir / f"rank={r}", schema.BUNDLE_MANIFEST_FILE)
        for e in ((m.get("optimizer") or {}).get("state") or []):
            key = (e["param"], e["key"])
            if key not in pieces and key not in unplaced:
                order.append(key)
            if e.get("placement"):
                if key in unplaced:
                    raise BundleError(f"step {step}: optimizer state {key[1]!r} of {key[0]!r} is placed as a "
                                      f"shard on some ranks and whole on others")
                pieces.setdefault(key, []).append((r, get("optimizer_state", e["tensor"]), e["placement"]))
            elif key not in unplaced:
                if key in pieces:
                    raise BundleError(f"step {step}: optimizer state {key[1]!r} of {key[0]!r} is placed as a "
                                      f"shard on some ranks and whole on others")
                unplaced[key] = get("optimizer_state", e["tensor"]) if e.get("tensor") else e.get("value")
    return [(n, k, reassemble(f"{n}:{k}", pieces[(n, k)], step) if (n, k) in pieces else unplaced[(n, k)])
            for n, k in order]


def _read_meta(meta_path: Path, root: Path) -> dict:
    return read_versioned_meta(meta_path, root, format_name=schema.BUNDLE_FORMAT_NAME,
                               version=schema.BUNDLE_SCHEMA_VERSION, word="bundle", model=BundleMeta)


def read_versioned_meta(meta_path: Path, root: Path, *, format_name: str, version: str, word: str, model) -> dict:
    """The JSON that describes a bundle or a window (`word`), read within
    the limits, its format name, major version and checksum checked, and
    validated by its `model`."""
    data = read_bytes(meta_path, root, BundleError, limits.MAX_JSON_BYTES)
    try:
        meta = parse_json(data, meta_path, BundleError)
    except Damaged as exc:
        raise BundleError(f"{meta_path} is truncated or not JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != format_name:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise BundleError(f"{meta_path}: format {fmt!r} is not {format_name!r}")
    found = str(meta.get("version"))
    try:
        major, _ = schema.parse_version(found)
    except ValueError:
        raise BundleError(f"{meta_path}: bad {word} version {found!r}") from None
    if major > schema.parse_version(version)[0]:
        raise BundleError(f"{meta_path}: {word} format {found} is newer than this amp-postmortem "
                          f"reads ({version}); upgrade amp-postmortem")
    if meta.get("checksum") != json_checksum(meta):
        raise BundleError(f"{meta_path} fails its checksum (edited or damaged)")
    return validate(model, meta, meta_path, BundleError)


def _check_place(path: Path, meta_path: Path, meta: dict) -> None:
    """A bundle inside a run (`bundles/step=N/rank=R`) must say the step,
    rank and run id of its place: a replay of another step's data under
    this step's name would be a wrong answer without a word."""
    if path.parent.parent.name != schema.BUNDLES_DIR:
        return  # a bundle copied out of its run: nothing to compare with
    run = path.parent.parent.parent
    for key, place in (("step", step_of(path.parent.name, path.parent, BundleError)),
                       ("rank", rank_of(path.name, path, BundleError))):
        if place is not None and meta[key] != place:
            raise BundleError(f"{shown(meta_path)}: {key}: {meta[key]!r} is not the {key} of its place "
                              f"({shown(path.relative_to(run))}: {key} {place})")
    check_run_id(run, meta_path, meta, "bundle")


def check_run_id(run: Path, meta_path: Path, meta: dict, word: str) -> None:
    """A bundle or window (`word`) inside `run` must name the run's id when
    both say one: another run's data under this run's name would be a
    wrong answer without a word."""
    manifest = run / schema.MANIFEST_FILE
    if not (manifest.exists() or os.path.lexists(manifest)):
        return
    from .loader import read_manifest
    try:
        run_id = read_manifest(manifest, run).get("run_id")
    except PostmortemError as exc:
        raise BundleError(str(exc)) from None
    if run_id is not None and meta.get("run_id") is not None and meta["run_id"] != run_id:
        raise BundleError(f"{shown(meta_path)}: run_id: {meta['run_id']!r} is not the run's "
                          f"({run_id!r} in {shown(manifest)}); a {word} of another run was put here")


def _check_files(path: Path, meta: dict, listed: str = schema.BUNDLE_TENSORS_FILE) -> None:
    files = meta.get("files")
    if not isinstance(files, dict) or listed not in files:
        raise BundleError(f"{path}: its manifest lists no {listed}")
    for name, info in files.items():
        f = path / name
        # A plain name in the bundle directory: no path, no hidden name.
        if name != Path(name).name or name.startswith(".") or "\\" in name:
            raise BundleError(f"{path}: bundle.json: files: names a file outside the bundle: {name!r} "
                              f"(valid: a file name inside the bundle directory)")
        if not (f.exists() or os.path.lexists(f)):
            raise BundleError(f"{path}: {name} is missing")
        with open_regular(f, path, BundleError) as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < info["bytes"]:
                raise BundleError(f"{path}: {name} is truncated ({size} of {info['bytes']} bytes)")
            try:
                digest = _sha256(fh) if size == info["bytes"] else None
            except OSError as exc:  # e.g. no permission: the user's to fix
                raise BundleError(f"cannot read {f} ({type(exc).__name__}: {exc.strerror or exc})") from None
        if digest != info["sha256"]:
            raise BundleError(f"{path}: {name} fails its sha256 check (tampered with or damaged)")


def _sha256(f) -> str:
    """sha256 of an open file's bytes (`recorders.format.plain.file_sha256`'s rule)."""
    h = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 22), b""):
        h.update(block)
    return h.hexdigest()


_INDEX_COLUMNS = [c.name for c in schema.BUNDLE_TENSOR_COLUMNS if c.name != "data"]


def read_tensor_file(file: Path, root: Path | None = None, roles=schema.BUNDLE_ROLES) -> dict:
    """`_read_tensors` for another file kind of the same columns (a
    counterfactual window: `roles` = `schema.WINDOW_ROLES`)."""
    fh = open_regular(file, root, BundleError)
    try:
        proc = f"/proc/self/fd/{fh.fileno()}"
        return _read_tensor_rows(file, proc if os.path.exists(proc) else str(file), roles)
    finally:
        fh.close()


def check_files(path: Path, meta: dict, listed: str = schema.BUNDLE_TENSORS_FILE) -> None:
    """Every file `meta["files"]` lists is present, complete and matches
    its sha256 (bundles and windows alike)."""
    _check_files(path, meta, listed)


def _read_tensors(file: Path, root: Path | None = None) -> dict:
    """{(role, name, micro_batch): tensor} from tensors.parquet. Sizes are
    checked before the raw bytes are decompressed: every shape against the
    element limit, and each row group's decompressed `data` (Parquet
    metadata) against what its rows' shapes and dtypes declare, so a small
    file cannot inflate into gigabytes."""
    fh = open_regular(file, root, BundleError)
    try:
        # pyarrow reads the descriptor that was checked (on Linux, through
        # /proc: no second lookup of the name); a Python file object would
        # be read from pyarrow's threads, which can abort at exit.
        proc = f"/proc/self/fd/{fh.fileno()}"
        return _read_tensor_rows(file, proc if os.path.exists(proc) else str(file))
    finally:
        fh.close()


def _read_tensor_rows(file: Path, source: str, roles=schema.BUNDLE_ROLES) -> dict:
    try:
        pf = pq.ParquetFile(source)
        got = pf.schema_arrow
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds
        raise BundleError(f"{file} is not readable Parquet: {exc}") from None
    for c in schema.BUNDLE_TENSOR_COLUMNS:
        if c.name not in got.names or got.field(c.name).type != c.type:
            raise BundleError(f"{file}: column {c.name!r} missing or not {c.type}")
    md = pf.metadata
    names = [md.schema.column(i).path.split(".")[0] for i in range(md.num_columns)]
    data_bytes, index_bytes = [], 0
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        sizes = [(names[i], rg.column(i).total_uncompressed_size) for i in range(rg.num_columns)]
        data_bytes.append(sum(n for c, n in sizes if c == "data"))
        index_bytes += sum(n for c, n in sizes if c != "data")
    if index_bytes > limits.MAX_BUNDLE_INDEX_BYTES:
        raise BundleError(f"{file}: names, dtypes and shapes decompress to {index_bytes} bytes, more than "
                          f"the {limits.MAX_BUNDLE_INDEX_BYTES} a bundle may have")
    try:
        table = pf.read(columns=_INDEX_COLUMNS)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds
        raise BundleError(f"{file} is not readable Parquet: {exc}") from None
    for n in table.column_names:
        if table.column(n).null_count:
            raise BundleError(f"{file}: column {n!r} holds nulls (valid: a value in every row)")
    cols = {n: table.column(n).to_pylist() for n in table.column_names}
    _check_sizes(file, cols, data_bytes, [md.row_group(g).num_rows for g in range(md.num_row_groups)])
    try:
        data_col = pf.read(columns=["data"]).column("data")
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds
        raise BundleError(f"{file} is not readable Parquet: {exc}") from None
    chunks: dict[tuple, list] = {}
    for i, key in enumerate(zip(cols["role"], cols["name"], cols["micro_batch"])):
        chunks.setdefault(key, []).append(i)
    out = {}
    for key, rows in chunks.items():
        role, name, _ = key
        if role not in roles:
            continue  # a newer minor version's role: ignored
        rows.sort(key=lambda i: cols["offset"][i])
        parts, pos = [], 0
        for i in rows:
            if cols["offset"][i] != pos:
                raise BundleError(f"{file}: tensor {role} {name!r} has a gap or overlap at byte {pos}")
            part = data_col[i].as_py()
            parts.append(part)
            pos += len(part)
        first = rows[0]
        try:
            t = tensor_from_bytes(parts[0] if len(parts) == 1 else b"".join(parts),
                                  cols["dtype"][first], cols["shape"][first])
        except ValueError as exc:
            raise BundleError(f"{file}: tensor {role} {name!r}: {exc}") from None
        if role == "input" and cols["requires_grad"][first] and t.is_floating_point():
            t.requires_grad_(True)
        out[key] = t
    return out


def _check_sizes(file: Path, cols: dict, data_bytes: list[int], group_rows: list[int]) -> None:
    """Every row's declared tensor (dtype, shape) within the limits, and each
    row group's decompressed raw bytes no more than its rows can hold (a
    row holds at most its tensor's bytes from its offset on)."""
    declared: dict[tuple, int] = {}
    row_room, sizes = [], {}
    for i, (role, name, mb, dtype, shape, offset) in enumerate(zip(
            cols["role"], cols["name"], cols["micro_batch"], cols["dtype"], cols["shape"], cols["offset"])):
        where = f"{shown(file)}: tensor {role} {name!r}"
        if dtype not in sizes:
            try:
                sizes[dtype] = itemsize(parse_dtype(dtype))
            except ValueError as exc:
                raise BundleError(f"{where}: dtype: {exc}") from None
        size = sizes[dtype]
        if any(d is None or d < 0 for d in shape):
            raise BundleError(f"{where}: shape: negative dimension in {shape} (valid: sizes >= 0)")
        numel = math.prod(shape)  # a Python int: never wraps round like an int64 product
        if numel > limits.MAX_TENSOR_ELEMENTS:
            raise BundleError(f"{where}: shape: {numel} elements, more than the {limits.MAX_TENSOR_ELEMENTS} "
                              f"a bundle tensor may have")
        nbytes = numel * size
        if not 0 <= offset <= max(nbytes - 1, 0):
            raise BundleError(f"{where}: offset: {offset} is outside its {nbytes} bytes")
        declared[(role, name, mb)] = nbytes
        row_room.append(nbytes - offset)
    total = sum(declared.values())
    if total > limits.MAX_BUNDLE_BYTES:
        raise BundleError(f"{shown(file)}: its tensors declare {total} bytes, more than the "
                          f"{limits.MAX_BUNDLE_BYTES} a bundle may have")
    start = 0
    for g, (got, rows) in enumerate(zip(data_bytes, group_rows)):
        room = sum(row_room[start:start + rows])
        start += rows
        allowed = room + rows * limits.PARQUET_SLACK_PER_ROW + limits.PARQUET_SLACK_BYTES
        if got > allowed:
            raise BundleError(f"{shown(file)}: data: row group {g} decompresses to {got} bytes, more than "
                              f"the {room} bytes its rows' dtypes and shapes declare")


def tensor_lookup(tensors: dict, path: Path, described_by: str):
    """`get(role, name, micro_batch=-1)`: a tensor `described_by` (the JSON
    file's name) refers to, or a BundleError naming what is missing."""
    def get(role, name, mb=-1):
        try:
            return tensors[(role, name, mb)]
        except KeyError:
            raise BundleError(f"{path}: {described_by} refers to a missing {role} tensor {name!r}"
                              + (f" of micro-batch {mb}" if mb >= 0 else "")) from None
    return get


def weights_of(meta: dict, get) -> tuple[dict, dict, dict]:
    """(params with tied aliases, persistent buffers, non-persistent buffers)."""
    params = {n: get("param", n) for n in meta["params"]["names"]}
    for alias, target in meta["params"].get("aliases", {}).items():
        params[alias] = params[target]
    non_persistent = set(meta["buffers"].get("non_persistent", []))
    buffers, extra = {}, {}
    for n in meta["buffers"]["names"]:
        (extra if n in non_persistent else buffers)[n] = get("buffer", n)
    return params, buffers, extra


def optimizer_state_of(meta: dict, get) -> list:
    """[(param name, key, Tensor or plain value)] of `optimizer.state`."""
    return [(e["param"], e["key"], get("optimizer_state", e["tensor"]) if e.get("tensor") else e.get("value"))
            for e in ((meta.get("optimizer") or {}).get("state") or [])]


def micro_batch_of(mb: dict, k: int, get) -> tuple[tuple, dict]:
    """Micro-batch `k`'s ((args, kwargs), {"cpu": ..., "cuda": [...]} RNG states)."""
    lookup = (lambda name: get("input", name, k))
    call = (tuple(decode_tree(mb["args"], lookup)), dict(decode_tree(mb["kwargs"], lookup)))
    rng = {"cpu": get("rng", mb["rng"]["cpu"], k), "cuda": [get("rng", n, k) for n in mb["rng"].get("cuda", [])]}
    return call, rng


def _assemble(path: Path, meta: dict, tensors: dict) -> Bundle:
    get = tensor_lookup(tensors, path, schema.BUNDLE_MANIFEST_FILE)
    params, buffers, extra = weights_of(meta, get)
    scale = meta.get("loss_scale")
    scaled = bool(meta.get("grad_outputs_scaled")) and scale not in (None, 0)
    inputs, grads, raw, rngs = [], [], [], []
    for k, mb in enumerate(meta["micro_batches"]):
        call, rng = micro_batch_of(mb, k, get)
        inputs.append(call)
        rngs.append(rng)
        g_raw = [None if n is None else get("grad_output", n, k) for n in mb["grad_outputs"]]
        raw.append(g_raw)
        # float64 holds every float16/bfloat16/float32 value exactly, and a
        # power-of-two scale divides out exactly.
        grads.append([None if g is None else (g.double() / scale if scaled else g.double()) for g in g_raw])
    return Bundle(
        path=str(path), step=int(meta["step"]), rank=int(meta["rank"]),
        params=params, buffers=buffers, inputs=inputs, grad_outputs=grads,
        loss=meta.get("loss"), loss_scale=scale,
        autocast=meta.get("autocast") or {"enabled": False, "device_type": None, "dtype": None},
        precision_flags=meta.get("precision_flags") or {}, scaler=meta.get("scaler"),
        rng=rngs[0] if rngs else {"cpu": None, "cuda": []},
        model_class=meta["model_class"], optimizer=meta.get("optimizer"), env=meta.get("env") or {},
        reason=meta["reason"], meta=meta, grad_outputs_raw=raw, micro_batch_rng=rngs,
        extra_buffers=extra, reasons=list(meta.get("reasons") or [meta["reason"]]),
        optimizer_state=optimizer_state_of(meta, get),
    )


def autocast_dtype(bundle: Bundle) -> torch.dtype | None:
    """The recorded autocast dtype as a torch dtype (None when off)."""
    name = (bundle.autocast or {}).get("dtype")
    return parse_dtype(name) if name else None
