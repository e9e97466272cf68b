"""Loads a diffusers Flux transformer checkpoint (safetensors) into :class:`FluxMMDiT`.

    from ditscale.models import build_mmdit, make_mmdit_config
    from ditscale.models.flux_weights import load_diffusers_flux
    model = build_mmdit(make_mmdit_config("flux.1-dev"), device="cuda", dtype=torch.bfloat16,
                        seed=None)
    load_diffusers_flux(model, "/ckpt/FLUX.1-dev/transformer")   # or one .safetensors file

Strict (every header checked before any tensor is read, all problems in one error) and streamed
(tensor by tensor onto the model's device). Accepted paths and the checks: docs/models.md.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Tuple

import torch

__all__ = ["load_diffusers_flux", "FluxCheckpointError", "resolve_checkpoint_files"]

INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
SINGLE_NAME = "diffusion_pytorch_model.safetensors"


class FluxCheckpointError(ValueError):
    """A checkpoint that does not match the model (all problems listed in the message)."""


def _safetensors():
    try:
        import safetensors  # noqa: F401
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("load_diffusers_flux needs the `safetensors` package "
                          "(pip install safetensors)") from e
    return safe_open


def _read_index(index_path: str) -> List[str]:
    try:
        with open(index_path) as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise FluxCheckpointError(f"{index_path}: cannot read the index json: {e}") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FluxCheckpointError(f"{index_path}: field 'weight_map' (key -> shard file) is "
                                  "missing or empty")
    folder = os.path.dirname(os.path.abspath(index_path))
    files = []
    for shard in sorted(set(weight_map.values())):
        path = os.path.join(folder, shard)
        if not os.path.isfile(path):
            keys = sorted(k for k, v in weight_map.items() if v == shard)
            raise FluxCheckpointError(f"{index_path}: shard file {path} (for {len(keys)} keys, "
                                      f"e.g. {keys[0]!r}) does not exist")
        files.append(path)
    return files


def resolve_checkpoint_files(path_or_dir: str) -> List[str]:
    """The safetensors files of a checkpoint path (see the module docstring)."""
    path = os.fspath(path_or_dir)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, INDEX_NAME)):
            return _read_index(os.path.join(path, INDEX_NAME))
        if os.path.isfile(os.path.join(path, SINGLE_NAME)):
            return [os.path.join(path, SINGLE_NAME)]
        if os.path.isdir(os.path.join(path, "transformer")):
            return resolve_checkpoint_files(os.path.join(path, "transformer"))
        found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if len(found) == 1:
            return [os.path.join(path, found[0])]
        raise FluxCheckpointError(
            f"{path}: no {INDEX_NAME} or {SINGLE_NAME} (nor a transformer/ subfolder) and "
            f"{len(found)} .safetensors files; pass the file or the index json")
    if not os.path.isfile(path):
        raise FluxCheckpointError(f"{path}: no such file or folder")
    if path.endswith(".json"):
        return _read_index(path)
    return [path]


def _headers(files: List[str]) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """key -> (file, shape) from the safetensors headers (no tensor data read)."""
    safe_open = _safetensors()
    found: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
    duplicates = []
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    shape = tuple(f.get_slice(key).get_shape())
                    if key in found:
                        duplicates.append(f"  {key}: in {found[key][0]} and {path}")
                    found[key] = (path, shape)
        except Exception as e:  # safetensors raises its own error types
            raise FluxCheckpointError(f"{path}: not a readable safetensors file: {e}") from e
    if duplicates:
        raise FluxCheckpointError("keys present in more than one file:\n" + "\n".join(duplicates))
    return found


def load_diffusers_flux(model: torch.nn.Module, path_or_dir: str) -> Dict[str, int]:
    """Loads the checkpoint into ``model`` (a materialised FluxMMDiT) in place.

    Returns counts {"tensors", "files", "bytes"} of what was read. Raises FluxCheckpointError
    listing every missing key, unexpected key and shape mismatch, each with its file."""
    files = resolve_checkpoint_files(path_or_dir)
    found = _headers(files)
    params = model.state_dict(keep_vars=True)
    where = files[0] if len(files) == 1 else f"{path_or_dir} ({len(files)} files)"
    problems = []
    for key in params:
        if key not in found:
            problems.append(f"  missing key {key!r} {tuple(params[key].shape)}: not in {where}")
    for key, (path, shape) in sorted(found.items()):
        if key not in params:
            problems.append(f"  unexpected key {key!r} {shape} in {path}")
        elif shape != tuple(params[key].shape):
            problems.append(f"  shape mismatch for {key!r} in {path}: file {shape}, model "
                            f"{tuple(params[key].shape)}")
    if problems:
        hint = ""
        if any(k.startswith(("double_blocks.", "single_blocks.")) for k in found):
            hint = ("\n  (the keys look like the original Black Forest Labs layout; convert the "
                    "checkpoint to the diffusers layout, e.g. load it with diffusers' "
                    "FluxTransformer2DModel.from_single_file and save_pretrained)")
        raise FluxCheckpointError(f"checkpoint {path_or_dir} does not match the model "
                                  f"({len(problems)} problems):\n" + "\n".join(problems) + hint)

    any_param = next(iter(params.values()))
    if any_param.device.type == "meta":
        raise FluxCheckpointError("load_diffusers_flux: the model is on the meta device; build it "
                                  "with build_mmdit(..., seed=None) to materialise it first")
    safe_open = _safetensors()
    stats = {"tensors": 0, "files": len(files), "bytes": 0}
    by_file: Dict[str, List[str]] = {}
    for key, (path, _) in found.items():
        by_file.setdefault(path, []).append(key)
    with torch.no_grad():
        for path in files:
            device = str(any_param.device)
            with safe_open(path, framework="pt", device=device) as f:
                for key in by_file.get(path, []):
                    dst = params[key]
                    src = f.get_tensor(key)
                    if src.device != dst.device:  # parameters on several devices
                        src = src.to(dst.device)
                    dst.copy_(src)  # casts to the model's dtype
                    stats["tensors"] += 1
                    stats["bytes"] += src.numel() * src.element_size()
                    del src
    return stats
