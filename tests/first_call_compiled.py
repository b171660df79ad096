"""A process whose first anynorm call on a tensor is traced by torch.compile(fullgraph=True),
anynorm imported before torch: torch must be bound (the ops registered, the per-type caches
seeded, the backend in force read as a constant) while Dynamo traces that call, with no
warning of anynorm's making. Run by tests/test_compile.py (CPU) and tests/gpu/test_hot_path.py
(CUDA, mode "reduce-overhead"): ``python first_call_compiled.py DEVICE [MODE]``; prints "ok".
"""

import sys
import warnings

import anynorm  # before torch: anynorm binds torch at its first call on a tensor
import torch

device, mode = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
w = torch.rand(16, device=device) + 0.5
x = torch.randn(4, 16, device=device) * 3 + 100


def block(x):
    y, h = anynorm.layer_norm(x, w, None, residual=x)
    z = anynorm.rms_norm(y, w, axis=[-1])  # a list axis: the call that no cache key takes
    return z + h + anynorm.group_norm(x.reshape(4, 4, 4), 2).reshape(4, 16)


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    compiled = torch.compile(block, fullgraph=True, mode=mode)
    got = [compiled(x) for _ in range(3)]  # reduce-overhead records on a later call
ours = [str(m.message)[:300] for m in caught
        if "lru_cache" in str(m.message) or "anynorm" in m.filename]
assert not ours, ours
for out in got:
    torch.testing.assert_close(out, block(x), rtol=1e-5, atol=1e-4)
print("ok")
