"""What the parallel VAE tests share: seeded inputs, the relative error, a refusal's message and
the convolution and attention FLOPs of a call (torch.utils.flop_counter)."""

import torch


def seeded_randn(shape) -> torch.Tensor:
    """Standard normal of ``shape``, seeded by the shape (the same on every rank)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return ((a - b).norm() / b.norm()).item()


def refusal(fn):
    """The message of the ValueError ``fn()`` raises, or None."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def conv_flops(fn) -> int:
    """The convolution FLOPs of ``fn()``."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        fn()
    counts = counter.get_flop_counts()["Global"]
    return sum(v for k, v in counts.items() if "convolution" in str(k))


def attention_flops(fn) -> int:
    """The attention matmuls' FLOPs of ``fn()`` (SDPA on its math backend: batched matmuls)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn()
    return sum(v for k, v in counter.get_flop_counts()["Global"].items() if "bmm" in str(k))


def unknown_processor_refusal(vae, attn) -> str:
    """parallelize_vae's refusal of ``vae`` once ``attn`` (one of its Attention modules) has a
    processor class the parallel VAE does not know (a subclass of AttnProcessor2_0)."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    from ditscale.diffusers.parallel_vae import parallelize_vae

    class MyProcessor(AttnProcessor2_0):
        pass

    attn.set_processor(MyProcessor())
    return refusal(lambda: parallelize_vae(vae))


def encode_rel(cases) -> list:
    """[rel(parallel encode, stock encode)] of each (vae, x) in ``cases``, each vae
    parallelized for the call and given back (its stock encode again, bit for bit)."""
    from ditscale.diffusers.parallel_vae import parallelize_vae
    out = []
    for vae, x in cases:
        ref = vae.encode(x).latent_dist.parameters
        handle = parallelize_vae(vae)
        out.append(rel(vae.encode(x).latent_dist.parameters, ref))
        handle.remove()
        assert torch.equal(vae.encode(x).latent_dist.parameters, ref)
    return out
