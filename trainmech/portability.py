"""Numeric paths: run the CPU notebooks under other kernels and measure what moves.

A learner's or a CI machine's CPU differs from the one that made the committed outputs: another
SIMD width, another BLAS code path, an ARM laptop. One machine reaches several of those paths
through environment variables that torch and MKL read at start-up:

    ATEN_CPU_CAPABILITY   default | avx2 | avx512 …  which vectorised ATen kernels run
    MKL_CBWR              COMPATIBLE | AVX2 | …      which MKL code path (BLAS) runs
    ONEDNN_MAX_CPU_ISA    AVX2 | AVX512_CORE | …     the newest instructions oneDNN may use

A path below AVX-512 caps oneDNN at AVX2 too, as a CPU without AVX-512 has it. Without the cap, a
CPU with AMX breaks: torch's CPU flash attention asks oneDNN whether to pack bfloat16/float16
blocks for AMX (the hardware says yes) and then calls a packing routine that only the AVX-512
build of ATen contains ("pack_vnni2 is only supported when avx512 is supported"), so every 16-bit
SDPA call fails under ATEN_CPU_CAPABILITY=default or avx2 (torch 2.13, Sapphire Rapids).

`python -m trainmech portability` executes the notebooks (with their committed default
parameters, as nbval does) once per path and reports three things:

1. outputs: every code cell's output, sanitised as nbval sanitises it, compared with the
   committed notebook: the output policy (trainmech.checks) holds when nothing differs;
2. margins: for every check that compares a value with a limit, the smallest distance to the
   limit across the paths against the spread of that distance (a claim must hold by at least
   3× its spread);
3. records: each path's records against results/cpu-reference (trainmech.drift).

The report goes to results/portability/ (REPORT.md and report.json); the executed notebooks and
records to results/portability-runs/<path>/.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import json
import math
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from trainmech import drift
from trainmech.session import NUMERIC_ENV, REPO_ROOT

__all__ = [
    "PATHS",
    "PATH_VARIABLES",
    "SANITIZE_FILE",
    "NOTEBOOKS_DIR",
    "RUNS_DIR",
    "REPORT_DIR",
    "MIN_MARGIN_RATIO",
    "SKIPPED_KEYS",
    "sanitize_patterns",
    "sanitize",
    "cell_outputs",
    "OutputDiff",
    "output_diffs",
    "Margin",
    "read_check_log",
    "margins",
    "environment",
    "execute",
    "analyse",
    "discover",
    "machine",
    "report_markdown",
    "main",
]

PATHS: dict[str, dict[str, str]] = {
    "native": {},
    "no-simd": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
PATH_VARIABLES = NUMERIC_ENV  # the variables a record names in environment.numeric_env
SANITIZE_FILE = REPO_ROOT / "tests" / "nbval_sanitize.cfg"
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
RUNS_DIR = REPO_ROOT / "results" / "portability-runs"
REPORT_DIR = REPO_ROOT / "results" / "portability"
MIN_MARGIN_RATIO = 3.0
# What nbval leaves out of its comparison (nbval.plugin.IPyNbFile.skip_compare, images included).
SKIPPED_KEYS = {
    "metadata",
    "traceback",
    "prompt_number",
    "output_type",
    "name",
    "execution_count",
    "application/vnd.jupyter.widget-view+json",
    "image/png",
    "image/jpeg",
}


# ----------------------------------------------------------------------------- outputs


def sanitize_patterns(path: Path = SANITIZE_FILE) -> list[tuple[re.Pattern, str]]:
    """The regex / replacement pairs of the nbval sanitize file, in file order."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(path, encoding="utf-8")
    return [(re.compile(parser[s]["regex"]), parser[s]["replace"]) for s in parser.sections()]


def sanitize(text: str, patterns: list[tuple[re.Pattern, str]]) -> str:
    for regex, replace in patterns:
        text = regex.sub(replace, text)
    return text


def cell_outputs(nb: dict, patterns: list[tuple[re.Pattern, str]]) -> dict[str, list[str]]:
    """{code cell id: its compared outputs as nbval sees them (streams merged, then each data key)}."""
    found = {}
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        parts, stream = [], {}
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream":
                stream[out["name"]] = stream.get(out["name"], "") + _text(out["text"])
            elif out["output_type"] == "error":
                parts.append(f"error: {out['ename']}: {out['evalue']}")
            else:
                parts += [
                    f"{key}: {_text(value)}"
                    for key, value in sorted(out.get("data", {}).items())
                    if key not in SKIPPED_KEYS
                ]
        parts = [f"{name}: {text}" for name, text in sorted(stream.items())] + parts
        found[cell.get("id", str(i))] = [sanitize(p, patterns) for p in parts]
    return found


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


@dataclass
class OutputDiff:
    path: str
    notebook: str
    cell: str
    committed: str
    fresh: str


def output_diffs(path: str, executed: Path, committed: Path, patterns) -> list[OutputDiff]:
    """Lines where an executed notebook's outputs differ from the committed one (first line per cell)."""
    a = cell_outputs(json.loads(committed.read_text(encoding="utf-8")), patterns)
    b = cell_outputs(json.loads(executed.read_text(encoding="utf-8")), patterns)
    diffs = []
    for cell in a:
        old, new = "\n".join(a[cell]).splitlines(), "\n".join(b.get(cell, ["(cell missing)"])).splitlines()
        for k in range(max(len(old), len(new))):
            x = old[k] if k < len(old) else "(no line)"
            y = new[k] if k < len(new) else "(no line)"
            if x != y:
                diffs.append(OutputDiff(path, committed.stem, cell, x, y))
                break
    return diffs


# ----------------------------------------------------------------------------- margins


@dataclass
class Margin:
    notebook: str
    n: int
    kind: str
    statement: str
    margins: dict[str, float]  # path -> distance to the limit (positive: holds)
    spread: float
    ratio: float  # smallest margin / spread (inf when the margin does not move)

    @property
    def ok(self) -> bool:
        return min(self.margins.values()) >= 0 and self.ratio >= MIN_MARGIN_RATIO


def read_check_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _distance(entry: dict) -> float | None:
    value, limit = entry.get("value"), entry.get("limit")
    if not isinstance(value, (int, float)) or not isinstance(limit, (int, float)):
        return None
    return value - limit if entry["kind"] == "at_least" else limit - value  # at_most and close: value ≤ limit


def margins(logs: dict[str, list[dict]], notebook: str) -> tuple[list[Margin], list[str]]:
    """(each quantitative check's margins across paths, problems: checks that differ between paths)."""
    problems, found = [], []
    counts = {p: len(entries) for p, entries in logs.items()}
    if len(set(counts.values())) > 1:
        problems.append(f"{notebook}: the paths ran a different number of checks {counts}")
    for n in range(min(counts.values(), default=0)):
        entries = {p: log[n] for p, log in logs.items()}
        kinds = {e["kind"] for e in entries.values()}
        holds = {p: e["holds"] for p, e in entries.items()}
        if len(kinds) > 1:
            problems.append(f"{notebook} check {n}: different checks on different paths {kinds}")
            continue
        if not all(holds.values()):
            problems.append(
                f"{notebook} check {n} ({next(iter(entries.values()))['statement']}): fails on {[p for p, h in holds.items() if not h]}"
            )
        distances = {p: _distance(e) for p, e in entries.items()}
        if any(d is None for d in distances.values()):
            continue
        spread = max(distances.values()) - min(distances.values())
        smallest = min(distances.values())
        ratio = math.inf if spread == 0 else smallest / spread
        first = next(iter(entries.values()))
        found.append(Margin(notebook, n, first["kind"], first["statement"], distances, spread, ratio))
    return found, problems


# ----------------------------------------------------------------------------- execution


@contextlib.contextmanager
def environment(variables: dict[str, str]):
    """Set the numeric-path variables (and unset the others) while inside."""
    from trainmech.execution import environ_set

    with environ_set(variables, unset=PATH_VARIABLES):
        yield


def _forget(out_dir: Path, stems: list[str]) -> None:
    """Remove the last run of these notebooks under out_dir (executed copy, check log, records); the
    other notebooks' last runs stay, so `--only` followed by `--reuse` reports on every notebook."""
    for stem in stems:
        (out_dir / "notebooks" / f"{stem}.ipynb").unlink(missing_ok=True)
        (out_dir / "checks" / f"{stem}.jsonl").unlink(missing_ok=True)
    for record in out_dir.glob("*.json"):
        try:
            notebook = json.loads(record.read_text(encoding="utf-8")).get("identity", {}).get("notebook")
        except (OSError, ValueError):
            notebook = None
        if notebook is None or notebook in stems:
            record.unlink()


def execute(path: str, notebooks: list[Path], out_dir: Path, timeout: float = 1200.0) -> dict[str, float]:
    """Execute the notebooks as committed (default parameters) under one numeric path.

    Executed copies go to out_dir/notebooks/, records and check logs to out_dir. Returns seconds
    per notebook.
    """
    import nbformat

    from trainmech.execution import notebook_client
    from trainmech.runner import records_into

    _forget(out_dir, [nb.stem for nb in notebooks])
    (out_dir / "notebooks").mkdir(parents=True, exist_ok=True)
    seconds = {}
    with environment(PATHS[path]), records_into(out_dir):
        for nb_path in notebooks:
            nb = nbformat.read(nb_path, as_version=4)
            client = notebook_client(nb, nb_path, timeout=int(timeout))
            t0 = time.perf_counter()
            try:
                client.execute()
            except Exception as e:  # the failing cell's error output stays in the copy: reported as a diff
                print(f"  {nb_path.stem}: {type(e).__name__}", file=sys.stderr)
            seconds[nb_path.stem] = round(time.perf_counter() - t0, 1)
            nbformat.write(nb, out_dir / "notebooks" / nb_path.name)
    return seconds


def analyse(paths: list[str], notebooks: list[Path], runs_dir: Path = RUNS_DIR) -> dict:
    patterns = sanitize_patterns()
    diffs, all_margins, problems, drifts = [], [], [], []
    for nb_path in notebooks:
        for p in paths:
            executed = runs_dir / p / "notebooks" / nb_path.name
            diffs += output_diffs(p, executed, nb_path, patterns)
        logs = {p: read_check_log(runs_dir / p / "checks" / f"{nb_path.stem}.jsonl") for p in paths}
        found, trouble = margins(logs, nb_path.stem)
        all_margins += found
        problems += trouble
    for p in paths:
        drifts += [
            (p, str(d))
            for d in drift.compare_runs(runs_dir / p, require_all=len(notebooks) == len(discover()))
        ]
    return {"diffs": diffs, "margins": all_margins, "problems": problems, "drifts": drifts}


def discover(only: list[str] | None = None) -> list[Path]:
    found = sorted(
        NOTEBOOKS_DIR.glob("Task*.ipynb"), key=lambda p: int(re.match(r"Task(\d+)", p.name).group(1))
    )
    if only:
        found = [p for p in found if any(p.stem == o or p.stem.startswith(o + "_") for o in only)]
    return found


# ----------------------------------------------------------------------------- report


def machine() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "machine": platform.machine(),
        "torch": torch.__version__,
        "native_capability": torch.backends.cpu.get_cpu_capability(),
    }


def report_markdown(result: dict, paths: list[str], seconds: dict) -> str:
    lines = [
        "# Portability report",
        "",
        f"Machine: {result['machine']['cpu']} ({result['machine']['machine']}, torch {result['machine']['torch']}, "
        f"native ATen capability {result['machine']['native_capability']}).",
        "",
        "| path | variables | seconds (all notebooks) |",
        "|---|---|---|",
    ]
    for p in paths:
        variables = " ".join(f"{k}={v}" for k, v in PATHS[p].items()) or "(none: this machine's defaults)"
        ran = seconds.get(p)  # None: analysed from the last runs (--reuse), not timed here
        lines.append(
            f"| {p} | {variables} | {f'{sum(ran.values()):.0f}' if ran else 'not timed (--reuse)'} |"
        )
    lines += ["", f"## Outputs against the committed notebooks: {len(result['diffs'])} differing cell(s)", ""]
    lines += [
        f"- {d.path} · {d.notebook} · {d.cell}: `{d.committed}` → `{d.fresh}`" for d in result["diffs"]
    ] or ["None."]
    lines += [
        "",
        f"## Claim margins (margin ≥ {MIN_MARGIN_RATIO:g}× spread across paths)",
        "",
        "Tightest quantitative check per notebook (margin: distance to the limit on the worst path; spread: how "
        "much that distance moves between paths).",
        "",
        "| notebook | check | margin | spread | ratio |",
        "|---|---|---|---|---|",
    ]
    by_nb: dict[str, Margin] = {}
    for m in result["margins"]:
        if m.notebook not in by_nb or m.ratio < by_nb[m.notebook].ratio:
            by_nb[m.notebook] = m
    for nb, m in by_nb.items():
        lines.append(
            f"| {nb} | {m.statement[:90]} | {min(m.margins.values()):.3g} | {m.spread:.3g} | "
            f"{'∞' if math.isinf(m.ratio) else f'{m.ratio:.3g}'} |"
        )
    bad = [m for m in result["margins"] if not m.ok]
    lines += ["", f"Checks below the ratio: {len(bad)} of {len(result['margins'])}.", ""]
    lines += [f"- {m.notebook} #{m.n} {m.statement}: margins {m.margins}, spread {m.spread:.3g}" for m in bad]
    lines += ["", f"## Problems: {len(result['problems'])}", ""] + [f"- {p}" for p in result["problems"]]
    lines += ["", f"## Records against results/cpu-reference: {len(result['drifts'])} drift(s)", ""]
    lines += [f"- {p}: {d}" for p, d in result["drifts"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainmech portability",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--paths",
        nargs="+",
        default=list(PATHS),
        choices=list(PATHS),
        help="numeric paths to run (default: all)",
    )
    parser.add_argument("--only", nargs="+", metavar="TaskN", help="only these notebooks")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="analyse the last runs in results/portability-runs/ without executing",
    )
    parser.add_argument(
        "--report", type=Path, default=REPORT_DIR, help="folder for REPORT.md and report.json"
    )
    args = parser.parse_args(argv)
    notebooks = discover(args.only)
    seconds: dict[str, dict[str, float]] = {}
    if not args.reuse:
        for p in args.paths:
            print(
                f"path {p}: {' '.join(f'{k}={v}' for k, v in PATHS[p].items()) or 'defaults'}",
                file=sys.stderr,
            )
            seconds[p] = execute(p, notebooks, RUNS_DIR / p)
    result = analyse(args.paths, notebooks)
    result["machine"] = machine()
    args.report.mkdir(parents=True, exist_ok=True)
    (args.report / "REPORT.md").write_text(report_markdown(result, args.paths, seconds), encoding="utf-8")
    payload = {
        "machine": result["machine"],
        "paths": {p: PATHS[p] for p in args.paths},
        "seconds": seconds,
        "diffs": [asdict(d) for d in result["diffs"]],
        "problems": result["problems"],
        "drifts": [{"path": p, "drift": d} for p, d in result["drifts"]],
        "margins": [
            {**asdict(m), "ratio": None if math.isinf(m.ratio) else m.ratio} for m in result["margins"]
        ],
    }
    (args.report / "report.json").write_text(
        json.dumps(payload, ensure_ascii=False, indent=1) + "\n", encoding="utf-8"
    )
    bad = [m for m in result["margins"] if not m.ok]
    print(
        f"{len(result['diffs'])} output diff(s), {len(bad)} tight margin(s), {len(result['problems'])} problem(s), "
        f"{len(result['drifts'])} record drift(s); report in {args.report}",
        file=sys.stderr,
    )
    return 1 if result["diffs"] or bad or result["problems"] or result["drifts"] else 0


if __name__ == "__main__":
    sys.exit(main())
