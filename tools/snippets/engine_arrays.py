"""Prelude of the engine snippets (docs/api-changes.md): an engine and one tensor's arrays.

`engine` (stepcore.Engine), `p` (an f32 parameter), `m`, `v` (its AdamW moments), `step`
(its 0-dim f32 counter) and `g` (its f32 gradient), numpy arrays of 1,000 elements.
"""

import numpy as np

import stepcore

engine = stepcore.Engine()
rng = np.random.default_rng(0)
p = rng.standard_normal(1000, dtype=np.float32)
g = rng.standard_normal(1000, dtype=np.float32)
m, v, step = np.zeros_like(p), np.zeros_like(p), np.zeros((), np.float32)
