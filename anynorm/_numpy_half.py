"""float16 <-> float32 conversion of NumPy blocks by SIMD integer passes.

NumPy's float16 casts convert one element at a time in software (2 ns per element to float32,
3.5 ns back on the development VM); these do the same conversions, bit for bit, in a few
vectorized integer/float passes (0.6 ns and 2.3 ns), so that float16 normalization costs
about what float32 does.  ``src`` and ``out`` have equal shapes; the scratch is contiguous.
"""

from __future__ import annotations

import numpy as np

__all__ = ["float_to_half", "half_to_float"]

_HALF_SCALE = np.float32(2.0 ** 112)  # float16 bits << 13, read as float32, times this: the value
_HALF_KEEP = np.uint32(0x8FFFE000).view(np.int32)  # sign bit, float16 exponent and mantissa
_HALF_MAX = np.float32(65504.0)
_MAGNITUDE = np.uint32(0x7FFFFFFF)
_NORMAL_LO = np.uint32(113 << 23)  # float32 bits of 2**-14, float16's smallest normal value
_NORMAL_HI = np.uint32(143 << 23)  # float32 bits of 2**16, past float16's largest finite value
# exponent bias 127 -> 15 and half a float16 ulp less one, as a wrapping uint32 addend
_REBIAS = np.uint32((0x100000000 - (112 << 23) + 0xFFF) & 0xFFFFFFFF)
_ONE, _SIGN16 = np.uint32(1), np.uint32(0x8000)


def half_to_float(src, out):
    """``out[...] = src`` for float16 ``src`` into float32 ``out``.

    ``bits(out) = (int32(bits(src)) << 13) & 0x8FFFE000`` puts the sign, exponent and
    mantissa in float32's fields with exponent bias 15; ``out *= 2**112`` rebiases it to 127
    (subnormal float16 values come out exact too).  Infinities and NaNs would come out as
    finite values >= 2**16: where any appear, NumPy's cast redoes the block.
    """
    bits = out.view(np.int32)
    np.copyto(bits, src.view(np.int16))  # sign-extending: bit 31 = the float16 sign
    np.left_shift(bits, 13, out=bits)
    np.bitwise_and(bits, _HALF_KEEP, out=bits)
    np.multiply(out, _HALF_SCALE, out=out)
    if out.size and (np.maximum.reduce(out, axis=None) > _HALF_MAX
                     or np.minimum.reduce(out, axis=None) < -_HALF_MAX):
        np.copyto(out, src)


def float_to_half(src, out, tmp, tmp2):
    """``out[...] = src`` rounded to nearest even, for float32 ``src`` into float16 ``out``.

    With ``u = bits(src)`` in float16's normal range (2**-14 <= |src| < 2**16)::

        bits(out) = ((u - (112 << 23) + 0xFFF + ((u >> 13) & 1)) >> 13) | ((u >> 16) & 0x8000)

    (exponent rebiased, mantissa rounded to 10 bits, ties to even; a carry rounds up into the
    exponent, up to infinity).  Elements below that range (zeros, float16 subnormals) are
    cast by NumPy one by one afterwards; a block with anything at or past 2**16 (overflow,
    infinities, NaNs) is cast by NumPy whole.  ``tmp``, ``tmp2``: uint32 scratch of
    ``src``'s shape.
    """
    if src.size == 0:
        return
    u, mag, low = src.view(np.uint32), tmp, tmp2
    np.bitwise_and(u, _MAGNITUDE, out=mag)
    if np.maximum.reduce(mag, axis=None) >= _NORMAL_HI:
        np.copyto(out, src)
        return
    tiny = None
    if np.minimum.reduce(mag, axis=None) < _NORMAL_LO:
        # one scan of the flat mask (np.nonzero on a 2-d mask costs 20x more); few hits
        tiny = np.unravel_index(np.flatnonzero(np.less(mag, _NORMAL_LO)), mag.shape)
    np.right_shift(u, 13, out=low)
    np.bitwise_and(low, _ONE, out=low)
    np.add(u, _REBIAS, out=mag)
    np.add(mag, low, out=mag)
    np.right_shift(u, 16, out=low)
    np.bitwise_and(low, _SIGN16, out=low)
    np.right_shift(mag, 13, out=mag)  # the sign lands on bit 18, which the narrowing drops
    np.bitwise_or(mag, low, out=mag)
    np.copyto(out.view(np.uint16), mag, casting="unsafe")
    if tiny is not None:
        out[tiny] = src[tiny]
