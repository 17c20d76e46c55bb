"""stepcore.torch: PyTorch optimizers and gradient clipping over the stepcore CPU engine.

``Adam``, ``AdamW``, ``SGD`` and ``Adagrad`` are ``torch.optim.Optimizer``s bit-identical to
``torch.optim.Adam/AdamW/SGD/Adagrad(fused=True)`` on CPU with float32, bfloat16 and
float16 params (constructor arguments, state layout and ``state_dict`` included; AdamW's
``formula="native"`` is stepcore's own), ``Lion`` takes lion-pytorch's arguments and
``SignSGD`` is stepcore's SignSGD; ``AdamW8bit`` and ``Adam8bit`` keep block-wise 8-bit
state (one class per optimizer whose table entry takes it, see ``_torch_q8``);
``optimizer_class(name)`` returns the one that steps an optimizer of
``stepcore.optimizer_table()``. ``clip_grad_norm_`` is signature-compatible
with ``torch.nn.utils.clip_grad_norm_`` but computes the correctly rounded,
order-independent norm (exact across ranks and DTensor shardings). ``GradientManager``
runs the step after backward in one of three places (``offload``), for every optimizer.
Every optimizer steps through the engine's one generic entry point (``Engine.step`` by
name, over a cached table of addresses it validated); tensors reach the engine zero-copy,
and the engine releases the GIL. See docs/python.md.

The modules behind it, by job: ``_torch_checks`` (argument checks), ``_torch_engine`` (the
engine owner and cached rows every drop-in shares), ``_torch_optim`` (the drop-ins),
``_torch_clip`` (``clip_grad_norm_``), ``_manager`` (``GradientManager``).
"""

from __future__ import annotations

from ._manager import GradientManager
from ._torch_checks import _COMPUTE_DTYPES, _GRAD_DTYPES, _PARAM_DTYPES  # noqa: F401
from ._torch_clip import clip_grad_norm_
from ._torch_optim import EIGHT_BIT as _EIGHT_BIT
from ._torch_optim import SGD, Adagrad, Adam, AdamW, Lion, SignSGD, optimizer_class

# The 8-bit drop-ins (AdamW8bit, Adam8bit): one per optimizer whose table entry takes
# 8-bit state, named after its f32 drop-in.
globals().update({_cls.__name__: _cls for _cls in _EIGHT_BIT.values()})

__all__ = ["Adagrad", "Adam", "AdamW", "GradientManager", "Lion", "SGD", "SignSGD",
           "clip_grad_norm_", "optimizer_class"] + sorted(c.__name__ for c in _EIGHT_BIT.values())
