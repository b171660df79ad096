"""``asv_bench/gpu_report.py`` runs end to end on CPU with tiny shapes, so the one command a GPU
session runs does not rot between sessions: every case checks out against torch and is timed.
The pieces that need no GPU are also tested in this process: argument parsing and section
selection, the sweeps and their --quick subsets, table formatting and the targets' pass/miss,
the Liger columns (blank without Liger; filled by a torch stand-in of its functional API, whose
refusal of a shape is a note, not a failure), the profiler-record filter behind the kernel-only
times, and the e2e section's model swapping (every LayerNorm replaced, state_dict keys kept,
outputs equal to the native model's). Nothing here asserts anything about time."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import pathlib
import subprocess
import sys
import types

import pytest

torch = pytest.importorskip("torch")

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "asv_bench" / "gpu_report.py"
# on CPU, --tiny --quick: 6 row widths x 2 dtypes x (layer/RMS norm) x (fwd, fwd+bwd); 10 strided
# workloads (ConvNeXt's first and last stage on NCHW and channels_last memory, NHWC instance and
# group norm and Stable Diffusion's NCHW group norm at their first and last stage) x 2 dtypes x
# 2 passes; 2 shapes x (no_grad, train); ConvNeXt NCHW and channels_last, TransformerEncoder,
# pre-norm blocks with the fused residual and with explicit adds
EXPECTED_ROWS = {"rows": 48, "strided": 40, "overhead": 4, "e2e": 7}
CASE_KEYS = {"section", "name", "shape", "dtype", "pass", "lib", "error", "errors", "max_err", "check_ok"}
# tiny e2e models: MiniConvNeXt (stem, one downsampling, two blocks, head), 2 pre-norm layers
E2E_SWAPPED = {"convnext_tiny NCHW": 5, "convnext_tiny channels_last": 5, "TransformerEncoder pre-norm": 4,
               "pre-norm blocks, fused residual": 4, "pre-norm blocks, explicit adds": 4}
E2E_GRAPHED = ("convnext_tiny NCHW, graphed", "pre-norm blocks, fused residual, graphed")  # CUDA only
TIMM = importlib.util.find_spec("timm") is not None


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_report"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gr():
    return load_script()


@pytest.fixture(scope="module")
def an_nn(gr):
    gr.import_anynorm()
    import anynorm.nn

    return anynorm.nn


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_report")
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=SCRIPT.parent.parent)
    return done, out


# --------------------------------------------------------------------------- the whole run

def test_exit_status_and_files(report):
    done, out = report
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (out / "gpu_report.md").read_text() == done.stdout.split("wrote ")[0].rstrip("\n") + "\n"


def test_json_has_every_case_without_errors(report):
    _, out = report
    data = json.loads((out / "gpu_report.json").read_text())
    assert {"meta", "targets", "cases"} <= set(data)
    assert data["meta"]["device"] == "cpu" and data["meta"]["elapsed_s"] > 0
    assert data["meta"]["settings"]["sections"] == ["rows", "strided", "overhead", "e2e"]
    assert data["meta"]["planned_cases"] == sum(EXPECTED_ROWS.values())
    cases = data["cases"]
    counts = {section: sum(c["section"] == section for c in cases) for section in EXPECTED_ROWS}
    assert counts == EXPECTED_ROWS
    for case in cases:
        assert CASE_KEYS <= set(case), case
        assert case["error"] is None, (case["name"], case["error"], case.get("traceback"))
        if case["name"] in E2E_GRAPHED:  # CUDA graphs: not on a CPU run
            assert case["unavailable"] == "CUDA graphs need a CUDA device", case
            continue
        assert case["check_ok"] is True and math.isfinite(case["max_err"]), case


def test_timed_cases_have_times_and_ratios(report):
    _, out = report
    for case in json.loads((out / "gpu_report.json").read_text())["cases"]:
        if case["section"] in ("overhead", "e2e"):
            continue
        nchw_convnext = case["name"].startswith("convnext") and "channels_last" not in case["name"]
        peers = {"ours", "torch", "copy"} | ({"torch_contig"} if nchw_convnext else set())
        assert set(case["times"]) == peers and not case["variant_errors"], case
        assert all(t["min_ms"] > 0 and t["repeats"] == 3 for t in case["times"].values())
        assert case["copy_fraction"] > 0 and case["ratio_torch"] > 0 and case["target_met"] in (True, False)
        assert set(case["of_copy"]) == peers - {"copy"} and set(case["ratios"]) == peers - {"ours", "copy"}
        assert case["bytes_moved"] == {"fwd": 2, "fwd+bwd": 5}[case["pass"]] * case["copy_bytes"] // 2
        assert case["peer_checks"] == {}  # no Liger on CPU
        if case["pass"] == "fwd+bwd":
            assert {"dx", "dweight"} <= set(case["errors"])


def test_every_timed_case_has_call_and_kernel_time(report):
    """Call time (wall clock) and the profiled time next to it, for every variant; on CPU the
    torch peers and the copy run torch ops, so the profiler sees them."""
    _, out = report
    for case in json.loads((out / "gpu_report.json").read_text())["cases"]:
        if case["section"] not in ("rows", "strided"):
            continue
        for name, timing in case["times"].items():
            assert "kernel_error" not in timing, (case["name"], name, timing)
            assert timing["call_us"] > 0 and timing["kernel_us"] >= 0, (case["name"], name, timing)
        assert case["times"]["torch"]["kernel_us"] > 0 and case["times"]["copy"]["kernel_us"] > 0, case["name"]
        assert case["times"]["copy"]["kernel_records_per_call"] >= 1
        assert "kernel_copy_fraction" in case and "kernel_ratio_torch" in case


def test_overhead_rows(report):
    _, out = report
    rows = [c for c in json.loads((out / "gpu_report.json").read_text())["cases"] if c["section"] == "overhead"]
    assert [(tuple(r["shape"]), r["mode"]) for r in rows] == [((4, 8), "no_grad"), ((4, 8), "train"),
                                                               ((64, 768), "no_grad"), ((64, 768), "train")]
    for row in rows:
        assert set(row["times_us"]) == {"ours", "torch", "empty_like"}, row
        for t in row["times_us"].values():
            assert 0 < t["min_us"] <= t["median_us"] <= t["max_us"] and len(t["samples_us"]) == row["rounds"]
        assert row["ratio_torch"] > 0
        if row["mode"] == "train":
            assert {"dx", "dweight", "dbias"} == set(row["errors"])
        if tuple(row["shape"]) == (64, 768):
            assert row["target"] and row["target_met"] in (True, False), row
        else:
            assert row["target"] is None and row["target_met"] is None


def test_e2e_rows(report):
    _, out = report
    rows = [c for c in json.loads((out / "gpu_report.json").read_text())["cases"] if c["section"] == "e2e"]
    assert [r["name"] for r in rows] == list(E2E_SWAPPED) + list(E2E_GRAPHED)
    rows = rows[:len(E2E_SWAPPED)]
    for row in rows:
        assert row["unavailable"] is None and row["error"] is None, row
        expected = E2E_SWAPPED[row["name"]] if not (TIMM and row["kind"] == "convnext") else 23
        assert row["norms_swapped"] == expected, row
        assert set(row["times_ms"]) == {"native", "anynorm"}
        assert all(t["median_ms"] > 0 and len(t["samples_ms"]) == 2 for t in row["times_ms"].values())
        assert row["ratio"] > 0 and row["target_met"] in (True, False)
        assert set(row["errors"]) == {"output", "loss"}
    assert rows[1]["config"]["memory_format"] == "channels_last" and rows[0]["config"]["memory_format"] == "NCHW"


def test_markdown_has_a_row_per_case(report):
    _, out = report
    markdown = (out / "gpu_report.md").read_text()
    table_rows = [line for line in markdown.splitlines()
                  if line.startswith("| ") and not line.startswith("| case ")]
    cases = json.loads((out / "gpu_report.json").read_text())["cases"]
    assert len(table_rows) == len(cases)
    for line, case in zip(table_rows, cases):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if case.get("unavailable"):
            assert cells[0] == case["name"] and f"not run: {case['unavailable']}" in cells, line
            continue
        assert cells[0] == case["name"] and "ok" in cells and "WRONG" not in cells, line
        assert "ERROR" not in line, line
        if case["section"] in ("overhead", "e2e") and case["target_met"] is not None:
            assert ("pass" if case["target_met"] else "miss") in cells, line
    assert "elapsed" in markdown.splitlines()[-1]
    for title in ("## Issue 14", "## Issue 15", "## Per-call overhead", "## End to end"):
        assert sum(line.startswith(title) for line in markdown.splitlines()) == 1, title


def table_cells(markdown, title):
    """``(header, rows)`` of the table under the section whose heading starts with ``title``."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    table = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("| "):
            table.append([cell.strip() for cell in line.strip("|").split("|")])
    return table[0], table[1:]


def test_without_liger_a_line_and_blank_columns(report):
    """No Liger (on CPU it is never loaded): the header and each kernel section say so, and the
    liger columns (kernel-only, fraction of copy, ratio, call time) stay in the table, blank."""
    _, out = report
    markdown = (out / "gpu_report.md").read_text()
    meta = json.loads((out / "gpu_report.json").read_text())["meta"]
    assert meta["liger_available"] is False and meta["liger"].startswith("Liger not used")
    assert sum("the liger columns are blank" in line for line in markdown.splitlines()) == 2
    for title in ("## Issue 14", "## Issue 15"):
        header, rows = table_cells(markdown, title)
        liger = [i for i, name in enumerate(header) if "liger" in name]
        assert [header[i] for i in liger] == ["liger kernel us", "liger of copy", "ours/liger", "liger call us"]
        assert rows and all(row[i] == "—" for row in rows for i in liger)
        assert {"ours kernel us", "torch kernel us", "copy kernel us", "ours of copy", "torch of copy",
                "ours/torch", "ours call us", "torch call us"} <= set(header)


def test_sections_flag_runs_only_those(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--quick",
                           "--sections", "overhead", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=SCRIPT.parent.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_report.json").read_text())
    assert {c["section"] for c in data["cases"]} == {"overhead"} and len(data["cases"]) == 4
    assert data["meta"]["planned_cases"] == 4
    assert "## End to end" not in done.stdout and "## Issue 14" not in done.stdout


# --------------------------------------------------------------------------- in process

def test_parse_sections(gr):
    parse = lambda *argv: gr.parse_args(list(argv))
    assert parse().sections == ("rows", "strided", "overhead", "e2e")
    assert parse("--sections", "e2e,overhead").sections == ("overhead", "e2e")  # run in a fixed order
    assert parse("--sections", "kernels").sections == ("rows", "strided")
    assert parse("--sections", "overhead, kernels,rows").sections == ("rows", "strided", "overhead")
    assert parse("--sections", "all").sections == gr.SECTIONS
    with pytest.raises(SystemExit):
        parse("--sections", "overhead,nope")


def test_quick_settings_do_fewer_repeats(gr):
    full = gr.Settings.from_args(gr.parse_args([]))
    quick = gr.Settings.from_args(gr.parse_args(["--quick"]))
    for field in ("repeats", "overhead_rounds", "e2e_rounds", "e2e_warmup", "call_calls"):
        assert getattr(quick, field) < getattr(full, field), field
    assert full.sections == gr.SECTIONS


def overhead_row(gr, shape, mode, ratio, ours_us=10.0):
    return {"section": "overhead", "name": f"layer_norm {shape[0]}x{shape[1]}", "shape": list(shape),
            "mode": mode, "error": None, "check_ok": True, "max_err": 0.0, "errors": {}, "ratio_torch": ratio,
            "times_us": {"ours": {"median_us": ours_us, "min_us": ours_us - 1, "max_us": ours_us + 1},
                         "torch": {"median_us": ours_us / ratio, "min_us": 1.0, "max_us": 9.0}}}


@pytest.mark.parametrize("mode, ratio, ours_us, met", [
    ("no_grad", 1.29, 10.0, True), ("no_grad", 1.31, 10.0, False),
    ("train", 0.99, 10.0, True), ("train", 1.01, 10.0, False),
    ("cupy", 5.0, 14.9, True), ("cupy", 0.5, 15.1, False),
])
def test_overhead_targets(gr, mode, ratio, ours_us, met):
    row = overhead_row(gr, (64, 768), mode, ratio, ours_us)
    text, got = gr.overhead_target(row)
    assert got is met and text == gr.OVERHEAD_TARGETS[mode][0]
    assert gr.overhead_target(overhead_row(gr, (4, 8), mode, ratio, ours_us)) == (None, None)
    row["check_ok"] = False  # a wrong result meets no target
    assert gr.overhead_target(row)[1] is None


def meta_for_tables():
    """The header's facts, made up, for a Report written in process."""
    return {"device": "cpu", "device_name": "test", "torch_threads": 1, "torch": "t", "cupy": "none",
            "anynorm": "a", "anynorm_path": "p", "backend": "auto", "python": "3", "git_commit": "c",
            "liger": "Liger not used", "planned_cases": 2, "max_calls_per_region": 1,
            "settings": {"repeats": 1, "region_ms": 1, "tiny": True, "budget_s": 1, "kernel_calls": 1,
                         "call_calls": 1, "sections": ["overhead", "e2e"]}}


def test_tables_format_rows(gr, tmp_path, capsys):
    report = gr.Report(tmp_path, meta_for_tables())
    report.section("overhead", "t", gr.OVERHEAD_COLUMNS)
    row = overhead_row(gr, (64, 768), "no_grad", 1.5)
    row["target"], row["target_met"] = gr.overhead_target(row)
    report.add(row)
    report.section("e2e", "t", gr.E2E_COLUMNS, intro=["an intro line"])
    e2e = gr.new_e2e_row(None, "a model", "convnext")
    e2e.update(norms_swapped=3, ratio=1.25, target_met=False, check_ok=True, max_err=1e-3,
               times_ms={"native": {"median_ms": 2.0, "min_ms": 1.5, "max_ms": 2.5},
                         "anynorm": {"median_ms": 2.5, "min_ms": 2.25, "max_ms": 3.0}},
               errors={"output": {"max_abs": 1e-3, "scale": 2.0}, "loss": {"max_abs": 0.0, "scale": 1.0}})
    report.add(e2e)
    report.add(dict(gr.new_e2e_row(None, "no timm", "convnext"), unavailable="timm is not usable"))
    lines = (tmp_path / "gpu_report.md").read_text().splitlines()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines
            if line.startswith("| ") and not line.startswith("| case ")]
    assert rows[0][:7] == ["layer_norm 64x768", "no_grad", "10.0", "9.0-11.0", "6.7", "1.0-9.0", "1.50"]
    assert rows[0][-3:-1] == ["ours/torch <= 1.3", "miss"]  # target, pass/miss, notes
    assert rows[1][:8] == ["a model", "—", "3", "2.00", "1.50-2.50", "2.50", "2.25-3.00", "1.250"]
    assert rows[1][8:10] == ["anynorm/native <= 1.0", "miss"] and rows[1][10] == "1.0e-03"
    assert rows[2][9] == "—" and "not run: timm is not usable" in rows[2][-1]
    assert "an intro line" in lines
    data = json.loads((tmp_path / "gpu_report.json").read_text())
    assert [c["name"] for c in data["cases"]] == ["layer_norm 64x768", "a model", "no timm"]
    assert report.failures() == []  # a miss and an unavailable model are not failures
    capsys.readouterr()


def test_profiler_records_counted(gr):
    """Kernel-only time sums kernels, memcpys and memsets; GPU annotation ranges and CPU-side
    records (launch calls) are left out."""
    def event(kind, us, annotation=False):
        return types.SimpleNamespace(device_type=f"DeviceType.{kind}", is_user_annotation=annotation,
                                     is_async=False, self_cpu_time_total=us,
                                     time_range=types.SimpleNamespace(elapsed_us=lambda: us))

    events = [event("CUDA", 5.0), event("CUDA", 2.5), event("CUDA", 100.0, annotation=True), event("CPU", 40.0)]
    cuda = [e for e in events if gr.is_device_record(e, "cuda")]
    assert sum(gr.record_us(e, "cuda") for e in cuda) == 7.5
    cpu = [e for e in events if gr.is_device_record(e, "cpu")]
    assert sum(gr.record_us(e, "cpu") for e in cpu) == 40.0


def test_profiled_time_on_cpu(gr):
    """The profiler path itself (as a GPU run takes it, with CPU activity): a torch op is seen."""
    env = types.SimpleNamespace(device="cpu", clock=gr.HostClock(),
                                settings=types.SimpleNamespace(kernel_calls=4, call_calls=3))
    x = torch.randn(256, 256)
    timing = gr.call_and_kernel_time(env, lambda i: torch.mm(x, x))
    assert timing["kernel_us"] > 0 and timing["call_us"] > 0 and timing["kernel_records_per_call"] >= 1


def norm_modules(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]


def tiny_encoder(gr):
    torch.manual_seed(0)
    return gr.build_transformer_encoder(torch, gr.E2E_TINY_TRANSFORMER).train()


def test_swap_transformer_encoder(gr, an_nn):
    native = tiny_encoder(gr)
    ours = copy.deepcopy(native)
    assert gr.swap_layer_norms(ours, an_nn) == 2 * gr.E2E_TINY_TRANSFORMER["layers"]
    assert norm_modules(ours) and all(type(m) is an_nn.LayerNorm for m in norm_modules(ours))
    assert all(m.axis == (-1,) for m in norm_modules(ours))
    assert list(ours.state_dict()) == list(native.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), native.state_dict().values()))
    assert gr.swap_layer_norms(ours, an_nn) == 0  # nothing left to swap
    x = torch.randn(2, 16, gr.E2E_TINY_TRANSFORMER["d_model"])
    torch.testing.assert_close(ours(x), native(x), rtol=1e-5, atol=1e-5)


def test_swap_keeps_arguments(gr, an_nn):
    model = torch.nn.Sequential(torch.nn.LayerNorm(8, eps=1e-3, bias=False),
                                torch.nn.LayerNorm((4, 8), elementwise_affine=False),
                                gr.model_classes().LayerNorm2d(8, eps=1e-6))
    with torch.no_grad():
        model[0].weight.uniform_()
        model[2].bias.uniform_()
    x = torch.randn(2, 8, 4, 8)
    expected = model(x)
    keys = list(model.state_dict())
    assert gr.swap_layer_norms(model, an_nn) == 3
    assert [type(m) for m in model] == [an_nn.LayerNorm] * 3
    assert (model[0].eps, model[0].bias) == (1e-3, None) and model[1].weight is None
    assert model[2].axis == 1 and model[2].eps == 1e-6 and model[0].axis == (-1,)
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("channels_last", [False, True])
def test_swap_convnext_stand_in(gr, an_nn, channels_last):
    torch.manual_seed(0)
    native = gr.model_classes().MiniConvNeXt().train()
    ours = copy.deepcopy(native)
    assert gr.swap_layer_norms(ours, an_nn) == 5
    assert all(type(m) is an_nn.LayerNorm for m in norm_modules(ours))
    assert sorted(str(m.axis) for m in norm_modules(ours)) == ["(-1,)"] * 2 + ["1"] * 3
    assert list(ours.state_dict()) == list(native.state_dict())
    x = torch.randn(2, 3, 32, 32)
    if channels_last:
        native, ours = (m.to(memory_format=torch.channels_last) for m in (native, ours))
        x = x.contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(ours(x), native(x), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not TIMM, reason="timm not installed")
def test_swap_timm_convnext_tiny(gr, an_nn):
    import timm

    native = timm.create_model("convnext_tiny", pretrained=False).train()
    ours = copy.deepcopy(native)
    assert gr.swap_layer_norms(ours, an_nn) == 23
    assert all(type(m) is an_nn.LayerNorm for m in norm_modules(ours))
    assert list(ours.state_dict()) == list(native.state_dict())
    x = torch.randn(1, 3, 64, 64)
    torch.testing.assert_close(ours(x), native(x), rtol=1e-4, atol=1e-4)


def test_prenorm_stack_is_the_transformer_encoder(gr, an_nn):
    """PreNormStack with torch's LayerNorm computes nn.TransformerEncoder(norm_first=True) from the
    same state_dict; with anynorm's fused residual the same again, gradients included."""
    cfg = gr.E2E_TINY_TRANSFORMER
    classes = gr.model_classes()
    dims = (cfg["layers"], cfg["d_model"], cfg["nhead"], cfg["dim_feedforward"])
    encoder = tiny_encoder(gr)
    native = classes.PreNormStack(*dims).train()
    fused = classes.PreNormStack(*dims, norm_cls=an_nn.LayerNorm, fused=True).train()
    assert list(native.state_dict()) == list(encoder.state_dict()) == list(fused.state_dict())
    native.load_state_dict(encoder.state_dict())
    fused.load_state_dict(encoder.state_dict())
    assert all(type(m) is an_nn.LayerNorm for m in norm_modules(fused))
    x = torch.randn(2, 16, cfg["d_model"])
    expected = encoder(x)
    torch.testing.assert_close(native(x), expected, rtol=1e-5, atol=1e-5)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    outs = [native(xs[0]), fused(xs[1])]
    torch.testing.assert_close(outs[1], expected, rtol=1e-5, atol=1e-5)
    for out in outs:
        out.square().mean().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fused.layers[0].norm1.weight.grad, native.layers[0].norm1.weight.grad,
                               rtol=1e-4, atol=1e-6)


def test_bare_kernel_compiles(gr):
    """The overhead section's floor, a RawKernel launch of BARE_KERNEL, compiles with NVRTC (no GPU
    needed; the GPU run launches it with two CuPy arrays, an int64 and a float32)."""
    import io

    cupy = pytest.importorskip("cupy", exc_type=ImportError)
    try:
        program = cupy.cuda.compiler._NVRTCProgram(gr.BARE_KERNEL, "bare.cu", method="cubin")
        log = io.StringIO()
        program.compile(("--gpu-architecture=sm_90",), log)
    except (AttributeError, OSError, RuntimeError) as exc:  # NVRTC missing, or CuPy's private API moved
        if type(exc).__name__ == "CompileException":
            raise
        pytest.skip(f"NVRTC not usable here: {exc}")
    assert "error" not in log.getvalue().lower()


# --------------------------------------------------------------------------- Liger and the sweeps, in process

def fake_liger(max_width=None):
    """A stand-in for ``liger_kernel.transformers.functional`` with its three signatures, computed
    by torch on CPU; like Liger's fused kernels it refuses rows wider than ``max_width``."""
    F = torch.nn.functional

    def liger_layer_norm(X, W, B, eps):
        if max_width is not None and X.shape[-1] > max_width:
            raise RuntimeError(f"Cannot launch Triton kernel since n = {X.shape[-1]} exceeds {max_width}.")
        return F.layer_norm(X, X.shape[-1:], W, B, eps)

    def liger_rms_norm(X, W, eps, offset=0.0, casting_mode="llama", in_place=True):
        assert in_place is False and offset == 0.0  # in place, its backward would overwrite dy
        return F.rms_norm(X, X.shape[-1:], W, eps)

    def liger_group_norm(X, affine_scaling_weight, affine_shifting_bias, num_channels, num_groups, eps):
        assert X.shape[1] == num_channels
        return F.group_norm(X.contiguous(), num_groups, affine_scaling_weight, affine_shifting_bias, eps)

    return types.SimpleNamespace(liger_layer_norm=liger_layer_norm, liger_rms_norm=liger_rms_norm,
                                 liger_group_norm=liger_group_norm)


def cpu_env(gr, *flags, liger=None):
    env = gr.Env(gr.parse_args(["--device", "cpu", "--tiny", *flags]))
    env.liger = liger
    return env


def test_liger_peer_fills_its_columns(gr, tmp_path, capsys):
    """With Liger loaded, every layer/RMS/group norm case (and ConvNeXt's layer norm) times it
    beside torch, checks it against torch, and the table shows its kernel-only and call times,
    its fraction of copy and anynorm's ratio to it; instance norm has no Liger peer."""
    env = cpu_env(gr, "--quick", liger=fake_liger())
    env.settings.repeats = 1
    cases = {c.work.name: c for c in [*gr.rows_cases(env), *gr.strided_cases(env)] if c.dtype == "float32"}
    picked = [cases[name] for name in cases if name.startswith(("layer_norm 1024", "rms_norm 1024", "group_norm",
                                                                "convnext layer_norm axis=1 channels_last"))]
    picked = [c for c in picked if c.direction == "fwd+bwd" or c.work.name.startswith("layer_norm")]
    assert {c.work.name.split(" ")[0] for c in picked} == {"layer_norm", "rms_norm", "group_norm", "convnext"}
    assert all("liger" not in c.work.peers for c in cases.values() if c.work.name.startswith("instance_norm"))
    report = gr.Report(tmp_path, {**meta_for_tables(), "liger": "liger-kernel (fake)"})
    report.section("Issue 15", "t", gr.timed_columns(("torch", "torch_contig", "liger"), False, False))
    for case in picked:
        row = gr.run_timed_case(env, case)
        assert row["error"] is None and not row["variant_errors"], row
        assert set(row["times"]) >= {"ours", "torch", "liger", "copy"}
        assert row["peer_checks"]["liger"]["ok"] is True, row["peer_checks"]
        assert row["kernel_ratios"]["liger"] > 0 and row["ratios"]["liger"] > 0
        assert row["kernel_of_copy"]["liger"] > 0 and row["times"]["liger"]["call_us"] > 0
        report.add(row)
    header, rows = table_cells((tmp_path / "gpu_report.md").read_text(), "## Issue 15")
    for name in ("liger kernel us", "liger of copy", "ours/liger", "liger call us"):
        assert all(row[header.index(name)] not in ("—", "error") for row in rows), name
    assert report.failures() == []
    capsys.readouterr()


def test_liger_refusing_a_shape_is_a_note(gr):
    """Liger's kernels refuse rows past 65536: the row keeps anynorm's and torch's figures, the
    liger cells say ``error``, the note says why, and the run does not count it as a failure."""
    env = cpu_env(gr, "--quick", liger=fake_liger(max_width=1024))
    env.settings.repeats = 1
    case = next(c for c in gr.rows_cases(env) if c.work.shape[-1] > 1024 and c.work.name.startswith("layer_norm"))
    row = gr.run_timed_case(env, case)
    assert row["error"] is None and row["check_ok"] is True
    assert set(row["variant_errors"]) == {"liger"} and "liger" not in row["times"]
    assert "error" in row["peer_checks"]["liger"] and "liger" not in row["kernel_ratios"]
    assert row["kernel_ratio_torch"] is not None and row["target_met"] in (True, False)
    notes = gr.notes_text(row)
    assert notes.count("Cannot launch Triton kernel") == 1, notes
    assert gr.us_of(row, "liger", "kernel_us") == "error"
    report = types.SimpleNamespace(cases=[row])
    assert gr.Report.failures(report) == []
    row["variant_errors"]["torch"] = "RuntimeError: boom"  # a required peer's failure still counts
    assert gr.Report.failures(report) == [row]


def test_load_liger_degrades(gr, monkeypatch):
    liger, why = gr.load_liger("cpu")
    assert liger is None and "--device cpu" in why
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", None)  # import fails
    liger, why = gr.load_liger("cuda")
    assert liger is None and why.startswith("not usable") and "pip install liger-kernel" in why
    assert gr.describe_liger(None, why) == f"Liger {why}"
    partial = types.SimpleNamespace(liger_layer_norm=None)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", partial)
    monkeypatch.setattr(gr.importlib, "import_module", lambda name: partial)
    liger, why = gr.load_liger("cuda")
    assert liger is None and "liger_rms_norm" in why and "liger_group_norm" in why


def test_row_sweep_and_quick_subsets(gr):
    """Issue 14's sweep, N = 512 ... 262144 with M = 2^25 // N, in three dtypes, forward and
    forward + backward; --quick keeps a subset; issue 15's shapes, ConvNeXt on both memories."""
    full = gr.Settings.from_args(gr.parse_args([]))
    quick = gr.Settings.from_args(gr.parse_args(["--quick"]))
    shapes = gr.row_shapes(full)
    assert [N for _, N in shapes] == list(gr.ROW_WIDTHS) and shapes[0][1] == 512 and shapes[-1][1] == 262144
    assert all(M == 2 ** 25 // N for M, N in shapes)  # 768 does not divide 2^25
    assert {N for _, N in gr.row_shapes(quick)} < {N for _, N in shapes}
    assert gr.sd_group_shapes(full) == list(gr.SD_GROUP_NCHW) and gr.sd_group_shapes(quick) == [(8, 320, 64, 64),
                                                                                                (8, 1280, 8, 8)]
    assert gr.convnext_shapes(quick) == [(64, 96, 56, 56), (64, 768, 7, 7)]
    assert gr.channels_last_shapes(quick) == [(32, 56, 56, 64), (32, 7, 7, 2048)]
    env = cpu_env(gr)
    rows = list(gr.rows_cases(env))
    assert len(rows) == 2 * 2 * 3 * len(gr.ROW_WIDTHS)
    assert {(c.dtype, c.direction) for c in rows} == {(d, p) for d in gr.KERNEL_DTYPES for p in gr.PASSES}
    strided = list(gr.strided_cases(env))
    workloads = {c.work.name for c in strided}
    assert len(workloads) == 2 * 4 + 2 * 5 + 4 and len(strided) == len(workloads) * 3 * 2
    assert sum("channels_last" in name for name in workloads) == 4


def test_channels_last_inputs(gr):
    env = cpu_env(gr)
    work = gr.convnext_layer_norm(env, (2, 8, 3, 5), channels_last=True)
    xs, w, _, dys = gr.random_inputs(env, work, "float32", 2, grad=True)
    assert all(t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous() for t in xs + dys)
    assert "torch_contig" not in work.peers and w.shape == (8,)
    assert "torch_contig" in gr.convnext_layer_norm(env, (2, 8, 3, 5)).peers


def synthetic_row(gr, section, width, direction, of_copy, ratios):
    case = types.SimpleNamespace(section=section, direction=direction,
                                 work=types.SimpleNamespace(shape=(64, width)))
    row = {"error": None, "check_ok": True, "target_basis": "kernel", "kernel_of_copy": {"ours": of_copy},
           "kernel_ratios": ratios, "of_copy": {}, "ratios": {}}
    return gr.target_met(row, case)


@pytest.mark.parametrize("section, width, direction, of_copy, ratios, met", [
    ("rows", 4096, "fwd", 0.91, {"torch": 0.9, "liger": 0.99}, True),
    ("rows", 4096, "fwd", 0.89, {"torch": 0.9, "liger": 0.99}, False),
    ("rows", 4096, "fwd", 0.95, {"torch": 0.9, "liger": 1.01}, False),  # behind Liger
    ("rows", 4096, "fwd", 0.95, {"torch": 0.9}, True),                  # Liger absent or refused
    ("rows", 65536, "fwd", 0.81, {"torch": 0.9}, True),
    ("rows", 4096, "fwd+bwd", 0.79, {"torch": 0.9}, False),
    ("rows", 262144, "fwd+bwd", 0.71, {"torch": 0.9}, True),
    ("rows", 4096, "fwd", 0.95, {"torch": 1.0}, False),
    ("strided", 64, "fwd", 0.81, {"torch": 0.5}, True),
    ("strided", 64, "fwd", 0.81, {"torch": 0.51}, False),
    ("strided", 64, "fwd+bwd", 0.71, {"torch": 0.4, "torch_contig": 2.0, "liger": 0.9}, True),
    ("strided", 64, "fwd+bwd", 0.69, {"torch": 0.4}, False),
])
def test_kernel_targets(gr, section, width, direction, of_copy, ratios, met):
    assert synthetic_row(gr, section, width, direction, of_copy, ratios) is met


def test_fractions_and_ratios(gr):
    times = {"ours": 10.0, "torch": 20.0, "liger": 5.0, "copy": 4.0}
    fractions = gr.fractions_of_copy(times, bytes_moved=500, copy_bytes=200)
    assert fractions == pytest.approx({"ours": 1.0, "torch": 0.5, "liger": 2.0})
    assert gr.ratios_to_peers(times) == pytest.approx({"torch": 0.5, "liger": 2.0})
    assert gr.ratios_to_peers({"ours": 0.0, "torch": 1.0}) == {} and gr.fractions_of_copy({"ours": 1.0}, 1, 1) == {}
