"""Exercises (练习): every check accepts its reference solution, reports an unfilled stub as not
attempted, and rejects typical wrong answers with a message naming what is off.

The wrong answers below are the mistakes a learner makes: a missing term, a wrong reduction, a
transposed index, a copy that is not one, a gate that lets a planted bug through. Each must raise
ClaimFailed, and the printed diagnosis must contain the fragment that names the mistake.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainmech import exercises
from trainmech import solutions as S
from trainmech.checks import ClaimFailed
from trainmech.errors import TrainmechError

pytestmark = pytest.mark.package

REPO = Path(__file__).resolve().parent.parent


def run_check(exercise_id, fn):
    """(result or the ClaimFailed raised, printed text)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            result = exercises.check(exercise_id, fn)
        except ClaimFailed as e:
            result = e
    return result, out.getvalue()


# ----------------------------------------------------------------------------- wrong answers


def sgd_no_decay(theta, grad, buf, *, lr, momentum, weight_decay):
    return S.sgd_momentum_update(theta, grad, buf, lr=lr, momentum=momentum, weight_decay=0.0)


def sgd_decay_outside_momentum(theta, grad, buf, *, lr, momentum, weight_decay):
    buf = grad.clone() if buf is None else momentum * buf + grad  # the momentum never sees λθ
    return theta - lr * (buf + weight_decay * theta), buf


def sgd_in_place(theta, grad, buf, *, lr, momentum, weight_decay):
    grad.add_(theta, alpha=weight_decay)  # right values, written into the inputs
    buf = grad if buf is None else buf.mul_(momentum).add_(grad)
    return theta.sub_(lr * buf), buf


def adamw_coupled(theta0, grad, *, lr, weight_decay, eps):
    g = grad + weight_decay * theta0
    return theta0 - lr * g / (g.abs() + eps)


def adamw_no_bias_correction(theta0, grad, *, lr, weight_decay, eps):
    m, v = 0.1 * grad, 0.001 * grad * grad
    return theta0 * (1 - lr * weight_decay) - lr * m / (v.sqrt() + eps)


def residual_no_identity(W, x, v):
    dx, dW = S.residual_vjp(W, x, v)
    return dx - v, dW


def residual_W_not_transposed(W, x, v):
    g = torch.tanh(W @ x)
    ub = v * (1 - g * g)
    return v + W @ ub, torch.outer(ub, x)


def tied_head_only(E, ids, G):
    return G.T @ E[ids]


def tied_assign(E, ids, G):
    lookup = torch.zeros_like(E)
    lookup[ids] = G @ E  # assignment: a repeated id keeps one row
    return G.T @ E[ids] + lookup


def rms_no_term2(saved, grad_out):
    dx, dw = S.rms_norm_backward(saved, grad_out)
    return saved["rstd"] * grad_out * saved["weight"], dw


def rms_dw_mean(saved, grad_out):
    dx, dw = S.rms_norm_backward(saved, grad_out)
    C = saved["x"].shape[-1]
    return dx, (grad_out * saved["x"] * saved["rstd"]).reshape(-1, C).mean(0)


def attention_group_mean(saved, grad_out):
    dq, dk, dv = S.attention_backward(saved, grad_out)
    G = saved["q"].shape[1] // saved["k"].shape[1]
    return dq, dk / G, dv / G


def attention_no_scale(saved, grad_out):
    dq, dk, dv = S.attention_backward(saved, grad_out)
    return dq / saved["scale"], dk / saved["scale"], dv


def attention_no_group_sum(saved, grad_out):
    q, k, v, P, s = saved["q"], saved["k"], saved["v"], saved["probs"], saved["scale"]
    G = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    dv = P.transpose(-1, -2) @ grad_out
    dP = grad_out @ vr.transpose(-1, -2)
    dS = P * (dP - (dP * P).sum(-1, keepdim=True)) * s
    return dS @ kr, dS.transpose(-1, -2) @ q, dv


def ce_divide_by_N(saved, grad_out):
    d = S.cross_entropy_backward(saved, grad_out)
    return d * saved["n_valid"] / saved["probs"].shape[0] if saved["reduction"] == "mean" else d


def window_micro_mean(model, micro_batches):
    total = 0.0
    for mb in micro_batches:
        loss = model(**mb).loss / len(micro_batches)  # each micro-batch's own mean, / n
        loss.backward()
        total += loss.item()
    return total


def window_unshifted(model, micro_batches):
    N, total = 0, 0.0
    for mb in micro_batches:
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        loss = F.cross_entropy(
            logits[:, :-1].flatten(0, 1), mb["labels"][:, 1:].flatten(), ignore_index=-100, reduction="sum"
        )
        loss.backward()
        N += int((mb["labels"] != -100).sum())  # counted before the causal shift
        total += loss.item()
    for p in model.parameters():
        p.grad.div_(N)
    return total / N


def window_never_divided(model, micro_batches):
    total = 0.0
    for mb in micro_batches:
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        loss = F.cross_entropy(
            logits[:, :-1].flatten(0, 1), mb["labels"][:, 1:].flatten(), ignore_index=-100, reduction="sum"
        )
        loss.backward()  # the sum's gradient, never divided by N
        total += loss.item()
    return total


def lrs_every_attempt(stepped, base_lr, wsd):
    from trainmech.update import wsd_multiplier

    lrs = [base_lr * wsd_multiplier(a, **wsd) for a in range(len(stepped))]
    logged = [sum(stepped[: a + 1]) for a in range(len(stepped))]
    return lrs, logged


def lrs_logged_attempts(stepped, base_lr, wsd):
    lrs, _ = S.scheduled_lrs(stepped, base_lr, wsd)
    return lrs, list(range(1, len(stepped) + 1))


def layer_no_logsumexp(cfg, batch, seq):
    return S.layer_saved_bytes(cfg, batch, seq) - 4 * batch * cfg.num_attention_heads * seq


def layer_with_probs(cfg, batch, seq):
    return S.layer_saved_bytes(cfg, batch, seq) + 4 * batch * cfg.num_attention_heads * seq * seq


def grads_released_at_optimizer(model):
    return {(k[0], "optimizer"): v for k, v in S.gradient_lifecycle(model).items()}


def grads_tied_head_in_head_phase(model):
    out = S.gradient_lifecycle(model)
    if model.config.tie_word_embeddings:
        n = model.lm_head.weight.numel() * 4
        out[("backward.head", "zero_grad")] += n
    return out


def offload_no_copy(keep):
    return (lambda t: t.detach()), (lambda t: t)


def offload_to_cpu_alias(keep):
    return (lambda t: t.to("cpu")), (lambda t: t)  # on a CPU this returns t itself


def offload_params_too(keep):
    return (lambda t: t.detach().clone()), (lambda t: t)  # the parameters are copied as well


def offload_closure(keep):
    store = {}

    def pack(t):
        store[len(store)] = t
        return len(store) - 1

    return pack, (lambda i: store[i])


def offload_half(keep):
    kept = {p.untyped_storage().data_ptr() for p in keep}

    def pack(t):
        if t.untyped_storage().data_ptr() in kept:
            return t.detach()
        if not t.is_floating_point():
            return t.detach().clone()
        return t.detach().to(torch.bfloat16)

    def unpack(p):
        return p.float() if p.dtype == torch.bfloat16 else p

    return pack, unpack


def checkpoint_plain(fn, x):
    return fn(x)


class _SavesOnlyInput(torch.autograd.Function):
    """The forward every checkpoint answer shares; the wrong answers differ in their backward."""

    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.save_for_backward(x)
        return fn(x)


class _NoEnableGrad(_SavesOnlyInput):
    @staticmethod
    def backward(ctx, g):  # the recompute runs with grad mode off: no graph to go back through
        (x,) = ctx.saved_tensors
        x_ = x.detach().requires_grad_(True)
        torch.autograd.backward(ctx.fn(x_), g)
        return None, x_.grad


def checkpoint_no_enable_grad(fn, x):
    return _NoEnableGrad.apply(fn, x)


class _OnlyX(_SavesOnlyInput):
    @staticmethod
    def backward(ctx, g):  # torch.autograd.grad w.r.t. x only: the parameters get nothing
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x_ = x.detach().requires_grad_(True)
            out = ctx.fn(x_)
        (dx,) = torch.autograd.grad(out, x_, g)
        return None, dx


def checkpoint_only_x(fn, x):
    return _OnlyX.apply(fn, x)


def gate_no_floor(ref, cand, rtol):
    errors = {}
    for n, g in ref.items():
        errors[n] = (
            math.inf
            if n not in cand
            else float((cand[n].double() - g.double()).abs().max() / g.double().abs().max())
        )
    return all(e <= rtol for e in errors.values()), errors


def gate_absolute(ref, cand, rtol):
    errors = {
        n: (math.inf if n not in cand else float((cand[n].double() - g.double()).abs().max()))
        for n, g in ref.items()
    }
    return all(e <= rtol for e in errors.values()), errors


def gate_max_nan(ref, cand, rtol):
    passed, errors = S.gradient_gate(ref, cand, rtol)
    return not max(errors.values()) > rtol, errors


def update_gate_counts_only(ref, cand, expected_lrs):
    eff = sum(s and f for s, f in zip(cand.stepped, cand.finite))
    want = sum(s and f for s, f in zip(ref.stepped, ref.finite))
    if cand.error or not all(cand.finite) or eff != want:
        return False, "counts differ"
    return True, "same number of effective updates"


def peak_no_vocab_grads(cfg, batch, seq):
    phase, composition = S.predict_peak(cfg, batch, seq)
    if phase == "backward.loss":
        composition = {
            **composition,
            "upstream_grads": composition["upstream_grads"] - 2 * 4 * batch * seq * cfg.vocab_size,
        }
    return phase, composition


def peak_always_at_the_loss(cfg, batch, seq):
    return "backward.loss", S.predict_peak(cfg, batch, seq)[1]


def fsdp_even_split(model, world_size, rank):
    psi = sum(p.numel() for p in model.parameters())
    return {
        "parameters": 4 * psi // world_size,
        "gradients": 4 * psi // world_size,
        "optimizer_states": 8 * psi // world_size,
    }


def fsdp_no_padding(model, world_size, rank):
    out = S.fsdp_held_bytes(model, world_size, rank)
    own = out["optimizer_states"] - 4 * len(list(model.parameters()))
    return {**out, "parameters": own // 2, "gradients": own // 2}


WRONG = {
    "task0.sgd_momentum_update": [
        (sgd_no_decay, "漏了权重衰减"),
        (sgd_decay_outside_momentum, "没有先加进梯度、进入动量"),
        (sgd_in_place, "原地修改了传入的 `theta`、`grad`"),
    ],
    "task0.adamw_first_update": [(adamw_coupled, "耦合进了梯度"), (adamw_no_bias_correction, "偏差校正")],
    "task1.residual_vjp": [
        (residual_no_identity, "恒等路径"),
        (residual_W_not_transposed, "W ū 而不是 Wᵀ ū"),
    ],
    "task1.tied_embedding_grad": [(tied_head_only, "漏了嵌入查表"), (tied_assign, "index_add_")],
    "task2.rms_norm_backward": [(rms_no_term2, "漏了第二项"), (rms_dw_mean, "取了平均")],
    "task2.attention_backward": [
        (attention_group_mean, "取了平均"),
        (attention_no_scale, "缩放"),
        (attention_no_group_sum, "要相加"),
    ],
    "task2.cross_entropy_backward": [(ce_divide_by_N, "有效行数")],
    "task3.streaming_window": [
        (window_micro_mean, "micro_mean"),
        (window_unshifted, "没有错位"),
        (window_never_divided, "没有把 .grad 除以 N"),
    ],
    "task3.scheduled_lrs": [
        (lrs_every_attempt, "被跳过的更新也推进了它"),
        (lrs_logged_attempts, "有效更新次数"),
    ],
    "task4.layer_saved_bytes": [(layer_no_logsumexp, "sdpa_logsumexp"), (layer_with_probs, "s×s")],
    "task4.gradient_lifecycle": [
        (grads_released_at_optimizer, "zero_grad"),
        (grads_tied_head_in_head_phase, "backward.embed"),
    ],
    "task4.predict_peak": [
        (peak_always_at_the_loss, "实测在 optimizer"),
        (peak_no_vocab_grads, "词表大小的 fp32 上游梯度"),
    ],
    "task4.fsdp_held_bytes": [(fsdp_even_split, "第 0 维切"), (fsdp_no_padding, "填充到")],
    "task5.offload_hooks": [
        (offload_no_copy, "没有被搬走"),
        (offload_to_cpu_alias, "t.to('cpu')"),
        (offload_params_too, "参数也被复制"),
        (offload_closure, "闭包"),
        (offload_half, "取回的张量与打包时不同"),
    ],
    "task5.checkpoint": [
        (checkpoint_plain, "只应留下输入"),
        (checkpoint_no_enable_grad, "enable_grad"),
        (checkpoint_only_x, "没有得到梯度"),
    ],
    "task6.gradient_gate": [(gate_no_floor, "下限"), (gate_absolute, "绝对误差"), (gate_max_nan, "NaN")],
    "task6.update_gate": [(update_gate_counts_only, "漏过去了")],
}


# ----------------------------------------------------------------------------- the tests


def test_every_exercise_has_a_solution_and_wrong_answers():
    assert set(S.SOLUTIONS) == set(exercises.EXERCISES) == set(WRONG)


def by_task(exercise_id: str, *values, id: str | None = None):
    """One parameter set carrying its Task's marker (`task3.streaming_window` -> task3), so that
    `pytest -m task3` also runs Task3's exercise checks."""
    return pytest.param(exercise_id, *values, id=id, marks=getattr(pytest.mark, exercise_id.split(".")[0]))


@pytest.mark.parametrize("exercise_id", [by_task(k) for k in S.SOLUTIONS])
def test_reference_solution_passes(exercise_id):
    result, text = run_check(exercise_id, S.SOLUTIONS[exercise_id])
    assert result is exercises.PASSED and result, text
    assert "✓" in text and "通过" in text and "✗" not in text


def _stub(*args, **kwargs):
    raise NotImplementedError("练习：在这里写你的实现")


@pytest.mark.parametrize("exercise_id", [by_task(k) for k in exercises.EXERCISES])
def test_unfilled_stub_is_not_attempted(exercise_id):
    result, text = run_check(exercise_id, _stub)
    assert result is None
    assert (
        text.splitlines()[1]
        == "未完成：`_stub` 还是存根（它抛出 NotImplementedError）。在上一格写出实现后，再运行这一格。"
    )
    assert len(text.splitlines()) == 2  # fixed text: the committed notebooks stay deterministic


@pytest.mark.parametrize(
    "exercise_id,fn,fragment",
    [by_task(k, fn, frag, id=f"{k}-{fn.__name__}") for k, items in WRONG.items() for fn, frag in items],
)
def test_wrong_answer_is_rejected_with_a_diagnosis(exercise_id, fn, fragment):
    result, text = run_check(exercise_id, fn)
    assert isinstance(result, ClaimFailed), text
    assert str(result).startswith(f"练习 {exercise_id} 未通过：")
    assert "✗" in text and fragment in text, text


def test_a_learner_error_is_reported_not_raised_raw():
    def broken(W, x, v):
        return W @ torch.ones(W.shape[0] + 1, dtype=W.dtype), W

    result, text = run_check("task1.residual_vjp", broken)
    assert isinstance(result, ClaimFailed)
    assert "你的函数抛出了 RuntimeError" in text


def test_a_half_finished_answer_is_wrong_not_unattempted():
    calls = []

    def half(theta, grad, buf, *, lr, momentum, weight_decay):
        calls.append(1)
        if buf is not None:
            raise NotImplementedError("later updates")
        return S.sgd_momentum_update(theta, grad, buf, lr=lr, momentum=momentum, weight_decay=weight_decay)

    result, text = run_check("task0.sgd_momentum_update", half)
    assert isinstance(result, ClaimFailed) and "NotImplementedError" in text and len(calls) == 2


def test_a_check_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    run_check("task5.checkpoint", S.my_checkpoint)
    run_check("task3.streaming_window", _stub)
    assert torch.equal(torch.get_rng_state(), before)


def test_unknown_exercise_id_is_refused():
    with pytest.raises(TrainmechError, match="没有练习"):
        exercises.check("task9.nothing", _stub)


def test_checks_never_read_the_solutions():
    paths = sorted((REPO / "trainmech" / "exercises").glob("*.py"))
    assert len(paths) == 9  # __init__.py, harness.py and task0.py ... task6.py
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {
            alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        }
        imported |= {
            f"{node.module}.{a.name}"
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for a in node.names
        }
        assert not any("solutions" in name for name in imported), path.name


def test_every_notebook_ends_with_its_exercises():
    """Each Task notebook ends with a 练习 section of two to four exercises, each a stub and a one-line
    check; together they cover every exercise id exactly once, and the committed output of every
    check is the fixed 未完成 text."""
    seen = []
    for path in sorted((REPO / "notebooks").glob("Task*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        start = next(
            i
            for i, c in enumerate(cells)
            if c["cell_type"] == "markdown" and "".join(c["source"]).startswith("## 练习")
        )
        checks = [
            c
            for c in cells[start:]
            if c["cell_type"] == "code" and "".join(c["source"]).startswith("trainmech.exercises.check(")
        ]
        ids = [ast.literal_eval("".join(c["source"]).split("(", 1)[1].split(",", 1)[0]) for c in checks]
        assert 2 <= len(ids) <= 4, path.name
        assert all(i.startswith(path.name[:5].lower() + ".") for i in ids), (path.name, ids)
        for c in checks:
            text = "".join("".join(o.get("text", [])) for o in c["outputs"])
            assert "未完成" in text and len(c["source"]) == 1, (path.name, c["source"])
        seen += ids
    assert sorted(seen) == sorted(exercises.EXERCISES)


def test_decay_outside_the_momentum_is_not_called_missing():
    result, text = run_check("task0.sgd_momentum_update", sgd_decay_outside_momentum)
    assert isinstance(result, ClaimFailed)
    assert "漏了权重衰减" not in text and "buf（动量缓冲）" in text, text


def test_an_in_place_answer_is_wrong_even_with_the_right_values():
    result, text = run_check("task0.sgd_momentum_update", sgd_in_place)
    assert isinstance(result, ClaimFailed) and "原地修改了输入" in str(result)
    assert "第 1 次更新" in text and "x.add_(…)" in text


def test_a_learner_error_quotes_the_learners_own_line():
    def helper(W):
        return W @ torch.ones(W.shape[0] + 1, dtype=W.dtype)  # the shape error is raised here

    def broken(W, x, v):
        return helper(W), W

    result, text = run_check("task1.residual_vjp", broken)
    assert isinstance(result, ClaimFailed)
    line = next(ln for ln in text.splitlines() if "出错的是你代码里的这一行" in ln)
    assert "test_exercises.py" in line and "return W @ torch.ones(W.shape[0] + 1, dtype=W.dtype)" in line, (
        text
    )


def test_in_a_kernel_feedback_shows_without_the_package_traceback():
    """What the learner sees in JupyterLab: a wrong answer prints the diagnosis and raises (Run All
    stops there) with a two-line error — the summary and the check's line — and no frames from
    trainmech; a passing check shows no `Out[n]`; their own error is quoted at their line."""
    from kernel_cells import errors_of, run_cells, text_of

    wrong, right, raising = run_cells(
        "import trainmech.exercises\nfrom trainmech import solutions as S\n"
        "def sgd(theta, grad, buf, *, lr, momentum, weight_decay):\n"
        "    buf = grad.clone() if buf is None else momentum * buf + grad\n"
        "    return theta - lr * (buf + weight_decay * theta), buf\n"
        'trainmech.exercises.check("task0.sgd_momentum_update", sgd)',
        'trainmech.exercises.check("task0.sgd_momentum_update", S.sgd_momentum_update)',
        "def adamw(theta0, grad, *, lr, weight_decay, eps):\n"
        "    m = grad.sum(dim=5)\n"
        "    return theta0\n"
        'trainmech.exercises.check("task0.adamw_first_update", adamw)',
    )
    [error] = errors_of(wrong)
    assert error.ename == "ClaimFailed" and "✗" in text_of(wrong)
    shown = "\n".join(error.traceback)
    assert len(error.traceback) == 2 and "练习 task0.sgd_momentum_update 未通过" in shown, shown
    assert "Cell In[1]，第 6 行：trainmech.exercises.check(" in shown
    assert "exercises" + "/__init__.py" not in shown and "Traceback" not in shown
    assert "通过" in text_of(right) and not errors_of(right)
    assert not [o for o in right.outputs if o.output_type == "execute_result"]  # no stray Out[n]: True
    assert "出错的是你代码里的这一行（Cell In[3]，第 2 行：m = grad.sum(dim=5)）" in text_of(raising), (
        text_of(raising)
    )
