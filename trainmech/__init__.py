"""trainmech: the helper package of the curriculum 反向传播与训练机制.

Importing it makes the whole process offline for Hugging Face libraries: nothing is downloaded
at run time (models are built from configurations, the tokenizer from shipped text).

Process state set here, on import: `os.environ` gets HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1
(whatever they were) and HF_HUB_DISABLE_TELEMETRY=1 (unless set), for this process and every
process it starts. When ATEN_CPU_CAPABILITY asks for a path below AVX-512 (`default`, `avx2`) and
ONEDNN_MAX_CPU_ISA is unset, it also gets ONEDNN_MAX_CPU_ISA=AVX2 (see `cap_onednn`). Nothing else
changes on import (see README, maintainers' section).
"""

import os
from pathlib import Path

# Set before transformers / huggingface_hub are imported anywhere through this package: they
# read these variables once, at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

# ATen paths that have no AVX-512 kernels. On a CPU with AMX, torch's 16-bit CPU attention asks
# oneDNN whether to pack blocks for AMX (the hardware says yes) and then calls a packing routine
# only the AVX-512 build of ATen has: "pack_vnni2 is only supported when avx512 is supported".
BELOW_AVX512 = ("default", "avx2")


def cap_onednn(environ=os.environ) -> bool:
    """Cap oneDNN at AVX2 when ATen runs below AVX-512 and nobody chose a cap; True if it set one.

    oneDNN reads ONEDNN_MAX_CPU_ISA once, at its first primitive, so this holds when it runs
    before the process's first oneDNN call (importing torch makes none).
    """
    below = environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() in BELOW_AVX512
    if below and "ONEDNN_MAX_CPU_ISA" not in environ:
        environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
        return True
    return False


cap_onednn()

from trainmech.errors import TrainmechError  # noqa: E402

__all__ = ["TrainmechError", "REPO_ROOT", "cap_onednn"]

# The checkout the package runs from (results/, notebooks/ and profiles/ sit beside trainmech/).
REPO_ROOT = Path(__file__).resolve().parent.parent
__version__ = "0.1.0"
