"""python -m trainmech ledger: the calculator on top of the ledger.

python -m trainmech ledger --config qwen2.5-0.5b --batch 2 --seq 512 --device cuda
python -m trainmech ledger --config path/to/config.json --batch 4 --seq 1024 --dtype autocast-bf16 --json
python -m trainmech ledger --config qwen2.5-0.5b --batch 2 --seq 512 --device cuda --scenario
python -m trainmech ledger --benchmark        # predicted vs measured on this machine, with accelerate and DeepSpeed
python -m trainmech ledger --benchmark --report results/benchmarks/ledger-peers.md   # and write it (.md + .json)
"""

from __future__ import annotations

import json
import sys

from trainmech.errors import TrainmechError
from trainmech.ledger import allocator, scenarios
from trainmech.ledger.book import Ledger, training_state_lifecycle
from trainmech.ledger.categories import CATEGORIES
from trainmech.ledger.inventory import ATTENTION
from trainmech.ledger.recipes import RECIPES
from trainmech.ledger.states import CHECKPOINTING, OPTIMIZER_IMPLS, OPTIMIZERS

__all__ = ["render", "build_parser", "main"]


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _context_line(context: allocator.CudaContext) -> str:
    where = "in neither allocated nor reserved"
    if context.nbytes is None:
        return (
            f"  CUDA context (driver, loaded kernels): unknown (null), {where}; no gpu-check report with a "
            "measured context (python -m trainmech gpu-check on the GPU writes one)"
        )
    return (
        f"  CUDA context (driver, loaded kernels): at most {_mib(context.nbytes)} ({context.nbytes:,} bytes), {where}; "
        f"measured as device used − reserved, which also holds any other process on the GPU: {context.source}"
    )


def render(book: Ledger, context: allocator.CudaContext | None = None) -> str:
    """The calculator's text: per-category table, the peak and the forward+backward peak, what the ledger does not count.
    context: the CUDA context as measured (`allocator.cuda_context()`); None: unknown."""
    peak, fwd_bwd, biggest, s = (
        book.peak_overlap(),
        book.forward_backward_peak(),
        book.state_bytes(),
        book.setup,
    )
    lines = [
        f"training-state ledger: {s.shape.name} ({s.shape.model_type}, {s.shape.n_params:,} parameters"
        f"{', tied embeddings' if s.shape.tie_word_embeddings else ''})",
        f"batch={s.batch} seq={s.seq}{' padded' if s.padded else ''} dtype={s.recipe} optimizer={s.optimizer} "
        f"({s.optimizer_impl}{', in backward' if s.in_backward else ''}) checkpointing={s.checkpointing} device={s.device} "
        f"attention={s.kernel} step={'first' if s.first_step else 'steady'}"
        + (f" micro-batch={s.micro_batch}/{s.micro_batches}" if s.micro_batches > 1 else "")
        + ("" if s.set_to_none else " zero_grad(set_to_none=False)"),
        "",
        f"{'category':<20}{'largest footprint':>20}{'at the peak':>20}",
        "(largest footprint: each category's own maximum over the step, at whatever moment it falls; at the peak:",
        " its bytes at the moment of the peak overlap, which is the column that adds up to the peak)",
    ]
    for c in CATEGORIES:
        lines.append(f"{c:<20}{_mib(biggest[c]):>20}{_mib(peak.by_category[c]):>20}")
    lines += [
        f"{'peak':<20}{'':>20}{_mib(peak.bytes):>20}",
        "",
        f"peak: {peak.bytes:,} bytes in phase {peak.phase} (moment {peak.tick})",
        f"forward+backward peak: {fwd_bwd.bytes:,} bytes at {fwd_bwd.tick}",
    ]
    if not RECIPES[s.recipe].measured:
        lines.append(
            f"note: the {s.recipe} recipe is paper accounting; Task4 compares fp32, bf16 and autocast with measurements"
        )
    if s.device == "cuda":  # the caching allocator's view of the same step (trainmech.ledger.allocator)
        gpu = allocator.cuda_peaks(
            training_state_lifecycle(s.shape, s.batch, s.seq, **book.options(first_step=True)),
            None if s.first_step else book,
        )
        lines += [
            "",
            "on the GPU, beyond tensor bytes (allocator model, not yet measured):",
            f"  allocated peak {gpu.allocated_peak:,} bytes (blocks rounded to 512 B; a block that is not split is counted whole)",
            f"  reserved peak  {gpu.reserved_peak:,} bytes (the caching allocator's segments; reserved − allocated "
            f"{_mib(gpu.reserved_peak - gpu.allocated_peak)})",
            "  cuBLAS/cuBLASLt workspaces: unknown (null), more in allocated; their size depends on the torch version and "
            "CUBLAS_WORKSPACE_CONFIG / CUBLASLT_WORKSPACE_SIZE: Task4 measures them on the GPU around a warm-up step",
            _context_line(context or allocator.CudaContext()),
        ]
    lines.append(
        "not counted: the input batch, kernel-internal scratch that never becomes a tensor, communication buffers"
    )
    return "\n".join(lines)


def build_parser():
    from trainmech.errors import OneLineParser

    parser = OneLineParser(
        prog="python -m trainmech ledger",
        description="Training-state ledger: bytes of parameters, gradients, optimizer states, activations (saved and unsaved), "
        "upstream gradients and workspace over one training step, the phase of the peak and what it is made of. "
        "Unlike `accelerate estimate-memory` it counts activations and the overlap at the peak.",
    )
    parser.add_argument(
        "--config",
        help="a Hugging Face config.json (file or folder) or a profile model name, e.g. qwen2.5-0.5b",
    )
    parser.add_argument("--batch", type=int, help="sequences per micro-batch")
    parser.add_argument("--seq", type=int, help="tokens per sequence")
    parser.add_argument("--dtype", default="fp32", help=f"dtype recipe: {', '.join(RECIPES)} (default fp32)")
    parser.add_argument("--optimizer", default="adamw", help=f"{', '.join(OPTIMIZERS)} (default adamw)")
    parser.add_argument(
        "--optimizer-impl",
        default="auto",
        help=f"{', '.join(OPTIMIZER_IMPLS)} (default auto: loop on cpu, foreach on cuda)",
    )
    parser.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        help="update each parameter in a post-accumulate-grad hook",
    )
    parser.add_argument(
        "--checkpointing",
        default="none",
        help=f"activation checkpointing: {', '.join(CHECKPOINTING)} (default none)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument(
        "--attention",
        default="auto",
        help=f"SDPA kernel: {', '.join(ATTENTION)} (default auto: PyTorch's choice)",
    )
    parser.add_argument("--padded", action="store_true", help="the batch has padding (an attention mask)")
    parser.add_argument(
        "--first-step",
        action="store_true",
        help="the step that creates the optimizer states (default: a later step)",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="gradient accumulation: micro-batches per update (default 1)",
    )
    parser.add_argument(
        "--keep-grads",
        action="store_true",
        help="zero_grad(set_to_none=False): gradients stay allocated as zeros",
    )
    parser.add_argument(
        "--scenario",
        action="store_true",
        help="the scenario matrix: baseline / checkpoint / offload × first / steady update",
    )
    parser.add_argument(
        "--gpu-check",
        metavar="REPORT",
        help="the gpu-check report whose measured CUDA context to show (default results/gpu-check/gpu-check.json)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (peak_bytes, by_category, …)"
    )
    parser.add_argument(
        "--benchmark",
        action="store_true",
        help="measure the CPU points here: the ledger, accelerate and DeepSpeed vs measured",
    )
    parser.add_argument(
        "--report",
        metavar="PATH.md",
        help="with --benchmark: also write the table to PATH.md and its data to PATH.json "
        "(e.g. results/benchmarks/ledger-peers.md)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """The calculator; a bad input gets one line on stderr and exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        if args.report and not args.benchmark:
            raise TrainmechError("--report writes the benchmark's table: use it with --benchmark")
        if args.report and not args.report.endswith(".md"):
            raise TrainmechError(f"--report takes a .md path (its .json lands beside it), got {args.report}")
        if args.benchmark:
            from trainmech.ledger.peers import timed_benchmark, write_report

            rows, seconds = timed_benchmark()
            if args.report:
                for path in write_report(rows, args.report, seconds=seconds):
                    print(f"wrote {path}")
            return 0
        missing = [f"--{k}" for k in ("config", "batch", "seq") if getattr(args, k) is None]
        if missing:
            raise TrainmechError(
                f"missing {', '.join(missing)} (for example --config qwen2.5-0.5b --batch 2 --seq 512)"
            )
        options = {
            "dtype": args.dtype,
            "optimizer": args.optimizer,
            "optimizer_impl": args.optimizer_impl,
            "optimizer_in_backward": args.optimizer_in_backward,
            "device": args.device,
            "attention": args.attention,
            "padded": args.padded,
            "set_to_none": not args.keep_grads,
        }
        if args.scenario:
            rows = scenarios.scenario_matrix(args.config, args.batch, args.seq, **options)
            if args.json:
                print(
                    json.dumps(
                        [
                            {
                                "strategy": r.strategy,
                                "update": r.update,
                                "peak_bytes": r.whole.bytes,
                                "peak_tick": r.whole.tick,
                                "forward_backward_peak_bytes": r.forward_backward.bytes,
                                "forward_backward_peak_tick": r.forward_backward.tick,
                            }
                            for r in rows
                        ],
                        indent=2,
                    )
                )
            else:
                print(
                    f"scenario matrix: {rows[0].book.shape.name}, batch={args.batch} seq={args.seq} dtype={args.dtype} "
                    f"device={args.device} ({rows[0].book.setup.optimizer_impl} {args.optimizer})"
                )
                print(scenarios.render_matrix(rows))
            return 0
        book = training_state_lifecycle(
            args.config,
            args.batch,
            args.seq,
            checkpointing=args.checkpointing,
            first_step=args.first_step,
            micro_batches=args.micro_batches,
            **options,
        )
        on_gpu = book.setup.device == "cuda"  # a CUDA context exists only there
        context = allocator.cuda_context(args.gpu_check) if on_gpu else allocator.CudaContext()
        if args.json:
            answer = book.to_json() | {
                "cuda_context_bytes": context.nbytes,
                "cuda_context_source": context.source,
            }
            print(json.dumps(answer, indent=2))
        else:
            print(render(book, context))
        return 0
    except TrainmechError as e:
        print(f"trainmech: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
