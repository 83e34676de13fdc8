"""trainmech: the helper package of the curriculum 反向传播与训练机制.

Importing it makes the whole process offline for Hugging Face libraries: nothing is downloaded
at run time (models are built from configurations, the tokenizer from shipped text).

Process state set here, on import: `os.environ` gets HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1
(whatever they were) and HF_HUB_DISABLE_TELEMETRY=1 (unless set), for this process and every
process it starts. Nothing else changes on import (see README, maintainers' section).
"""

import os
from pathlib import Path

# Set before transformers / huggingface_hub are imported anywhere through this package: they
# read these variables once, at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from trainmech.errors import TrainmechError  # noqa: E402

__all__ = ["TrainmechError", "REPO_ROOT"]

# The checkout the package runs from (results/, notebooks/ and profiles/ sit beside trainmech/).
REPO_ROOT = Path(__file__).resolve().parent.parent
__version__ = "0.1.0"
