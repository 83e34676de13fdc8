"""gpu-check's report: the JSON as written, and its readable half (Markdown)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["write", "summary_lines"]


def write(out: Path, report: dict) -> None:
    """<out>/gpu-check.json and <out>/gpu-check.md."""
    (out / "gpu-check.json").write_text(
        json.dumps(report, ensure_ascii=False, indent=2, default=str) + "\n", encoding="utf-8"
    )
    (out / "gpu-check.md").write_text("\n".join(summary_lines(report)) + "\n", encoding="utf-8")


def summary_lines(report: dict) -> list[str]:
    """The readable half of the report (Markdown)."""
    env = report["environment"]
    lines = [
        f"# gpu-check ({report['mode']})",
        "",
        f"{report['started_at']}, {report['seconds']:.0f} s. {env.get('gpu') or 'no GPU'}, driver {env.get('driver')}, "
        f"CUDA {env.get('cuda')}, Python {env['python']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"accelerate {env.get('accelerate')}. Version problems: {'; '.join(env['version_problems']) or 'none'}. "
        f"Bundle requirements unmet: {'; '.join(env['bundle_requirement_problems']) or 'none'}.",
        "",
    ]
    limits = report.get("limits")
    if limits:
        bw, ph, bound = limits["bandwidth"], limits["baseline_step"], limits["offload_bound"]
        lines += [
            "## The machine's limits",
            "",
            f"- copies ({bw['path']}): host→device {bw['h2d_gbps']:.1f} GB/s, device→host {bw['d2h_gbps']:.1f} GB/s alone; "
            f"both at once {bw['both_h2d_gbps']:.1f} / {bw['both_d2h_gbps']:.1f} GB/s; copies equal: {bw['copies_equal']}",
            f"- baseline step {ph['shape']} ({ph['timer']}): forward {ph['forward_s'] * 1e3:.1f} ms, backward "
            f"{ph['backward_s'] * 1e3:.1f} ms, update {ph['update_s'] * 1e3:.1f} ms"
            + (
                f"; {limits['effective_tflops']:.3g} TFLOP/s effective"
                if limits.get("effective_tflops")
                else ""
            ),
        ]
        if limits.get("cuda_context_bytes") is not None:
            lines.append(
                f"- CUDA context (device used − reserved after the baseline step): "
                f"{limits['cuda_context_bytes'] / 2**20:,.0f} MiB"
            )
        if bound:
            lines.append(
                f"- offload bound: {bound['d2h_bytes'] / 2**30:.2f} GiB each way takes {bound['d2h_s'] * 1e3:.1f} ms D2H / "
                f"{bound['h2d_s'] * 1e3:.1f} ms H2D; exposed at least {bound['exposed_transfer_bound_s'] * 1e3:.1f} ms per step "
                "(a timed offload median lies that much above its baseline's, less timing noise: limits.added_time_floor). "
                f"Assumes {bound['assumes']}"
            )
        lines.append("")
    if report.get("budget_lines"):
        lines += [
            "## Budget of the full run (Qwen2.5-0.5B shape)",
            "",
            "```",
            *report["budget_lines"],
            "```",
            "",
        ]
    lines += [
        "## Branches",
        "",
        "| branch | status | reason | s | device memory used, peak − start |",
        "|---|---|---|---|---|",
    ]
    for r in report["branches"]:
        peak = (
            f"{(r['device_memory_used_peak_bytes'] - r['device_memory_used_at_start_bytes']) / 2**20:,.0f} MiB"
            if r.get("device_memory_used_peak_bytes") is not None
            else ""
        )
        seconds = f"{r['seconds']:.1f}" if r.get("seconds") is not None else ""
        lines.append(
            f"| {r['name']} | {r['status']} | {r['reason'].replace('|', '/')} | {seconds} | {peak} |"
        )
    if report.get("notebooks"):
        lines += [
            "",
            "## Notebooks (small pass)",
            "",
            "| notebook | status | s | device memory used, peak | first error |",
            "|---|---|---|---|---|",
        ]
        for n in report["notebooks"]:
            err = (
                f"{n['error']['ename']}: {n['error']['evalue'].splitlines()[0][:120]}"
                if n.get("error")
                else ""
            )
            used = n["device_memory_used_peak_bytes"]
            lines.append(
                f"| {n['notebook']} | {n['status']} | {n['seconds']:.0f} | "
                f"{'' if used is None else f'{used / 2**30:.1f} GiB'} | {err.replace('|', '/')} |"
            )
    s = report["summary"]
    lines += [
        "",
        f"{s['ok']} ok, {s['failed']} failed, {s['expected']} expected failures, {s['not-run']} not run.",
    ]
    return lines
