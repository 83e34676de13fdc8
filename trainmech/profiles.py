"""Environment profiles: `profiles/<PROFILE_ID>.toml` as validated data.

A profile fixes what a run mode means: the device, the package requirements, the model
configurations and the workloads of the asset registry. `load(profile_id)` reads and validates
one; `for_mode(run_mode)` maps a run mode to its profile.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainmech.errors import TrainmechError, first_validation_error

__all__ = [
    "PROFILES_DIR",
    "MODES",
    "ModelSpec",
    "WorkloadSpec",
    "Profile",
    "available",
    "load",
    "for_mode",
    "check_mode",
    "installed_versions",
    "version_problems",
]

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"

# run mode -> profile id (ARCHITECTURE §2)
MODES: dict[str, str] = {"cpu": "TRAIN-CPU", "TRAIN-CUDA-MECHANISM": "TRAIN-CUDA-MECHANISM"}


class ModelSpec(BaseModel):
    """A model identity plus its transformers.Qwen2Config fields (kept as extra keys)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    model_id: str
    model_commit: str | None = None
    weights_sha256: str | None = None
    n_params: int | None = None
    vocab_size: int | Literal["tokenizer"]
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelSpec":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        return self

    def qwen2_config(self) -> dict[str, Any]:
        """The Qwen2Config keyword arguments (identity fields removed)."""
        identity = {"model_id", "model_commit", "weights_sha256", "n_params"}
        return {k: v for k, v in self.model_dump().items() if k not in identity}


class WorkloadSpec(BaseModel):
    """One registry workload: model, batch and sequence shape, micro-batch splits, updates."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str
    batch: int = Field(gt=0)
    seq: int = Field(gt=1)
    micro_batches: list[int] = [1]
    updates: int = Field(ge=0)
    dtype: Literal["float32", "float16", "bfloat16", "float64"] = "float32"
    experiments: list[str] = []

    @model_validator(mode="after")
    def _splits_divide_batch(self) -> "WorkloadSpec":
        bad = [m for m in self.micro_batches if m <= 0 or self.batch % m]
        if bad:
            raise ValueError(f"micro_batches {bad} do not divide batch {self.batch}")
        return self


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    profile_id: str
    run_mode: str
    device: Literal["cpu", "cuda"]
    evidence_level: str
    description: str
    default_model: str
    packages: dict[str, str]
    models: dict[str, ModelSpec]
    workloads: dict[str, WorkloadSpec]

    @model_validator(mode="after")
    def _references_exist(self) -> "Profile":
        names = set(self.models)
        if self.default_model not in names:
            raise ValueError(f"default_model {self.default_model!r} is not among models {sorted(names)}")
        for wid, w in self.workloads.items():
            if w.model not in names:
                raise ValueError(f"workload {wid!r} names model {w.model!r}, not among {sorted(names)}")
        return self

    def model(self, name: str | None = None) -> ModelSpec:
        name = name or self.default_model
        if name not in self.models:
            raise TrainmechError(
                f"profile {self.profile_id} has no model {name!r}; valid: {', '.join(self.models)}"
            )
        return self.models[name]

    def workload(self, workload_id: str) -> WorkloadSpec:
        if workload_id not in self.workloads:
            raise TrainmechError(
                f"profile {self.profile_id} has no workload {workload_id!r}; valid: {', '.join(self.workloads)}"
            )
        return self.workloads[workload_id]


def available() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))


def load(profile_id: str, directory: Path | None = None) -> Profile:
    """Read and validate `profiles/<profile_id>.toml`; refuses unknown ids and malformed files."""
    directory = directory or PROFILES_DIR
    path = directory / f"{profile_id}.toml"
    if not path.is_file():
        valid = sorted(p.stem for p in directory.glob("*.toml"))
        raise TrainmechError(f"unknown profile {profile_id!r}; valid: {', '.join(valid)}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        profile = Profile.model_validate(data)
    except tomllib.TOMLDecodeError as e:
        raise TrainmechError(f"profile file {path.name} is malformed: {e}") from None
    except ValidationError as e:
        raise TrainmechError(
            f"profile file {path.name} is malformed: {first_validation_error(e, 'profile')}"
        ) from None
    if profile.profile_id != profile_id:
        raise TrainmechError(f"profile file {path.name} declares profile_id {profile.profile_id!r}")
    return profile


def for_mode(run_mode: str) -> Profile:
    """The profile of a run mode: cpu -> TRAIN-CPU, TRAIN-CUDA-MECHANISM -> TRAIN-CUDA-MECHANISM."""
    return load(MODES[check_mode(run_mode)])


def check_mode(run_mode: object) -> str:
    if run_mode not in MODES:
        raise TrainmechError(f"unknown run mode {run_mode!r}; valid: {', '.join(MODES)}")
    return run_mode  # type: ignore[return-value]


def installed_versions(names) -> dict[str, str | None]:
    """name -> the version this interpreter would import (Python's own for "python"); None if absent."""
    import platform
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = platform.python_version() if name == "python" else metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def version_problems(profile: Profile, installed: dict[str, str | None] | None = None) -> list[str]:
    """What in this environment does not satisfy the profile's [packages]: one line each, empty when all do.

    `installed` (name -> version or None) defaults to what this interpreter sees.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    installed = installed_versions(profile.packages) if installed is None else installed
    problems = []
    for name, spec in profile.packages.items():
        version = installed.get(name)
        if version is None:
            problems.append(f"{name} is not installed ({profile.profile_id} wants {spec})")
            continue
        try:
            ok = SpecifierSet(spec).contains(Version(version), prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            problems.append(f"{name} {version} does not satisfy {spec} ({profile.profile_id})")
    return problems
