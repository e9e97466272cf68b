"""The training benchmark's result file: prepare, throughput and loss tables, and the loss plot.

``markdown(...)`` joins ``bench.reporter``'s header and three tables: prepare (clips/s over the
encode time; the rest of the run: probing, planning, loading the encoders, the manifest), train
throughput per run (steady-state tokens/s, step time, loader wait, peak memory) with the store
/ synthetic ratio against its target, and the loss of ``balanced`` vs ``equal-token`` at evenly
spaced steps (each the mean of a window of steps). ``plot`` draws both loss curves against the
step and against the samples trained (matplotlib, Agg). See bench/README.md.
"""

from __future__ import annotations

from typing import List, Sequence

from bench import reporter

TARGET = 0.97                   # store tokens/s over synthetic tokens/s, at least
LOSS_ROWS = 10

PREPARE_COLUMNS = ("inputs", "good", "bad", "shards", "clips encoded", "encode s", "clips/s",
                   "rest s", "total s")
THROUGHPUT_COLUMNS = ("run", "data", "policy", "steps", "tokens/s", "samples/s",
                      *(f"step {c}" for c in reporter.TIMING_COLUMNS), "loader wait s",
                      "peak GiB")
LOSS_COLUMNS = ("step", "samples (balanced)", "loss (balanced)", "samples (equal-token)",
                "loss (equal-token)")


def prepare_row(p: dict) -> list:
    rate = p["encoded"] / p["encode_seconds"] if p["encode_seconds"] > 0 else 0.0
    return [p["inputs"], p["good"], p["bad"], p["shards"], p["encoded"], p["encode_seconds"],
            rate, p["seconds"] - p["encode_seconds"], p["seconds"]]


def throughput_row(name: str, data: str, policy: str, t, peak) -> list:
    return [name, data, policy, t.steps, t.tokens_per_s, t.samples_per_s,
            *reporter.timing_cells(t.step_time), t.data_wait_s,
            "-" if peak is None else peak]


def _window_mean(xs: Sequence[float], i: int, half: int) -> float:
    part = xs[max(0, i - half): i + half + 1]
    return sum(part) / len(part)


def loss_rows(balanced, equal) -> List[list]:
    """Up to LOSS_ROWS evenly spaced steps of the shorter run: its step, the samples trained
    up to it and the loss (mean of a window of steps) of each run."""
    n = min(len(balanced.metrics), len(equal.metrics))
    picks = sorted({round(k * (n - 1) / max(LOSS_ROWS - 1, 1)) for k in range(LOSS_ROWS)})
    half = max(0, n // (2 * LOSS_ROWS))
    rows = []
    for i in picks:
        row = [balanced.metrics[i]["step"]]
        for r in (balanced, equal):
            seen = sum(len(m["samples"]) for m in r.metrics[: i + 1])
            row += [seen, _window_mean(r.losses(), i, half)]
        rows.append(row)
    return rows


def ratio_line(store_t, synth_t) -> str:
    ratio = store_t.tokens_per_s / synth_t.tokens_per_s
    verdict = "meets" if ratio >= TARGET else "MISSES"
    return (f"store / synthetic tokens/s: **{ratio:.1%}** ({verdict} the target of at least "
            f"{TARGET:.0%})")


def markdown(title: str, notes: str, prepare: dict, throughput_rows: list, ratio: str,
             same_ids: bool, balanced, equal, plot_name: str) -> str:
    lines = reporter.header_lines(title)
    text = "\n".join(lines) + "\n" + notes.rstrip() + "\n\n## prepare\n\n"
    text += reporter.table(PREPARE_COLUMNS, [prepare_row(prepare)], digits=2)
    text += "\n## train throughput\n\n"
    text += reporter.table(THROUGHPUT_COLUMNS, throughput_rows, digits=2)
    text += (f"\n{ratio}; the two runs trained the same ids in every step: "
             f"{'yes' if same_ids else 'NO'}\n")
    text += "\n## loss: balanced vs equal-token (same seed)\n\n"
    text += reporter.table(LOSS_COLUMNS, loss_rows(balanced, equal), digits=4)
    return text + f"\n![loss curves]({plot_name})\n"


def plot(path: str, balanced, equal) -> bool:
    """Both loss curves, against the step and the samples trained; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r, label in ((balanced, "balanced"), (equal, "equal-token")):
        steps = [m["step"] for m in r.metrics]
        seen, total = [], 0
        for m in r.metrics:
            total += len(m["samples"])
            seen.append(total)
        axes[0].plot(steps, r.losses(), label=label, lw=1)
        axes[1].plot(seen, r.losses(), label=label, lw=1)
    for ax, xlabel in zip(axes, ("step", "samples trained")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("flow-matching loss")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
