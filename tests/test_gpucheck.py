"""gpu-check (trainmech.gpucheck) on a CPU: the branch registry in step with the code, every check run
with the CPU side chosen, the machine-limit functions, the plan, the carry bundle's list.

A GPU runs the same checks with the CUDA side; here they must pass first, so that a short GPU window
is spent on the GPU's findings, not on gpu-check's own bugs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from trainmech import measure, profiles, workload
from trainmech.errors import TrainmechError
from trainmech.gpucheck import branches, budget, bundle, checks, limits, scan
from trainmech.gpucheck import main as gpu_check
from trainmech.gpucheck.probe import Probe

pytestmark = pytest.mark.package

CPU = torch.device("cpu")


# ---------------------------------------------------------------- the registry keeps up with the code


def test_every_cuda_only_branch_has_a_gpu_check_entry():
    missing = [s for s in scan.all_sites() if s.key not in branches.covered()]
    assert not missing, (
        "CUDA-only branches without a gpu-check entry (add the key to trainmech/gpucheck/branches.py):\n"
        + "\n".join(f"  {s.key}: {s.path}:{s.line}  {s.text}" for s in missing)
    )


def test_no_entry_names_a_site_that_is_gone():
    keys = scan.by_key(scan.all_sites())
    listed = [k for b in branches.registry() if b.name not in branches.KERNEL_CHOICE_CELLS for k in b.covers]
    stale = [k for k in [*listed, *branches.NOT_BRANCHES] if k not in keys]
    assert not stale, f"gpu-check entries whose branch is no longer in the code: {stale}"


def test_kernel_choice_cells_exist_and_each_site_is_covered_once():
    for key in branches.KERNEL_CHOICE_CELLS:
        task, cell = key.split(":")
        nb = json.loads(branches.repo_path(key).read_text(encoding="utf-8"))
        assert any(c.get("id") == cell and c["cell_type"] == "code" for c in nb["cells"]), key
    keys = [k for b in branches.registry() for k in b.covers] + list(branches.NOT_BRANCHES)
    assert len(keys) == len(set(keys)), [k for k in keys if keys.count(k) > 1]


def test_every_torch_cuda_call_exists_in_the_installed_torch():
    """An API renamed between torch versions fails here, not on the GPU."""
    for site in scan.all_sites():
        for call in re.findall(r"torch\.cuda(?:\.\w+)+(?=\()", site.text):
            obj = torch
            for part in call.split(".")[1:]:
                assert hasattr(obj, part), (
                    f"{site.path}:{site.line}: {call} does not exist in torch {torch.__version__}"
                )
                obj = getattr(obj, part)


def test_the_scanner_finds_each_kind_of_site_and_skips_annotations(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "mod.py").write_text(
        "import torch\n"
        "class Harness:\n"
        "    event: torch.cuda.Event | None = None\n"
        "    def go(self, device):\n"
        "        if device.type == 'cuda':\n"
        "            torch.cuda.synchronize()\n"
        "    def flag(self) -> torch.cuda.Event | None:\n"
        "        return self.on_cuda\n"
        "def plain(x: torch.cuda.Stream):\n"
        "    return x\n",
        encoding="utf-8",
    )
    found = scan.by_key(scan.package_sites(pkg))
    assert set(found) == {"mod.Harness.go", "mod.Harness.flag"}
    assert [s.text for s in found["mod.Harness.go"]] == ["device.type == 'cuda'", "torch.cuda.synchronize()"]
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    cell = {
        "cell_type": "code",
        "id": "cell-07",
        "metadata": {},
        "outputs": [],
        "execution_count": None,
        "source": ["%matplotlib inline\n", "if session.on_cuda:\n", "    print(1)\n"],
    }
    terms = {
        **cell,
        "id": "cell-08",
        "source": ["TERMS = ledger.device_terms(DEVICE)\n", "x = TERMS.slack\n"],
    }
    (nbs / "Task9_x.ipynb").write_text(
        json.dumps({"cells": [cell, terms], "metadata": {}, "nbformat": 4, "nbformat_minor": 5})
    )
    assert [(s.key, s.line) for s in scan.notebook_sites(nbs)] == [("Task9:cell-07", 2), ("Task9:cell-08", 2)]


# ---------------------------------------------------------------- every check, the CPU side chosen


@pytest.fixture(scope="module")
def cpu_self_test(tmp_path_factory):
    """`gpu-check --cpu` once for this module: the limits, then every package check with the CPU side
    chosen, each as the GPU runs it (one probe, one report row per check); (exit status, report folder)."""
    out = tmp_path_factory.mktemp("gpu-check-cpu")
    return gpu_check(["--cpu", "--out", str(out)]), out


@pytest.mark.parametrize("branch", branches.PACKAGE, ids=lambda b: b.name)
def test_package_check_runs_on_cpu(branch, cpu_self_test):
    _, out = cpu_self_test
    report = json.loads((out / "gpu-check.json").read_text(encoding="utf-8"))
    row = next(r for r in report["branches"] if r["name"] == branch.name)
    assert row["status"] == "ok", (row["reason"], *row.get("traceback", []))
    reason = row["reason"]
    assert isinstance(reason, str) and reason and "\n" not in reason


def test_attention_kernel_probe_sees_the_kernel_that_ran():
    probe = Probe.for_device(CPU)
    model, batch = probe.model(), probe.lm_batch()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    assert checks.dispatched_attention_kernel(model, batch) == "flash"
    with sdpa_kernel(SDPBackend.MATH):
        assert checks.dispatched_attention_kernel(model, batch) == "math"


# ---------------------------------------------------------------- allocator statistics, the source forced


def test_allocator_window_counts_what_was_alive_at_once_on_the_cpu_allocator():
    n = 4 << 20
    with measure.allocator_window(CPU, "cpu-profiler", assume_start_bytes=1000) as w:
        a = torch.empty(n, dtype=torch.uint8)
        b = torch.empty(2 * n, dtype=torch.uint8)
        del a
        c = torch.empty(n, dtype=torch.uint8)
        del b, c
    assert (w.source, w.start_bytes, w.peak_above_start, w.peak_reserved_bytes) == (
        "cpu-profiler",
        1000,
        3 * n,
        None,
    )


@pytest.mark.parametrize(
    "source, words", [("cuda", "cannot count memory on a cpu"), ("gpu", "valid: cuda, cpu-profiler")]
)
def test_allocator_window_refuses_in_one_sentence(source, words):
    with pytest.raises(TrainmechError) as e:
        with measure.allocator_window(CPU, source):
            pass
    assert words in str(e.value) and "\n" not in str(e.value)


def test_step_memory_with_the_cpu_allocator_forced_runs_the_cuda_bookkeeping(tiny_profile_model):
    """step_peak_allocated_bytes (the allocator's view, as on CUDA) equals the tracked tensor peak."""
    model = tiny_profile_model(seed=0).model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = workload.lm_batch("domain", 2, 32)
    for _ in ("first", "steady"):
        step = measure.training_step_memory(model, optimizer, batch, allocator="cpu-profiler")
        assert step.outside_bytes == 0
        assert step.peak_allocated_bytes == step.step_peak_allocated_bytes
        assert abs(step.step_peak_allocated_bytes - step.peak_bytes) <= 0.01 * step.peak_bytes
    plain = measure.training_step_memory(model, optimizer, batch)
    assert (plain.peak_allocated_bytes, plain.peak_reserved_bytes, plain.step_peak_allocated_bytes) == (
        None,
        None,
        None,
    )


# ---------------------------------------------------------------- the machine's limits, on a CPU


def test_copy_bandwidth_on_a_cpu_says_what_it_measured():
    bw = limits.copy_bandwidth(CPU, nbytes=4 << 20, repeats=2)
    assert bw["copies_equal"] and not bw["pinned"] and "no accelerator" in bw["path"]
    assert all(bw[k] > 0 for k in ("h2d_gbps", "d2h_gbps", "both_h2d_gbps", "both_d2h_gbps"))


def test_step_phase_times_and_the_offload_bound():
    probe = Probe.for_device(CPU)
    model = probe.model()
    phases = limits.step_phase_times(
        model, probe.lm_batch(), torch.optim.AdamW(model.parameters()), warmup=1, repeats=2
    )
    assert all(phases[k] > 0 for k in ("forward_s", "backward_s", "update_s"))
    assert phases["step_s"] == pytest.approx(phases["forward_s"] + phases["backward_s"] + phases["update_s"])
    assert all(p.grad is None for p in model.parameters())
    bw = {"h2d_gbps": 50.0, "d2h_gbps": 40.0}
    ph = {"forward_s": 0.1, "backward_s": 0.2, "step_s": 0.35}
    bound = limits.offload_bound(bw, ph, d2h_bytes=8 * 10**9, h2d_bytes=5 * 10**9)
    # D2H 0.2 s under a 0.1 s forward: 0.1 exposed; H2D 0.1 s hides under the 0.2 s backward
    assert bound["exposed_transfer_bound_s"] == pytest.approx(0.1)
    assert bound["step_ratio_bound"] == pytest.approx(0.45 / 0.35)


def test_dry_run_lists_every_branch_and_the_budget_and_exits_0(capsys):
    assert gpu_check(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for b in branches.registry():
        assert b.name.split(":")[-1] in out, b.name
    assert all(f"Task{i}" in out for i in range(7))
    assert re.search(
        r"verdict: (the full run fits one 10-minute command|split the run into \d commands)", out
    )
    assert re.search(r"small pass: ~\d+ s", out)


def test_gpu_check_without_cuda_is_refused_in_one_sentence(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpu_check(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a CUDA GPU" in err and "--dry-run" in err and "\n" not in err


def test_cpu_self_test_writes_both_halves_of_the_report(cpu_self_test):
    code, tmp_path = cpu_self_test
    assert code == 0
    report = json.loads((tmp_path / "gpu-check.json").read_text(encoding="utf-8"))
    assert [r["name"] for r in report["branches"]] == [b.name for b in branches.PACKAGE]
    assert all(r["status"] == "ok" for r in report["branches"])
    assert report["limits"]["bandwidth"]["pinned"] is False and report["limits"]["offload_bound"] is None
    assert report["environment"]["gpu"] is None and report["environment"]["version_problems"] == []
    md = (tmp_path / "gpu-check.md").read_text(encoding="utf-8")
    assert "cpu-self-test" in md and "| session | ok |" in md


def test_each_notebook_parameter_of_the_small_pass_exists():
    from trainmech import runner
    from trainmech.gpucheck.notebooks import SMOKE

    cuda = profiles.for_mode("TRAIN-CUDA-MECHANISM")
    assert set(SMOKE) == {p.stem.split("_")[0] for p in runner.discover()}
    for path in runner.discover():
        nb = json.loads(path.read_text(encoding="utf-8"))
        cell = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
        names = set(re.findall(r"^(\w+)\s*=", "".join(cell["source"]), re.M))
        params = SMOKE[path.stem.split("_")[0]]
        assert set(params) <= names, (path.stem, set(params) - names)
        for key in ("WORKLOAD", "CHECKPOINT_WORKLOAD", "OFFLOAD_WORKLOAD"):
            if key in params:
                assert not cuda.workload(params[key]).experiments, (
                    "a smoke workload must not serve an experiment"
                )
        for wid in params.get("ACCUMULATION_WORKLOADS", []):
            cuda.workload(wid)
        if "MODEL" in params:
            cuda.model(params["MODEL"])
        if "POINTS" in params:  # Task4 reads its workload's point back from POINTS
            w = cuda.workload(params["WORKLOAD"])
            assert (w.batch, w.seq) in [tuple(p) for p in params["POINTS"][w.model]]


def test_the_notebook_pass_judges_each_registered_cell_from_the_executed_notebook(tmp_path):
    """The CUDA pass's machinery on a CPU: Task0 in cpu mode with its own parameters, through the runner."""
    from trainmech.gpucheck.notebooks import _cell_outcome, run_notebooks

    notebooks, cells = run_notebooks(tmp_path, CPU, ["Task0"], 300, mode="cpu", params={})
    assert [(n["notebook"], n["status"], n["error"]) for n in notebooks] == [("Task0", "ok", None)]
    assert [(c["name"], c["status"]) for c in cells] == [
        (b.name, "ok") for b in branches.notebook_cells("Task0")
    ]
    assert (tmp_path / "notebooks" / "smoke-Task0" / "run.json").is_file()
    error = {"output_type": "error", "ename": "ClaimFailed", "evalue": "1 % claim\ndetails"}
    assert _cell_outcome({"outputs": [error], "execution_count": 3}) == ("failed", "ClaimFailed: 1 % claim")
    assert _cell_outcome({"outputs": [], "execution_count": None})[0] == "not-run"
    assert _cell_outcome(None)[0] == "failed"


# ---------------------------------------------------------------- the budget


def test_budget_rows_and_split():
    rows = budget.notebook_budgets()
    assert [r["notebook"] for r in rows] == [f"Task{i}" for i in range(7)]
    assert all(r["peak_bytes"] > 0 and r["seconds"] > 0 for r in rows)
    fake = [{"notebook": f"T{i}", "seconds": s} for i, s in enumerate((300, 50, 200, 90))]
    assert budget.split(fake, budget_s=600, margin=1.5) == [["T0", "T1"], ["T2", "T3"]]
    assert budget.split(fake, budget_s=6000) == [["T0", "T1", "T2", "T3"]]


# ---------------------------------------------------------------- versions and the carry bundle


def test_cuda_profile_accepts_the_gpu_machines_stack_and_the_cpu_profile_keeps_its_pin():
    gpu = {
        "python": "3.12.3",
        "torch": "2.11.0+cu130",
        "transformers": "5.17.0",
        "accelerate": "1.15.0",
        "tokenizers": "0.23.2",
        **{n: v for n, v in bundle.pins() if n in ("nbclient", "pydantic")},
    }
    assert profiles.version_problems(profiles.for_mode("TRAIN-CUDA-MECHANISM"), gpu) == []
    assert profiles.version_problems(profiles.for_mode("cpu"), gpu) == [
        "torch 2.11.0+cu130 does not satisfy ==2.13.0 (TRAIN-CPU)"
    ]
    old = gpu | {"transformers": "5.16.0", "torch": "2.10.0"}
    assert len(profiles.version_problems(profiles.for_mode("TRAIN-CUDA-MECHANISM"), old)) == 2
    assert profiles.version_problems(profiles.for_mode("cpu")) == []


def test_bundle_list_is_exactly_what_the_runtime_needs_beyond_the_gpu_image():
    pinned = bundle.pins()
    names = [n for n, _ in pinned]
    assert len(names) == len(set(names)), f"listed twice: {sorted({n for n in names if names.count(n) > 1})}"
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.+!]*", v) for _, v in pinned), "every line pins NAME==VERSION"
    needed, unresolved = bundle.needed()
    assert unresolved == [], f"runtime requirements this environment cannot resolve: {unresolved}"
    shadows = bundle.shadows()
    assert shadows <= bundle.preinstalled(), "only a preinstalled package can be shadowed"
    assert set(needed) - set(names) == set(), (
        f"missing from profiles/cuda-bundle.txt: {sorted(set(needed) - set(names))}"
    )
    assert set(names) - set(needed) - shadows == set(), (
        f"not needed on the GPU machine: {sorted(set(names) - set(needed) - shadows)}"
    )
    for required in (
        "nbclient",
        "nbformat",
        "jupyter-client",
        "jupyter-core",
        "ipykernel",
        "ipython",
        "pyzmq",
        "tornado",
        "pydantic",
        "pydantic-core",
    ):
        assert required in names


def test_bundle_folder_check_finds_missing_extra_doubled_and_foreign_wheels(tmp_path):
    pinned = [("nbclient", "0.11.0"), ("pyzmq", "27.3.0")]
    for name in ("nbclient-0.11.0-py3-none-any.whl", "pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl"):
        (tmp_path / name).write_bytes(b"x")
    assert bundle.check_folder(tmp_path, pinned) == []
    (tmp_path / "pyzmq-27.2.0-cp312-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"x")
    (tmp_path / "tornado-6.6.1-cp311-abi3-macosx_10_9_universal2.whl").write_bytes(b"x")
    problems = bundle.check_folder(tmp_path, pinned)
    assert any("pyzmq==27.3.0: found 27.2.0, 27.3.0" in p for p in problems)
    assert any("tornado" in p and "does not install" in p for p in problems)
    assert any("tornado is not in" in p for p in problems)
    (tmp_path / "nbclient-0.11.0-py3-none-any.whl").unlink()
    assert any("nbclient==0.11.0: found nothing" in p for p in bundle.check_folder(tmp_path, pinned))


def test_bundle_requirements_are_met_here():
    assert bundle.requirement_problems() == []
    assert bundle.requirement_problems(["no-such-package"]) == ["no-such-package is not installed"]


def test_the_downloaded_bundle_if_present_is_complete_and_small():
    folder = Path(bundle.REPO_ROOT) / ".whl"
    if not any(folder.glob("*.whl")):
        pytest.skip("no .whl/ here: `make gpu-bundle` builds it")
    assert bundle.check_folder(folder) == []


def test_rng_placement_is_compared_in_bytes_not_shapes():
    # cuDNN's op makes (1,) int64 seed and offset where its meta kernel says (): the same 8 bytes each
    weighed, paper = (((1,), 8, True), ((1,), 8, True)), (((), 8, True), ((), 8, True))
    assert checks._rng_bytes(weighed) == checks._rng_bytes(paper) == ((8, True), (8, True))
    # a wrong placement or a wrong size still differs: flash's (2,) uint64 seed is 16 bytes
    assert checks._rng_bytes((((2,), 8, True),)) != checks._rng_bytes((((), 8, True),))
    assert checks._rng_bytes((((), 8, False),)) != checks._rng_bytes((((), 8, True),))
