"""The training-state ledger: state bytes, their lifecycles over one training step, and the peak overlap.

    book = ledger.training_state_lifecycle("qwen2.5-0.5b", batch=2, seq=512, device="cuda")
    book.peak_overlap()        # Peak: the tick and phase of the peak, its bytes, its composition by category
    book.states                # every State: category, bytes, created / last consumed / released_at tick
    ledger.scenario_matrix(…)  # first vs steady update, forward+backward vs whole update, per strategy

Read it one file at a time, in this order:

    categories.py   the seven state categories, shared with trainmech.measure
    recipes.py      dtype recipes: bytes per element of each state (pure, autocast, ZeRO's mixed)
    shape.py        a decoder config -> ModelShape, with transformers' defaults
    clock.py        the step's ticks, and a State's lifecycle on them
    inventory.py    what one layer saves for its backward, SDPA kernel by kernel
    states.py       every state of one step: the byte formulas
    book.py         the Ledger: live bytes per tick, peaks, offload, lifecycles
    scenarios.py    the scenario matrix (strategy × update × optimizer step) and the update's variants
    zero.py         the per-device projection over N data-parallel devices (ZeRO stages, FSDP2)
    allocator.py    what `allocated` cannot see: CUDA's caching allocator, context, cuBLAS workspace
    formulas.py     published formulas beside it: ZeRO, Korthikanti, DeepSpeed's estimators
    compare.py      predicted vs measured at one point (measure_point, Comparison)
    record.py       a point's allocator peaks and its TRAIN-STATE-LEDGER record fields
    terms.py        what a device's measurements are held to on Task4 (values, never other code)
    measured_matrix.py  the scenario matrix's cells, measured
    peers.py        the benchmark: the ledger, accelerate and DeepSpeed against the same measurements
    cli.py          python -m trainmech ledger
"""

from trainmech.ledger import allocator, scenarios, zero
from trainmech.ledger.book import Ledger, Peak, training_state_lifecycle
from trainmech.ledger.categories import BATCH_STATES, CATEGORIES, CATEGORY_ZH, MODEL_STATES
from trainmech.ledger.cli import build_parser, main, render
from trainmech.ledger.clock import AFTER, BEFORE, LAYER_BACKWARD_MOMENTS, UPDATES, State, phase_of, ticks
from trainmech.ledger.compare import (
    CPU_POINTS,
    CUDA_LIFECYCLE_TOLERANCE,
    CUDA_POINTS,
    CUDA_SLACK_BYTES_PER_LAYER,
    Comparison,
    clear_blas_workspaces,
    measure_point,
    measured_bytes_per_param,
    model_state_bytes_per_param,
    padded_batch,
)
from trainmech.ledger.formulas import (
    deepspeed_zero2_gpu_bytes,
    deepspeed_zero3_gpu_bytes,
    korthikanti_activation_bytes,
    korthikanti_differences,
    zero_bytes_per_device,
    zero_communication_volume,
)
from trainmech.ledger.inventory import (
    ATTENTION,
    DEVICES,
    EFFICIENT_GQA_SINCE,
    KERNELS,
    SavedTensor,
    SdpaStack,
    attention_kernel,
    kernel_of_ops,
    layer_saved,
    rng_state_saved,
    sdpa_stack,
)
from trainmech.ledger.measured_matrix import (
    Measured,
    matrix_heading,
    measure_matrix,
    measured_peaks,
    measured_saved_after_forward,
    peak_pairs,
    tracked_step,
)
from trainmech.ledger.peers import benchmark
from trainmech.ledger.recipes import (
    FP32_BYTES,
    INDEX_BYTES,
    RECIPES,
    STEP_COUNTER_BYTES,
    Recipe,
    recipe,
    recipe_for_dtype,
)
from trainmech.ledger.record import AllocatedReserved, allocated_reserved, record_fields
from trainmech.ledger.scenarios import Scenario, scenario_ledger, scenario_matrix
from trainmech.ledger.shape import SUPPORTED_MODEL_TYPES, ModelShape, load_config, model_shape
from trainmech.ledger.states import CHECKPOINTING, OPTIMIZER_IMPLS, OPTIMIZERS
from trainmech.ledger.terms import DeviceTerms, allocator_pair, device_terms

__all__ = [
    "Ledger",
    "Peak",
    "training_state_lifecycle",
    "BATCH_STATES",
    "CATEGORIES",
    "CATEGORY_ZH",
    "MODEL_STATES",
    "AFTER",
    "BEFORE",
    "LAYER_BACKWARD_MOMENTS",
    "UPDATES",
    "State",
    "phase_of",
    "ticks",
    "CPU_POINTS",
    "CUDA_POINTS",
    "CUDA_LIFECYCLE_TOLERANCE",
    "CUDA_SLACK_BYTES_PER_LAYER",
    "AllocatedReserved",
    "Comparison",
    "allocated_reserved",
    "clear_blas_workspaces",
    "measure_point",
    "record_fields",
    "measured_bytes_per_param",
    "model_state_bytes_per_param",
    "padded_batch",
    "DeviceTerms",
    "device_terms",
    "allocator_pair",
    "deepspeed_zero2_gpu_bytes",
    "deepspeed_zero3_gpu_bytes",
    "korthikanti_activation_bytes",
    "korthikanti_differences",
    "zero_bytes_per_device",
    "zero_communication_volume",
    "ATTENTION",
    "DEVICES",
    "KERNELS",
    "SavedTensor",
    "EFFICIENT_GQA_SINCE",
    "SdpaStack",
    "sdpa_stack",
    "attention_kernel",
    "kernel_of_ops",
    "layer_saved",
    "rng_state_saved",
    "FP32_BYTES",
    "INDEX_BYTES",
    "STEP_COUNTER_BYTES",
    "RECIPES",
    "Recipe",
    "recipe",
    "recipe_for_dtype",
    "SUPPORTED_MODEL_TYPES",
    "ModelShape",
    "load_config",
    "model_shape",
    "CHECKPOINTING",
    "OPTIMIZER_IMPLS",
    "OPTIMIZERS",
    "allocator",
    "scenarios",
    "zero",
    "build_parser",
    "main",
    "render",
    "benchmark",
    "Scenario",
    "scenario_ledger",
    "scenario_matrix",
    "Measured",
    "measure_matrix",
    "matrix_heading",
    "peak_pairs",
    "measured_peaks",
    "measured_saved_after_forward",
    "tracked_step",
]
