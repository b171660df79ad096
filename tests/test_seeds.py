"""The worked examples printed in the seed tutorials, reproduced to their 4 printed decimals.

Inputs are the tutorials' own: printed integer tensors, or ``torch.manual_seed`` draws (which
need torch) passed through the tutorial's sinusoidal positional encoding.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import anynorm

PRINTED = 0.5e-4 + 1e-6  # "to 4 decimals": within half a unit of the last printed digit


def assert_printed(actual, printed):
    """``actual`` rounds to the ``printed`` 4-decimal numbers."""
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), np.asarray(printed), rtol=0, atol=PRINTED)


# A (4, 5, 3) tensor of integers normalized over its last two axes, as nn.LayerNorm((5, 3)).
MATRICES = [
    [[76, 2, 43], [79, 50, 29], [59, 78, 73], [95, 94, 76], [9, 74, 64]],
    [[76, 87, 50], [2, 65, 44], [74, 9, 82], [83, 54, 82], [6, 97, 52]],
    [[88, 19, 95], [14, 96, 96], [93, 58, 0], [19, 37, 6], [28, 23, 7]],
    [[7, 54, 59], [57, 30, 18], [88, 89, 63], [56, 75, 56], [63, 23, 73]],
]
MATRIX_MEANS = [60.0667, 57.5333, 45.2667, 54.0667]
MATRIX_VARS = [751.6622, 887.8489, 1344.1956, 561.9289]
MATRICES_NORMED = [
    [[0.5812, -2.1179, -0.6225], [0.6906, -0.3672, -1.1331], [-0.0389, 0.6541, 0.4717],
     [1.2742, 1.2377, 0.5812], [-1.8626, 0.5082, 0.1435]],
    [[0.6198, 0.9889, -0.2528], [-1.8637, 0.2506, -0.4542], [0.5526, -1.6288, 0.8211],
     [0.8547, -0.1186, 0.8211], [-1.7295, 1.3245, -0.1857]],
    [[1.1656, -0.7164, 1.3565], [-0.8528, 1.3838, 1.3838], [1.3019, 0.3473, -1.2347],
     [-0.7164, -0.2255, -1.0710], [-0.4710, -0.6073, -1.0437]],
    [[-1.9855, -0.0028, 0.2081], [0.1237, -1.0153, -1.5215], [1.4315, 1.4737, 0.3769],
     [0.0816, 0.8831, 0.0816], [0.3769, -1.3106, 0.7987]],
]

# A (2, 3, 5) batch: 2 sequences of 3 tokens with 5-element embeddings, normalized per token.
TOKENS = [
    [[49, 90, 29, 76, 33], [86, 42, 20, 56, 79], [40, 49, 72, 16, 85]],
    [[44, 62, 14, 46, 5], [22, 45, 8, 47, 78], [96, 17, 7, 56, 60]],
]
TOKEN_MEANS = [[55.4, 56.6, 52.4], [34.2, 40.0, 47.2]]
TOKENS_NORMED = [
    [[-0.2675, 1.4464, -1.1036, 0.8611, -0.9364], [1.2167, -0.6042, -1.5147, -0.0248, 0.9270],
     [-0.5116, -0.1403, 0.8087, -1.5018, 1.3450]],
    [[0.4601, 1.3051, -0.9483, 0.5539, -1.3708], [-0.7518, 0.2088, -1.3366, 0.2924, 1.5872],
     [1.5204, -0.9409, -1.2525, 0.2742, 0.3988]],
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_matrices_over_last_two_axes(backend, dtype):
    x = backend.asarray(MATRICES, dtype)
    y, mean, rstd = anynorm.layer_norm(x, axis=(-2, -1), return_stats=True)
    assert tuple(mean.shape) == (4, 1, 1)
    assert_printed(backend.to_numpy(y), MATRICES_NORMED)
    assert_printed(backend.to_numpy(mean).ravel(), MATRIX_MEANS)
    variance = 1.0 / backend.to_numpy(rstd).ravel() ** 2 - 1e-5  # rstd = 1/sqrt(var + eps)
    np.testing.assert_allclose(variance, MATRIX_VARS, rtol=0, atol=1e-3 if dtype == "float32" else PRINTED)


def test_matrices_with_the_layer_norm_module():
    """The tutorial's ``nn.LayerNorm((5, 3))`` call, through anynorm.nn."""
    torch = pytest.importorskip("torch")
    module = anynorm.nn.LayerNorm((5, 3))
    y = module(torch.tensor(MATRICES, dtype=torch.float32))
    assert y.grad_fn is not None
    assert_printed(y.detach().numpy(), MATRICES_NORMED)


@pytest.mark.parametrize("axis", [-1, 2, (2,)])
def test_token_batch(backend, axis):
    x = backend.asarray(TOKENS, "float32")
    y, mean, _ = anynorm.layer_norm(x, axis=axis, return_stats=True)
    assert_printed(backend.to_numpy(mean)[..., 0], TOKEN_MEANS)
    assert_printed(backend.to_numpy(y), TOKENS_NORMED)


def test_token_batch_module_state_dict():
    """``nn.LayerNorm((5,))``'s state_dict is weight of ones and bias of zeros, under those keys."""
    torch = pytest.importorskip("torch")
    state = anynorm.nn.LayerNorm((5,)).state_dict()
    assert list(state) == ["weight", "bias"]
    assert torch.equal(state["weight"], torch.ones(5)) and torch.equal(state["bias"], torch.zeros(5))


def test_standard_scores_with_eps_zero(backend):
    """The z-scores of [22, 5, 6, 8, 10, 19, 2]: mean 10.2857, std 6.9016 (layer norm with eps=0)."""
    x = backend.asarray([22, 5, 6, 8, 10, 19, 2], "float32")
    y, mean, rstd = anynorm.layer_norm(x, eps=0, return_stats=True)
    assert_printed(backend.to_numpy(mean), [10.2857])
    assert_printed(1.0 / backend.to_numpy(rstd), [6.9016])
    assert_printed(backend.to_numpy(y), [1.6973, -0.7659, -0.6210, -0.3312, -0.0414, 1.2626, -1.2005])


# --- torch.manual_seed draws through the tutorial's positional encoding -----------------------

def positional_encoding(torch, x):
    """Scale by sqrt(d_model), add sin (even) / cos (odd) encodings: the tutorial's module."""
    length, d_model = x.shape[1], x.shape[2]
    position = torch.arange(0, length).float().unsqueeze(1)
    speed = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
    pe = torch.zeros(length, d_model)
    pe[:, 0::2] = torch.sin(position * speed)
    pe[:, 1::2] = torch.cos(position * speed)
    return x * math.sqrt(d_model) + pe.unsqueeze(0)


SEED34_INPUTS = [
    [[-3.8049, 1.9899, -1.7325, 2.1359], [1.7854, 0.8155, 0.1116, -1.7420]],
    [[-2.4273, 1.3559, 2.8615, 2.0084], [-1.0353, -1.2766, -2.2082, -0.6952]],
    [[-0.8044, 1.9707, 3.3704, 2.0587], [4.2256, 6.9575, 1.4770, 2.0762]],
]
SEED34_MEANS = [[-0.3529, 0.2426], [0.9496, -1.3038], [1.6489, 3.6841]]
SEED34_VARS = [[6.3756, 1.6661], [4.0862, 0.3153], [2.3135, 4.6163]]
SEED34_NORMED = [
    [[-1.3671, 0.9279, -0.5464, 0.9857], [1.1953, 0.4438, -0.1015, -1.5376]],
    [[-1.6706, 0.2010, 0.9458, 0.5238], [0.4782, 0.0485, -1.6106, 1.0839]],
    [[-1.6129, 0.2116, 1.1318, 0.2695], [0.2520, 1.5236, -1.0272, -0.7484]],
]


def test_seed34_step_by_step(backend):
    torch = pytest.importorskip("torch")
    torch.manual_seed(34)
    inputs = positional_encoding(torch, torch.randn(3, 2, 4))
    assert_printed(inputs.numpy(), SEED34_INPUTS)
    y, mean, rstd = anynorm.layer_norm(backend.asarray(inputs.numpy(), "float32"), return_stats=True)
    assert_printed(backend.to_numpy(mean)[..., 0], SEED34_MEANS)
    assert_printed(1.0 / backend.to_numpy(rstd)[..., 0] ** 2 - 1e-5, SEED34_VARS)
    assert_printed(backend.to_numpy(y), SEED34_NORMED)
    # the tutorial's check: each normalized token has mean 0 and (biased) std 1
    first = backend.to_numpy(y)[0, 0]
    assert abs(first.mean()) < 1e-6 and abs(first.std() - 1.0) < PRINTED


def test_seed23_wide_tokens():
    """(4, 1, 256) draws: the printed first and last three features, before and after."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(23)
    encoded = positional_encoding(torch, torch.randn(4, 1, 256))
    ends = lambda t: torch.cat([t[:, 0, :3], t[:, 0, -3:]], dim=1).detach().numpy()  # noqa: E731
    assert_printed(ends(encoded), [
        [-14.4193, 10.0495, -7.8116, -15.4844, -18.0732, -3.9566],
        [2.6628, -3.5462, -23.6461, -0.9403, -18.4375, -37.4197],
        [-24.6397, -1.9127, -16.4244, -17.3708, -26.0550, -14.0706],
        [13.7988, 21.4612, 10.4125, -3.2333, -17.0188, 3.9237]])
    normed = anynorm.nn.LayerNorm(256)(encoded)
    assert_printed(ends(normed), [
        [-0.9210, 0.5911, -0.5127, -0.9868, -1.1467, -0.2744],
        [0.1399, -0.2607, -1.5574, -0.0925, -1.2214, -2.4460],
        [-1.5755, -0.1191, -1.0491, -1.1097, -1.6662, -0.8982],
        [0.8643, 1.3324, 0.6575, -0.1761, -1.0183, 0.2611]])


def test_two_features_become_plus_minus_one(backend):
    """Layer norm over two features gives -1 and +1 whatever the values (the tutorial's warning)."""
    torch = pytest.importorskip("torch")
    source = torch.tensor([[[1.0349, 0.9661], [0.8055, -0.9169]]])
    encoded = positional_encoding(torch, source)
    assert_printed(encoded.numpy(), [[[1.4636, 2.3663], [1.9806, -0.7564]]])
    y = anynorm.layer_norm(backend.asarray(encoded.numpy(), "float32"))
    assert_printed(backend.to_numpy(y), [[[-1.0, 1.0], [1.0, -1.0]]])


def test_seed11_projected_sequence():
    """A seeded nn.Linear(2, 6) projection, encoded, then normalized over its 6 features."""
    torch = pytest.importorskip("torch")
    source = torch.tensor([[[1.0349, 0.9661], [0.8055, -0.9169]]])
    torch.manual_seed(11)
    projected = positional_encoding(torch, torch.nn.Linear(2, 6)(source))
    assert_printed(projected.detach().numpy(), [
        [[-2.0934, 1.5040, 1.8742, 0.0628, 0.3034, 2.0190],
         [-0.8853, 2.8213, 0.5911, 2.4193, -2.5230, 0.3599]]])
    normed = anynorm.nn.LayerNorm(6)(projected)
    assert_printed(normed.detach().numpy(), [
        [[-1.9061, 0.6287, 0.8896, -0.3868, -0.2172, 0.9917],
         [-0.7362, 1.2864, 0.0694, 1.0670, -1.6299, -0.0568]]])
