"""The predicted step time of a sequence-parallel training step at degree d, from one measured
degree: the balanced planner's per-rank cost of a micro-batch (ditscale/balance/sp_cost.h;
docs/balance.md, "Sequence parallelism per micro-batch") with its per-sample work ``Work(S)``
taken from the measurement instead of a fitted cost model:

    T(d) = Work(S) / (d * eff(d)) + comm(d, S),   comm(d, S) = 3 * L * exposed(d, S)
    Work(S) = (T(d0) - comm(d0, S)) * d0 * eff(d0)       (d0: the anchor, the smallest measured)

``exposed(d, S)``: the sp simulator's mean exposed communication per rank of one attention layer,
plain Ulysses (U = d, NCCL) on one machine of the node topology (``ditscale.sp.predict_candidate``,
batch 1, S tokens, the model's heads and head dim, its text tokens joint); L: the blocks;
3: forward + backward. ``eff(d)``: bench.sp.block_share's ``--json`` efficiencies, 1 without
them. The planner's ``a_mb`` (a per-micro-batch floor) is inside ``Work``: exact at the anchor.
"""

from __future__ import annotations

import json
from typing import Dict, Optional

TOPOLOGY = "h100-8x"  # the planner's default node (sp_cost.h kDefaultSpTopology)


def comm_s(degree: int, tokens: int, heads: int, head_dim: int, layers: int,
           topology: str = TOPOLOGY) -> float:
    """comm(d, S) in seconds (0 at d = 1)."""
    if degree == 1:
        return 0.0
    from ditscale import sp
    mesh = sp.Mesh(machines=1, gpus_per_machine=degree)
    c = sp.predict_candidate(mesh, batch=1, seq=tokens, text=0, heads=heads, head_dim=head_dim,
                             strategy="ulysses", ulysses_degree=degree, ring_degree=1,
                             transport="nccl", topology=topology)
    return 3.0 * layers * float(c["breakdown"]["mean_exposed_comm_s"])


def read_eff(path: Optional[str], model: str, tokens: int) -> Dict[int, float]:
    """eff(d) of ``model`` at the token count nearest ``tokens`` in block_share's JSON
    ({"model": {"d": {"S": eff}}}); {} without a file or an entry for the model."""
    if not path:
        return {}
    with open(path) as f:
        data = json.load(f)
    table = data.get(model) if isinstance(data, dict) else None
    out = {}
    for d, by_s in (table or {}).items():
        nearest = min(by_s, key=lambda s: abs(int(s) - tokens))
        e = float(by_s[nearest])
        if not 0.01 <= e <= 1.5:
            raise ValueError(f"--eff-json: eff({d}) = {e} of {model} is outside [0.01, 1.5]")
        out[int(d)] = e
    return out


def predict(measured_s: Dict[int, float], degrees, comm: Dict[int, float],
            eff: Dict[int, float]) -> Dict[int, float]:
    """T(d) for each degree from the smallest measured degree (module); {} when none is."""
    if not measured_s:
        return {}
    d0 = min(measured_s)
    work = (measured_s[d0] - comm[d0]) * d0 * eff.get(d0, 1.0)
    return {d: work / (d * eff.get(d, 1.0)) + comm[d] for d in degrees}
