"""Command line: python -m trainmech {run, registry, lint} — see `python -m trainmech --help`."""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from pathlib import Path

from trainmech.errors import TrainmechError

DESCRIPTION = """\
trainmech — 反向传播与训练机制 (Backpropagation and Training Mechanics).

  run       execute every Task notebook headless and write results/<label>/
            (executed notebooks, result records, run.json, REGISTRY.md)
  registry  print the experiment registry with each experiment's evidence status
  lint      check notebook prose against the glossary's writing rules
  refresh   re-execute the committed notebooks in place (maintainers, before committing)
  ledger    the training-state ledger: state bytes, peak phase and its composition for a model
            (see python -m trainmech ledger --help)
  portability  run the notebooks under other numeric paths (SIMD width, BLAS code path) and
            report output differences, claim margins and record drift (maintainers)
  gpu-check run every CUDA-only branch once at small sizes and report (--dry-run: the plan and budget
            on any machine; see python -m trainmech gpu-check --help)

Examples:
  python -m trainmech run                         # all notebooks, CPU mode, label "local"
  python -m trainmech run --only Task0 --label try1
  python -m trainmech run --mode TRAIN-CUDA-MECHANISM --label h200-2026-11-29
  python -m trainmech registry --label cpu-reference
  python -m trainmech ledger --config qwen2.5-0.5b --batch 2 --seq 512
  python -m trainmech gpu-check --dry-run
"""


# Commands with a parser of their own: name -> (module with main(argv), one-line help).
OWN_PARSERS = {
    "ledger": ("trainmech.ledger", "the training-state ledger calculator (its own --help)"),
    "portability": ("trainmech.portability", "outputs, margins and records under other numeric paths (its own --help)"),
    "gpu-check": ("trainmech.gpucheck", "run every CUDA-only branch once and report (its own --help)"),
}


def _parse_override(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise TrainmechError(f"override {text!r} is not NAME=VALUE (for example -p SEQ=64)")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value  # a bare word is a string


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainmech", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", metavar="{run,registry,lint,refresh,ledger,portability,gpu-check}")

    run = sub.add_parser("run", help="execute the notebooks headless", description="Execute the Task notebooks headless with nbclient.")
    run.add_argument("--mode", default="cpu", help="run mode: cpu (default) or TRAIN-CUDA-MECHANISM (needs one CUDA GPU)")
    run.add_argument("--label", default="local", help="results folder name under results/ (letters, digits, . _ -); default: local")
    run.add_argument("--only", nargs="+", metavar="TaskN", help="run only these notebooks, e.g. --only Task0 Task3")
    run.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE", help="override a parameter of the notebooks' parameters cell")
    run.add_argument("--timeout", type=float, default=1200.0, help="seconds one notebook may run before it is stopped (default 1200)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")

    reg = sub.add_parser("registry", help="print the registry table from a run's records", description="Render the experiment registry from the records of results/<label>/.")
    reg.add_argument("--label", default="cpu-reference", help="which run under results/ (default: cpu-reference)")

    ref = sub.add_parser("refresh", help="re-execute notebooks in place (maintainers)", description="Re-execute the committed notebooks with their default parameters (CPU) and store the outputs that nbval compares against.")
    ref.add_argument("--only", nargs="+", metavar="TaskN", help="refresh only these notebooks")

    for name, (_, help_text) in OWN_PARSERS.items():
        sub.add_parser(name, add_help=False, help=help_text)

    lint = sub.add_parser("lint", help="glossary and prose rules", description="Lint notebook markdown and notebooks/reference/*.md against the glossary's writing rules.")
    lint.add_argument("--write-glossary", action="store_true", help="regenerate notebooks/reference/glossary.md first")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in OWN_PARSERS:  # these commands parse their own options
        return importlib.import_module(OWN_PARSERS[argv[0]][0]).main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            from trainmech import runner

            overrides = dict(_parse_override(p) for p in args.param)
            return runner.run(args.mode, args.label, only=args.only, overrides=overrides, timeout=args.timeout, progress=not args.quiet)
        if args.command == "registry":
            from trainmech import results
            from trainmech.runner import RESULTS_ROOT

            results.check_label(args.label)
            folder = RESULTS_ROOT / args.label
            if not folder.is_dir():
                runs = sorted(p.name for p in RESULTS_ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
                raise TrainmechError(f"no run labelled {args.label!r} under results/; present: {', '.join(runs) or 'none'}")
            print(results.registry_markdown(results.read_records(folder), args.label), end="")
            return 0
        if args.command == "refresh":
            from trainmech import runner

            failed = 0
            for name, status, error in runner.refresh_in_place(runner.discover(only=args.only)):
                print(f"{name:<28} {status}" + (f"  {error['ename']}: {error['evalue']}" if error else ""))
                failed += status != "ok"
            return 1 if failed else 0
        if args.command == "lint":
            from trainmech import glossary

            return glossary.main(["--write-glossary"] if args.write_glossary else [])
        parser.print_help()
        return 2
    except TrainmechError as e:
        print(f"trainmech: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("trainmech: interrupted; earlier results are unchanged", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
