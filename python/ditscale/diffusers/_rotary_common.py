"""Shared pieces of the rotary processors (``rotary_wan``, ``rotary_flux``): when ``ops.rotary``
can take a call, and :class:`Replacing`, the processor's hold on the stock one it replaced."""

from __future__ import annotations

import torch

from .. import ops

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CARRIED = ("_attention_backend", "_parallel_config")  # instance settings of a processor


def op_applies(x: torch.Tensor, tables) -> bool:
    """True when ``ops.rotary`` can rotate ``x`` (or tensors of its dtype and device) by
    ``tables`` = (cos, sin): an eager call (not under torch.compile), the compiled ops
    available, x bf16 / fp16 / fp32, cos and sin float32 tensors on x's device that require no
    grad."""
    if torch.compiler.is_compiling() or not ops.is_available() or x.dtype not in _DTYPES:
        return False
    return all(isinstance(f, torch.Tensor) and f.dtype == torch.float32 and not f.requires_grad
               and f.device == x.device for f in tables)


def carry(src, dst) -> None:
    """The attention backend / parallel config set on processor ``src`` (instance attributes,
    as diffusers' ``set_attention_backend`` sets them), onto ``dst``."""
    for name in _CARRIED:
        if name in vars(src):
            setattr(dst, name, vars(src)[name])


class Replacing:
    """Mixin of a processor that replaced diffusers' ``stock`` one on a module: it keeps it,
    takes over its backend settings, and gives it back (with the settings made meanwhile, e.g.
    by ``set_attention_backend``) on :meth:`restore`."""

    def _replace(self, stock) -> None:
        self.stock = stock
        carry(stock, self)

    def restore(self):
        """The processor this one replaced, with this one's backend settings."""
        carry(self, self.stock)
        return self.stock
