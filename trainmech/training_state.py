"""Resumable training state: everything a resume needs, written and read with safetensors.

    save_training_state(folder, model=m, optimizer=opt, scaler=None, clock=clock, data_position=k)
    clock, k = load_training_state(folder, model=m, optimizer=opt, scaler=None)

Tensors plus JSON metadata; nothing is pickled. The model's parameters and buffers, the optimizer's
state and hyper-parameters, the loss scaler, the update clock (`trainmech.update.UpdateClock`), the
data position, and the RNG states (torch's CPU and CUDA generators, Python's `random`, NumPy's global
one). Loading restores those process-wide RNG states (unless restore_rng=False). Re-exported by
`trainmech.update`, where Task3 reaches it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainmech.errors import TrainmechError

if TYPE_CHECKING:
    from trainmech.update import UpdateClock

__all__ = ["MODEL_FILE", "STATE_FILE", "save_training_state", "load_training_state"]

MODEL_FILE = "model.safetensors"
STATE_FILE = "training_state.safetensors"


def _rng_state(device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    tensors = {"rng.torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["rng.torch_cuda"] = torch.cuda.get_rng_state(device)
    version, internal, gauss = random.getstate()
    meta: dict[str, object] = {"python_random": [version, list(internal), gauss]}
    import numpy as np  # a dependency

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["rng.numpy_keys"] = torch.from_numpy(keys.astype("int64"))
    meta["numpy_random"] = [kind, pos, has_gauss, cached]
    return tensors, meta


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict, device: torch.device) -> None:
    torch.set_rng_state(tensors["rng.torch_cpu"])
    if "rng.torch_cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng.torch_cuda"], device)
    version, internal, gauss = meta["python_random"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy_random" in meta:
        import numpy as np

        kind, pos, has_gauss, cached = meta["numpy_random"]
        np.random.set_state(
            (kind, tensors["rng.numpy_keys"].numpy().astype("uint32"), pos, has_gauss, cached)
        )


def save_training_state(
    folder: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    clock: UpdateClock,  # trainmech.update's
    data_position: int,
) -> list[str]:
    """Write a resumable checkpoint into `folder`; returns the fields it holds.

    model.safetensors: the parameters and buffers (`safetensors.torch.save_model`, which keeps
    one copy of a tied weight). training_state.safetensors: the optimizer's state tensors, the
    RNG states as tensors, and JSON metadata (optimizer hyper-parameters, scaler, update clock,
    data position, the Python and NumPy RNG). Nothing is pickled.
    """
    from safetensors.torch import save_file, save_model

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_model(model, str(folder / MODEL_FILE))
    opt = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    plain_state: dict[str, dict[str, object]] = {}
    for index, state in opt["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"optimizer.{index}.{key}"] = value.detach().contiguous().cpu()
            else:
                plain_state.setdefault(str(index), {})[key] = value
    rng_tensors, rng_meta = _rng_state(next(model.parameters()).device)
    tensors.update(rng_tensors)
    meta = {
        "optimizer_param_groups": opt["param_groups"],
        "optimizer_plain_state": plain_state,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "update_clock": clock.state_dict(),
        "data_position": int(data_position),
        **rng_meta,
    }
    save_file(tensors, str(folder / STATE_FILE), metadata={k: json.dumps(v) for k, v in meta.items()})
    return ["model", "optimizer", "scaler", "update_clock", "rng", "data_position"]


def load_training_state(
    folder: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    restore_rng: bool = True,
) -> tuple[UpdateClock, int]:
    """Read a checkpoint written by `save_training_state` into model, optimizer and scaler.

    Restores the RNG states too (unless restore_rng=False, to show what that breaks). Returns
    (update clock, data position). Refuses a folder without both files.
    """
    from safetensors import safe_open
    from safetensors.torch import load_model

    folder = Path(folder)
    if not (folder / MODEL_FILE).is_file() or not (folder / STATE_FILE).is_file():
        raise TrainmechError(f"{folder} is not a training checkpoint: it needs {MODEL_FILE} and {STATE_FILE}")
    device = next(model.parameters()).device
    load_model(model, str(folder / MODEL_FILE), device=str(device))
    with safe_open(str(folder / STATE_FILE), framework="pt") as f:
        meta = {k: json.loads(v) for k, v in f.metadata().items()}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    state: dict[int, dict[str, object]] = {}
    for name, value in tensors.items():
        if name.startswith("optimizer."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = value
    for index, plain in meta["optimizer_plain_state"].items():
        state.setdefault(int(index), {}).update(plain)
    groups = [
        {k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["optimizer_param_groups"]
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    if scaler is not None and meta["scaler"]:
        scaler.load_state_dict(meta["scaler"])
    if restore_rng:
        _set_rng_state(tensors, meta, device)
    from trainmech.update import UpdateClock  # here: update imports this module to re-export it

    clock = UpdateClock()
    clock.load_state_dict(meta["update_clock"])
    return clock, int(meta["data_position"])
