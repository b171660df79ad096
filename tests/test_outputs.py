"""The NumPy executor's reused large outputs (``anynorm._outputs``): a block is handed out
again only once nothing refers to it, results stay those of fresh outputs."""

import ctypes
import gc

import numpy as np
import pytest

import anynorm
from anynorm import _outputs

import reference
from support import run_in_threads

ROWS, N = 2048, 4096  # float32: 32 MiB, past glibc's largest mmap threshold


@pytest.fixture(autouse=True)
def empty_cache(monkeypatch):
    monkeypatch.setattr(_outputs, "ENABLED", True)
    _outputs.clear()
    yield
    _outputs.clear()


def _x(seed=0, shape=(ROWS, N)):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def _ln(x):
    return anynorm.layer_norm(x, axis=-1)


def _held_block(y):
    """The id of the cache's block under ``y`` (failing where ``y`` has none)."""
    assert any(y.base is b for b in _outputs._blocks)
    return id(y.base)


def test_the_loop_pattern_alternates_two_blocks():
    x = _x()
    y = _ln(x)
    blocks = set()
    for _ in range(4):
        y = _ln(x)  # the previous y is alive while the next is made
        blocks.add(_held_block(y))
    assert len(blocks) == 2 and len(_outputs._blocks) == 2


def test_a_residual_loop_alternates_four_blocks():
    x, r = _x(0), _x(1)
    y, h = anynorm.layer_norm(x, residual=r, axis=-1)
    blocks = set()
    for _ in range(4):
        y, h = anynorm.layer_norm(x, residual=r, axis=-1)
        blocks.update((_held_block(y), _held_block(h)))
    assert len(blocks) == 4
    np.testing.assert_array_equal(h, x + r)


def test_the_cache_keeps_its_bounds(monkeypatch):
    monkeypatch.setattr(_outputs, "CACHE_BYTES", 4 * (ROWS * N * 4))
    monkeypatch.setattr(_outputs, "CACHE_BLOCKS", 3)
    x = _x()
    held = [_ln(x) for _ in range(5)]  # all in use: older blocks are forgotten, not reused
    assert len(_outputs._blocks) == 3
    assert len({y.ctypes.data for y in held}) == 5
    wide = _ln(_x(shape=(ROWS, 2 * N)))  # 64 MiB: a block of 32 MiB is not handed out
    assert wide.base.nbytes == wide.nbytes
    assert sum(b.nbytes for b in _outputs._blocks) == _outputs.CACHE_BYTES and len(_outputs._blocks) == 3
    del held, wide
    reused = {_held_block(_ln(x)) for _ in range(3)}
    assert len(reused) == 1


# Ways a caller keeps an output's memory, each with how to read the output back through it:
# each alone must keep its block from reuse.
HOLDERS = {
    "the output": (lambda y: y, lambda h: h),
    "a view": (lambda y: y[5:, ::3], lambda h: h),
    "a memoryview": (memoryview, np.asarray),
    "np.frombuffer": (lambda y: np.frombuffer(y, np.uint8), lambda h: h.view(np.float32).reshape(ROWS, N)),
    "as_strided": (lambda y: np.lib.stride_tricks.as_strided(y, (ROWS // 2, N), (2 * N * 4, 4)), lambda h: h),
    "a ctypes pointer": (lambda y: y.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                         lambda h: np.ctypeslib.as_array(h, (ROWS, N))),
    "a list": (lambda y: [y], lambda h: h[0]),
}
# What each reads back, from the full output
SEEN = {"a view": lambda e: e[5:, ::3], "as_strided": lambda e: e[::2]}


@pytest.mark.parametrize("kind", HOLDERS)
def test_a_block_in_use_is_never_handed_out(kind):
    hold, read = HOLDERS[kind]
    x, other = _x(0), _x(1)
    y = _ln(x)
    expected = SEEN.get(kind, lambda e: e)(y.copy())
    holder = hold(y)
    del y
    gc.collect()
    for _ in range(3):  # fills the cache and more
        _ln(other)
    np.testing.assert_array_equal(read(holder), expected)


def test_a_torch_tensor_keeps_its_block():
    torch = pytest.importorskip("torch")
    x = _x()
    t = torch.from_numpy(_ln(x))
    expected = t.clone()
    others = [_ln(_x(1)) for _ in range(3)]
    assert all(o.ctypes.data != t.data_ptr() for o in others)
    assert torch.equal(t, expected)


def test_small_outputs_and_a_disabled_cache_take_np_empty(monkeypatch):
    rows = _outputs.MIN_BYTES // (4 * 1024)
    small = _ln(_x(shape=(rows - 1, 1024)))
    assert small.base is None and not _outputs._blocks
    smallest = _ln(_x(shape=(rows, 1024)))
    block = _held_block(smallest)
    del smallest
    assert _held_block(_ln(_x(1, shape=(rows, 1024)))) == block
    _outputs.clear()
    monkeypatch.setattr(_outputs, "ENABLED", False)
    y = _ln(_x())
    assert y.base is None and not _outputs._blocks


@pytest.mark.parametrize("call", [
    pytest.param(_ln, id="rows"),
    pytest.param(lambda x: anynorm.layer_norm(x.reshape(8, 256, 64, 64), axis=1), id="channels-first"),
    pytest.param(lambda x: anynorm.group_norm(x.reshape(8, 64, 64, 256), 32, channel_axis=-1),
                 id="nhwc-groups"),
    pytest.param(lambda x: anynorm.layer_norm(x, axis=0), id="columns"),
    pytest.param(lambda x: anynorm.layer_norm_backward(x, x, axis=-1)[0], id="backward"),
    pytest.param(lambda x: anynorm.rms_norm(x.astype(np.float64), axis=-1), id="float64"),
])
def test_every_executor_path_reuses_a_dropped_output_and_agrees(call):
    x = _x()
    first = call(x)
    expected = first.copy()
    block = _held_block(first)
    del first
    second = call(x)
    assert _held_block(second) == block
    np.testing.assert_array_equal(second, expected)
    assert second.shape == expected.shape and second.dtype == expected.dtype
    assert second.flags.c_contiguous and second.flags.writeable


def test_threads_never_share_a_block():
    xs = [_x(seed) for seed in range(4)]
    expected = [reference.forward("layer_norm", x, axis=-1)[0] for x in xs]

    def work(i):
        held = []
        for _ in range(4):
            held.append(_ln(xs[i]))
            held = held[-2:]
            for y in held:
                np.testing.assert_allclose(y, expected[i], rtol=0, atol=2e-5)

    run_in_threads(work, 4)
