"""Reading the rank reports of `trainmech.distributed.run`: against the ledger, and against one process.

books = predictions(reports)                    # the ledger's per-rank book for each (stage, N, rank)
text, worst, exact = per_rank_table(reports, books)
text, same = communication_table(reports)       # collectives: measured beside predicted
agreed = agreement(reports, reference_update())  # bitwise? how far from the same update in one process
write_records(session, reports, books, agreed)  # one TRAIN-STATE-LEDGER record per (stage, N)
"""

from __future__ import annotations

from trainmech.rank_update import LR, STAGES, RankReport

__all__ = [
    "reference_update",
    "predictions",
    "per_rank_table",
    "communication_table",
    "torch_isfinite",
    "agreement",
    "torch_equal",
    "update_counts",
    "write_records",
]


def reference_update(model: str = "qwen2-tiny", batch: int = 4, seq: int = 32) -> tuple[float, dict, dict]:
    """The same update in this one process on the whole batch, on one thread like each worker (the thread
    count changes how a matmul splits its sums): (loss, gradients, parameters after the update)."""
    import torch

    from trainmech import profiles, workload

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = workload.build_model(profiles.for_mode("cpu").model(model), seed=0).model
        optimizer = torch.optim.AdamW(m.parameters(), lr=LR)
        loss = m(**workload.lm_batch("domain", batch, seq), use_cache=False).loss
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
        optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return float(loss.detach()), grads, {n: p.detach().clone() for n, p in m.named_parameters()}


def predictions(reports: list[RankReport], model: str = "qwen2-tiny", batch: int = 4, seq: int = 32) -> dict:
    """(stage, N, rank) -> the ledger's per-rank book (`trainmech.ledger.zero.per_rank`)."""
    from trainmech.ledger import zero

    return {
        (r.stage, r.world_size, r.rank): zero.per_rank(model, batch, seq, r.stage, r.world_size, r.rank)
        for r in reports
    }


def per_rank_table(
    reports: list[RankReport], books: dict, model: str = "qwen2-tiny"
) -> tuple[str, float, bool]:
    """One line per (N, stage, rank): held bytes and the peak, measured beside predicted. Returns the text,
    the worst relative peak error and whether every held byte count was predicted exactly."""
    from trainmech.ledger import zero

    lines = [
        "held bytes: params and opt states after optimizer.step(); grads when it starts (zero_grad frees them after)",
        f"{'N':>2} {'stage':>5} {'rank':>4} {'params':>9} {'grads':>9} {'opt states':>10} {'peak measured':>14} "
        f"{'predicted':>10} {'error':>7}  peak phase (measured / predicted)",
    ]
    worst, exact = 0.0, True
    for r in reports:
        book = books[(r.stage, r.world_size, r.rank)]
        peak = book.peak_overlap()
        held = zero.held_per_rank(model, r.stage, r.world_size, r.rank)
        exact &= held == r.held
        err = peak.bytes / r.peak_bytes - 1
        worst = max(worst, abs(err))
        lines.append(
            f"{r.world_size:>2} {r.stage:>5} {r.rank:>4} {r.held['parameters']:>9,} {r.held['gradients']:>9,} "
            f"{r.held['optimizer_states']:>10,} {r.peak_bytes:>14,} {peak.bytes:>10,} {err:>+7.2%}  "
            f"{r.peak_phase} / {peak.phase}"
        )
    return "\n".join(lines), worst, exact


def communication_table(reports: list[RankReport], model: str = "qwen2-tiny") -> tuple[str, bool]:
    """Per (stage, N), rank 0's collectives: calls and payload, the volume in the ZeRO paper's terms (in units of
    Ψ fp32 elements, Ψ the parameter count: 4Ψ bytes), beside the prediction. Returns the text and whether every
    count and payload matched."""
    from trainmech.ledger import model_shape, zero, zero_communication_volume

    shape = model_shape(model)
    psi = 4 * shape.n_params
    lines = [
        f"{'N':>2} {'stage':>5}  {'collectives: calls × payload (measured)':<58} {'volume':>7} {'paper':>6}  as predicted"
    ]
    same = True
    for r in (r for r in reports if r.rank == 0):
        measured = {k: (c.calls, c.payload_bytes) for k, c in r.collectives.items()}
        predicted = zero.communication(shape, r.stage, r.world_size)
        same &= measured == predicted
        text = (
            ", ".join(f"{k.strip('_')} {c} × {b / psi:.2f}Ψ" for k, (c, b) in measured.items())
            or "none (one rank)"
        )
        paper = zero_communication_volume(1, r.stage) if r.world_size > 1 else 0
        lines.append(
            f"{r.world_size:>2} {r.stage:>5}  {text:<58} {zero.zero_volume(measured) / psi:>6.2f}Ψ {paper:>5.0f}Ψ  "
            f"{'yes' if measured == predicted else 'no: ' + str(predicted)}"
        )
    return "\n".join(lines), same


def torch_isfinite(t) -> bool:
    """Every element of a tensor finite."""
    import torch

    return bool(torch.isfinite(t).all())


def agreement(reports: list[RankReport], reference: tuple[float, dict, dict]) -> dict[tuple[int, int], dict]:
    """(stage, N) -> the comparison with one process: bitwise (gradients and parameters), the largest relative
    gradient error, the largest parameter difference, the mean loss over the ranks minus the reference loss."""
    loss, grads, params = reference
    out = {}
    for r in (r for r in reports if r.rank == 0):
        losses = [x.loss for x in reports if (x.stage, x.world_size) == (r.stage, r.world_size)]
        out[(r.stage, r.world_size)] = {
            "bitwise": all(torch_equal(r.grads[n], g) for n, g in grads.items())
            and all(torch_equal(r.params[n], p) for n, p in params.items()),
            "grad_rel": max(float((r.grads[n] - g).abs().max() / g.abs().max()) for n, g in grads.items()),
            "grad_abs": max(float((r.grads[n] - g).abs().max()) for n, g in grads.items()),
            "all_finite": all(torch_isfinite(g) for g in r.grads.values())
            and all(torch_isfinite(p) for p in r.params.values()),
            "param_abs": max(float((r.params[n] - p).abs().max()) for n, p in params.items()),
            "loss_diff": sum(losses) / len(losses) - loss,
        }
    return out


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def update_counts(ranks: list[RankReport], n_tensors: int, all_finite: bool | None) -> dict[str, int]:
    """skipped_updates / effective_updates of one sharded update, counted from each rank's AdamW step counts.

    The update ran when every parameter tensor was stepped exactly once by the rank(s) holding its state:
    every rank for DDP and FSDP2 (each holds a state for each tensor, its shard), exactly one rank for
    ZeroRedundancyOptimizer (its optimizer sees only its own tensors), so the counts together cover
    `n_tensors` tensors that many times. Effective: it ran and everything was finite.
    """
    counts = [c for r in ranks for c in r.step_counts]
    per_rank = {len(r.step_counts) for r in ranks}
    covered = per_rank == {n_tensors} or len(counts) == n_tensors  # DDP / FSDP2, or ZeRO-1's partition
    ran = covered and all(c == 1 for c in counts)
    return {"skipped_updates": int(not ran), "effective_updates": int(ran and bool(all_finite))}


def write_records(
    session,
    reports: list[RankReport],
    books: dict,
    agreed: dict,
    model: str = "qwen2-tiny",
    batch: int = 4,
    seq: int = 32,
) -> list:
    """One TRAIN-STATE-LEDGER record per (stage, N): rank 0's measured and predicted bytes, the others' peaks."""
    from trainmech import profiles, workload

    built = workload.build_model(profiles.for_mode("cpu").model(model), seed=0)
    n_tensors = len(list(built.model.parameters()))
    out = []
    for r in (r for r in reports if r.rank == 0):
        key, peak = (r.stage, r.world_size), books[(r.stage, r.world_size, 0)].peak_overlap()
        ranks = [x for x in reports if (x.stage, x.world_size) == key]
        data = workload.lm_batch("domain", batch, seq)
        out.append(
            session.record(
                "TRAIN-STATE-LEDGER",
                f"cpu-tiny-b{batch}s{seq}-zero{r.stage}-n{r.world_size}",
                built=built,
                input_shape=[batch, seq],
                effective_batch={
                    "sequences": batch,
                    "supervised_tokens": workload.supervised_tokens(data["labels"]),
                },
                dtype="float32",
                update_count=1,
                candidate=f"zero-stage-{r.stage}",
                correctness={
                    "grad_max_abs_error": agreed[key]["grad_abs"],
                    "all_finite": agreed[key]["all_finite"],
                    **update_counts(ranks, n_tensors, agreed[key]["all_finite"]),
                },
                conclusion={
                    "evidence_level": "cpu-mechanism",
                    "next_step": "torchrun --nproc-per-node N -m trainmech.distributed on GPUs (NCCL)",
                },
                metrics={
                    "engine": STAGES[r.stage],
                    "world_size": r.world_size,
                    "backend": "gloo",
                    "held_bytes_rank0": r.held,
                    "measured_peak_bytes_per_rank": [x.peak_bytes for x in ranks],
                    "measured_peak_phase": r.peak_phase,
                    "predicted_peak_bytes": peak.bytes,
                    "predicted_peak_phase": peak.phase,
                    "peak_error": peak.bytes / r.peak_bytes - 1,
                    "measured_by_category": r.peak_by_category,
                    "predicted_by_category": peak.by_category,
                    "collective_calls": {k.strip("_"): c.calls for k, c in r.collectives.items()},
                    "collective_payload_bytes": {
                        k.strip("_"): c.payload_bytes for k, c in r.collectives.items()
                    },
                    "bitwise_equal_to_one_process": agreed[key]["bitwise"],
                    "grad_max_rel_error": agreed[key]["grad_rel"],
                    "param_max_abs_error": agreed[key]["param_abs"],
                }
                | (
                    {}
                    if r.torch_tracker_peak
                    is None  # only where PyTorch's FSDPMemTracker ran (torch_tracker=)
                    else {"torch_fsdp_mem_tracker_peak_bytes": r.torch_tracker_peak}
                ),
            )
        )
    return out
