"""Result records: the pydantic model, the atomic writer, the validating reader, the registry.

One JSON file per experiment and workload, `<semantic_id>__<workload_id>.json`, with the six
field groups of the registry's public result fields plus free-form `metrics`. A value that does
not apply is null. Records are strict: JSON types only (no "5" for 5), no negative bytes, times or
counts, the file name is the record's identity, the run label is the folder's name, and GPU
evidence needs a GPU. `registry_markdown(records)` renders the asset registry's table with each
experiment's evidence status derived from the records of one run.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
import tomllib
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainmech import REPO_ROOT
from trainmech.errors import TrainmechError, first_validation_error

__all__ = [
    "REPO_ROOT",
    "RESULTS_ENV",
    "SCHEMA_VERSION",
    "MAX_RECORD_BYTES",
    "MAX_LABEL_LENGTH",
    "PARTIAL_SUFFIX",
    "LABEL_RE",
    "ID_RE",
    "EVIDENCE_LEVELS",
    "Evidence",
    "Decision",
    "Scalar",
    "Count",
    "Seconds",
    "Error",
    "Identity",
    "EffectiveBatch",
    "Workload",
    "NumericEnv",
    "Environment",
    "Correctness",
    "Resources",
    "Conclusion",
    "Record",
    "check_label",
    "run_label_of",
    "validate",
    "write_record",
    "shown",
    "read_json",
    "read_record",
    "record_paths",
    "read_records",
    "read_run",
    "json_schema",
    "write_schema",
    "experiments",
    "reference_figures",
    "outcome_of",
    "evidence_status",
    "registry_markdown",
    "runs_with_evidence",
]

RESULTS_ENV = "TRAINMECH_RESULTS_DIR"  # where kernels write records when the runner or the tests say so

SCHEMA_VERSION = (
    2  # 2: the environment names the CPU, its ISA, BLAS, oneDNN, threads (1 is read as 2 with those null)
)
MAX_RECORD_BYTES = 1 << 20  # a record is a few KB; anything larger is not one
MAX_LABEL_LENGTH = 100  # a label is a folder name, with room for .staging-…-<pid> beside it
PARTIAL_SUFFIX = ".partial"  # results/<label>.partial/: a run that did not complete (see trainmech.runner)
LABEL_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*\Z")  # \Z: `$` would let a trailing newline in
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z")

# What a record proves, weakest first: a CPU mechanism check, a CUDA path run whose numbers were
# not measured (for example no GPU present), GPU measurements.
EVIDENCE_LEVELS = ("cpu-mechanism", "not-measured", "gpu-measured")
Evidence = Literal["cpu-mechanism", "not-measured", "gpu-measured"]
Decision = Literal["accept", "tune", "reject"]
Scalar = float | int | str | bool | None
Count = Annotated[int, Field(ge=0)]  # bytes, counts, updates
Seconds = Annotated[float, Field(ge=0)]
Error = Annotated[float, Field(ge=0)]  # a max abs error


class _Group(BaseModel):
    # strict: a JSON string is never read as a number, a float never as an int; JSON has no NaN / Infinity
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


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
    sequences: Count | None = None
    supervised_tokens: Count | None = None


class Workload(_Group):
    model_id: str
    model_commit: str | None = None
    model_weights: str
    tokenizer: str
    input_shape: list[Annotated[int, Field(ge=1)]]
    effective_batch: EffectiveBatch
    update_count: Count | None = None
    dtype: str
    seed: int


class NumericEnv(_Group):
    """The variables that choose CPU numeric paths, as set for the run (null: not set)."""

    ATEN_CPU_CAPABILITY: str | None = None
    MKL_CBWR: str | None = None
    ONEDNN_MAX_CPU_ISA: str | None = None


class Environment(_Group):
    profile_id: str
    run_mode: str
    python: str
    torch: str
    transformers: str
    accelerate: str | None
    cuda: str | None
    gpu: str | None
    gpu_memory_bytes: Count | None
    device: str
    # provenance of the numbers (schema 2): which CPU and which kernels computed them
    cpu: str | None = None  # the CPU model
    cpu_capability: str | None = None  # the ISA torch dispatches to: torch.backends.cpu.get_cpu_capability()
    blas: str | None = None  # e.g. "mkl 2024.2"
    onednn: str | None = None  # the oneDNN (MKL-DNN) version
    intra_op_threads: Annotated[int, Field(ge=1)] | None = None
    numeric_env: NumericEnv = Field(default_factory=NumericEnv)


class Correctness(_Group):
    output_max_abs_error: Error | None = None
    grad_max_abs_error: Error | None = None
    all_finite: bool | None = None
    skipped_updates: Count | None = None
    effective_updates: Count | None = None


class Resources(_Group):
    peak_allocated_bytes: Count | None = None
    peak_reserved_bytes: Count | None = None
    step_time_median_s: Seconds | None = None
    step_time_p95_s: Seconds | None = None
    transfer_bytes: Count | None = None
    recompute_count: Count | None = None


class Conclusion(_Group):
    failure: str | None = None
    evidence_level: Evidence
    decision: Decision | None = None
    next_step: str | None = None


class Record(_Group):
    schema_version: Literal[2]
    identity: Identity
    workload: Workload
    environment: Environment
    correctness: Correctness = Field(default_factory=Correctness)
    resources: Resources = Field(default_factory=Resources)
    conclusion: Conclusion
    metrics: dict[str, Scalar | list[Scalar] | dict[str, Scalar]] = Field(default_factory=dict)

    @field_validator("schema_version", mode="before")
    @classmethod
    def _an_integer(cls, v: Any) -> Any:
        if type(v) is not int:  # Literal[2] alone lets 2.0 through
            raise ValueError(f"schema_version must be the integer {SCHEMA_VERSION}")
        return v

    @model_validator(mode="after")
    def _evidence_matches_the_environment(self) -> Record:
        env = self.environment
        if self.conclusion.evidence_level == "gpu-measured" and not (
            env.device.startswith("cuda") and env.gpu
        ):
            raise ValueError(
                f"evidence_level gpu-measured needs a CUDA device and a named gpu, but device is {env.device!r}"
            )
        return self

    @property
    def filename(self) -> str:
        return f"{self.identity.semantic_id}__{self.identity.workload_id}.json"


def check_label(label: object) -> str:
    """A run label becomes a folder name: 1 to 100 of [A-Za-z0-9._-], no leading dot."""
    if not isinstance(label, str) or not LABEL_RE.match(label) or len(label) > MAX_LABEL_LENGTH:
        text = repr(label if not isinstance(label, str) or len(label) <= 40 else label[:40] + "…")
        raise TrainmechError(
            f"invalid run label {text}: use 1 to {MAX_LABEL_LENGTH} letters, digits, '.', '_' or '-', "
            "not starting with a dot"
        )
    return label


def run_label_of(folder: Path) -> str:
    """The run label whose records a results folder holds: its name, less `.partial`."""
    return Path(folder).name.removesuffix(PARTIAL_SUFFIX)


def validate(data: dict[str, Any]) -> Record:
    """The Record for data (schema_version added when absent), or a one-sentence TrainmechError."""
    try:
        return Record.model_validate({"schema_version": SCHEMA_VERSION, **_plain(data)})
    except ValidationError as e:
        raise TrainmechError(f"record does not validate: {first_validation_error(e, 'record')}") from None


def _plain(value: Any) -> Any:
    """Tuples as lists and numpy / torch scalars as Python numbers: what the JSON file will hold."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if not isinstance(value, (str, int, float, bool, type(None))) and hasattr(value, "item"):
        return value.item()
    return value


def write_record(record: Record | dict[str, Any], directory: Path) -> Path:
    """Validate, then write atomically (temporary file in the same folder + rename)."""
    if not isinstance(record, Record):
        record = validate(record)
    directory = Path(directory)
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


def shown(path: Path) -> str:
    """A file's name fit for a one-line message (escaped when it holds control characters)."""
    name = Path(path).name
    return name if name.isprintable() else ascii(name)


def read_json(
    path: Path, what: str = "file", max_bytes: int = MAX_RECORD_BYTES, name: str | None = None
) -> Any:
    """The JSON value of a regular file of at most max_bytes; anything else is refused in one sentence
    naming it: "<what> <name>" (name: the file's name unless given)."""
    path, name = Path(path), name or shown(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block the open
    except FileNotFoundError:
        raise TrainmechError(f"{what} {name} does not exist") from None
    except OSError as e:
        raise TrainmechError(f"{what} {name} cannot be opened ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # /dev/zero, a FIFO, a folder: never read
        os.close(fd)
        raise TrainmechError(f"{what} {name} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        try:
            raw = f.read(max_bytes + 1)
        except OSError as e:
            raise TrainmechError(f"{what} {name} cannot be read ({e.strerror})") from None
    if len(raw) > max_bytes:
        raise TrainmechError(f"{what} {name} is larger than {max_bytes:,} bytes")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise TrainmechError(f"{what} {name} is not UTF-8 text (bad byte at offset {e.start})") from None
    except RecursionError:
        raise TrainmechError(f"{what} {name} is not readable JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, or an integer too long to convert
        raise TrainmechError(f"{what} {name} is not readable JSON ({_one_line(str(e))})") from None


def read_record(path: Path, run_label: str | None = None) -> Record:
    """Read and validate one record; refused in one sentence naming the file: unreadable, malformed,
    a file name other than its identity, or (when run_label is given) another run's record."""
    path = Path(path)
    data = read_json(path, "record")
    if isinstance(data, dict) and type(data.get("schema_version")) is int and data["schema_version"] == 1:
        data = {**data, "schema_version": SCHEMA_VERSION}  # schema 1 lacks only the provenance fields: null
    try:
        record = Record.model_validate(data)
    except ValidationError as e:
        raise TrainmechError(
            f"record {shown(path)} is malformed: {first_validation_error(e, 'record')}"
        ) from None
    if path.name != record.filename:
        raise TrainmechError(
            f"record {shown(path)} has the identity of {record.filename}; a record's file name is its identity"
        )
    if run_label is not None and record.identity.run_label != run_label:
        raise TrainmechError(
            f"record {shown(path)} belongs to run {record.identity.run_label!r}, not to {run_label!r} whose folder holds it"
        )
    return record


def record_paths(directory: Path) -> list[Path]:
    return sorted(p for p in Path(directory).glob("*__*.json") if not p.name.startswith("."))


def read_records(directory: Path) -> list[Record]:
    """Every record of a run folder; the first invalid one is refused (see read_run to list them instead)."""
    return [read_record(p, run_label_of(directory)) for p in record_paths(directory)]


def read_run(directory: Path, run_label: str | None = None) -> tuple[list[Record], dict[str, str]]:
    """(valid records, {file name: why it is invalid}) of a run folder; run_label defaults to the folder's."""
    label = run_label_of(directory) if run_label is None else run_label
    records, invalid = [], {}
    for path in record_paths(directory):
        try:
            records.append(read_record(path, label))
        except TrainmechError as e:
            invalid[shown(path)] = str(e)
    return records, invalid


def _one_line(text: str) -> str:
    return " ".join(text.split())


def json_schema() -> dict[str, Any]:
    return Record.model_json_schema()


def write_schema(path: Path) -> Path:
    path.write_text(json.dumps(json_schema(), ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- the registry


def experiments() -> list[dict[str, Any]]:
    """The registry's experiments (package data `registry.toml`), in curriculum order."""
    text = resources.files("trainmech").joinpath("data/registry.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)["experiments"]


def reference_figures(semantic_id: str) -> dict[str, Any]:
    """The GPU figures the registry quotes for one experiment (`figures` in registry.toml): device,
    workload and changes as fractions (-0.337: a 33.7 % drop). Quoted from the registry document,
    not measured by this project; {} when the registry quotes none."""
    for e in experiments():
        if e["semantic_id"] == semantic_id:
            return dict(e.get("figures", {}))
    raise TrainmechError(f"no experiment {semantic_id!r} in the registry")


def outcome_of(record: Record) -> str | None:
    """What a record concluded, in words that keep "wrong" apart from "not worth it": `metrics.outcome` (the
    gates' accept / tune / no-gain / costs-memory / reject; the `decision` field files no-gain and costs-memory
    as reject), with the failure
    beside it; the failure alone where no outcome was recorded; None where neither was."""
    outcome, failure = record.metrics.get("outcome"), record.conclusion.failure
    if isinstance(outcome, str):
        return f"{outcome} ({failure})" if failure else outcome
    return failure


def evidence_status(records: list[Record]) -> str:
    """One cell of the registry: the strongest evidence of an experiment's records, in words, with the decisions
    and the outcomes (`outcome_of`) the records hold."""
    if not records:
        return "no record"
    best = max(records, key=lambda r: EVIDENCE_LEVELS.index(r.conclusion.evidence_level))
    level = best.conclusion.evidence_level
    workloads = ", ".join(sorted({r.identity.workload_id for r in records}))
    failed = [r for r in records if r.conclusion.failure]
    decisions = sorted({r.conclusion.decision for r in records if r.conclusion.decision})
    outcomes = sorted({o for r in records if (o := outcome_of(r))})
    text = f"{level} ({workloads})"
    if decisions:
        text += "; decision " + "/".join(decisions)
    if outcomes:
        text += "; outcome " + " / ".join(outcomes)
    if failed:
        text += f"; {len(failed)} failed"
    return text


def _page(e: dict) -> str:
    """The registry's page, and the course notebook (TaskN) that runs the experiment where they differ."""
    task = e["notebook"].split("_")[0]
    return e["page"] if e["page"] == task else f"{e['page']} → {task}"


def registry_markdown(
    records: list[Record], run_label: str | None = None, invalid: dict[str, str] | None = None
) -> str:
    """The asset registry's table for one run: every experiment, its status from the records;
    invalid ({file name: reason}, see read_run) are listed below the table, not counted in it."""
    by_id: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_id[r.identity.semantic_id].append(r)
    known = {e["semantic_id"] for e in experiments()}
    lines = [
        f"# 实验资产表 · 运行 `{run_label}`" if run_label else "# 实验资产表",
        "",
        "证据状态由本次运行的结果记录推出（`python -m trainmech registry`）；没有记录的实验写 `no record`。"
        "“Part 02 · NN”是资产表原稿的页码，箭头后是本课程里做这个实验的 Notebook。"
        "`decision` 是记录的决策字段（accept / tune / reject）；`outcome` 是门槛给出的结论，"
        "把“错”（`reject`，括号里是失败的门槛）与“对但不值得”（`no-gain`：既不更省也不更快；`costs-memory`：没有收益、峰值还更高；两者在 `decision` 里都记作 reject）分开。",
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
    if invalid:
        lines += [
            "",
            f"## 无效记录（invalid records）：{len(invalid)} 个",
            "",
            "下列文件不是这次运行的有效结果记录，没有计入上表：",
            "",
        ]
        lines += [f"- `{name}`: {reason}" for name, reason in sorted(invalid.items())]
    return "\n".join(lines) + "\n"


def runs_with_evidence(root: Path, level: str = "gpu-measured") -> dict[str, list[Record]]:
    """{run label: its readable records} for each run folder under root holding at least one
    record of this evidence level, labels sorted; unreadable records are left out (as the runner does)."""
    if level not in EVIDENCE_LEVELS:
        raise TrainmechError(f"unknown evidence level {level!r}; valid: {', '.join(EVIDENCE_LEVELS)}")
    found: dict[str, list[Record]] = {}
    for folder in sorted(
        p
        for p in Path(root).iterdir()
        if p.is_dir() and LABEL_RE.match(p.name) and not p.name.startswith(".")
    ):
        records, _ = read_run(folder)
        if any(r.conclusion.evidence_level == level for r in records):
            found[folder.name] = records
    return found
