"""Compute or transfer, in orders of magnitude: a link's and a GPU's nominal rates, and one step's FLOPs.

Task5 §4.2 divides the ledger's offloaded bytes by a link's bandwidth and a step's FLOPs by the GPU's
rate (`trainmech.gpucheck.limits.offload_bound` takes the two); CUDA mode repeats it with measured rates.
"""

from __future__ import annotations

__all__ = ["NOMINAL", "step_flops", "flops_per_byte", "crossover_flops_per_byte", "serial_x_scaled"]

# Nominal figures from the vendors' datasheets (not measured here): a link's bandwidth per direction
# (GB/s, 1e9 bytes) and the FP32 non-tensor-core rate (TFLOP/s) — PyTorch's FP32 matmuls use it unless
# TF32 is allowed. PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b coding.
NOMINAL = {
    "RTX 5070 Ti (PCIe 5.0 x16)": {"link_gbps": 63.0, "fp32_tflops": 43.9},
    "H200 SXM (PCIe 5.0 x16)": {"link_gbps": 63.0, "fp32_tflops": 67.0},
    "GH200 (NVLink-C2C)": {"link_gbps": 450.0, "fp32_tflops": 67.0},
}


def step_flops(book, *, recompute: bool = False) -> dict[str, float]:
    """FLOPs of one training step from a `trainmech.ledger.Ledger`'s model shape: 2 per parameter and token
    forward (the tied head counted as a matmul), twice that backward, plus attention's two s×s matmuls per
    layer; a full recompute adds one forward of the decoder layers."""
    shape, tokens = book.shape, book.batch * book.seq
    matmul = shape.n_params + (shape.vocab_size * shape.hidden_size if shape.tie_word_embeddings else 0)
    matmul -= shape.vocab_size * shape.hidden_size  # the embedding lookup is no matmul
    attention = 2 * 2 * book.batch * book.seq**2 * shape.num_heads * shape.head_dim * shape.num_layers
    forward = 2 * matmul * tokens + attention
    layers = forward - 2 * shape.vocab_size * shape.hidden_size * tokens  # without the head
    return {"forward": forward, "backward": 2 * forward, "recompute": layers if recompute else 0.0}


def flops_per_byte(book, nbytes: int) -> float:
    """The step's FLOPs (`step_flops`) per byte copied, counting each byte twice: off the device and back."""
    return sum(step_flops(book).values()) / (2 * nbytes)


def crossover_flops_per_byte(gpu: str) -> float:
    """Below this many FLOPs per byte moved, a GPU's copies over its link outlast its compute (nominal rates)."""
    spec = NOMINAL[gpu]
    return spec["fp32_tflops"] * 1e12 / (spec["link_gbps"] * 1e9)


def serial_x_scaled(serial_x: float, scale: float) -> float:
    """A serial step-time bound 1 + t_copy / t_step with the copied bytes (so t_copy) scaled by `scale`."""
    return 1 + (serial_x - 1) * scale
