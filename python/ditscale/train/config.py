"""The training run's configuration: one declarative table of fields, read from TOML and flags.

``FIELDS`` declares every field once (section, name, type, default, range or choices, help);
from it come the TOML reader (``[section]`` tables, top-level keys for section ``run``), the
command-line flags (``--name-with-dashes``, booleans as ``--x`` / ``--no-x``), the range checks
(``ditscale._checks``: ``"<name>: <value> is out of range [lo, hi]"``) and the table of
docs/train.md and examples/train.toml (``docgen``). Precedence: defaults < TOML file < flags.
See [docs/train.md](../../../docs/train.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._checks import INT64_MAX, check_int, check_real
from ..sp.grad import GRAD_STRATEGIES

SECTIONS = ("run", "data", "transformer", "objective", "optim", "checkpoint", "validation",
            "logging")


@dataclasses.dataclass(frozen=True)
class Field:
    """One field: ``kind`` is "int", "float", "bool", "str" or "choice"; ``lo``/``hi`` its range
    (numbers), ``choices`` (choice), ``required`` (no default: must be given)."""

    section: str
    name: str
    kind: str
    default: Any
    help: str
    lo: Optional[float] = None
    hi: Optional[float] = None
    choices: Tuple[str, ...] = ()
    required: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def range_text(self) -> str:
        if self.kind in ("int", "float"):
            return f"[{_num(self.lo)}, {_num(self.hi)}]"
        if self.kind == "choice":
            return " \\| ".join(self.choices)
        return "true \\| false" if self.kind == "bool" else "path / text"


def _num(v) -> str:
    return "2^63-1" if v == INT64_MAX else (f"{v:g}" if isinstance(v, float) else str(v))


def _f(section, name, kind, default, help, lo=None, hi=None, choices=(), required=False):
    return Field(section, name, kind, default, help, lo, hi, tuple(choices), required)


# What the backward of each sp_strategy keeps and moves (docs/sp.md, "Gradients").
SP_BACKWARD = {
    "ulysses": "its program transposed, keeping the head group's q, k, v over the sequence, "
               "output and LSE (dOut, then dQ, dK, dV all-to-all)",
    "ulysses-overlap": "as ulysses",
    "ring": "its own, keeping the rank's q, k, v, output rows and LSE; each of N steps sends "
            "a k, v block with its fp32 dK, dV accumulator (no head split)",
    "usp": "its own, keeping the head group's query rows, output, LSE and last k, v block "
           "(about the inputs' size; the all-to-alls transposed, the ring reversed)",
    "swiftfusion-tas": "as usp",
    "torus": "its program transposed, keeping the head group's query rows, output, LSE and "
             "k, v of the whole sequence (more than usp)",
    "auto": "that of the planner's choice per attention shape",
}

FIELDS: List[Field] = [
    _f("run", "store", "str", "", "latent store folder (python -m ditscale.prepare)",
       required=True),
    _f("run", "out", "str", "", "run folder: metrics.jsonl, tensorboard/, checkpoints/, "
       "validation/", required=True),
    _f("run", "model", "str", "wan2.1-1.3b", "WanTransformer3DModel: a preset (tiny, "
       "wan2.1-1.3b, wan2.1-14b; random weights) or a local diffusers model folder"),
    _f("run", "num_layers", "int", 0, "blocks of a preset (0: the preset's)", 0, 1000),
    _f("run", "steps", "int", 1000, "optimizer steps of the whole run", 1, 10**9),
    _f("run", "device", "choice", "auto", "auto: cuda when available (NCCL), else cpu (gloo)",
       choices=("auto", "cuda", "cpu")),
    _f("run", "dtype", "choice", "auto", "compute dtype (auto: bf16 on cuda, fp32 on cpu); "
       "master weights and optimizer state are fp32", choices=("auto", "bf16", "fp32")),
    _f("run", "seed", "int", 0, "weights of a preset, plan, noise and timesteps", 0, INT64_MAX),
    _f("run", "resume", "str", "auto", "auto: the latest checkpoint in OUT/checkpoints if any; "
       "never: start over (refused when OUT has checkpoints); or a checkpoint folder"),
    _f("run", "pg_timeout_s", "float", 600.0, "process-group timeout: a rank left alone in a "
       "collective fails after it", 1.0, 86400.0),
    _f("data", "policy", "choice", "balanced", "AdaptiveLoad policy of BalancedBatchSampler",
       choices=("equal-token", "adaptive", "balanced")),
    _f("data", "cost", "str", "", "cost-model JSON from `ditscale fit` (empty: the model's "
       "analytical cost)"),
    _f("data", "m_mem_tokens", "int", 0, "tokens per micro-batch M_mem (0: from the memory "
       "model and gpu_mem_gib)", 0, 2**50),
    _f("data", "gpu_mem_gib", "float", 80.0, "GPU memory the plan may use per rank", 0.001,
       1048576.0),
    _f("data", "tail", "choice", "drop", "the epoch's last step (see docs/balance.md)",
       choices=("drop", "pad", "keep")),
    _f("data", "num_workers", "int", 2, "DataLoader worker processes per rank", 0, 64),
    _f("data", "prefetch_factor", "int", 4, "micro-batches each worker loads ahead", 1, 64),
    _f("data", "pin_memory", "bool", True, "page-locked host batches (cuda only)"),
    _f("transformer", "fused_adaln", "bool", True, "ditscale's fused AdaLN in the blocks "
       "(ditscale.diffusers.apply_fused_adaln)"),
    _f("transformer", "activation_checkpointing", "choice", "off", "recompute blocks in the "
       "backward: off, full (every block), every (every k-th block, k = ac_every)",
       choices=("off", "full", "every")),
    _f("transformer", "ac_every", "int", 2, "k of activation_checkpointing = every", 1, 1000),
    _f("transformer", "sp_degree", "int", 1, "sequence parallelism: each sample's tokens "
       "split over sp_degree consecutive ranks (must divide the world size; data-parallel "
       "size = world / sp_degree; > 1 on CUDA: its attention tested with ranks sharing one "
       "GPU, not yet run on several GPUs)", 1, 64),
    _f("transformer", "sp_degrees", "str", "", "sequence parallelism per micro-batch: the "
       "degrees the balanced plan may give a micro-batch, e.g. 1,2,4 (powers of two in [1, 8] "
       "dividing the world size; a micro-batch of degree d runs on the aligned group of d "
       "ranks); empty: off; not with sp_degree > 1"),
    _f("transformer", "sp_strategy", "choice", "ulysses", "attention strategy of sp_degree > 1 "
       "within a group; its backward on CPU (gloo), nothing recomputed: " + "; ".join(
           f"{s}: {SP_BACKWARD[s]}" for s in GRAD_STRATEGIES) + ". On one machine usp is "
       "Ulysses over the group, swiftfusion-tas and torus a ring; a strategy whose Ulysses "
       "degree exceeds the model's heads on the groups is refused at start-up. On CUDA (NCCL) "
       "ulysses, ulysses-overlap (as ulysses), ring, usp and swiftfusion-tas train through "
       "PyTorch's point-to-point transfers with the LSE saved and nothing recomputed (cuDNN "
       "attention); torus recomputes the layer as Ulysses",
       choices=GRAD_STRATEGIES),
    _f("objective", "timestep_sampling", "choice", "uniform", "distribution of u in [0, 1] "
       "before the shift", choices=("uniform", "logit-normal")),
    _f("objective", "logit_mean", "float", 0.0, "logit-normal mean", -10.0, 10.0),
    _f("objective", "logit_std", "float", 1.0, "logit-normal standard deviation", 0.01, 10.0),
    _f("objective", "shift", "float", 5.0, "timestep shift s: sigma = s u / (1 + (s - 1) u) "
       "(Wan 2.1: 5; 1: none)", 0.01, 100.0),
    _f("optim", "lr", "float", 1e-4, "peak learning rate of AdamW", 0.0, 1.0),
    _f("optim", "beta1", "float", 0.9, "AdamW beta1", 0.0, 0.999999),
    _f("optim", "beta2", "float", 0.999, "AdamW beta2", 0.0, 0.999999),
    _f("optim", "adam_eps", "float", 1e-8, "AdamW epsilon", 1e-30, 1.0),
    _f("optim", "weight_decay", "float", 0.0, "AdamW decoupled weight decay", 0.0, 10.0),
    _f("optim", "warmup_steps", "int", 100, "linear warm-up from 0 to lr", 0, 10**9),
    _f("optim", "min_lr_ratio", "float", 0.0, "cosine decay ends at lr * min_lr_ratio at "
       "`steps`", 0.0, 1.0),
    _f("optim", "grad_clip", "float", 1.0, "max global gradient norm (0: no clipping)", 0.0,
       1e6),
    _f("optim", "ema_decay", "float", 0.0, "EMA of the weights (0: off; e.g. 0.999)", 0.0,
       0.999999),
    _f("checkpoint", "checkpoint_every", "int", 500, "steps between checkpoints (0: only at "
       "the end and at SIGTERM)", 0, 10**9),
    _f("checkpoint", "keep_checkpoints", "int", 3, "checkpoints kept (oldest removed)", 1, 1000),
    _f("validation", "validate_every", "int", 0, "steps between validations (0: off)", 0, 10**9),
    _f("validation", "validation_samples", "int", 2, "prompts: the text embeddings of store "
       "samples 0 .. n-1", 1, 64),
    _f("validation", "validation_seed", "int", 0, "seed of sample i is validation_seed + i", 0,
       2**62),
    _f("validation", "validation_steps", "int", 30, "denoising steps", 1, 1000),
    _f("validation", "validation_frames", "int", 17, "frames (4k + 1; 1: an image, PNG)", 1,
       1025),
    _f("validation", "validation_height", "int", 480, "height in pixels (multiple of 16)", 16,
       4096),
    _f("validation", "validation_width", "int", 832, "width in pixels (multiple of 16)", 16,
       4096),
    _f("validation", "validation_guidance", "float", 1.0, "classifier-free guidance (1: off; "
       "negative prompt: zero embeddings)", 1.0, 30.0),
    _f("validation", "validation_fps", "int", 16, "frame rate of the MP4", 1, 240),
    _f("logging", "tensorboard", "bool", True, "TensorBoard event files in OUT/tensorboard"),
    _f("logging", "progress", "bool", True, "progress bar on rank 0 (tqdm)"),
]
BY_NAME: Dict[str, Field] = {f.name: f for f in FIELDS}

TrainConfig = dataclasses.make_dataclass(
    "TrainConfig", [(f.name, Any, dataclasses.field(default=f.default)) for f in FIELDS],
    frozen=True)
TrainConfig.__doc__ = "A checked configuration: one attribute per field of FIELDS."


def check_value(field: Field, value, where: str = ""):
    """``value`` checked against ``field`` (type, range, choices); errors name the field."""
    name = where + field.name
    if field.kind == "int":
        return check_int(name, value, int(field.lo), int(field.hi))
    if field.kind == "float":
        if isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        return check_real(name, value, field.lo, field.hi)
    if field.kind == "bool":
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected true or false, got {value!r}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a string, got {type(value).__name__} {value!r}")
    if field.kind == "choice" and value not in field.choices:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(field.choices)}")
    return value


def read_toml(path: str) -> Dict[str, Any]:
    """The fields set in a TOML file: top-level keys of section ``run``, ``[section]`` tables
    for the others; an unknown key or table, or a key in the wrong table, is a ValueError."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"config {path!r}: cannot read: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config {path!r}: not valid TOML: {e}") from e
    out: Dict[str, Any] = {}
    for key, value in doc.items():
        section, items = ("run", {key: value}) if not isinstance(value, dict) else (key, value)
        if section not in SECTIONS or section == "run" and isinstance(value, dict):
            raise ValueError(f"config {path!r}: unknown table [{key}]; tables: "
                             f"{', '.join(SECTIONS[1:])}")
        for name, v in items.items():
            field = BY_NAME.get(name)
            if field is None or field.section != section:
                where = f"[{section}]" if section != "run" else "the top level"
                home = (f"[{field.section}]" if field and field.section != "run"
                        else "the top level")
                hint = f" (it belongs in {home})" if field else ""
                raise ValueError(f"config {path!r}: unknown key {name!r} in {where}{hint}")
            out[name] = check_value(field, v, f"config {path!r}: ")
    return out


def _parse_flag(field: Field):
    def parse(text: str):
        try:
            return int(text) if field.kind == "int" else float(text)
        except ValueError:
            kind = "an integer" if field.kind == "int" else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}")
    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m ditscale.train", description="Train a Wan DiT on a latent store "
        "(docs/train.md). Every field of the TOML config is also a flag; flags win.")
    ap.add_argument("--config", default=None, help="TOML file (examples/train.toml)")
    for f in FIELDS:
        text = f"[{f.section}] {f.help}; default {f.default!r}, range {f.range_text()}"
        text = text.replace("%", "%%").replace("\\|", "|")
        if f.kind == "bool":
            ap.add_argument(f.flag, dest=f.name, action=argparse.BooleanOptionalAction,
                            default=None, help=text)
        elif f.kind in ("int", "float"):
            ap.add_argument(f.flag, dest=f.name, type=_parse_flag(f), default=None, help=text)
        else:
            ap.add_argument(f.flag, dest=f.name, default=None, help=text)
    return ap


def load_config(argv: Optional[Sequence[str]] = None) -> TrainConfig:
    """Defaults < ``--config`` TOML < flags, every value checked; ValueError / TypeError name
    the field (argparse exits with status 2 on a flag it cannot parse)."""
    args = build_parser().parse_args(argv)
    values = {f.name: f.default for f in FIELDS}
    if args.config is not None:
        values.update(read_toml(args.config))
    for f in FIELDS:
        v = getattr(args, f.name)
        if v is not None:
            values[f.name] = check_value(f, v, "")
    return finish(values)


def finish(values: Dict[str, Any]) -> TrainConfig:
    """The checked TrainConfig of a full set of values (rules across fields included)."""
    for f in FIELDS:
        values[f.name] = check_value(f, values[f.name])
        if f.required and not values[f.name]:
            raise ValueError(f"{f.name}: required (flag {f.flag} or key {f.name!r} in "
                             f"{'the top level' if f.section == 'run' else f'[{f.section}]'} of "
                             f"the config)")
    v = values
    if (v["validation_frames"] - 1) % 4:
        raise ValueError(f"validation_frames: {v['validation_frames']} is not 4k + 1")
    for k in ("validation_height", "validation_width"):
        if v[k] % 16:
            raise ValueError(f"{k}: {v[k]} is not a multiple of 16")
    if v["sp_degrees"]:
        from .parallel_mixed import parse_degrees

        parse_degrees(v["sp_degrees"])
        if v["sp_degree"] > 1:
            raise ValueError(f"sp_degrees and sp_degree: give one of them (sp_degrees "
                             f"{v['sp_degrees']!r}: a degree per micro-batch; sp_degree "
                             f"{v['sp_degree']}: one degree for every sample)")
        if v["policy"] != "balanced":
            raise ValueError(f"sp_degrees: needs policy 'balanced' (got {v['policy']!r}): only "
                             f"the balanced plan gives micro-batches degrees")
    if v["resume"] not in ("auto", "never") and not os.path.isdir(v["resume"]):
        raise ValueError(f"resume: {v['resume']!r} is not a checkpoint folder (or auto, never)")
    return TrainConfig(**v)
