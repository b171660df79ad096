"""Find and read the CUDA sources in ``kernels/``.

Installed from a wheel, they sit in ``anynorm/kernels/`` (pyproject maps the top-level
``kernels/`` directory there as package data); in a source checkout or an editable install
they are the repository's ``kernels/`` next to the ``anynorm`` package. The local
``#include "common.cuh"`` is expanded here so that CuPy's compile cache, keyed on the source
text, sees header changes too.
"""

from __future__ import annotations

import functools
import os
import re

__all__ = ["kernel_dir", "read_source", "SOURCE_FILES"]

SOURCE_FILES = ("rows.cu", "cols.cu", "tiles.cu", "samples.cu", "finish.cu", "params.cu")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def _candidates():
    yield os.path.join(_PACKAGE_DIR, "kernels")  # installed wheel
    yield os.path.join(os.path.dirname(_PACKAGE_DIR), "kernels")  # source checkout


@functools.lru_cache(maxsize=None)
def kernel_dir() -> str:
    """The directory holding ``common.cuh`` and the ``.cu`` files."""
    for path in _candidates():
        if os.path.isfile(os.path.join(path, "common.cuh")):
            return path
    raise FileNotFoundError("anynorm's CUDA sources (kernels/*.cu) were not found in any of "
                            f"{list(_candidates())}; reinstall anynorm")


def _read(name: str, seen: frozenset) -> str:
    path = os.path.join(kernel_dir(), name)
    with open(path, encoding="utf-8") as f:
        text = f.read()

    def expand(match):
        header = match.group(1)
        if header in seen:  # a second inclusion of a `#pragma once` header
            return ""
        return f'// ---- begin "{header}"\n{_read(header, seen | {header})}\n// ---- end "{header}"'

    return _LOCAL_INCLUDE.sub(expand, text)


@functools.lru_cache(maxsize=None)
def read_source(name: str) -> str:
    """Text of ``kernels/<name>`` with its local ``#include "..."`` lines inlined."""
    return _read(name, frozenset({name}))
