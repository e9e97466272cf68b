"""A checkpoint folder's transformer and VAE configs, checked before any weight is allocated.

:func:`check_checkpoint` reads each component's ``config.json`` (at most :data:`MAX_CONFIG_BYTES`)
and checks every field against its class's table in ``checkpoint_ranges`` (type and range);
then it builds the model on the meta device (``accelerate.init_empty_weights``: no storage) to
count the bytes its parameters and buffers take in the requested dtype (``accelerate``'s
``compute_module_sizes``); other components (text encoders) count by their safetensors
headers. A checkpoint whose components together exceed the memory available (host RAM; on
CUDA also the device's free memory) is refused. Each error is a ValueError naming
the file, the field, the value and its range. ``tiny.load_pipeline`` calls it first; see
docs/diffusers/pipelines.md (local checkpoints).
"""

from __future__ import annotations

import json
import math
import os
from typing import Dict, Optional

import torch

from .._checks import check_int, check_real
from .checkpoint_ranges import COMPONENTS, RANGES, SCHEDULER, SUMS, Field

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few kB
MAX_STR = 64


def _fail_type(name: str, want: str, value) -> None:
    raise ValueError(f"{name}: expected {want}, got {type(value).__name__} {value!r:.80}")


def _check_scalar(name: str, kind: str, spec: Field, value) -> None:
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            _fail_type(name, f"an integer in [{spec.lo}, {spec.hi}]", value)
        check_int(name, value, spec.lo, spec.hi)
    elif kind == "real":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail_type(name, f"a number in [{spec.lo:g}, {spec.hi:g}]", value)
        check_real(name, value, spec.lo, spec.hi)
    elif kind == "bool":
        if not isinstance(value, bool):
            _fail_type(name, "true or false", value)
    elif not isinstance(value, str):
        _fail_type(name, "a string", value)
    elif spec.choices and value not in spec.choices:
        raise ValueError(f"{name}: {value!r:.80} is not one of {', '.join(spec.choices)}")
    elif len(value) > MAX_STR:
        raise ValueError(f"{name}: a string of {len(value)} characters is out of range "
                         f"[0, {MAX_STR}]")


def check_field(name: str, spec: Field, value) -> None:
    """``value`` (parsed JSON) fits ``spec``, else a ValueError naming ``name``, the value and
    the range."""
    if value is None:
        if not spec.null:
            raise ValueError(f"{name}: null is not allowed (give a value, or leave the field "
                             f"out for the class default)")
        return
    if not spec.kind.endswith("s"):
        _check_scalar(name, spec.kind, spec, value)
        return
    if not isinstance(value, list):
        _fail_type(name, f"a list of {spec.count[0]} to {spec.count[1]} {spec.kind}", value)
    lo, hi = spec.count
    if not lo <= len(value) <= hi:
        raise ValueError(f"{name}: a list of {len(value)} items is out of range [{lo}, {hi}]")
    for i, item in enumerate(value):
        _check_scalar(f"{name}[{i}]", spec.kind[:-1], spec, item)


def read_config(path: str) -> dict:
    """The JSON object in ``path`` (a ValueError naming it when missing, too large or not a
    JSON object)."""
    try:
        size = os.path.getsize(path)
        if size > MAX_CONFIG_BYTES:
            raise ValueError(f"{path}: {size} bytes is out of range [0, {MAX_CONFIG_BYTES}]")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON, UTF-8, digits
        raise ValueError(f"{path}: cannot read a JSON config: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def check_config(cls_name: str, config: dict, where: str, table=None) -> None:
    """Every constructor field of ``cls_name`` in ``config`` fits its range in ``table``
    (default ``RANGES[cls_name]``; fields the class does not take, such as ``_class_name``,
    are ignored, as diffusers ignores them)."""
    table = RANGES[cls_name] if table is None else table
    for key, value in config.items():
        if key in table:
            check_field(f"{where}: {key}", table[key], value)


def check_sums(cls_name: str, config: dict, where: str) -> None:
    """The :data:`SUMS` relation of ``cls_name`` holds (fields absent from ``config`` take the
    class defaults), else a ValueError naming both fields and their values."""
    if cls_name not in SUMS:
        return
    import inspect

    import diffusers

    defaults = inspect.signature(getattr(diffusers, cls_name).__init__).parameters
    parts, whole = SUMS[cls_name]
    axes = config.get(parts, defaults[parts].default)
    dim = config.get(whole, defaults[whole].default)
    if sum(axes) != dim:
        raise ValueError(f"{where}: {parts}: {list(axes)} sums to {sum(axes)}, not {whole} "
                         f"{dim} (the rotary axes split the head dimension)")


def model_bytes(cls_name: str, config: dict, dtype: torch.dtype, where: str) -> int:
    """The bytes of ``cls_name(**config)``'s parameters and buffers in ``dtype``, from a build on
    the meta device (a failing build: a ValueError naming ``where``)."""
    import diffusers
    from accelerate import init_empty_weights
    from accelerate.utils import compute_module_sizes

    try:
        with init_empty_weights(include_buffers=True):
            model = getattr(diffusers, cls_name).from_config(config)
    except Exception as e:  # the class's own consistency checks (any exception type)
        raise ValueError(f"{where}: diffusers cannot build a {cls_name} from it: "
                         f"{type(e).__name__}: {e}") from e
    return int(compute_module_sizes(model, dtype=dtype)[""])


def available_bytes(device) -> int:
    """Host memory available now, and on a CUDA ``device`` the smaller of it and the device's
    free memory (``from_pretrained`` loads on the host, then the pipeline moves)."""
    import psutil

    free = int(psutil.virtual_memory().available)
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free = min(free, int(torch.cuda.mem_get_info(device)[0]))
    return free


def files_bytes(folder: str, dtype: torch.dtype) -> int:
    """The bytes the weight files in ``folder`` take once loaded in ``dtype``: for safetensors
    files the element counts in their headers (floating tensors in ``dtype``, others as
    stored), for other weight files (``.bin``, ``.pt``) their size on disk. For components
    without a range table (text encoders)."""
    from safetensors import safe_open

    total = 0
    size = torch.empty((), dtype=dtype).element_size()
    for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        path = os.path.join(folder, entry)
        if entry.endswith(".safetensors"):
            try:
                with safe_open(path, "pt") as f:
                    for key in f.keys():
                        part = f.get_slice(key)
                        kind = getattr(torch, _SAFETENSORS_DTYPES.get(part.get_dtype(), "uint8"))
                        each = size if kind.is_floating_point else kind.itemsize
                        total += math.prod(part.get_shape()) * each
            except Exception as e:  # a damaged header: safetensors' own error types
                raise ValueError(f"{path}: cannot read its safetensors header: {e}") from e
        elif entry.endswith((".bin", ".pt", ".pth", ".ckpt")):
            total += os.path.getsize(path)
    return total


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                       "U8": "uint8", "BOOL": "bool"}


def _index_class(index: dict, key: str) -> Optional[str]:
    entry = index.get(key)
    if not isinstance(entry, (list, tuple)) or len(entry) != 2 or entry[1] is None:
        return None  # absent or saved as None: from_pretrained decides
    return str(entry[1])


def _component_bytes(name: str, weights_dir: str, index: dict, dtype) -> Dict[str, int]:
    """{component: bytes in ``dtype``} after each component's config is checked: the range
    tables and a meta build for the transformer(s) and VAE, :data:`SCHEDULER` for the
    scheduler, the weight files' headers for the rest."""
    sizes = {}
    for key, expected in COMPONENTS[name].items():
        cls_name = _index_class(index, key)
        if cls_name is None:
            continue
        path = os.path.join(weights_dir, key, "config.json")
        if cls_name != expected:
            raise ValueError(f"{os.path.join(weights_dir, 'model_index.json')}: {key}: "
                             f"{cls_name!r} is not {expected!r}, the {name} pipeline's {key}")
        config = read_config(path)
        check_config(cls_name, config, path)
        check_sums(cls_name, config, path)
        sizes[key] = model_bytes(cls_name, config, dtype, path)
    if _index_class(index, "scheduler"):
        path = os.path.join(weights_dir, "scheduler", "scheduler_config.json")
        check_config("scheduler", read_config(path), path, SCHEDULER)
    for key in index:  # text encoders and other components with weights
        if key not in COMPONENTS[name] and not key.startswith("_") and _index_class(index, key):
            size = files_bytes(os.path.join(weights_dir, key), dtype)
            if size:  # schedulers and tokenizers have no weights
                sizes[key] = size
    return sizes


def check_checkpoint(name: str, weights_dir: str, index: dict, dtype: torch.dtype = torch.float32,
                     device="cpu", memory_bytes: Optional[int] = None) -> Dict[str, int]:
    """Checks the components of the pipeline ``name``'s checkpoint folder ``weights_dir``
    (``index``: its parsed model_index.json) against ``checkpoint_ranges`` and their bytes in
    ``dtype`` together against ``memory_bytes`` (default :func:`available_bytes` of
    ``device``). Returns {component: bytes}; a ValueError names the file, field, value, range."""
    sizes = _component_bytes(name, weights_dir, index, dtype)
    limit = available_bytes(device) if memory_bytes is None else memory_bytes
    total = sum(sizes.values())
    if total > limit:
        parts = ", ".join(f"{k} {v / 2**30:.3g} GiB" for k, v in sizes.items())
        raise ValueError(f"{weights_dir}: its components take {total / 2**30:.3g} GiB in "
                         f"{str(dtype).replace('torch.', '')} ({parts}): out of range "
                         f"[0, {limit / 2**30:.3g}] GiB, the memory available"
                         + ("" if memory_bytes is not None else f" on {device}"))
    return sizes
