"""Command line: python -m trainmech {run, registry, lint} — see `python -m trainmech --help`."""

from __future__ import annotations

import argparse
import importlib
import sys

from trainmech.errors import OneLineParser, TrainmechError, refuse

__all__ = ["DESCRIPTION", "OWN_PARSERS", "RUN_DESCRIPTION", "build_parser", "main"]

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
  twins     write (or --check) the notebooks' text twins in notebooks/text/, code and prose for diffs

Examples:
  python -m trainmech run                         # all notebooks, CPU mode, label "local"
  python -m trainmech run --only Task0 --label try1
  python -m trainmech run --jobs 2                # two notebooks at once
  python -m trainmech run --mode TRAIN-CUDA-MECHANISM --label h200-2026-11-29
  python -m trainmech registry --label cpu-reference
  python -m trainmech ledger --config qwen2.5-0.5b --batch 2 --seq 512
  python -m trainmech gpu-check --dry-run
"""


# Commands with a parser of their own: name -> (module with main(argv), one-line help).
OWN_PARSERS = {
    "ledger": ("trainmech.ledger", "the training-state ledger calculator (its own --help)"),
    "portability": (
        "trainmech.portability",
        "outputs, margins and records under other numeric paths (its own --help)",
    ),
    "gpu-check": ("trainmech.gpucheck", "run every CUDA-only branch once and report (its own --help)"),
    "twins": (
        "trainmech.twins",
        "write or check the notebooks' text twins, notebooks/text/*.md (its own --help)",
    ),
}


def _parse_overrides(items: list[str]) -> dict[str, str]:
    """{NAME: VALUE text} from -p NAME=VALUE; the runner checks each against the notebooks' parameters cells."""
    out: dict[str, str] = {}
    for text in items:
        name, sep, value = text.partition("=")
        if not sep or not name.isidentifier():
            raise TrainmechError(f"override {text[:60]!r} is not NAME=VALUE (for example -p SEED=1)")
        if name in out:
            raise TrainmechError(f"-p {name} is given twice; give each parameter once")
        out[name] = value
    return out


RUN_DESCRIPTION = """\
Execute the Task notebooks headless with nbclient, each in its own kernel.

Where the results go:
  every notebook ok     results/<label>/ is replaced as a whole (exit 0)
  a notebook failed or  the run goes to results/<label>.partial/ and results/<label>/ stays
  timed out             as it was (exit 1); the other notebooks still run, nothing is lost
  --only TaskN …        merges into results/<label>/: the other notebooks' records and
                        executed copies are kept, the named notebooks' are replaced
  Ctrl-C or SIGTERM     the kernels are stopped, results/ is left exactly as it was
                        (exit 130 / 143)
One run per label at a time; a second one is refused. With --jobs N, N notebooks run at
once (longest first); failures, timeouts, interruption and replacement behave as with one.
"""


def _command(sub, name: str, help_text: str, description: str, *options: tuple[str, dict]) -> None:
    """A subcommand with its one-line help, its description and its options (flag, add_argument's keywords)."""
    command = sub.add_parser(name, help=help_text, description=description)
    for flag, keywords in options:
        command.add_argument(flag, **keywords)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m trainmech",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(
        dest="command", metavar="{run,registry,lint,refresh,ledger,portability,gpu-check,twins}"
    )

    run = sub.add_parser(
        "run",
        help="execute the notebooks headless",
        description=RUN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "--mode", default="cpu", help="run mode: cpu (default) or TRAIN-CUDA-MECHANISM (needs one CUDA GPU)"
    )
    run.add_argument(
        "--label",
        default="local",
        help="results folder name under results/ (1-100 letters, digits, . _ -; "
        "not ending in .partial); default: local",
    )
    run.add_argument(
        "--only",
        nargs="+",
        metavar="TaskN",
        help="run only these notebooks and merge them into the label, e.g. --only Task0 Task3",
    )
    run.add_argument(
        "-p",
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a variable the notebooks' parameters cell assigns, with a value of its default's type "
        "(e.g. -p SEED=1); it goes to the notebooks that assign it. RUN_MODE and RUN_LABEL: use --mode and --label",
    )
    run.add_argument(
        "--timeout",
        type=float,
        default=1200.0,
        help="seconds one notebook may run before it is stopped and reported as timeout (default 1200)",
    )
    run.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="notebooks executed at once, each in its own kernel, longest "
        "first (by the label's last run.json); default: the usable cores (1 in TRAIN-CUDA-MECHANISM mode), "
        "lowered when the available memory would not hold that many kernels of the largest peak RSS the label's "
        "last run measured (2 GiB each before any). Results are the same as with --jobs 1",
    )
    run.add_argument(
        "--benchmark-jobs",
        action="store_true",
        help="benchmark, writes nothing: run every notebook (CPU) with "
        "--jobs 1 and then --jobs N (default 2) into a throw-away folder and print both times, their ratio "
        "and whether the records and outputs agree apart from times",
    )
    run.add_argument("--quiet", action="store_true", help="no progress lines")

    _command(
        sub,
        "registry",
        "print the registry table from a run's records",
        "Render the experiment registry from the records of results/<label>/.",
        ("--label", dict(default="cpu-reference", help="which run under results/ (default: cpu-reference)")),
    )
    _command(
        sub,
        "refresh",
        "re-execute notebooks in place (maintainers)",
        "Re-execute the committed notebooks with their default parameters (CPU) and store the outputs that "
        "nbval compares against.",
        ("--only", dict(nargs="+", metavar="TaskN", help="refresh only these notebooks")),
    )
    for name, (_, help_text) in OWN_PARSERS.items():
        sub.add_parser(name, add_help=False, help=help_text)
    _command(
        sub,
        "lint",
        "glossary and prose rules",
        "Lint notebook markdown and notebooks/reference/*.md against the glossary's writing rules.",
        (
            "--write-glossary",
            dict(action="store_true", help="regenerate notebooks/reference/glossary.md first"),
        ),
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in OWN_PARSERS:  # these commands parse their own options
        return importlib.import_module(OWN_PARSERS[argv[0]][0]).main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error already printed in one line (2)
        return e.code
    try:
        if args.command == "run":
            from trainmech import runner

            if args.benchmark_jobs:
                runner.benchmark_jobs(args.jobs or 2, timeout=args.timeout)
                return 0
            overrides = _parse_overrides(args.param)
            return runner.run(
                args.mode,
                args.label,
                only=args.only,
                overrides=overrides,
                timeout=args.timeout,
                jobs=args.jobs,
                progress=not args.quiet,
            )
        if args.command == "registry":
            return _registry(args.label)
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
        return refuse(e)
    except KeyboardInterrupt as e:  # runner.Interrupted carries the signal's exit code
        print(f"trainmech: interrupted ({e or 'SIGINT'}); results/ is unchanged", file=sys.stderr)
        return getattr(e, "exit_code", 130)


def _registry(label: str) -> int:
    """Print the registry of results/<label>/; invalid records are listed below it (exit 1)."""
    from trainmech import results
    from trainmech.runner import RESULTS_ROOT

    results.check_label(label)
    folder = RESULTS_ROOT / label
    if not folder.is_dir():
        runs = (
            sorted(p.name for p in RESULTS_ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
            if RESULTS_ROOT.is_dir()
            else []
        )
        raise TrainmechError(
            f"no run labelled {label!r} under results/; present: {', '.join(runs) or 'none'}"
        )
    records, invalid = results.read_run(folder)
    print(results.registry_markdown(records, label, invalid), end="")
    return 1 if invalid else 0


if __name__ == "__main__":
    sys.exit(main())
