"""The one configuration of ditscale.sp: :class:`Config` (what a user chooses: strategy,
degrees, chunks, transport, comm_sms, topology), validated when made against the ranges that
C++ exports (``_core.sp_config_fields``); :func:`make_config`, the one path from ``config=`` and
keyword overrides to a Config, filling unset fields from the environment (read here and nowhere
else: docs/configuration.md); and the one text encoding of a Config (:func:`config_text`,
:func:`config_of_text`) that the custom op carries and C++ parses (ditscale/torch/sp_args.h).
Experiment variants of the runtime are not here: ditscale._experimental.sp_variants. No torch.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from .. import _core
from .._checks import check_choice, check_int

# The strategies, transports and integer ranges are C++'s (ditscale/torch/sp_args.h), exported by
# _core rather than copied here.
_FIELDS = _core.sp_config_fields()
STRATEGIES = tuple(_FIELDS["strategies"])
TRANSPORTS = tuple(_FIELDS["transports"])
RANGES: Dict[str, Tuple[int, int]] = {k: tuple(v) for k, v in _FIELDS["ranges"].items()}
DEFAULT_TOPOLOGY = "h200-local"

# Environment variables (overrides of fields left unset, i.e. None).
ENV_TOPOLOGY = "DITSCALE_SP_TOPOLOGY"
ENV_COMM_SMS = "DITSCALE_SP_COMM_SMS"


@dataclass(frozen=True)
class Config:
    """One sequence-parallel configuration. Fields (ranges checked when the Config is made; the
    integer ranges are RANGES, from C++):

    - ``strategy``: one of STRATEGIES, or ``"auto"`` (the planner chooses strategy, degrees,
      chunks and, with ``comm_sms`` None, comm_sms for the mesh and ``topology``).
    - ``ulysses_degree``, ``ring_degree``: [0, 65536]; 0 = the strategy's default.
    - ``chunks``: torus token chunks, [1, 4096]; None = 2 for torus, else 1. Torus only.
    - ``ulysses_chunks``: Ulysses head chunks, [1, 4096] (each chunk's all-to-all pipelined with
      the attention of the chunk before). Strategy ulysses only.
    - ``transport``: one of TRANSPORTS.
    - ``comm_sms``: SMs kept out of the compute stream's reach for communication kernels,
      [0, 4096]; None = the planner's choice under "auto", else $DITSCALE_SP_COMM_SMS or 0.
    - ``topology``: the cluster model of "auto", plan and predict (a preset name or a topology
      JSON file, without ';'); None = $DITSCALE_SP_TOPOLOGY or "h200-local".
    """

    strategy: str = "auto"
    ulysses_degree: int = 0
    ring_degree: int = 0
    chunks: Optional[int] = None
    ulysses_chunks: int = 1
    transport: str = "nccl"
    comm_sms: Optional[int] = None
    topology: Optional[str] = None

    def __post_init__(self):
        check_choice("strategy", self.strategy, STRATEGIES + ("auto",))
        for name, (lo, hi) in RANGES.items():
            value = getattr(self, name)
            if value is not None:
                check_int(name, value, lo, hi)
        check_choice("transport", self.transport, TRANSPORTS)
        if self.topology is not None and (not isinstance(self.topology, str) or
                                          not self.topology or ";" in self.topology):
            raise ValueError(f"topology: {self.topology!r} is not a preset name or a file "
                             f"(a path without ';')")
        self._check_applies()

    def _check_applies(self) -> None:
        """Fields that the strategy does not use are refused, naming the one to use."""
        if self.strategy == "auto":
            chosen = [f for f in ("ulysses_degree", "ring_degree") if getattr(self, f)]
            chosen += ["chunks"] if self.chunks is not None else []
            chosen += ["ulysses_chunks"] if self.ulysses_chunks != 1 else []
            if chosen:
                raise ValueError(f"{', '.join(chosen)}: chosen by the planner under "
                                 f"strategy='auto'; name a strategy to set them")
        if self.chunks is not None and self.chunks > 1 and self.strategy not in ("torus",):
            raise ValueError(f"chunks: {self.chunks} token chunks need strategy 'torus', not "
                             f"{self.strategy!r}" +
                             (" (ulysses head chunks: ulysses_chunks)"
                              if self.strategy == "ulysses" else ""))
        if self.ulysses_chunks > 1 and self.strategy != "ulysses":
            raise ValueError(f"ulysses_chunks: {self.ulysses_chunks} head chunks need strategy "
                             f"'ulysses', not {self.strategy!r}")

    def replace(self, **fields) -> "Config":
        """A copy with ``fields`` changed (validated again)."""
        return dataclasses.replace(self, **fields)

    @property
    def torus_chunks(self) -> int:
        """The token chunks the schedule uses: ``chunks``, or 2 for torus and 1 otherwise."""
        if self.chunks is not None:
            return self.chunks
        return 2 if self.strategy == "torus" else 1

    @property
    def one_sided(self) -> bool:
        return self.transport != "nccl"


def make_config(where: str, config: Optional[Config] = None, **overrides) -> Config:
    """``config`` (default: Config()) with every override that is not None applied, and the
    unset fields that have an environment variable filled from it. Errors are ValueError or
    TypeError prefixed with ``where``, naming the field (or variable), the value and its range."""
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"{where}: config must be a ditscale.sp.Config, got "
                        f"{type(config).__name__}")
    fields = {k: v for k, v in overrides.items() if v is not None}
    try:
        cfg = dataclasses.replace(config or Config(), **fields)
        return _with_environment(cfg)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{where}: {e}") from None


def _env_text(name: str) -> Optional[str]:
    text = os.environ.get(name, "").strip()
    return text or None


def _env_int(name: str, lo: int, hi: int) -> Optional[int]:
    text = _env_text(name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"${name}: {text!r} is not an integer in [{lo}, {hi}]") from None
    return check_int(f"${name}", value, lo, hi)


def default_topology() -> str:
    """The cluster model of strategy="auto", plan() and predict() when no topology is given:
    $DITSCALE_SP_TOPOLOGY (a preset name or the topology JSON that ``bench/sp/calibrate.py fit``
    writes from measurements on this cluster), else the ``h200-local`` preset."""
    return _env_text(ENV_TOPOLOGY) or DEFAULT_TOPOLOGY


def _with_environment(cfg: Config) -> Config:
    """Fills the unset (None) fields from their environment variables, else their defaults;
    comm_sms stays None under strategy "auto" (the planner chooses it)."""
    fill = {}
    if cfg.topology is None:
        fill["topology"] = default_topology()
    if cfg.comm_sms is None and cfg.strategy != "auto":
        v = _env_int(ENV_COMM_SMS, *RANGES["comm_sms"])
        fill["comm_sms"] = 0 if v is None else v
    return dataclasses.replace(cfg, **fill) if fill else cfg


# The text encoding (ditscale/torch/sp_args.h): "key=value" joined by ';', every field of Config
# once; None (chunks, comm_sms under strategy "auto") is written as "auto".
_KEYS = tuple(f.name for f in dataclasses.fields(Config))
_TEXT_MEMO: Dict[str, Config] = {}


def config_text(cfg: Config) -> str:
    """``cfg`` as text: "strategy=torus;ulysses_degree=0;...;topology=h200-local". Chunks are
    written as the schedule uses them (:attr:`Config.torus_chunks`) once a strategy is named."""
    values = {k: getattr(cfg, k) for k in _KEYS}
    if cfg.strategy != "auto":
        values["chunks"] = cfg.torus_chunks
    return ";".join(f"{k}={'auto' if v is None else v}" for k, v in values.items())


def config_of_text(text: str) -> Config:
    """The Config of :func:`config_text`'s text (validated again; memoised)."""
    cfg = _TEXT_MEMO.get(text)
    if cfg is None:
        try:
            entries = dict(item.split("=", 1) for item in text.split(";"))
            if sorted(entries) != sorted(_KEYS):
                raise ValueError(f"keys {sorted(entries)} are not {sorted(_KEYS)}")
            cfg = Config(**{k: _value_of_text(k, v) for k, v in entries.items()})
        except (ValueError, TypeError) as e:
            raise ValueError(f"config {text!r}: {e}") from None
        _TEXT_MEMO[text] = cfg
    return cfg


def _value_of_text(key: str, text: str):
    if key not in RANGES:
        return text
    if text == "auto" and key in ("chunks", "comm_sms"):
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{key}: {text!r} is not an integer") from None


def resolved_text(cfg: Config) -> str:
    """:func:`config_text` of a configuration the runtime can run: a strategy and comm_sms chosen
    (not "auto"; ``cfg`` from make_config, then the planner's choice)."""
    if cfg.strategy == "auto" or cfg.comm_sms is None:
        raise ValueError("the configuration has no strategy or comm_sms chosen yet")
    return config_text(cfg)
