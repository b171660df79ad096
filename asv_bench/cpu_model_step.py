"""A ConvNeXt-like model on torch CPU with its norms from ``torch.nn`` or ``anynorm.nn``: the
end-to-end ratio of a training step and of inference, interleaved round by round.

The model is timm's ConvNeXt in miniature: a 4x4 stem convolution and ``LayerNorm2d``
(channels-first layer norm: timm permutes to NHWC, normalizes, permutes back), then per stage
a ``LayerNorm2d`` and 2x2 downsampling convolution, and blocks of a 7x7 depthwise convolution,
``LayerNorm`` over the channels of the NHWC permute, a 4x MLP with GELU and the residual.
anynorm's side uses ``anynorm.nn.LayerNorm(C, axis=1)`` for ``LayerNorm2d``; both sides share
the weights.  ``--channels-last`` feeds the images in channels_last memory: timm's
``LayerNorm2d`` returns channels_last either way, anynorm's returns x's layout, so without it
every convolution after the stem runs NCHW on anynorm's side and channels_last on torch's.

    python asv_bench/cpu_model_step.py [--rounds 7] [--batch 16] [--size 128]
                                       [--dims 96,192,384,768] [--depth 2] [--channels-last]

Prints ``max |y_anynorm - y_torch|`` and, per mode, each side's median time and the median
(min-max) of the per-round ratio anynorm / torch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import anynorm.nn as ann


class LayerNorm2d(nn.Module):
    """Channels-first layer norm: timm's idiom (``ours=False``) or anynorm's over axis 1."""

    def __init__(self, channels, ours):
        super().__init__()
        self.ours = ours
        self.norm = ann.LayerNorm(channels, axis=1) if ours else nn.LayerNorm(channels)

    def forward(self, x):
        if self.ours:
            return self.norm(x)
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Block(nn.Module):
    def __init__(self, channels, ours):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = (ann.LayerNorm if ours else nn.LayerNorm)(channels)
        self.fc1, self.fc2 = nn.Linear(channels, 4 * channels), nn.Linear(4 * channels, channels)

    def forward(self, x):
        y = self.norm(self.conv(x).permute(0, 2, 3, 1))
        return x + self.fc2(nn.functional.gelu(self.fc1(y))).permute(0, 3, 1, 2)


def model(ours, dims, depth):
    layers = [nn.Conv2d(3, dims[0], 4, 4), LayerNorm2d(dims[0], ours)]
    for i, channels in enumerate(dims):
        if i:
            layers += [LayerNorm2d(dims[i - 1], ours), nn.Conv2d(dims[i - 1], channels, 2, 2)]
        layers += [Block(channels, ours) for _ in range(depth)]
    return nn.Sequential(*layers)


def _train_step(net, images):
    net.zero_grad(set_to_none=True)
    net(images).square().mean().backward()


def _infer(net, images):
    with torch.no_grad():
        net(images)


def _seconds(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--dims", default="96,192,384,768")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--channels-last", action="store_true")
    args = parser.parse_args(argv)
    dims = tuple(int(d) for d in args.dims.split(","))
    torch.manual_seed(0)
    ours, theirs = model(True, dims, args.depth), model(False, dims, args.depth)
    theirs.load_state_dict(ours.state_dict())
    images = torch.randn(args.batch, 3, args.size, args.size)
    if args.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        print(f"max |y_anynorm - y_torch| {(ours(images) - theirs(images)).abs().max().item():.2e}")
    for name, fn in (("train step", _train_step), ("inference", _infer)):
        for net in (ours, theirs, ours, theirs):  # warm both, twice
            fn(net, images)
        mine, peer = [], []
        for _ in range(args.rounds):
            mine.append(_seconds(fn, ours, images))
            peer.append(_seconds(fn, theirs, images))
        ratios = sorted(a / b for a, b in zip(mine, peer))
        print(f"{name}: anynorm {statistics.median(mine) * 1e3:.1f} ms, torch {statistics.median(peer) * 1e3:.1f} ms, "
              f"anynorm / torch {statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
