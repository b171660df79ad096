"""The tile kernels' vector paths (``kernels/tiles.cu``, issue 15) on the CPU emulator.

Tiles load in 16-byte vectors where inner, the tile width and the buffers allow, else element
by element; y and dx are staged in the tile (in place of x and dy) and stored in the widest of
16-, 8- and 4-byte vectors that divides inner and the width and to which the output starts
aligned (``tile_vec_len``). Odd sizes take the narrower vectors or none: C = 12 or 20 (not multiples of 8: 8-byte vectors in 16-bit types),
C = 6 (4 bytes), HW = 49 (7 x 7: none), HW = 1, and buffers that start off alignment. The
emulator faults on a misaligned vector access (``test_selftest_misaligned_vector_load_is_caught``),
so a wrong choice of width fails here as well as a wrong element.
"""

from __future__ import annotations

import os

import numpy as np

import pytest

import test_kernels_emulated as K
emu = K.emu  # the harness instance whose DeviceArrays K.run_* make

pytestmark = pytest.mark.skipif(emu.compiler() is None or not hasattr(os, "fork"),
                                reason="the CUDA emulation needs g++ and fork()")

DTYPES = ("float16", "bfloat16", "float32", "float64")


@pytest.fixture(scope="module")
def tiles():
    """The tile kernels and param_grad_finish alone."""
    return K.kernel_set(("tiles.cu", "params.cu"), ("cols_fwd_tile", "cols_bwd_tile", "cols_bwd_tile_vec",
                                                    "param_grad_finish"), "tiles-vectors")


# (id, case, tile width): the vector width each dtype takes is in the comment (bytes; "-": none).
CASES = [
    ("ln_cf_7x7_partial", lambda: K.layer_norm_channels_first(2, 12, 7, 7), 16),  # inner 49: -
    ("ln_cf_7x7_whole", lambda: K.layer_norm_channels_first(2, 12, 7, 7), 49),  # one tile of 49: -
    ("ln_cf_14x14", lambda: K.layer_norm_channels_first(2, 10, 14, 14), 64),  # 196: 8 (16-bit), 16
    ("in_nhwc_c12", lambda: K.instance_norm_nhwc(2, 5, 5, 12), 12),  # 8 (16-bit), 16 (float32, 64)
    ("in_nhwc_c6", lambda: K.instance_norm_nhwc(2, 3, 5, 6), 6),  # 4 (16-bit), 8 (float32), 16 (64)
    ("gn_nhwc_c20", lambda: K.group_norm_nhwc(2, 3, 3, 20, 5), 8),  # group 4: 8 / 16, last tile 4 wide
    ("in_nhwc_hw1", lambda: K.instance_norm_nhwc(3, 1, 1, 24), 8),  # one row per slice: 16
    ("gn_nhwc_hw1", lambda: K.group_norm_nhwc(2, 1, 1, 40, 5), 16),  # group 8, one row
    ("in_nhwc_c64", lambda: K.instance_norm_nhwc(2, 37, 1, 64), 16),  # 16 bytes, 37 rows
    ("ln_cf_3136", lambda: K.layer_norm_channels_first(1, 6, 56, 56), 256),  # 16 bytes, 13 tiles
]
# element offsets of every buffer: 0 (aligned), 1 (16-bit: 2 bytes, none), 2 (16-bit: 4 bytes)
OFFSETS = (0, 1, 2)


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,make,width", CASES, ids=[c[0] for c in CASES])
def test_tile_forward_vectors(tiles, name, make, width, dtype, offset):
    K.check_forward(tiles, make(), dtype, path="tile", items=width, offset=offset,
                    residual=dtype != "float64")


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,make,width", CASES, ids=[c[0] for c in CASES])
def test_tile_backward_vectors(tiles, name, make, width, dtype, offset):
    K.check_backward(tiles, make(), dtype, path="tile", items=width, offset=offset)


@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
@pytest.mark.parametrize("name,make,width", CASES, ids=[c[0] for c in CASES])
def test_tile_stats_only_and_rms(tiles, name, make, width, dtype):
    """No y (statistics alone: nothing staged) and RMS norm (no shift)."""
    K.check_forward(tiles, make(), dtype, path="tile", items=width, want_y=False)
    K.check_forward(tiles, make(), dtype, path="tile", items=width, center=0)
    K.check_backward(tiles, make(), dtype, path="tile", items=width, center=0)


# The forward's arithmetic in shared-memory vectors (tiles.cu: fwd_tile_vec, taken where a tile
# row holds a power of two, at most 64, of TileCpt-column vectors: 4 columns in 16-bit types
# and float32, 2 in float64): statistics of 1, 2, 4 and 32 columns next to the vector width,
# vectors side by side in a warp (qw) from 1 to 8, warps sharing columns (G) from 8 to 1, and
# the scalar form where the width is no such multiple (the CASES above: widths 12, 6, 49).
VECTOR_CASES = [
    ("ln_cf_w8", lambda: K.layer_norm_channels_first(2, 13, 3, 8), 8),  # 2 (f32) / 4 (f64) vectors a row
    ("ln_cf_w32_partial", lambda: K.layer_norm_channels_first(1, 7, 5, 9), 32),  # inner 45: second tile 13 wide
    ("ln_cf_w128", lambda: K.layer_norm_channels_first(2, 5, 1, 200), 128),  # 32 vectors: 4 warps a row
    ("gn_nhwc_g2", lambda: K.group_norm_nhwc(2, 5, 7, 64, 32), 16),  # 2 statistics in each vector
    ("gn_nhwc_g32", lambda: K.group_norm_nhwc(1, 3, 5, 128, 4), 64),  # a statistic over 8 vectors
    ("in_nhwc_long", lambda: K.instance_norm_nhwc(1, 11, 29, 8), 8),  # 319 rows, 64-128 lanes a column
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,make,width", VECTOR_CASES, ids=[c[0] for c in VECTOR_CASES])
def test_tile_forward_vector_form(tiles, name, make, width, dtype):
    """fwd_tile_vec against the float64 reference: y, mean and rstd, with a residual, without
    parameters, as RMS norm, and with weight and bias stored in x's dtype (channels-first
    layer norm: the per-storage loops) or weight alone (the generic loop)."""
    case = make()
    K.check_forward(tiles, case, dtype, path="tile", items=width, residual=dtype != "float64")
    K.check_forward(tiles, case, dtype, path="tile", items=width, weight=False, bias=False)
    K.check_forward(tiles, case, dtype, path="tile", items=width, center=0, bias=False)
    K.check_forward(tiles, case, dtype, path="tile", items=width, params_in_t=True)
    K.check_forward(tiles, case, dtype, path="tile", items=width, bias=False, params_in_t=True)
    K.check_forward(tiles, case, dtype, path="tile", items=width, want_y=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,make,width", VECTOR_CASES, ids=[c[0] for c in VECTOR_CASES])
def test_tile_backward_vector_form(tiles, name, make, width, dtype):
    """cols_bwd_tile_vec (the launcher's choice at these widths) and cols_bwd_tile on the same
    launch against the float64 reference: dx with a weight in A and in x's dtype, without
    one, and as RMS norm; dweight/dbias partial sums per column (NHWC) or per row
    (channels-first), with and without dbias, on a grid of one block and of one per item."""
    case = make()
    assert K.tile_bwd_kernel(case, dtype, width) == "cols_bwd_tile_vec"
    for kernel in ("cols_bwd_tile_vec", "cols_bwd_tile"):
        K.check_backward(tiles, case, dtype, path="tile", items=width, kernel=kernel)
    K.check_backward(tiles, case, dtype, path="tile", items=width, params_in_t=True)
    K.check_backward(tiles, case, dtype, path="tile", items=width, weight=False)
    K.check_backward(tiles, case, dtype, path="tile", items=width, center=0)
    x, w, _ = K._data(case, dtype, 3)
    dy = np.random.default_rng(4).standard_normal(case.shape)
    xr, dyr = K._rounded(x, dtype), K._rounded(dy, dtype)
    _, mean, rstd = K.ref_forward(case, xr, None, None, 1, 1e-5)
    for blocks in (1, None):
        for with_bias in (True, False):
            got = K.tile_param_grads_launch(tiles, case, dtype, dy, x, w, mean, rstd, width, blocks=blocks,
                                            with_bias=with_bias)
            K.check_tile_param_grads(case, dtype, dyr, xr, w, *got)


def test_vector_backward_refuses_other_widths(tiles):
    """cols_bwd_tile_vec traps (the launch fails) at a width its geometry does not hold (12
    columns: 3 vectors a row), where the launcher takes cols_bwd_tile."""
    case = K.instance_norm_nhwc(2, 5, 5, 12)
    assert K.tile_bwd_kernel(case, "float32", 12) == "cols_bwd_tile"
    with pytest.raises(emu.EmulationError, match="__trap"):
        K.check_backward(tiles, case, "float32", path="tile", items=12, kernel="cols_bwd_tile_vec")
