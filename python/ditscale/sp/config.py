"""The one configuration of ditscale.sp: :class:`Config`, validated when made, and the
environment variables that override its unset fields (read here and nowhere else; the table of
every DITSCALE_* variable is docs/configuration.md).

Every entry point (attention, plan, predict, describe, timeline, run_local, replay_compute)
takes ``config=`` and, for compatibility, the same fields as keyword overrides; :func:`make_config`
is the one code path that turns both into a Config. No torch needed.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Dict, Optional

from .._checks import check_int

STRATEGIES = ("ulysses", "ulysses-overlap", "ring", "usp", "swiftfusion-tas", "torus")
# nccl: Send/Recv everywhere; nvshmem: puts with signals on every link; nvshmem-intra: puts
# within machines, NCCL Send/Recv between them.
TRANSPORTS = ("nccl", "nvshmem", "nvshmem-intra")
# How one-sided transfers run (runtime::OneSidedEngine): auto = copy-engine.
ENGINES = ("auto", "copy-engine", "nvshmem")
# How the copy-engine engine signals: a stream write into the peer's word, or an 8-byte copy.
SIGNALS = ("write", "copy")

MAX_DEGREE = 65536  # ulysses_degree, ring_degree (ditscale/torch/sp_args.h: kMaxDegree)
MAX_CHUNKS = 4096  # chunks, ulysses_chunks (kMaxChunks)
MAX_COMM_SMS = 4096  # comm_sms (kMaxCommSms)
MAX_NET_CHANNELS = 64  # net_channels_per_peer
DEFAULT_TOPOLOGY = "h200-local"

# Environment variables (A/B overrides of fields left unset, i.e. None).
ENV_TOPOLOGY = "DITSCALE_SP_TOPOLOGY"
ENV_COMM_SMS = "DITSCALE_SP_COMM_SMS"
ENV_ENGINE = "DITSCALE_SP_ONE_SIDED_ENGINE"
ENV_SIGNAL = "DITSCALE_SP_CE_SIGNAL"
ENV_NET_CHANNELS = "DITSCALE_SP_NET_CHANNELS_PER_PEER"


def _choice(name: str, value, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(choices)}")
    return value


@dataclass(frozen=True)
class Config:
    """One sequence-parallel configuration. Fields (ranges checked when the Config is made):

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
      JSON file); None = $DITSCALE_SP_TOPOLOGY or "h200-local".
    - ``engine``: how one-sided transfers run, one of ENGINES; None =
      $DITSCALE_SP_ONE_SIDED_ENGINE or "auto" (copy engines).
    - ``signal``: the copy-engine engine's signals, one of SIGNALS; None = $DITSCALE_SP_CE_SIGNAL
      or "write".
    - ``net_channels_per_peer``: NCCL channels per peer of the inter-machine communicator,
      [0, 64], 0 = NCCL's choice; None = $DITSCALE_SP_NET_CHANNELS_PER_PEER or 0. Applies when
      a mesh's communicators are made (its first attention call).
    """

    strategy: str = "auto"
    ulysses_degree: int = 0
    ring_degree: int = 0
    chunks: Optional[int] = None
    ulysses_chunks: int = 1
    transport: str = "nccl"
    comm_sms: Optional[int] = None
    topology: Optional[str] = None
    engine: Optional[str] = None
    signal: Optional[str] = None
    net_channels_per_peer: Optional[int] = None

    def __post_init__(self):
        _choice("strategy", self.strategy, STRATEGIES + ("auto",))
        check_int("ulysses_degree", self.ulysses_degree, 0, MAX_DEGREE)
        check_int("ring_degree", self.ring_degree, 0, MAX_DEGREE)
        if self.chunks is not None:
            check_int("chunks", self.chunks, 1, MAX_CHUNKS)
        check_int("ulysses_chunks", self.ulysses_chunks, 1, MAX_CHUNKS)
        _choice("transport", self.transport, TRANSPORTS)
        if self.comm_sms is not None:
            check_int("comm_sms", self.comm_sms, 0, MAX_COMM_SMS)
        if self.topology is not None and (not isinstance(self.topology, str) or
                                          not self.topology):
            raise ValueError(f"topology: {self.topology!r} is not a preset name or a file")
        if self.engine is not None:
            _choice("engine", self.engine, ENGINES)
        if self.signal is not None:
            _choice("signal", self.signal, SIGNALS)
        if self.net_channels_per_peer is not None:
            check_int("net_channels_per_peer", self.net_channels_per_peer, 0, MAX_NET_CHANNELS)
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
    TypeError prefixed with ``where``, naming the field (or variable), the value and its range.

    Compatibility: ``chunks`` given for strategy "ulysses" is its head-chunk count (what it meant
    before ``ulysses_chunks``), unless ``ulysses_chunks`` is given too."""
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"{where}: config must be a ditscale.sp.Config, got "
                        f"{type(config).__name__}")
    fields = {k: v for k, v in overrides.items() if v is not None}
    base = config or Config()
    try:
        strategy = fields.get("strategy", base.strategy)
        if strategy == "ulysses" and "chunks" in fields and "ulysses_chunks" not in fields:
            fields["ulysses_chunks"] = fields.pop("chunks")
        cfg = dataclasses.replace(base, **fields)
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


def _env_choice(name: str, choices) -> Optional[str]:
    text = _env_text(name)
    return None if text is None else _choice(f"${name}", text, choices)


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
    if cfg.engine is None:
        fill["engine"] = _env_choice(ENV_ENGINE, ENGINES) or "auto"
    if cfg.signal is None:
        fill["signal"] = _env_choice(ENV_SIGNAL, SIGNALS) or "write"
    if cfg.net_channels_per_peer is None:
        v = _env_int(ENV_NET_CHANNELS, 0, MAX_NET_CHANNELS)
        fill["net_channels_per_peer"] = 0 if v is None else v
    if cfg.comm_sms is None and cfg.strategy != "auto":
        v = _env_int(ENV_COMM_SMS, 0, MAX_COMM_SMS)
        fill["comm_sms"] = 0 if v is None else v
    return dataclasses.replace(cfg, **fill) if fill else cfg


def op_fields(cfg: Config) -> Dict[str, str]:
    """The configuration as the torch ops of the GPU runtime take it (a str -> str dict parsed by
    ditscale/torch/sp_config_dict.h). ``cfg``: from make_config, with a strategy chosen."""
    if cfg.strategy == "auto" or cfg.comm_sms is None:
        raise ValueError("op_fields: the configuration has no strategy or comm_sms chosen yet")
    return {
        "strategy": cfg.strategy,
        "transport": cfg.transport,
        "ulysses_degree": str(cfg.ulysses_degree),
        "ring_degree": str(cfg.ring_degree),
        "chunks": str(cfg.torus_chunks),
        "ulysses_chunks": str(cfg.ulysses_chunks),
        "comm_sms": str(cfg.comm_sms),
        "engine": cfg.engine or "auto",
        "signal": cfg.signal or "write",
    }
