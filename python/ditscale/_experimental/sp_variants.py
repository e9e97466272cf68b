"""Variants of the GPU runtime of ditscale.sp for A/B runs (not a user's choice, so not in
ditscale.sp.Config): how one-sided transfers run (``engine``), how the copy-engine engine
signals (``signal``) and the NCCL channels per peer of the inter-machine communicator. The
defaults are the tuned choices; a benchmark sets the environment variables below (read at each
call, memoised while they keep their values) or calls :func:`set_current`. docs/sp.md
("Experiments"); the runtime's side: ditscale/runtime/gpu_executor.h (OneSidedEngine, Transports).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from .._checks import check_choice, check_int

# auto = copy-engine: cudaMemcpyAsync into the peer's symmetric buffer and stream-written
# signals (no SM); nvshmem: NVSHMEM's on-stream put-with-signal (kernels).
ENGINES = ("auto", "copy-engine", "nvshmem")
# write: a stream write into the peer's word; copy: an 8-byte copy of a word written locally.
SIGNALS = ("write", "copy")
MAX_NET_CHANNELS = 64

ENV_ENGINE = "DITSCALE_SP_ONE_SIDED_ENGINE"
ENV_SIGNAL = "DITSCALE_SP_CE_SIGNAL"
ENV_NET_CHANNELS = "DITSCALE_SP_NET_CHANNELS_PER_PEER"


@dataclass(frozen=True)
class Variant:
    """``engine`` one of ENGINES, ``signal`` one of SIGNALS, ``net_channels_per_peer`` [0, 64]
    (0 = NCCL's choice; applies when a mesh's communicators are made, its first layer)."""

    engine: str = "auto"
    signal: str = "write"
    net_channels_per_peer: int = 0

    def __post_init__(self):
        check_choice("engine", self.engine, ENGINES)
        check_choice("signal", self.signal, SIGNALS)
        check_int("net_channels_per_peer", self.net_channels_per_peer, 0, MAX_NET_CHANNELS)

    def op_text(self) -> str:
        """Its entries of the torch ops' configuration text (ditscale/torch/sp_config_text.h)."""
        return f"engine={self.engine};signal={self.signal}"


_SET: Optional[Variant] = None
_FROM_ENV: Dict[Tuple, Variant] = {}


def set_current(variant: Optional[Variant]) -> None:
    """Makes ``variant`` the current one (None: back to the environment's)."""
    global _SET
    if variant is not None and not isinstance(variant, Variant):
        raise TypeError(f"set_current: expected a Variant, got {type(variant).__name__}")
    _SET = variant


def current() -> Variant:
    """The variant set by :func:`set_current`, else the environment's (its unset variables: the
    defaults). A malformed variable is a ValueError naming it, its value and its range."""
    if _SET is not None:
        return _SET
    env = tuple(os.environ.get(n, "").strip() for n in (ENV_ENGINE, ENV_SIGNAL, ENV_NET_CHANNELS))
    variant = _FROM_ENV.get(env)
    if variant is None:
        variant = _of_environment(*env)
        _FROM_ENV[env] = variant
    return variant


def _of_environment(engine: str, signal: str, channels: str) -> Variant:
    fields = {}
    if engine:
        fields["engine"] = check_choice(f"${ENV_ENGINE}", engine, ENGINES)
    if signal:
        fields["signal"] = check_choice(f"${ENV_SIGNAL}", signal, SIGNALS)
    if channels:
        try:
            value = int(channels)
        except ValueError:
            raise ValueError(f"${ENV_NET_CHANNELS}: {channels!r} is not an integer in "
                             f"[0, {MAX_NET_CHANNELS}]") from None
        fields["net_channels_per_peer"] = check_int(f"${ENV_NET_CHANNELS}", value, 0,
                                                    MAX_NET_CHANNELS)
    return Variant(**fields)
