"""Tensors and call arguments as plain bytes and JSON, without pickle.

Shared by the bundle writer (`recorders.bundles.directory`) and the bundle loader
(`amp_postmortem.reading.bundle`). A tensor travels as (dtype name, shape, raw
little-endian bytes of the contiguous tensor). Dtypes numpy lacks (bfloat16,
the float8 family) go through a same-width integer view, so every bit,
NaN payloads included, survives the round trip.

Call arguments (nested tuples, lists and dicts of tensors and plain values)
become a JSON tree whose tensor leaves name a tensor row; nothing in the tree
can name code to run.
"""
from __future__ import annotations

import math
import sys

import numpy as np
import torch

_NUMPY = {
    torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
    torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
    torch.uint8: np.uint8, torch.bool: np.bool_,
    torch.complex64: np.complex64, torch.complex128: np.complex128,
}
# Dtypes stored through a same-width integer view (numpy has no equivalent).
_VIEW = {torch.bfloat16: torch.int16}
for _name, _view in (("float8_e4m3fn", torch.uint8), ("float8_e5m2", torch.uint8),
                     ("float8_e4m3fnuz", torch.uint8), ("float8_e5m2fnuz", torch.uint8),
                     ("uint16", torch.int16), ("uint32", torch.int32), ("uint64", torch.int64)):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _VIEW[getattr(torch, _name)] = _view

SUPPORTED_DTYPES = {str(d).replace("torch.", ""): d for d in list(_NUMPY) + list(_VIEW)}

MAX_DEPTH = 16


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def parse_dtype(name: str) -> torch.dtype:
    try:
        return SUPPORTED_DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported tensor dtype {name!r} (valid: {', '.join(sorted(SUPPORTED_DTYPES))})") from None


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def host_array(t: torch.Tensor) -> np.ndarray:
    """The tensor's values as a flat little-endian uint8 numpy array (host copy)."""
    if t.layout != torch.strided or t.is_quantized:
        raise ValueError(f"cannot store a {t.layout} / quantized tensor")
    if t.dtype not in _NUMPY and t.dtype not in _VIEW:
        raise ValueError(f"cannot store a tensor of dtype {dtype_name(t.dtype)}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.resolve_conj().resolve_neg().contiguous()
    view = _VIEW.get(t.dtype)
    if view is not None:
        t = t.view(view)
    arr = t.numpy().reshape(-1)
    if sys.byteorder != "little" and arr.dtype.itemsize > 1:
        arr = arr.byteswap()
    return arr.view(np.uint8)


def tensor_from_bytes(data, dtype: str | torch.dtype, shape) -> torch.Tensor:
    """Rebuild a tensor from `host_array` bytes; raises ValueError when the
    byte count does not match the dtype and shape."""
    dt = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    shape = [int(s) for s in shape]
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    numel = math.prod(shape)  # a Python int: an int64 product would wrap round
    storage = _VIEW.get(dt, dt)
    np_dtype = np.dtype(_NUMPY[storage]).newbyteorder("<")
    if len(data) != numel * np_dtype.itemsize:
        raise ValueError(f"{len(data)} bytes for a {dtype_name(dt)} tensor of shape {shape} "
                         f"(expected {numel * np_dtype.itemsize})")
    arr = np.frombuffer(data, dtype=np_dtype).astype(np_dtype.newbyteorder("="), copy=True)
    t = torch.from_numpy(arr)
    if storage is not dt:
        t = t.view(dt)
    return t.reshape(shape)


# ------------------------------------------------------------ call arguments
def encode_inputs(args, kwargs) -> tuple[dict, list]:
    """One micro-batch's call arguments as a JSON spec (`{"args", "kwargs"}`)
    and the `(name, tensor)` list its tensor leaves name: one entry per
    tensor object, a repeated one referenced twice (a bundle's and a
    window's inputs)."""
    names: dict[int, str] = {}
    tensors: list = []

    def name_tensor(path, t):
        if id(t) not in names:
            names[id(t)] = path if path not in names.values() else f"{path}#{len(tensors)}"
            tensors.append((names[id(t)], t))
        return names[id(t)]

    spec = {"args": encode_tree(tuple(args), name_tensor, "args"),
            "kwargs": encode_tree(dict(kwargs or {}), name_tensor, "kwargs")}
    return spec, tensors


def encode_tree(obj, name_tensor, path: str = "", _depth: int = 0):
    """JSON tree of `obj`; each tensor leaf is replaced by
    `{"kind": "tensor", "name": name_tensor(path, tensor)}`."""
    if _depth > MAX_DEPTH:
        return {"kind": "unsupported", "type": "nesting deeper than %d" % MAX_DEPTH}
    sub = (lambda key: f"{path}.{key}" if path else str(key))
    if isinstance(obj, torch.Tensor):
        return {"kind": "tensor", "name": name_tensor(path, obj)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"kind": "value", "value": obj}
    if isinstance(obj, torch.dtype):
        return {"kind": "dtype", "value": dtype_name(obj)}
    if isinstance(obj, torch.device):
        return {"kind": "device", "value": str(obj)}
    if isinstance(obj, (tuple, list)):
        kind = "list" if isinstance(obj, list) else "tuple"
        node = {"kind": kind, "items": [encode_tree(v, name_tensor, sub(i), _depth + 1) for i, v in enumerate(obj)]}
        if kind == "tuple" and type(obj) is not tuple:
            node["type"] = f"{type(obj).__module__}.{type(obj).__qualname__}"  # informational
        return node
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not (k is None or isinstance(k, (bool, int, float, str))):
                return {"kind": "unsupported", "type": f"dict with a {type(k).__name__} key"}
            items.append([k, encode_tree(v, name_tensor, sub(k), _depth + 1)])
        return {"kind": "dict", "items": items}
    if hasattr(obj, "__dataclass_fields__"):
        fields = [[f, encode_tree(getattr(obj, f, None), name_tensor, sub(f), _depth + 1)]
                  for f in obj.__dataclass_fields__]
        return {"kind": "dict", "items": fields,
                "type": f"{type(obj).__module__}.{type(obj).__qualname__}"}
    return {"kind": "unsupported", "type": f"{type(obj).__module__}.{type(obj).__qualname__}"}


def decode_tree(node, tensor_by_name):
    """Inverse of `encode_tree`. Dataclasses come back as dicts (the loader
    imports no user code); unsupported leaves come back as None."""
    kind = node.get("kind") if isinstance(node, dict) else None
    if kind == "tensor":
        return tensor_by_name(node["name"])
    if kind == "value":
        return node.get("value")
    if kind == "dtype":
        return parse_dtype(node["value"])
    if kind == "device":
        return torch.device(node["value"])
    if kind == "list":
        return [decode_tree(v, tensor_by_name) for v in node["items"]]
    if kind == "tuple":
        return tuple(decode_tree(v, tensor_by_name) for v in node["items"])
    if kind == "dict":
        return {k: decode_tree(v, tensor_by_name) for k, v in node["items"]}
    if kind == "unsupported":
        return None
    raise ValueError(f"unknown argument node {node!r:.80}")


def clone_tree(obj, _depth: int = 0):
    """Copy of the tensors in plain tuples/lists/dicts (`clone_inputs=True`)."""
    if _depth > MAX_DEPTH:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if type(obj) is tuple:
        return tuple(clone_tree(v, _depth + 1) for v in obj)
    if type(obj) is list:
        return [clone_tree(v, _depth + 1) for v in obj]
    if type(obj) is dict:
        return {k: clone_tree(v, _depth + 1) for k, v in obj.items()}
    return obj
