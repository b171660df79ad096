"""Shared fixtures: the array backends, a clean anynorm backend setting, hypothesis profiles."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

import anynorm
from support import BACKEND_NAMES, get_backend

# "ci" (the default): reproducible and quick.  "thorough": for a long local run.
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", params=BACKEND_NAMES)
def backend(request):
    """Each array library under test (skipped when not installed or, for cupy/torch-cuda, no GPU)."""
    return get_backend(request.param)


@pytest.fixture(autouse=True)
def _restore_backend():
    """A test that calls ``set_backend`` leaves the setting as it found it."""
    before = anynorm.get_backend()
    yield
    anynorm.set_backend(before)
