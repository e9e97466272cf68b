"""python -m ditscale.serve --weights DIR on the CPU: local diffusers checkpoints built offline.

:func:`save_tiny_flux` writes the tiny random-weight Flux of ``tiny.make_pipeline("flux")``
(transformer, VAE, scheduler) as a diffusers checkpoint folder, with tiny random-weight text
encoders and working tokenizers made here from configs (:func:`tiny_text_encoders`: CLIP with a
byte-level BPE vocabulary and a few merges, T5 with a Unigram vocabulary of a few words and the
letters), or without them (``save_pretrained`` of a pipeline whose encoders are None: its index
lists them as ``[null, null]``).

With encoders, a request's ``prompt`` goes through the pipeline's own encoders
(``"text_encoder": "pipeline"``): the server's image must be bit-identical to the same
checkpoint loaded and called directly with the prompt text, in this process on 1 thread for the
1-process server, on 2 gloo ranks (gloo_util) for the 2-rank one (torchrun). Without encoders
the server uses stand-in embeddings for a prompt and takes request embeddings (no request
needs the encoders). A weights folder that is missing, has no model_index.json or holds
another pipeline's checkpoint makes the command (``cli.main``, as test_serve_units.py checks
the options) exit with status 2 and a message naming the folder (tiny.load_pipeline's own
errors: test_generate_example.py).

The three servers and the 2-rank direct run start together (:func:`started`): each is mostly
imports, and on a 2-core machine they overlap. Every subprocess is killed in a finally.
"""

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers", minversion="5")  # the tokenizers' constructors (vocab=...)

from test_serve import Served, call, png_array  # noqa: E402

FLUX_TEXT_WIDTH, FLUX_POOLED_WIDTH = 16, 8  # tiny Flux: joint_attention_dim, pooled dim
CLIP_MAX_TOKENS = 77
T5_MAX_TOKENS = 512  # FluxPipeline's default max_sequence_length
SIZE, STEPS = "20x12", 2  # tiny Flux's default shape (15 image tokens)
WAIT_S = 400  # a start, or the direct runs, on a loaded 2-core machine


# ---- the checkpoints ----------------------------------------------------------------------

def _byte_chars():
    """GPT-2 / CLIP's byte-to-unicode table: one printable character per byte."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, extra = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return [chr(c) for c in cs]


def clip_tokenizer():
    """A CLIPTokenizer (byte-level BPE) over every byte, with and without CLIP's end-of-word
    suffix, a few merges, and CLIP's start / end tokens (the end one the highest id, as in
    CLIP's vocabulary)."""
    from transformers import CLIPTokenizer

    chars = _byte_chars()
    merges = [("f", "o"), ("fo", "x</w>"), ("r", "e"), ("re", "d</w>")]
    vocab = {}
    for token in (chars + [c + "</w>" for c in chars] + [a + b for a, b in merges]
                  + ["<|startoftext|>", "<|endoftext|>"]):
        vocab.setdefault(token, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_MAX_TOKENS)


def t5_tokenizer():
    """A T5 tokenizer (Unigram, T5's <pad> 0, </s> 1, <unk> 2) of a few words and the
    letters and digits; anything else is <unk>."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -1.0) for w in ("a", "red", "blue", "fox", "cat", "blurry")]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_TOKENS)


def tiny_text_encoders(seed: int = 1) -> dict:
    """FluxPipeline's text encoder and tokenizer components: a 1-layer CLIPTextModel whose
    pooled output is the transformer's pooled width, a 1-layer T5EncoderModel of its text
    width; random weights from ``seed`` (the global RNG state is left as it was)."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tok, tok2 = clip_tokenizer(), t5_tokenizer()
    clip = CLIPTextConfig(vocab_size=len(tok), hidden_size=FLUX_POOLED_WIDTH,
                          intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                          max_position_embeddings=CLIP_MAX_TOKENS,
                          projection_dim=FLUX_POOLED_WIDTH, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    t5 = T5Config(vocab_size=len(tok2), d_model=FLUX_TEXT_WIDTH, d_kv=8, d_ff=32, num_layers=1,
                  num_heads=2, relative_attention_num_buckets=8,
                  relative_attention_max_distance=32, pad_token_id=tok2.pad_token_id,
                  eos_token_id=tok2.eos_token_id, decoder_start_token_id=tok2.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return dict(text_encoder=CLIPTextModel(clip).eval(), tokenizer=tok,
                    text_encoder_2=T5EncoderModel(t5).eval(), tokenizer_2=tok2)


def save_tiny_flux(folder, encoders: bool) -> str:
    """``tiny.make_pipeline("flux")`` saved as a diffusers checkpoint in ``folder``, with
    :func:`tiny_text_encoders` or without encoders (their index entries ``[null, null]``)."""
    import diffusers

    from ditscale.diffusers import tiny

    base = tiny.make_pipeline("flux", size="tiny", seed=0)
    text = tiny_text_encoders() if encoders else dict(
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    pipe = diffusers.FluxPipeline(scheduler=base.scheduler, vae=base.vae,
                                  transformer=base.transformer, **text)
    pipe.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"encoders": DIR, "bare": DIR (no encoders), "sd3": DIR (the tiny SD3, no encoders)}."""
    from ditscale.diffusers import tiny

    root = tmp_path_factory.mktemp("checkpoints")
    out = {"encoders": save_tiny_flux(root / "flux-encoders", True),
           "bare": save_tiny_flux(root / "flux-bare", False)}
    tiny.make_pipeline("sd3").save_pretrained(str(root / "sd3"))
    out["sd3"] = str(root / "sd3")
    return out


def test_the_checkpoints_load_with_and_without_encoders(checkpoints):
    from ditscale.diffusers import tiny

    pipe = tiny.load_pipeline("flux", checkpoints["encoders"])
    assert type(pipe.text_encoder).__name__ == "CLIPTextModel"
    assert type(pipe.text_encoder_2).__name__ == "T5EncoderModel"
    ids = pipe.tokenizer("a red fox")["input_ids"]
    assert ids[0] == pipe.tokenizer.bos_token_id and ids[-1] == pipe.tokenizer.eos_token_id
    assert len(ids) == 5  # start, "a", "red" and "fox" (merges), end
    assert pipe.tokenizer_2("a red fox")["input_ids"] == [4, 5, 7, 1]  # three words and </s>
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt("a red fox", prompt_2=None)
    assert embeds.shape == (1, T5_MAX_TOKENS, FLUX_TEXT_WIDTH)
    assert pooled.shape == (1, FLUX_POOLED_WIDTH)
    bare = tiny.load_pipeline("flux", checkpoints["bare"])  # [null, null] components: None
    assert all(getattr(bare, k) is None for k in ("text_encoder", "tokenizer", "text_encoder_2",
                                                   "tokenizer_2"))
    assert torch.equal(bare.transformer.proj_out.weight, pipe.transformer.proj_out.weight)


# ---- the direct pipeline call ---------------------------------------------------------------

def direct_outputs(rank, world, jobs):
    """For each (weights, cases) of ``jobs``: each case's uint8 image from the checkpoint
    ``weights`` loaded and parallelized as the server does it, called directly. A case:
    (steps, guidance, seed, text) at SIZE; text ("prompt", prompt, negative): the pipeline's
    encoders; ("stand-in", prompt): the stand-in embeddings of T5_MAX_TOKENS tokens
    (--text-tokens' default with --weights); a dict: the request's embeddings (nested lists)."""
    from ditscale.diffusers import generation, parallelize_pipeline, tiny
    from ditscale.diffusers.generation import stand_in_seed

    height, width = _size_hw()
    out = []
    for weights, cases in jobs:
        pipe = parallelize_pipeline(tiny.load_pipeline("flux", weights), cfg_parallel=True,
                                    strategy="auto")
        images = []
        for steps, guidance, seed, text in cases:
            prompts, embeds = None, None
            if isinstance(text, dict):
                embeds = {k: torch.tensor(v, dtype=torch.float32) for k, v in text.items()}
            elif text[0] == "prompt":
                prompts = {"prompt": [text[1]], "negative_prompt": [text[2]]}
            else:
                embeds = tiny.make_prompt_embeds(pipe, T5_MAX_TOKENS, negative=guidance > 1,
                                                 seed=stand_in_seed(text[1], ""))
            kw = generation.call_kwargs("flux", height=height, width=width, frames=1,
                                        steps=steps, guidance=guidance, seeds=[seed],
                                        device=torch.device("cpu"), text=prompts,
                                        embeds=embeds)
            with torch.no_grad():
                array = generation.output_array(pipe(**kw), False)
            images.append(generation.to_uint8(array)[0])
        out.append(images)
    return out


def direct_here(jobs):
    """:func:`direct_outputs` in this process, on 1 thread like the server's rank (_env:
    OMP_NUM_THREADS=1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return direct_outputs(0, 1, jobs)
    finally:
        torch.set_num_threads(threads)


def run_direct(world, jobs):
    import gloo_util

    results = gloo_util.run_gloo(direct_outputs, world, jobs, timeout_s=240)
    for r in results[1:]:
        assert all(np.array_equal(a, b) for x, y in zip(results[0], r) for a, b in zip(x, y)), \
            "the ranks differ"
    return results[0]


def _size_hw():
    w, h = map(int, SIZE.split("x"))
    return h, w


def _embeds(seed, tokens):
    """Flux prompt embeddings (guidance 1: no negative ones) as nested lists."""
    rng = np.random.default_rng(seed)
    return {"prompt_embeds": rng.standard_normal((1, tokens, FLUX_TEXT_WIDTH)).round(3).tolist(),
            "pooled_prompt_embeds": rng.standard_normal((1, FLUX_POOLED_WIDTH)).round(3)
            .tolist()}


ENCODER_EMBEDS, BARE_EMBEDS = _embeds(0, 5), _embeds(1, 6)
ENCODER_REQUESTS = [  # (request body, the direct call's (steps, guidance, seed, text))
    ({"prompt": "a red fox", "seed": 3}, (STEPS, 1.0, 3, ("prompt", "a red fox", ""))),
    ({"prompt": "a blue cat", "seed": 3}, (STEPS, 1.0, 3, ("prompt", "a blue cat", ""))),
    ({"prompt": "a red fox", "negative_prompt": "blurry", "guidance": 2.0, "seed": 4,
      "steps": 1}, (1, 2.0, 4, ("prompt", "a red fox", "blurry"))),
    ({**ENCODER_EMBEDS, "seed": 5, "guidance": 1.0}, (STEPS, 1.0, 5, ENCODER_EMBEDS)),
]
BARE_REQUESTS = [
    ({"prompt": "a red fox", "seed": 7}, (STEPS, 1.0, 7, ("stand-in", "a red fox"))),
    ({**BARE_EMBEDS, "seed": 8, "guidance": 1.0}, (STEPS, 1.0, 8, BARE_EMBEDS)),
]


# ---- everything starts at once --------------------------------------------------------------

class Later:
    """``fn(*args)`` on a thread started now; :meth:`get` waits for its value or raises its
    exception (the servers and direct runs start together: the machine's cores overlap their
    imports)."""

    def __init__(self, fn, *args):
        self._box = {}
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn, args):
        try:
            self._box["value"] = fn(*args)
        except BaseException as e:  # pytest.fail's too: raised again by get()
            self._box["error"] = e

    def get(self, timeout: float = WAIT_S):
        self._thread.join(timeout)
        if self._thread.is_alive():
            pytest.fail(f"not done within {timeout:g} s")
        if "error" in self._box:
            raise self._box["error"]
        return self._box["value"]


def _direct_2_ranks(checkpoints):
    return run_direct(2, [(checkpoints["encoders"], [case for _, case in ENCODER_REQUESTS])])[0]


def _serve(weights, nproc, log_path):
    return Served(["--pipeline", "flux", "--weights", weights, "--group-timeout", "60"], nproc,
                  log_path)


@pytest.fixture(scope="module")
def started(checkpoints, tmp_path_factory):
    """Later()s, all started at once: the servers "encoders-1", "encoders-2" (2 ranks) and
    "bare", and "direct-2" (the encoder requests' direct outputs on 2 gloo ranks)."""
    logs = tmp_path_factory.mktemp("serve-weights")
    later = {"direct-2": Later(_direct_2_ranks, checkpoints),
             "encoders-1": Later(_serve, checkpoints["encoders"], 1, logs / "encoders-1.log"),
             "encoders-2": Later(_serve, checkpoints["encoders"], 2, logs / "encoders-2.log"),
             "bare": Later(_serve, checkpoints["bare"], 1, logs / "bare.log")}
    try:
        yield later
    finally:
        for key, job in later.items():
            try:
                value = job.get()
            except BaseException:  # failed (a server that did not start was killed): its test
                continue           # says so
            if key != "direct-2" and value.proc.returncode is None:  # its test did not kill it
                value.kill()


def _generate(url, body):
    status, result = call(url, "POST", "/v1/images/generations", body)
    assert status == 200, result
    return result


def _requests(server, requests):
    """The servers' results of ``requests`` (at SIZE, and STEPS unless a body gives steps)."""
    results = []
    for body, _ in requests:
        result = _generate(server.url, {"size": SIZE, "steps": STEPS, **body})
        assert result["seed"] == body["seed"] and result["size"] == SIZE
        results.append(result)
    return results


def _same_as_direct(results, expected):
    h, w = _size_hw()
    for i, (result, ref) in enumerate(zip(results, expected)):
        image = png_array(result["data"][0]["b64_json"])
        assert image.shape == (h, w, 3)
        assert np.array_equal(image, ref), (i, np.abs(image.astype(int) - ref).max())


# ---- with the pipeline's text encoders ------------------------------------------------------

def _serve_prompts(checkpoints, started, world):
    server = started[f"encoders-{world}"].get()
    try:
        _, models = call(server.url, "GET", "/v1/models")
        assert models["data"][0]["text_encoders"] is True
        results = _requests(server, ENCODER_REQUESTS)
    finally:
        server.kill()
    assert [r["text_encoder"] for r in results] == ["pipeline"] * 3 + ["request"]
    cases = [case for _, case in ENCODER_REQUESTS]
    expected = (direct_here([(checkpoints["encoders"], cases)])[0] if world == 1
                else started["direct-2"].get())
    _same_as_direct(results, expected)
    assert results[0]["data"] != results[1]["data"]  # the prompt text matters


def test_prompt_goes_through_the_checkpoint_encoders(checkpoints, started):
    _serve_prompts(checkpoints, started, 1)


def test_prompt_goes_through_the_checkpoint_encoders_on_2_ranks(checkpoints, started):
    _serve_prompts(checkpoints, started, 2)


# ---- without text encoders ----------------------------------------------------------------

def test_a_checkpoint_without_encoders_serves_stand_ins_and_embeddings(checkpoints, started):
    server = started["bare"].get()
    try:
        _, models = call(server.url, "GET", "/v1/models")
        assert models["data"][0]["text_encoders"] is False
        results = _requests(server, BARE_REQUESTS)
        # no request needs the encoders (a prompt without them gets stand-ins); a bad one is
        # still refused by its field
        status, err = call(server.url, "POST", "/v1/images/generations",
                           {"prompt_embeds": BARE_EMBEDS["prompt_embeds"], "size": SIZE})
        assert status == 400 and err["error"]["param"] == "pooled_prompt_embeds", err
        assert "required by flux" in err["error"]["message"]
    finally:
        server.kill()
    assert [r["text_encoder"] for r in results] == ["stand-in", "request"]
    _same_as_direct(results, direct_here([(checkpoints["bare"],
                                            [case for _, case in BARE_REQUESTS])])[0])


# ---- bad weights folders ------------------------------------------------------------------

def test_bad_weights_folders_exit_2_naming_the_folder(checkpoints, tmp_path, capsys):
    from ditscale.serve import cli

    empty = tmp_path / "empty"
    empty.mkdir()
    other = ("holds a StableDiffusion3Pipeline checkpoint (model_index.json), not a "
             "FluxPipeline")
    for folder, words in ((str(tmp_path / "not-there"), "does not exist or is not a folder"),
                          (str(empty), "has no model_index.json"),
                          (checkpoints["sd3"], other)):
        code = cli.main(["--pipeline", "flux", "--device", "cpu", "--port", "0", "--weights",
                         folder])
        err = capsys.readouterr().err
        assert code == 2, err
        assert f"load_pipeline: weights folder {folder!r}" in err and words in err, err


def test_a_checkpoint_with_some_of_the_encoders_is_refused(tmp_path, capsys):
    import diffusers

    from ditscale.diffusers import tiny
    from ditscale.serve import cli

    base = tiny.make_pipeline("flux", size="tiny", seed=0)
    clip_only = {k: v for k, v in tiny_text_encoders().items() if not k.endswith("_2")}
    diffusers.FluxPipeline(scheduler=base.scheduler, vae=base.vae, transformer=base.transformer,
                           text_encoder_2=None, tokenizer_2=None,
                           **clip_only).save_pretrained(str(tmp_path / "clip-only"))
    code = cli.main(["--pipeline", "flux", "--device", "cpu", "--port", "0", "--weights",
                     str(tmp_path / "clip-only")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("the checkpoint has some of the pipeline's text encoders / tokenizers but not "
            "text_encoder_2, tokenizer_2") in err, err
