"""diffusers' ``WanTransformer3DModel`` as the model of ditscale's training helpers
(``ditscale.models.training``, ``--model-impl diffusers``): built from a :class:`WanConfig`
(random weights) or loaded from a local checkpoint folder (``checkpoint_config`` / ``load``),
float32 modules split out for FSDP (``fp32_split``), and called with a MicroBatch's tensors
(``forward``: ``x_t [B, C, F, H, W]``, ``t [B]``, ``text [B, L, text_dim]`` -> the velocity).

The config mapping, the equivalence with WanDiT, the checkpoint rules and the precision split:
docs/diffusers/training.md ("The diffusers Wan model of the training helpers").
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .wan_dit import WanConfig, make_config

CLASS_NAME = "WanTransformer3DModel"
CONFIG_FILE = "config.json"
WEIGHT_FILES = ("diffusion_pytorch_model.safetensors",
                "diffusion_pytorch_model.safetensors.index.json",
                "diffusion_pytorch_model.bin", "diffusion_pytorch_model.bin.index.json")
ROPE_THETA = 10000.0  # diffusers' WanRotaryPosEmbed default, not a config field
PATCH = (1, 2, 2)  # the patch the manifest's training shapes are tokenised with


def _transformer_class():
    try:
        from diffusers import WanTransformer3DModel
    except ImportError as e:
        raise ImportError(f"--model-impl diffusers needs the diffusers package with "
                          f"{CLASS_NAME} (the pinned version: tools/setup_debian.sh): {e}") from e
    return WanTransformer3DModel


def diffusers_config(cfg: WanConfig) -> Dict:
    """The ``WanTransformer3DModel`` constructor arguments of ``cfg`` (see the module)."""
    if cfg.rope_theta != ROPE_THETA:
        raise ValueError(f"cfg.rope_theta: {cfg.rope_theta} is not diffusers' {ROPE_THETA} "
                         f"(WanRotaryPosEmbed has no theta option)")
    return dict(patch_size=tuple(cfg.patch), num_attention_heads=cfg.num_heads,
                attention_head_dim=cfg.head_dim, in_channels=cfg.in_channels,
                out_channels=cfg.out_channels, text_dim=cfg.text_dim, freq_dim=cfg.freq_dim,
                ffn_dim=cfg.ffn_dim, num_layers=cfg.num_layers, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=cfg.eps, image_dim=None,
                added_kv_proj_dim=None)


# ---- checkpoints --------------------------------------------------------------------------------

def _read_checkpoint(folder: str) -> Dict:
    """The checkpoint's config.json merged over the constructor's defaults, after checking that
    ``folder`` is a WanTransformer3DModel folder with a weights file."""
    where = f"--weights: folder {folder!r}"
    if not os.path.isdir(folder):
        raise ValueError(f"{where} does not exist or is not a folder")
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(path):
        hint = (f"; its transformer is in {os.path.join(folder, 'transformer')!r}"
                if os.path.isfile(os.path.join(folder, "transformer", CONFIG_FILE)) else "")
        raise ValueError(f"{where} has no {CONFIG_FILE} (not a diffusers model folder){hint}")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot read {CONFIG_FILE}: {e}") from e
    if not isinstance(raw, dict) or raw.get("_class_name") != CLASS_NAME:
        got = raw.get("_class_name") if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"{where} holds a {got!r}, not a {CLASS_NAME} ({CONFIG_FILE} "
                         f"_class_name)")
    if not any(os.path.isfile(os.path.join(folder, w)) for w in WEIGHT_FILES):
        raise ValueError(f"{where} has no weights file: expected {WEIGHT_FILES[0]} (or "
                         f"{', '.join(WEIGHT_FILES[1:])})")
    params = inspect.signature(_transformer_class().__init__).parameters
    merged = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    merged.update({k: v for k, v in raw.items() if not k.startswith("_")})
    return merged


def _check_trainable(where: str, c: Dict) -> None:
    """The checkpoint fits the loop's text-to-video synthetic data (see the module)."""
    out_ch = c.get("out_channels") or c["in_channels"]
    if out_ch != c["in_channels"]:
        raise ValueError(f"{where}: out_channels {out_ch} != in_channels {c['in_channels']} "
                         f"(an image-to-video checkpoint; only text-to-video trains here)")
    for field in ("image_dim", "added_kv_proj_dim"):
        if c.get(field) is not None:
            raise ValueError(f"{where}: {field} is {c[field]} (image conditioning); only "
                             f"text-to-video checkpoints (null) train here")
    if tuple(c["patch_size"]) != PATCH:
        raise ValueError(f"{where}: patch_size {list(c['patch_size'])} is not {list(PATCH)} "
                         f"(the manifest's shapes are Wan 2.1 latents patchified 1x2x2)")


def checkpoint_config(folder: str, base: WanConfig, num_layers: Optional[int] = None) -> WanConfig:
    """The WanConfig of the checkpoint in ``folder``: its dimensions, with ``base``'s text_len
    (the padded prompt length, not a model field). ``num_layers``, when given, must equal the
    checkpoint's (a checkpoint's blocks are not dropped silently)."""
    where = f"--weights: folder {folder!r}"
    c = _read_checkpoint(folder)
    _check_trainable(where, c)
    if num_layers is not None and num_layers != c["num_layers"]:
        raise ValueError(f"{where} has {c['num_layers']} blocks; --num-layers {num_layers} "
                         f"differs (leave it out with --weights)")
    heads, head_dim = int(c["num_attention_heads"]), int(c["attention_head_dim"])
    cfg = make_config(base.name, int(c["num_layers"]), dim=heads * head_dim, num_heads=heads,
                      ffn_dim=int(c["ffn_dim"]),
                      in_channels=int(c["in_channels"]), out_channels=int(c["in_channels"]),
                      patch=PATCH, text_dim=int(c["text_dim"]), freq_dim=int(c["freq_dim"]),
                      eps=float(c["eps"]))
    return dataclasses.replace(cfg, name=f"diffusers:{os.path.basename(os.path.normpath(folder))}")


def _weight_files(folder: str) -> List[str]:
    """The checkpoint's weight files: the first of WEIGHT_FILES present; an index lists its
    shards (each must exist)."""
    where = f"--weights: folder {folder!r}"
    name = next(w for w in WEIGHT_FILES if os.path.isfile(os.path.join(folder, w)))
    if not name.endswith(".index.json"):
        return [os.path.join(folder, name)]
    try:
        with open(os.path.join(folder, name)) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{where}: cannot read the shard list of {name}: {e!r}") from e
    for shard in shards:
        if not os.path.isfile(os.path.join(folder, shard)):
            raise ValueError(f"{where}: {name} lists {shard!r}, which is missing")
    return [os.path.join(folder, shard) for shard in shards]


def _read_state_dict(folder: str, device: torch.device) -> Dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's weight files, read onto ``device`` in its stored dtype."""
    state: Dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        try:
            if path.endswith(".safetensors"):
                from safetensors.torch import load_file

                part = load_file(path, device=str(device))
            else:
                part = torch.load(path, map_location=device, weights_only=True)
        except Exception as e:  # noqa: BLE001  (a corrupt file: name it)
            raise ValueError(f"--weights: cannot read {path!r}: {e}") from e
        state.update(part)
    return state


def load(folder: str, cfg: WanConfig, device: torch.device) -> nn.Module:
    """The checkpoint in ``folder`` as a float32 model on ``device`` in training mode; its
    dimensions must be ``cfg``'s (``checkpoint_config(folder, ...)``).

    The model is built from the folder's config.json (``from_config``) and its weights copied
    in (upcast to float32), every parameter and persistent buffer of the model required and
    nothing else allowed: what ``from_pretrained(local_files_only=True,
    torch_dtype=torch.float32)`` loads, without its dependency on ``accelerate`` (which
    WanTransformer3DModel's float32 modules make mandatory there)."""
    where = f"--weights: folder {folder!r}"
    c = _read_checkpoint(folder)
    _check_trainable(where, c)
    with open(os.path.join(folder, CONFIG_FILE)) as f:
        raw = json.load(f)
    want = diffusers_config(cfg)
    for k in ("num_attention_heads", "attention_head_dim", "ffn_dim", "num_layers", "in_channels",
              "text_dim", "freq_dim"):
        if c[k] != want[k]:
            raise ValueError(f"{where}: {k} {c[k]} differs from the training config's "
                             f"{want[k]} (build the config with checkpoint_config)")
    with torch.device(device):
        model = _transformer_class().from_config(raw)
    state = _read_state_dict(folder, device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{where}: the weights do not match its config: {len(missing)} "
                         f"missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
                         f", {len(unexpected)} unexpected ({', '.join(unexpected[:3])}"
                         f"{', ...' if len(unexpected) > 3 else ''})")
    return model.train()


# ---- building -----------------------------------------------------------------------------------

def build(cfg: WanConfig, device: torch.device, *, seed: int = 0, weights: Optional[str] = None,
          fused_adaln: bool = False) -> nn.Module:
    """A float32 WanTransformer3DModel on ``device``: random weights from ``seed`` or the
    checkpoint ``weights``; with ``fused_adaln`` its blocks go through
    ``ditscale.diffusers.apply_fused_adaln`` (before any sharding: it patches the blocks of
    diffusers' exact class)."""
    if weights is None:
        cls = _transformer_class()
        torch.manual_seed(seed)
        with torch.device(device):
            model = cls(**diffusers_config(cfg))
        model.train()
    else:
        model = load(weights, cfg, device)
    if fused_adaln:
        fused_adaln_function()(model)
    return model


def fused_adaln_function():
    """``ditscale.diffusers.apply_fused_adaln`` once its Wan module imports, else a RuntimeError
    that says so (train with --no-fused-adaln meanwhile)."""
    try:
        import ditscale.diffusers.adaln_wan  # noqa: F401  (the Wan patch the dispatcher loads)
        from ditscale.diffusers import apply_fused_adaln
    except ImportError as e:
        raise RuntimeError(f"fused AdaLN for the diffusers {CLASS_NAME} needs "
                           f"ditscale.diffusers.apply_fused_adaln (python/ditscale/diffusers/"
                           f"adaln_wan.py), which does not import: {e}; pass --no-fused-adaln"
                           ) from e
    return apply_fused_adaln


def fp32_split(model: nn.Module) -> Tuple[List[nn.Module], List[nn.Parameter]]:
    """(float32 FSDP units, replicated float32 parameters) of ``model`` (see the module): the
    outermost modules named in ``_keep_in_fp32_modules`` that hold parameters and are not in a
    block, and every other parameter whose name has a component in that list."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    units, unit_names = [], []
    for name, module in model.named_modules():
        if (not name or name.split(".")[-1] not in keep or name.startswith("blocks.")
                or any(name.startswith(u + ".") for u in unit_names)):
            continue
        if any(True for _ in module.parameters()):
            units.append(module)
            unit_names.append(name)
    in_units = {id(p) for m in units for p in m.parameters()}
    replicated = [p for n, p in model.named_parameters()
                  if keep & set(n.split(".")) and id(p) not in in_units]
    return units, replicated


def forward(model: nn.Module, x_t: torch.Tensor, t: torch.Tensor,
            text: torch.Tensor) -> torch.Tensor:
    """The predicted velocity of the diffusers model for one micro-batch (see the module)."""
    return model(hidden_states=x_t, timestep=t, encoder_hidden_states=text,
                 return_dict=False)[0]
