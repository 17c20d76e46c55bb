"""The exact L2 and L1 norms in Python integers, rounded once to f32: the tests' independent
reference."""

import math


def round_sqrt_to_f32(s):
    """Returns sqrt(s * 2^-298) correctly rounded to f32 (ties to even), s a non-negative int."""
    if s == 0:
        return 0.0
    j = max(0, (130 - s.bit_length()) // 2 + 1)   # >= 65 bits of the root
    t = s << (2 * j)
    q = math.isqrt(t)
    sticky = q * q != t                          # root in (q, q+1) when inexact
    e = -149 - j                                 # root = (q + frac) * 2^e
    msb = q.bit_length() - 1 + e
    lsb = max(msb - 23, -149)                    # f32 ulp there (subnormals: 2^-149)
    shift = lsb - e
    m, rem, half = q >> shift, q & ((1 << shift) - 1), 1 << (shift - 1)
    if rem > half or (rem == half and (sticky or m & 1)):
        m += 1
    r = math.ldexp(m, lsb)
    return math.inf if r >= 2.0**128 else r


def exact_norm(tensors):
    """Returns the correctly rounded f32 L2 norm of the tensors' values (NaN, then Inf win)."""
    s, nan, inf = 0, False, False
    for t in tensors:
        for x in t.detach().float().reshape(-1).tolist():
            if math.isnan(x):
                nan = True
            elif math.isinf(x):
                inf = True
            else:
                n, d = x.as_integer_ratio()        # d is a power of two <= 2^149
                k = n * ((1 << 149) // d)          # x * 2^149, an integer
                s += k * k
    if nan:
        return math.nan
    if inf:
        return math.inf
    return round_sqrt_to_f32(s)


def round_units_to_f32(s):
    """Returns s * 2^-149 correctly rounded to f32 (ties to even), s a non-negative int."""
    if s == 0:
        return 0.0
    drop = max(s.bit_length() - 24, 0)           # the f32 grid there, in units of 2^-149
    m, rem = s >> drop, s & ((1 << drop) - 1)
    half = (1 << drop) >> 1
    if drop and (rem > half or (rem == half and m & 1)):
        m += 1
    r = math.ldexp(m, drop - 149)
    return math.inf if r >= 2.0**128 else r


def exact_l1(tensors):
    """Returns the correctly rounded f32 1-norm of the tensors' values (NaN, then Inf win)."""
    s, nan, inf = 0, False, False
    for t in tensors:
        for x in t.detach().float().reshape(-1).tolist():
            if math.isnan(x):
                nan = True
            elif math.isinf(x):
                inf = True
            else:
                n, d = abs(x).as_integer_ratio()
                s += n * ((1 << 149) // d)         # |x| * 2^149, an integer
    if nan:
        return math.nan
    if inf:
        return math.inf
    return round_units_to_f32(s)
