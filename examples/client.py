#!/usr/bin/env python3
"""A client of ``python -m ditscale.serve`` (docs/serve.md), with the standard library only.

    python examples/client.py --url http://127.0.0.1:8000 --prompt "a red fox" --out fox.png

Asks the server which pipeline it runs (``GET /v1/models``), posts one generation request
(an image, or a video when the server runs a video pipeline) and saves the result.
"""

import argparse
import base64
import json
import urllib.error
import urllib.request


def call(url, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:  # the server's {"error": {"message", ...}}
        raise SystemExit(f"{e.code}: {json.load(e)['error']['message']}") from None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--prompt", default="a red fox running through fresh snow")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="default: the server's")
    p.add_argument("--out", default=None, help="default: out.png or out.mp4")
    args = p.parse_args()

    model = call(args.url, "/v1/models")["data"][0]
    video = model["kind"] == "video"
    body = {"prompt": args.prompt, "seed": args.seed}
    if args.steps is not None:
        body["steps"] = args.steps
    result = call(args.url, f"/v1/{'videos' if video else 'images'}/generations", body)
    out = args.out or ("out.mp4" if video else "out.png")
    with open(out, "wb") as f:
        f.write(base64.b64decode(result["data"][0]["b64_json"]))
    t = result["timings"]
    print(f"{model['id']}: {out} ({result['size']}, seed {result['seed']}, {result['steps']} "
          f"steps, text encoder: {result['text_encoder']}, {t['run_s']:.2f} s)")
    if "denoising_s" in t:  # the stages (seconds, on the server's rank 0)
        print(f"  text encoding {t['text_encoding_s']:.3f} s, denoising {t['denoising_s']:.3f} s "
              f"({len(t['denoising_steps_s'])} steps), VAE decode {t['vae_decode_s']:.3f} s, "
              f"output encoding {t['output_encoding_s']:.3f} s")


if __name__ == "__main__":
    main()
