"""A parallel VAE decode and encode: every rank of the group computes one band of rows of the
image (plus the halo rows its convolutions need, exchanged layer by layer) and gets the full
output; with diffusers' tiling on, every rank computes its share of the stock tiles instead.

    handle = parallelize_vae(pipe.vae)           # mesh: a ditscale.sp.Mesh, default group
    video = pipe.vae.decode(latents).sample      # the same full latents on every rank
    handle.remove()                              # or unparallelize_vae(pipe.vae)

Modules: bands (geometry), comm (collectives), layers (per-layer replacements), attention (a
mid block's attention for the band's queries), wan / kl /
hunyuan / cogvideox (the plan of each VAE class), tiles (diffusers' tiles over the ranks),
apply (class table, apply/remove). Manual: docs/diffusers/vae.md.
"""

from .apply import VaeHandle, parallelize_vae, unparallelize_vae

__all__ = ["VaeHandle", "parallelize_vae", "unparallelize_vae"]
