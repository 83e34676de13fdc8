"""Result records: the pydantic model, the atomic writer, the validating reader, the registry.

One JSON file per experiment and workload, `<semantic_id>__<workload_id>.json`, with the six
field groups of the registry's public result fields plus free-form `metrics`. A value that does
not apply is null. `registry_markdown(records)` renders the asset registry's table with each
experiment's evidence status derived from the records of one run.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import tomllib
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trainmech.errors import TrainmechError

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_ENV = "TRAINMECH_RESULTS_DIR"  # where a session writes its records when the runner or a test sets it
LABEL_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*\Z")  # \Z: `$` would let a trailing newline in
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z")

# What a record proves, weakest first: a CPU mechanism check, a CUDA path run whose numbers were
# not measured (for example no GPU present), GPU measurements.
EVIDENCE_LEVELS = ("cpu-mechanism", "not-measured", "gpu-measured")
Evidence = Literal["cpu-mechanism", "not-measured", "gpu-measured"]
Decision = Literal["accept", "tune", "reject"]
Scalar = float | int | str | bool | None


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # JSON has no NaN / Infinity


class Identity(_Group):
    semantic_id: str
    workload_id: str
    run_label: str
    page: str
    notebook: str
    candidate: str | None = None

    @field_validator("semantic_id", "workload_id")
    @classmethod
    def _safe_id(cls, v: str) -> str:
        if not ID_RE.match(v):
            raise ValueError(f"{v!r} is not a safe id ([A-Za-z0-9._-], no leading dot)")
        return v


class EffectiveBatch(_Group):
    sequences: int | None = None
    supervised_tokens: int | None = None


class Workload(_Group):
    model_id: str
    model_commit: str | None = None
    model_weights: str
    tokenizer: str
    input_shape: list[int]
    effective_batch: EffectiveBatch
    update_count: int | None = None
    dtype: str
    seed: int


class Environment(_Group):
    profile_id: str
    run_mode: str
    python: str
    torch: str
    transformers: str
    accelerate: str | None
    cuda: str | None
    gpu: str | None
    gpu_memory_bytes: int | None
    device: str


class Correctness(_Group):
    output_max_abs_error: float | None = None
    grad_max_abs_error: float | None = None
    all_finite: bool | None = None
    skipped_updates: int | None = None
    effective_updates: int | None = None


class Resources(_Group):
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    step_time_median_s: float | None = None
    step_time_p95_s: float | None = None
    transfer_bytes: int | None = None
    recompute_count: int | None = None


class Conclusion(_Group):
    failure: str | None = None
    evidence_level: Evidence
    decision: Decision | None = None
    next_step: str | None = None


class Record(_Group):
    schema_version: Literal[1] = SCHEMA_VERSION
    identity: Identity
    workload: Workload
    environment: Environment
    correctness: Correctness = Field(default_factory=Correctness)
    resources: Resources = Field(default_factory=Resources)
    conclusion: Conclusion
    metrics: dict[str, Scalar | list[Scalar] | dict[str, Scalar]] = Field(default_factory=dict)

    @property
    def filename(self) -> str:
        return f"{self.identity.semantic_id}__{self.identity.workload_id}.json"


def check_label(label: object) -> str:
    """A run label becomes a folder name: [A-Za-z0-9._-] only, not empty, no leading dot."""
    if not isinstance(label, str) or not LABEL_RE.match(label):
        raise TrainmechError(
            f"invalid run label {label!r}: use letters, digits, '.', '_' or '-' only, not starting with a dot"
        )
    return label


def validate(data: dict[str, Any]) -> Record:
    """The Record for data, or a one-sentence TrainmechError naming the first problem."""
    try:
        return Record.model_validate(data)
    except ValidationError as e:
        raise TrainmechError(f"record does not validate: {_first_error(e)}") from None


def write_record(record: Record | dict[str, Any], directory: Path) -> Path:
    """Validate, then write atomically (temporary file in the same folder + rename)."""
    if not isinstance(record, Record):
        record = validate(record)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / record.filename
    text = json.dumps(record.model_dump(mode="json"), ensure_ascii=False, indent=2, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_record(path: Path) -> Record:
    """Read and validate one record; a malformed file is refused with one sentence naming it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise TrainmechError(f"record {Path(path).name} is not readable JSON ({e})") from None
    try:
        return Record.model_validate(data)
    except ValidationError as e:
        raise TrainmechError(f"record {Path(path).name} is malformed: {_first_error(e)}") from None


def record_paths(directory: Path) -> list[Path]:
    return sorted(p for p in Path(directory).glob("*__*.json") if not p.name.startswith("."))


def read_records(directory: Path) -> list[Record]:
    return [read_record(p) for p in record_paths(directory)]


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"]) or "record"
    return f"{where}: {err['msg']} ({len(e.errors())} error(s) in all)"


def json_schema() -> dict[str, Any]:
    return Record.model_json_schema()


def write_schema(path: Path) -> Path:
    path.write_text(json.dumps(json_schema(), ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- the registry

def experiments() -> list[dict[str, str]]:
    """The registry's experiments (package data `registry.toml`), in curriculum order."""
    text = resources.files("trainmech").joinpath("data/registry.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)["experiments"]


def evidence_status(records: list[Record]) -> str:
    """One cell of the registry: the strongest evidence of an experiment's records, in words."""
    if not records:
        return "no record"
    best = max(records, key=lambda r: EVIDENCE_LEVELS.index(r.conclusion.evidence_level))
    level = best.conclusion.evidence_level
    workloads = ", ".join(sorted({r.identity.workload_id for r in records}))
    failed = [r for r in records if r.conclusion.failure]
    decisions = sorted({r.conclusion.decision for r in records if r.conclusion.decision})
    text = f"{level} ({workloads})"
    if decisions:
        text += "; decision " + "/".join(decisions)
    if failed:
        text += f"; {len(failed)} failed"
    return text


def _page(e: dict) -> str:
    """The registry's page, and the course notebook (TaskN) that runs the experiment where they differ."""
    task = e["notebook"].split("_")[0]
    return e["page"] if e["page"] == task else f"{e['page']} → {task}"


def registry_markdown(records: list[Record], run_label: str | None = None) -> str:
    """The asset registry's table for one run: every experiment, its status from the records."""
    by_id: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_id[r.identity.semantic_id].append(r)
    known = {e["semantic_id"] for e in experiments()}
    lines = [
        f"# 实验资产表 · 运行 `{run_label}`" if run_label else "# 实验资产表",
        "",
        "证据状态由本次运行的结果记录推出（`python -m trainmech registry`）；没有记录的实验写 `no record`。"
        "“Part 02 · NN”是资产表原稿的页码，箭头后是本课程里做这个实验的 Notebook。",
        "",
        "| 实验 ID / 页面 | 固定对照 | 主要指标 | 证据状态 | 参考数字 |",
        "|---|---|---|---|---|",
    ]
    for e in experiments():
        status = evidence_status(by_id.get(e["semantic_id"], []))
        lines.append(
            f"| {e['semantic_id']} / {_page(e)} | {e['comparison']} | {e['metrics']} | {status} | {e['reference']} |"
        )
    extra = sorted(set(by_id) - known)
    for sid in extra:
        lines.append(f"| {sid} / — | — | — | {evidence_status(by_id[sid])} | — |")
    return "\n".join(lines) + "\n"


def runs_with_evidence(root: Path, level: str = "gpu-measured") -> dict[str, list[Record]]:
    """{run label: its readable records} for each run folder under root holding at least one
    record of this evidence level, labels sorted; unreadable records are left out (as the runner does)."""
    if level not in EVIDENCE_LEVELS:
        raise TrainmechError(f"unknown evidence level {level!r}; valid: {', '.join(EVIDENCE_LEVELS)}")
    found: dict[str, list[Record]] = {}
    for folder in sorted(p for p in Path(root).iterdir() if p.is_dir() and LABEL_RE.match(p.name) and not p.name.startswith(".")):
        records = []
        for path in record_paths(folder):
            try:
                records.append(read_record(path))
            except TrainmechError:
                continue
        if any(r.conclusion.evidence_level == level for r in records):
            found[folder.name] = records
    return found
