#!/usr/bin/env python
"""One forward + backward of issue 15's strided and grouped shapes inside a profiler range, for ncu.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats python asv_bench/ncu_strided.py

CUDA torch tensors (x = 3 + 2 randn, weight and bias), after three warm-up calls (compilation,
the launch plans) outside the range: NHWC instance norm 32x56x56x64 (float32 and bfloat16),
NHWC group norm (32 groups) 32x56x56x64 bfloat16, ConvNeXt's channels-first layer norm
64x96x56x56 bfloat16 and Stable Diffusion's NCHW group norm 8x320x64x64 bfloat16: the tile,
cluster and shared-memory kernels that ran at 0.16-0.69 of copy on an H200
(``asv_bench/gpu_results/h200-2026-11-27/``).
"""

from __future__ import annotations


def _cases(torch, anynorm):
    def make(shape, dtype, channel_axis):
        x = (torch.randn(shape, device="cuda") * 2 + 3).to(dtype).requires_grad_()
        c = shape[channel_axis]
        w = (torch.rand(c, device="cuda") + 0.5).to(dtype).requires_grad_()
        b = torch.randn(c, device="cuda").to(dtype).requires_grad_()
        return x, w, b, torch.randn_like(x)

    bf16 = torch.bfloat16
    return [
        (lambda x, w, b: anynorm.instance_norm(x, w, b, channel_axis=-1), make((32, 56, 56, 64), torch.float32, -1)),
        (lambda x, w, b: anynorm.instance_norm(x, w, b, channel_axis=-1), make((32, 56, 56, 64), bf16, -1)),
        (lambda x, w, b: anynorm.group_norm(x, 32, w, b, channel_axis=-1), make((32, 56, 56, 64), bf16, -1)),
        (lambda x, w, b: anynorm.layer_norm(x, w, b, axis=1), make((64, 96, 56, 56), bf16, 1)),
        (lambda x, w, b: anynorm.group_norm(x, 32, w, b), make((8, 320, 64, 64), bf16, 1)),
    ]


def main():
    import torch

    import anynorm

    cases = _cases(torch, anynorm)
    for _ in range(3):
        for fn, (x, w, b, dy) in cases:
            fn(x, w, b).backward(dy)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for fn, (x, w, b, dy) in cases:
        fn(x, w, b).backward(dy)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
