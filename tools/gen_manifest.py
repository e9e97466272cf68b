#!/usr/bin/env python3
"""Deterministic generator of synthetic training-corpus manifests and shape benchmarks.

Manifest mode (default) writes an Open-Sora-style CSV (or JSONL with --jsonl) that resembles a
mixed corpus of WebDataset images and Koala-36M video clips:
  - ~40% images (num_frames 1, empty fps): common photo/web sizes and random aspect ratios;
  - ~60% videos: 2-20 s clips at 24/25/30/60 fps (and 23.976/29.97), 480p/720p/1080p, ~15%
    portrait; num_frames = round(duration * fps);
  - captions with commas, doubled quotes and, rarely (0.1%), a newline: the CSV stresses RFC-4180
    quoting.
Columns: path,text,num_frames,height,width,aspect_ratio,fps,resolution.
With --short: the 6 columns path,text,num_frames,height,width,fps, a short path and a short
unquoted caption ("a cat jumps"): ~54 bytes a row, ~540 MB for 10M rows (the shapes are those of
the 8-column form with the same seed).

Bench mode (--bench) writes a synthetic shape benchmark (batch_size,seq_len,step_time_s,
peak_mem_bytes) from a known power model t = a + b*B*S^p with 2% multiplicative noise and a
linear memory model, for `ditscale fit`. The true parameters are written in '#' comment lines.

The output is a pure function of (--rows, --seed, mode). Rows are generated and written in chunks,
so 10M rows take a couple of minutes and bounded memory.

  tools/gen_manifest.py --rows 2000 --seed 0 --out examples/manifests/mixed_2k.csv
  tools/gen_manifest.py --rows 10000000 --seed 1 --out /tmp/m10m.csv
  tools/gen_manifest.py --rows 10000000 --seed 1 --short --out /tmp/m10m-short.csv
  tools/gen_manifest.py --bench --seed 0 --out examples/manifests/bench_example.csv
"""
import argparse
import json
import sys

import numpy as np

CHUNK = 200_000

SUBJECTS = ["a woman", "a man", "two children", "a golden retriever", "a red car", "an old train",
            "a chef", "a flock of birds", "a cyclist", "a street musician", "a cat", "a drone",
            "a surfer", "an astronaut", "a robot", "a family", "a horse", "a small boat"]
ACTIONS = ["walks slowly", "runs", "turns around", "smiles at the camera", "jumps", "drives past",
           "cooks dinner", "plays the guitar", "looks out of a window", "waves", "dances",
           "rides through traffic", "sits quietly", "flies overhead"]
PLACES = ["in a busy market", "on a snowy mountain", "by the sea", "in a neon-lit street",
          "in a quiet library", "in a sunflower field", "inside a train station", "at sunset",
          "in the rain", "in a forest", "on a rooftop", "in a kitchen", "underwater"]
STYLES = ["cinematic", "handheld", "slow motion", "aerial shot", "close-up", "wide angle",
          "shallow depth of field", "warm light", "35mm film", "time-lapse", "4k", "static camera"]
SIGNS = ["OPEN", "EXIT", "Hello, world", "SALE 50%", "Caf\u00e9", "No \"parking\""]

IMAGE_SIZES = [(512, 512), (768, 768), (1024, 1024), (768, 1024), (1024, 768), (1080, 1920),
               (1920, 1080), (720, 1280), (1280, 720), (1536, 2048), (2048, 1536), (640, 480),
               (480, 640), (1200, 1800), (1800, 1200), (2160, 3840), (256, 256), (400, 600)]
VIDEO_TIERS = [(480, 854), (480, 640), (720, 1280), (1080, 1920)]  # (h, w) landscape
VIDEO_TIER_P = [0.25, 0.1, 0.4, 0.25]
FPS = np.array([24.0, 25.0, 30.0, 60.0, 23.976, 29.97])
FPS_P = [0.3, 0.15, 0.3, 0.1, 0.08, 0.07]


def captions(rng, n, short=False):
    s = rng.integers(0, len(SUBJECTS), n).tolist()
    a = rng.integers(0, len(ACTIONS), n).tolist()
    p = rng.integers(0, len(PLACES), n).tolist()
    st1 = rng.integers(0, len(STYLES), n).tolist()
    st2 = rng.integers(0, len(STYLES), n).tolist()
    extra = rng.random(n).tolist()
    sign = rng.integers(0, len(SIGNS), n).tolist()
    out = []
    for i in range(n):
        if short:
            out.append(f"{SUBJECTS[s[i]]} {ACTIONS[a[i]]}")
            continue
        c = f"{SUBJECTS[s[i]]} {ACTIONS[a[i]]} {PLACES[p[i]]}, {STYLES[st1[i]]}, {STYLES[st2[i]]}"
        e = extra[i]
        if e < 0.15:
            c += f', a sign reads "{SIGNS[sign[i]]}"'
        elif e < 0.151:
            c += ".\nThe scene then cuts to black"
        out.append(c)
    return out


def chunk_rows(rng, start, n, short_form=False):
    """Rows as tuples (path, text, num_frames, height, width, aspect_ratio, fps, resolution);
    short_form: short paths and captions (the other columns and the random stream are unchanged)."""
    is_image = (rng.random(n) < 0.4).tolist()
    # Images: 70% common sizes, 30% random web sizes (aspect 0.5..2, short side 200..2500).
    common = rng.integers(0, len(IMAGE_SIZES), n).tolist()
    short = rng.integers(200, 2500, n).tolist()
    ar = np.exp(rng.uniform(np.log(0.5), np.log(2.0), n)).tolist()
    use_common = (rng.random(n) < 0.7).tolist()
    # Videos.
    tier = rng.choice(len(VIDEO_TIERS), n, p=VIDEO_TIER_P).tolist()
    portrait = (rng.random(n) < 0.15).tolist()
    fps_idx = rng.choice(len(FPS), n, p=FPS_P).tolist()
    duration = (2.0 + 18.0 * rng.beta(1.5, 2.5, n)).tolist()
    fps_values = FPS.tolist()
    text = captions(rng, n, short_form)
    rows = []
    for i in range(n):
        idx = start + i
        if is_image[i]:
            if use_common[i]:
                h, w = IMAGE_SIZES[common[i]]
            else:
                h = short[i]
                w = int(round(short[i] * ar[i]))
                if ar[i] < 1:
                    h, w = w, h
            if short_form:
                path = f"i/{idx:08d}.jpg"
            else:
                path = f"webdataset/{idx // 10000:05d}/{idx:09d}.jpg"
            rows.append((path, text[i], 1, h, w, f"{h / w:.4f}", "", h * w))
        else:
            h, w = VIDEO_TIERS[tier[i]]
            if portrait[i]:
                h, w = w, h
            fps = fps_values[fps_idx[i]]
            frames = max(2, int(round(duration[i] * fps)))
            path = f"v/{idx:08d}.mp4" if short_form else f"koala36m/clip_{idx:09d}.mp4"
            rows.append((path, text[i], frames, h, w, f"{h / w:.4f}", f"{fps:g}", h * w))
    return rows


def csv_lines(rows):
    """RFC-4180 lines; only the caption can need quoting (it always gets quoted here)."""
    return "".join(
        f'{r[0]},"{r[1].replace(chr(34), chr(34) * 2)}",{r[2]},{r[3]},{r[4]},{r[5]},{r[6]},{r[7]}\n'
        for r in rows)


def short_csv_lines(rows):
    """The 6-column form: the short caption has no comma or quote and is written unquoted."""
    return "".join(f"{r[0]},{r[1]},{r[2]},{r[3]},{r[4]},{r[6]}\n" for r in rows)


HEADER = ["path", "text", "num_frames", "height", "width", "aspect_ratio", "fps", "resolution"]
SHORT_HEADER = ["path", "text", "num_frames", "height", "width", "fps"]


def write_manifest(args):
    rng = np.random.Generator(np.random.PCG64(args.seed))
    with open(args.out, "w", newline="", encoding="utf-8") as f:
        header = SHORT_HEADER if args.short else HEADER
        if not args.jsonl:
            f.write(",".join(header) + "\n")
        done = 0
        while done < args.rows:
            n = min(CHUNK, args.rows - done)
            rows = chunk_rows(rng, done, n, args.short)
            if not args.jsonl:
                f.write(short_csv_lines(rows) if args.short else csv_lines(rows))
            else:
                lines = []
                for r in rows:
                    d = dict(zip(HEADER, r))
                    d["fps"] = float(d["fps"]) if d["fps"] else None
                    d["aspect_ratio"] = float(d["aspect_ratio"])
                    if args.short:
                        d = {k: d[k] for k in SHORT_HEADER}
                    lines.append(json.dumps(d, ensure_ascii=False))
                f.write("\n".join(lines) + "\n")
            done += n
            if args.rows >= 1_000_000:
                print(f"\r{done}/{args.rows} rows", end="", file=sys.stderr, flush=True)
    if args.rows >= 1_000_000:
        print(file=sys.stderr)


def write_bench(args):
    rng = np.random.Generator(np.random.PCG64(args.seed))
    # Roughly Wan 2.1 1.3B on one H200: ~1.5 s for one 81-frame 480p sample (32760 tokens).
    a, p = 0.08, 1.45
    b = 1.5 / 32760 ** p
    m0, m1 = 12.0 * 2 ** 30, 150.0 * 1024
    max_tokens = 600_000
    with open(args.out, "w", newline="") as f:
        f.write(f"# synthetic shape benchmark: tools/gen_manifest.py --bench --seed {args.seed}\n")
        f.write(f"# true model: step_time_s = {a} + {b:.6e} * B * S^{p}, 2% noise\n")
        f.write(f"# true memory: peak_mem_bytes = {m0:.0f} + {m1:.0f} * B * S, 0.5% noise\n")
        f.write("batch_size,seq_len,step_time_s,peak_mem_bytes\n")
        for s in [1024, 2048, 4096, 8192, 16384, 32760, 49140, 65520, 98280, 131040]:
            for bsz in [1, 2, 4, 8, 16, 32]:
                if bsz * s > max_tokens:
                    continue
                t = (a + b * bsz * s ** p) * (1 + 0.02 * rng.standard_normal())
                mem = (m0 + m1 * bsz * s) * (1 + 0.005 * rng.standard_normal())
                f.write(f"{bsz},{s},{t:.5f},{mem:.0f}\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2000, help="manifest rows (default 2000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--jsonl", action="store_true", help="write JSONL instead of CSV")
    ap.add_argument("--short", action="store_true",
                    help="6 columns (path,text,num_frames,height,width,fps), short path, caption")
    ap.add_argument("--bench", action="store_true", help="write a synthetic shape benchmark")
    args = ap.parse_args()
    if args.rows < 0:
        ap.error("--rows must be >= 0")
    if args.bench:
        write_bench(args)
    else:
        write_manifest(args)


if __name__ == "__main__":
    main()
