"""Task5 exercises: saved-tensor hooks that move saved tensors away; activation checkpointing by hand."""

from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_leaves

from trainmech.checks import dtype_name
from trainmech.exercises.harness import (
    _exercise,
    _first_line,
    _rel,
    _Run,
    _tensor,
    _tiny_model,
    _tuple,
    _Wrong,
)

__all__: list[str] = []  # nothing to import: the checks register into EXERCISES


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensors_in(packed, depth: int = 0) -> list[torch.Tensor]:
    """Tensors reachable from a learner's packed value.

    Not `saved_state.flat_tensors` alone: its pytree walk covers tuples, lists and dicts, but a pack hook
    may also return a plain object (a small class or a dataclass holding the tensor), which pytree
    keeps as one opaque leaf; such an object would hide an alias of `t` and be counted as moved. So
    the nest is walked with pytree and each plain object's attributes with it in turn (a few levels).
    """
    found = []
    for leaf in tree_leaves(packed):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif depth < 3 and hasattr(leaf, "__dict__") and not isinstance(leaf, type):
            found += _tensors_in(vars(leaf), depth + 1)
    return found


def _offload_model():
    from trainmech import workload

    return _tiny_model(), workload.lm_batch("domain", 2, 16)


@_exercise("task5.offload_hooks", "一对把保存张量搬走的 saved-tensor 钩子")
def _task5_offload(run: _Run) -> None:
    model, batch = _offload_model()
    where = "qwen2-tiny，2 × 16 Token，一次前向 + 反向"
    hooks = _tuple(where, run.call(where, model.parameters()), ("pack", "unpack"))
    pack, unpack = hooks
    params = {_storage_ptr(p) for p in model.parameters()}

    def forward_backward(pack_hook, unpack_hook):
        model.zero_grad(set_to_none=True)
        alive = []

        def watch(t):  # noqa: E306
            if _storage_ptr(t) not in params:
                alive.append(weakref.ref(t.untyped_storage()))
            return pack_hook(t)

        with torch.autograd.graph.saved_tensors_hooks(watch, unpack_hook):
            loss = model(**batch, use_cache=False).loss
        still = sum(r() is not None for r in alive)  # device storages the packed values keep alive
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, still

    base_loss, base_grads, _ = forward_backward(lambda t: t, lambda t: t)

    def copy_every_non_parameter(
        t,
    ):  # the reference: nothing but parameters left referenced by a packed value
        return t.detach() if _storage_ptr(t) in params else (t.device, t.to("cpu", copy=True))

    *_, reference_alive = forward_backward(
        copy_every_non_parameter, lambda v: v if isinstance(v, torch.Tensor) else v[1].to(v[0])
    )

    stats = {
        "packed": 0,
        "params_kept": 0,
        "params_copied": 0,
        "moved": 0,
        "moved_bytes": 0,
        "not_moved": 0,
        "unpacked": 0,
        "differ": [],
    }

    def pack_watch(t):
        stats["packed"] += 1
        packed = pack(t)
        aliased = any(_storage_ptr(x) == _storage_ptr(t) for x in _tensors_in(packed))
        if _storage_ptr(t) in params:
            stats["params_kept" if aliased else "params_copied"] += 1
        elif aliased:
            stats["not_moved"] += 1
        else:
            stats["moved"] += 1
            stats["moved_bytes"] += t.numel() * t.element_size()
        return (t.detach().clone(), t.stride()), packed  # a private copy to compare the unpacked tensor with

    def unpack_watch(value):
        (original, stride), packed = value
        t = unpack(packed)
        stats["unpacked"] += 1
        if not isinstance(t, torch.Tensor):
            stats["differ"].append(f"返回了 {type(t).__name__}")
        elif t.dtype != original.dtype or t.shape != original.shape:
            stats["differ"].append(
                f"{tuple(original.shape)} {dtype_name(original.dtype)} 取回成了 {tuple(t.shape)} {dtype_name(t.dtype)}"
            )
        elif not torch.equal(t, original):
            stats["differ"].append(
                f"{tuple(original.shape)} 的数值变了（max|Δ|={(t.double() - original.double()).abs().max().item():.1e}）"
            )
        return t

    try:
        loss, grads, alive = forward_backward(pack_watch, unpack_watch)
    except _Wrong:
        raise
    except Exception as e:  # noqa: BLE001
        raise _Wrong(
            f"✗ {where}：带着你的钩子做前向 + 反向时出错：{type(e).__name__}：{_first_line(e)}"
        ) from None
    lines = []
    if stats["params_copied"]:
        lines.append(
            f"✗ {stats['params_copied']} 个参数也被复制走了：参数本来就常驻设备，搬走它只会多传一遍——"
            "用 keep 里各参数的存储地址（t.untyped_storage().data_ptr()）判断，原样返回 t.detach()"
        )
    if stats["not_moved"]:
        lines.append(
            f"✗ {stats['not_moved']} / {stats['not_moved'] + stats['moved']} 个非参数的保存张量没有被搬走："
            "pack 返回的东西仍然引用原来的存储"
        )
        lines.append(
            "    在 CPU 上 t.to('cpu') 直接返回 t 本身、不复制；用 t.detach().clone() 或 t.to('cpu', copy=True) 复制一份"
        )
    elif alive > reference_alive:
        lines.append(
            f"✗ 前向结束时仍有 {alive} 块被保存的存储活着（把每个非参数张量都复制走的参考钩子只剩 {reference_alive} 块）："
            "pack 在别处（例如闭包里的字典）留住了原张量，设备上的内存没有被释放"
        )
    if stats["differ"]:
        lines.append(
            f"✗ {len(stats['differ'])} / {stats['unpacked']} 个取回的张量与打包时不同，第一个：{stats['differ'][0]}"
        )
    if not torch.equal(loss, base_loss):
        lines.append(f"✗ 损失与不加钩子的基线不同：{loss.item():.6f} vs {base_loss.item():.6f}")
    wrong = [n for n in base_grads if not torch.equal(grads[n], base_grads[n])]
    if wrong:
        lines.append(
            f"✗ {len(wrong)} / {len(base_grads)} 个参数的梯度与基线不逐位相等，例如 {wrong[0]}"
            f"（相对误差 {_rel(grads[wrong[0]], base_grads[wrong[0]]):.1e}）"
        )
    if lines:
        raise _Wrong(lines, lines[0].lstrip("✗ ").split("：")[0])
    run.ok(
        f"{where}：打包 {stats['packed']} 个保存张量——参数 {stats['params_kept']} 个原样留下，"
        f"其余 {stats['moved']} 个复制走（{stats['moved_bytes']:,} 字节），前向结束时设备上只剩 {alive} 块（与参考钩子相同）"
    )
    run.ok(
        f"{where}：{stats['unpacked']} 个取回的张量逐位等于打包时的张量；损失与 {len(grads)} 个参数梯度与基线逐位相等"
    )


@_exercise("task5.checkpoint", "手写激活检查点：前向只留输入，反向重算")
def _task5_checkpoint(run: _Run) -> None:
    model = _tiny_model()
    layer = model.model.layers[0]
    x0 = torch.randn(2, 16, model.config.hidden_size)
    params = {
        f"{m}.{n}": p
        for m in ("post_attention_layernorm", "mlp")
        for n, p in getattr(layer, m).named_parameters()
    }
    param_ptrs = {_storage_ptr(p) for p in params.values()}
    calls = [0]

    def block(h):
        """A residual MLP block of qwen2-tiny's layer 0: h + mlp(norm(h))."""
        calls[0] += 1
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def run_once(fn):
        layer.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        saved = {}

        def pack(t):  # noqa: E306
            if _storage_ptr(t) not in param_ptrs:
                saved[_storage_ptr(t)] = t.untyped_storage().nbytes()
            return t

        calls[0] = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(x)
        forward_calls = calls[0]
        return x, out, sum(saved.values()), forward_calls

    x_ref, out_ref, base_bytes, _ = run_once(block)
    out_ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in params.items()}
    ref_dx = x_ref.grad.clone()

    where = "qwen2-tiny 第 0 层的 h + mlp(norm(h))，h 为 (2, 16, 64)"
    x, out, ours_bytes, forward_calls = run_once(lambda h: run.call(where, block, h))
    input_bytes = x0.untyped_storage().nbytes()
    if not isinstance(out, torch.Tensor):
        raise _Wrong(f"✗ {where}：应返回 fn(x) 的输出张量，你返回了 {type(out).__name__}")
    if not torch.equal(out.detach(), out_ref.detach()):
        _tensor(where, "输出", out, out_ref, rtol=0.0, against="不加检查点的 fn(x)")
    if not out.requires_grad:
        raise _Wrong(
            f"✗ {where}：输出不需要梯度（requires_grad=False）：它没有接进计算图，反向到不了 x 和参数"
        )
    if ours_bytes > input_bytes:
        raise _Wrong(
            [
                f"✗ {where}：前向留下了 {ours_bytes:,} 字节的保存张量（不计参数），不加检查点是 {base_bytes:,} 字节；"
                f"检查点只应留下输入 x 的 {input_bytes:,} 字节",
                "    在 torch.autograd.Function 的 forward 里调用 fn（那里不记录计算图），只 ctx.save_for_backward(x)",
            ],
            f"前向保存了 {ours_bytes:,} 字节，应只有 {input_bytes:,}",
        )
    calls[0] = 0
    try:
        out.sum().backward()
    except Exception as e:  # noqa: BLE001
        lines = [f"✗ {where}：反向时出错：{type(e).__name__}：{_first_line(e)}"]
        if "does not require grad" in str(e) or "does not have a grad_fn" in str(e):
            lines.append(
                "    重算要在 torch.enable_grad() 里进行（Function.backward 默认不记录计算图），"
                "并对 x.detach().requires_grad_() 调用 fn"
            )
        raise _Wrong(lines, f"反向出错：{type(e).__name__}") from None
    if calls[0] != 1:
        raise _Wrong(
            f"✗ {where}：反向里 fn 被调用了 {calls[0]} 次，应重算恰好 1 次", f"反向调用 fn {calls[0]} 次"
        )
    if x.grad is None:
        raise _Wrong(
            f"✗ {where}：反向之后 x.grad 是 None：backward 要返回对 x 的梯度（对 fn 参数的位置返回 None）"
        )
    _tensor(where, "x.grad", x.grad, ref_dx, rtol=0.0, against="不加检查点的反向")
    missing = [n for n, p in params.items() if n in ref_grads and p.grad is None]
    if missing:
        raise _Wrong(
            [
                f"✗ {where}：{len(missing)} 个参数没有得到梯度，例如 {missing[0]}",
                "    重算出的输出要对全部需要梯度的张量反向：torch.autograd.backward(out, grad_out) 会把参数的梯度"
                "累加进它们的 .grad（torch.autograd.grad(out, x, …) 只给 x）",
            ],
            f"{len(missing)} 个参数没有梯度",
        )
    for n, g in ref_grads.items():
        _tensor(where, f"{n}.grad", params[n].grad, g, rtol=0.0, against="不加检查点的反向")
    run.ok(
        f"{where}：输出逐位相同；前向只保存 {ours_bytes:,} 字节（输入本身；不加检查点是 {base_bytes:,} 字节）；"
        f"fn 前向调用 {forward_calls} 次、反向重算 1 次"
    )
    run.ok(f"{where}：x.grad 与 {len(ref_grads)} 个参数的梯度都与不加检查点的反向逐位相等")
