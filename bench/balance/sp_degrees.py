"""Sequence-parallel degree per micro-batch against one fixed degree, predicted by `ditscale plan`.

Writes a mixed manifest (images, 480p and 720p clips of 17..121 frames at 16 fps; seeded), a
shape model (wan2.1-14b with max_frames 121) and, per memory regime, a cost file (the analytical
wan2.1-14b H200 cost with the memory model of that regime), then runs
`ditscale plan --compare --sp-degrees 1,2,4,8 --json` at each world size and prints the markdown
tables of bench/results/train-sp-degree-predicted_cpu_2026-12.md. A prediction of the cost model
(no GPU): docs/balance.md, "Sequence parallelism per micro-batch".

    python -m bench.balance.sp_degrees --ditscale build/tools/ditscale [--rows 20000]
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import subprocess
import tempfile
from pathlib import Path

from ditscale._checks import check_int, check_real

# kind -> (height, width); clips draw frames 4k + 1 in [17, 121]. Rows: --image-share images,
# the rest 480p and 720p clips 3:2.
CLIPS = {"480p": (480, 832), "720p": (720, 1280)}
IMAGE_SIZES = [(1024, 1024), (768, 1024), (1024, 768), (512, 512), (720, 1280), (480, 832)]
WORLD_SIZES = (8, 16, 64)
MODEL = {"base": "wan2.1-14b", "name": "wan2.1-14b-121f", "max_frames": 121}
# H200 (141 GiB, 10% kept free), FSDP over 8: m0 = 14e9 * 16 B / 8 + 4 GiB (cost_model.h).
M0 = 14e9 * 16 / 8 + 4 * 2**30
HIDDEN, LAYERS = 5120, 40
# memory regime -> bytes per token (cost_model.h, MemoryAssumptions).
REGIMES = {
    "full activation checkpointing": (2 * LAYERS + 34) * HIDDEN,
    "no activation checkpointing": 34 * LAYERS * HIDDEN,
}


def write_manifest(path: Path, rows: int, seed: int, image_share: float) -> None:
    rng = random.Random(seed)
    kinds = ["image", "480p", "720p"]
    weights = [image_share, 0.6 * (1 - image_share), 0.4 * (1 - image_share)]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "text", "num_frames", "height", "width", "fps"])
        for i in range(rows):
            kind = rng.choices(kinds, weights)[0]
            if kind == "image":
                h, wd = rng.choice(IMAGE_SIZES)
                w.writerow([f"img/{i:07d}.jpg", "an image", 1, h, wd, ""])
            else:
                h, wd = CLIPS[kind]
                frames = 4 * rng.randint(4, 30) + 1
                w.writerow([f"{kind}/{i:07d}.mp4", "a clip", frames, h, wd, 16])


def analytical_cost(ditscale: str, manifest: Path, model: Path) -> dict:
    r = subprocess.run([ditscale, "plan", "--manifest", str(manifest), "--model", str(model),
                        "--world-size", "8", "--quiet", "--json", "--m-mem", "1000000"],
                       capture_output=True, text=True, check=True)
    cost = json.loads(r.stdout)["cost"]
    cost.pop("source", None)
    return cost


def plan(ditscale: str, manifest: Path, model: Path, cost: Path, world: int) -> dict:
    r = subprocess.run([ditscale, "plan", "--manifest", str(manifest), "--model", str(model),
                        "--cost", str(cost), "--world-size", str(world), "--quiet", "--json",
                        "--compare", "--sp-degrees", "1,2,4,8", "--gpu-mem-gib", "141"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"ditscale plan failed:\n{r.stderr}")
    return json.loads(r.stdout)


def table(results: dict) -> str:
    lines = ["| ranks | run | tok/s/GPU | vs best fixed | bubble | comm | unfit (dropped) | "
             "micro-batches d=1/2/4/8 |", "|---|---|---|---|---|---|---|---|"]
    for world, j in results.items():
        runs = {k: v for k, v in j["policies"].items() if k.startswith("balanced sp=")}
        fixed = [v["tokens_per_s_per_gpu"] for k, v in runs.items()
                 if "," not in k and v["samples_unfit"] == 0]
        best = max(fixed) if fixed else float("nan")
        for name, v in runs.items():
            per = "/".join(str(v["per_degree"].get(str(d), {}).get("micro_batches", 0))
                           for d in (1, 2, 4, 8))
            lines.append(f"| {world} | {name} | {v['tokens_per_s_per_gpu']:,.0f} | "
                         f"{v['tokens_per_s_per_gpu'] / best:.3f}x | "
                         f"{100 * v['bubble_fraction']:.2f}% | {100 * v['comm_fraction']:.2f}% | "
                         f"{v['samples_unfit']} | {per} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ditscale", default="build/tools/ditscale")
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image-share", type=float, default=0.5, help="share of image rows")
    ap.add_argument("--sp-efficiency", default="",
                    help="JSON for the cost file's sp_efficiency, e.g. '{\"8\": 0.85}'")
    args = ap.parse_args()
    check_int("--rows", args.rows, 1, 10_000_000)
    check_real("--image-share", args.image_share, 0.0, 1.0)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        manifest, model = d / "corpus.csv", d / "model.json"
        write_manifest(manifest, args.rows, args.seed, args.image_share)
        model.write_text(json.dumps(MODEL))
        base = analytical_cost(args.ditscale, manifest, model)
        if args.sp_efficiency:
            base["sp_efficiency"] = json.loads(args.sp_efficiency)
        for regime, m1 in REGIMES.items():
            cost = d / "cost.json"
            cost.write_text(json.dumps({**base, "memory": {"m0": M0, "m1": m1}}))
            results = {w: plan(args.ditscale, manifest, model, cost, w) for w in WORLD_SIZES}
            first = results[WORLD_SIZES[0]]
            print(f"\n### {regime}: m1 = {m1:,} B/token, M_mem = {first['m_mem_tokens']:,} "
                  f"tokens\n")
            print(table(results))


if __name__ == "__main__":
    main()
