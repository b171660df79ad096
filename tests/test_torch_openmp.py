"""anynorm's threads for torch calls run in torch's own OpenMP team (anynorm._torch_openmp)."""

import gc
import sys
import threading
import weakref

import pytest

torch = pytest.importorskip("torch")

import anynorm  # noqa: E402
from anynorm import _numpy, _torch_openmp  # noqa: E402


@pytest.fixture
def team():
    found = _torch_openmp.team()
    if found is None:
        pytest.skip("torch's OpenMP runtime not found here (not Linux, or not libgomp-like)")
    return found


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def test_found_where_torch_runs_on_openmp():
    """On Linux with torch on OpenMP (its wheels' libgomp) the runtime is found: without it
    the pool would share the cores with torch's spinning threads."""
    if not sys.platform.startswith("linux") or "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("not Linux, or torch not on OpenMP")
    assert _torch_openmp.team() is not None


def test_tasks_run_once_each_on_separate_threads_in_order(team, two_threads):
    ran = []

    def task(i):
        def run():
            ran.append((i, threading.get_native_id()))
            return i * 10
        return run

    assert team.run([task(i) for i in range(2)]) == [0, 10]
    assert sorted(i for i, _ in ran) == [0, 1]
    assert len({tid for _, tid in ran}) == 2
    assert threading.get_native_id() in {tid for _, tid in ran}  # the caller is thread 0


def test_more_tasks_than_threads_and_nested_regions(team, two_threads):
    """A region inside a task has one thread, which runs every inner task."""
    inner = lambda: team.run([lambda i=i: i for i in range(5)])  # noqa: E731
    assert team.run([inner, inner, lambda: 7]) == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], 7]


def test_an_exception_in_a_task_is_raised_after_all_ran(team, two_threads):
    ran = []

    def bad():
        raise ValueError("from a task")

    with pytest.raises(ValueError, match="from a task"):
        team.run([bad, lambda: ran.append(1)])
    assert ran == [1]


def test_leaves_no_reference_cycle(team, two_threads):
    """The outputs a task returns are freed with the call, not by the garbage collector:
    the output cache (anynorm._outputs) reuses a block only once nothing refers to it
    (ctypes.cast of the callback made a cycle: 128 MiB outputs faulted in again, 25x slower)."""
    class Output:
        pass

    def run_returning_one():
        out = Output()
        team.run([lambda: out, lambda: None])
        return weakref.ref(out)

    enabled = gc.isenabled()
    gc.disable()
    try:
        alive = run_returning_one()
        with pytest.raises(KeyError):
            team.run([lambda: {}["x"], lambda: None])
        assert alive() is None
    finally:
        if enabled:
            gc.enable()


def test_torch_calls_on_the_team_match_the_pool(monkeypatch, two_threads):
    """A threaded torch CPU call gives the same bits on torch's team as on anynorm's pool,
    forward and backward (the same parts, the same kernels)."""
    from anynorm import _torch, _torch_direct

    monkeypatch.setattr(_numpy, "NUM_THREADS", 2)
    monkeypatch.setattr(_torch_direct, "DIRECT_MAX_THREADED_ELEMENTS", 0)  # the executor, not the packed call
    x = torch.randn(1536, 4096) * 3 + 1e3  # rows past NATIVE_MAX_ROW: the executor's
    assert x.numel() * 4 >= _torch.LONG_ROWS_KERNEL_MIN_BYTES and x.numel() >= _numpy.PARALLEL_MIN_ELEMENTS
    w, b, dy = torch.randn(4096), torch.randn(4096), torch.randn(1536, 4096)

    def call():
        y, mean, rstd = anynorm.layer_norm(x, weight=w, bias=b, return_stats=True)
        return (y, mean, rstd) + tuple(anynorm.layer_norm_backward(dy, x, weight=w, stats=(mean, rstd)))

    teams = []
    real_run = _numpy._run
    monkeypatch.setattr(_numpy, "_run", lambda *a, **kw: teams.append(kw.get("team")) or real_run(*a, **kw))
    on_team = call()
    assert len(teams) == 2 and all((t is None) == (_torch_openmp.team() is None) for t in teams)
    monkeypatch.setattr(_torch_openmp, "_TEAM", False)
    on_pool = call()
    assert len(teams) == 4 and teams[2:] == [None, None]
    for a, b_ in zip(on_team, on_pool):
        assert torch.equal(a, b_)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("ANYNORM_TORCH_OPENMP", "0")
    assert _torch_openmp._find() is None


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork here")
def test_a_forked_child_runs_on_one_thread(team, two_threads):
    """A child forked after the team ran has none of its threads (libgomp would wait on them
    for ever, as torch's own parallel ops do there): its calls run on one thread."""
    import os
    import subprocess
    import textwrap

    script = textwrap.dedent("""
        import os, sys, torch, anynorm
        from anynorm import _torch_openmp
        torch.set_num_threads(2)
        x = torch.randn(256, 768)
        with torch.no_grad():
            parent = anynorm.layer_norm(x)
            assert _torch_openmp.kernels_on_team()
            pid = os.fork()
            if pid == 0:
                # (no torch op here: torch's own parallel ops wait for ever in such a child)
                ok = (anynorm.layer_norm(x).numpy() == parent.numpy()).all() and _torch_openmp.team() is None
                os._exit(0 if ok else 3)
            _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(anynorm.__file__)),
                                                                   os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", script], env=env, timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
