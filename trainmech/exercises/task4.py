"""Task4 exercises: the bytes one decoder layer saves for backward; the gradients' bytes and lifetime; the
peak of a config the page never shows; what one FSDP2 rank holds."""

from __future__ import annotations

from itertools import combinations

import torch

from trainmech.exercises.harness import _exercise, _Run, _tiny_model, _Wrong

__all__ = ["UNSEEN", "WHY"]


@_exercise("task4.layer_saved_bytes", "一个解码层为反向保存的字节数（fp32，CPU）")
def _task4_layer(run: _Run) -> None:
    from trainmech import ledger, profiles, workload

    profile = profiles.for_mode("cpu")
    for c, (model_name, b, s) in enumerate((("qwen2-tiny", 2, 16), ("qwen2-small", 1, 24)), 1):
        cfg = workload.qwen2_config(profile.model(model_name))
        where = (
            f"输入 {c}（{model_name}：hidden={cfg.hidden_size}, heads={cfg.num_attention_heads}, "
            f"kv_heads={cfg.num_key_value_heads}, intermediate={cfg.intermediate_size}；batch={b}, seq={s}）"
        )
        ours = run.call(where, cfg, b, s)
        (point,) = ledger.measure_point(model_name, b, s, steps=("first",))
        added = point.measured.saved_added_per_layer(cfg.num_hidden_layers)
        measured = added[0]
        if not isinstance(ours, (int, float)) or isinstance(ours, bool) or ours != int(ours):
            raise _Wrong(f"✗ {where}：应返回一个整数（字节数），你返回了 {ours!r}")
        ours = int(ours)
        if ours == measured:
            run.ok(
                f"{where}：{ours:,} 字节，等于实测每层前向新增的保存张量字节（{', '.join(f'{x:,}' for x in added)}）"
            )
            continue
        diff = ours - measured
        lines = [
            f"✗ {where}：你算出 {ours:,} 字节，实测每层新增 {measured:,} 字节，{'多' if diff > 0 else '少'}了 {abs(diff):,} 字节"
            f"（每个位置 {abs(diff) / (b * s):g} 字节，即 {abs(diff) / (4 * b * s):g} 个 fp32 元素）"
        ]
        shape = ledger.model_shape(cfg)
        if diff > 0 and diff == 4 * b * shape.num_heads * s * s:
            lines.append(
                "    多出的正好是 s×s 的注意力概率 (B, H, T, T)：CPU 上 SDPA 的 flash 内核不保存它，只保存每行的 logsumexp"
            )
        elif diff > 0 and diff == 4 * b * (shape.num_heads - shape.num_kv_heads) * s * shape.head_dim * 2:
            lines.append(
                "    多出的正好是把 K、V 复制到每个查询头的量：分组查询注意力只保存 kv_heads 个头的 K、V"
            )
        else:
            rows = ledger.layer_saved(shape, b, s, "fp32")
            for size in (1, 2, 3):
                hit = next(
                    (
                        combo
                        for combo in combinations(rows, size)
                        if sum(t.nbytes for t in combo) == abs(diff)
                    ),
                    None,
                )
                if hit:
                    names = "、".join(f"{t.name} {t.shape}" for t in hit)
                    lines.append(
                        f"    账本清单里{'恰好' if size == 1 else '这几项加起来'}是这么多字节的：{names}"
                        + ("——是不是漏了？" if diff < 0 else "——是不是算了两遍？")
                    )
                    break
        raise _Wrong(lines, f"每层保存字节 {ours:,} ≠ 实测 {measured:,}（差 {diff:+,}）")


def _phase_label(key) -> str:
    return f"{key[0]} → {key[1]}"


@_exercise("task4.gradient_lifecycle", "梯度这一类状态的字节与生命周期")
def _task4_gradients(run: _Run) -> None:
    from trainmech import measure, workload

    batch = workload.lm_batch("domain", 1, 16)
    for c, tied in enumerate((True, False), 1):
        model = _tiny_model(tie_word_embeddings=tied)
        where = f"输入 {c}（qwen2-tiny，{'输出头与嵌入共享权重' if tied else '输出头有自己的权重'}）"
        ours = run.call(where, model)
        if not isinstance(ours, dict):
            raise _Wrong(
                f"✗ {where}：应返回 dict {{(创建阶段, 释放阶段): 字节数}}，你返回了 {type(ours).__name__}"
            )
        model.zero_grad(set_to_none=True)
        step = measure.training_step_memory(model, torch.optim.AdamW(model.parameters(), lr=1e-4), batch)
        measured = {
            (born, died): n for (cat, born, died), n in step.lifecycles().items() if cat == "gradients"
        }
        try:
            ours = {(str(k[0]), str(k[1])): int(v) for k, v in ours.items()}
        except Exception:  # noqa: BLE001
            raise _Wrong(f"✗ {where}：字典的键应是 (创建阶段, 释放阶段) 两个字符串，值是整数字节数") from None
        if ours == measured:
            run.ok(
                f"{where}：{len(measured)} 组生命周期、共 {sum(measured.values()):,} 字节，与实测逐字节一致"
            )
            continue
        lines = [f"✗ {where}：与实测（trainmech.measure 追踪的 .grad 存储）不一致："]
        for key in sorted(ours.keys() | measured.keys()):
            a, m = ours.get(key, 0), measured.get(key, 0)
            if a != m:
                lines.append(
                    f"    {_phase_label(key):<32} 你的 {a:>9,} 字节，实测 {m:>9,} 字节（差 {a - m:+,}）"
                )
        released = {k[1] for k in ours}
        if "optimizer" in released:
            lines.append(
                "    提示：更新读完梯度（最后消费）并不释放它；要等 zero_grad(set_to_none=True) 才释放，释放阶段是 zero_grad"
            )
        head = model.lm_head.weight.numel() * 4
        if (
            tied
            and ours.get(("backward.head", "zero_grad"), 0) - measured.get(("backward.head", "zero_grad"), 0)
            == head
        ):
            lines.append(
                "    提示：共享权重时，输出头那份梯度先在自动求导引擎里等着，到 backward.embed 与查表那份相加后才写进 .grad"
            )
        if tied and sum(ours.values()) - sum(measured.values()) == head:
            lines.append("    提示：共享的权重只有一个 .grad，只算一次")
        raise _Wrong(lines, "梯度的生命周期与实测不一致")


# configs the page never shows: a large untied vocabulary with a short batch, and a small tied one with a long batch
UNSEEN = (
    (
        {
            "vocab_size": 8192,
            "hidden_size": 64,
            "intermediate_size": 176,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
        },
        1,
        16,
    ),
    (
        {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 176,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
        },
        4,
        128,
    ),
)
WHY = {  # what dominates the moment the peak really falls in
    "backward.loss": "反向刚开始：前向留下的保存张量全部还在，再加两块 b·s·V·4 字节的 fp32 上游梯度（NLL 的梯度与 log-softmax 对 logits 的梯度）",
    "optimizer": "更新时刻：全部梯度、两个 AdamW 矩，加上逐张量循环的临时张量（工作区：按参数顺序取 2·n_i + n_{i−1} 的最大值，乘 4 字节）；保存张量早已释放",
    "backward.embed": "共享权重的汇合时刻：输出头那份梯度在引擎里等着，查表那份到了，两者相加成 .grad：三块 V·h·4 字节同时存在",
}


def _steady_step(cfg_dict: dict, batch: int, seq: int):
    """A steady AdamW update (PyTorch's CPU default, the per-tensor loop) tracked on a fresh fp32 model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainmech import measure, workload

    torch.manual_seed(0)
    cfg = Qwen2Config(**cfg_dict, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg)
    data = workload.lm_batch("domain", batch, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    measure.training_step_memory(model, opt, data)  # the first update creates the optimizer states
    return cfg, measure.training_step_memory(model, opt, data)


def _saved_hint(cfg, b: int, s: int, missing: int) -> list[str]:
    """Name the saved tensors outside the decoder layers whose bytes make up `missing` (measured − yours)."""
    h, v, d = cfg.hidden_size, cfg.vocab_size, cfg.hidden_size // cfg.num_attention_heads
    outside = {  # alive as the backward begins, beside every layer's saved tensors
        "loss.log_softmax（fp32 的 log-softmax 输出，b·s·V·4）": 4 * b * s * v,
        "model.norm.*（最后的 RMSNorm：fp32 输入、rsqrt、归一化结果、输出，4·(3·b·s·h + b·s)）": 4
        * (3 * b * s * h + b * s),
        "rope.cos_sin（旋转位置编码的 cos 与 sin，2·s·d·4）": 2 * s * d * 4,
        "loss.value（训练循环手里的损失标量，4）": 4,
    }
    lines = [f"    保存张量差 {missing:+,} 字节。层之外也有保存张量（反向刚开始时都还在）："]
    lines += [f"      {name}：{n:,} 字节" for name, n in outside.items()]
    for size in range(1, len(outside) + 1):
        hit = next((c for c in combinations(outside, size) if sum(outside[k] for k in c) == missing), None)
        if hit:
            lines.append(f"    你少算的正好是：{'、'.join(k.split('（')[0] for k in hit)}")
            break
    return lines


@_exercise("task4.predict_peak", "没见过的配置：峰值在哪个阶段、由什么组成")
def _task4_predict_peak(run: _Run) -> None:
    from trainmech.ledger import CATEGORIES

    for c, (cfg_dict, b, s) in enumerate(UNSEEN, 1):
        cfg, step = _steady_step(cfg_dict, b, s)
        where = (
            f"输入 {c}（vocab={cfg.vocab_size}, hidden={cfg.hidden_size}, layers={cfg.num_hidden_layers}, "
            f"{'共享' if cfg.tie_word_embeddings else '不共享'}嵌入；batch={b}, seq={s}）"
        )
        ours = run.call(where, cfg, b, s)
        if not (
            isinstance(ours, tuple)
            and len(ours) == 2
            and isinstance(ours[0], str)
            and isinstance(ours[1], dict)
        ):
            raise _Wrong(f"✗ {where}：应返回 (阶段名, {{类别: 字节数}})，你返回了 {ours!r:.80}")
        phase, composition = ours
        unknown = set(composition) - set(CATEGORIES)
        if unknown:
            raise _Wrong(
                f"✗ {where}：类别名 {sorted(unknown)} 不在 ledger.CATEGORIES 里（{', '.join(CATEGORIES)}）"
            )
        measured, peak = step.by_category(), step.peak_bytes
        if phase != step.peak_phase:
            raise _Wrong(
                [
                    f"✗ {where}：你说峰值在 {phase}，实测在 {step.peak_phase}（{peak:,} 字节）",
                    f"    那一刻：{WHY.get(step.peak_phase, '')}",
                ],
                f"峰值阶段 {phase} ≠ 实测 {step.peak_phase}",
            )
        off = {
            k: int(composition.get(k, 0)) - measured[k]
            for k in CATEGORIES
            if abs(int(composition.get(k, 0)) - measured[k]) > 0.02 * peak
        }
        if off:
            lines = [f"✗ {where}：阶段 {phase} 对了，但这些类别与实测相差超过峰值的 2%："]
            lines += [
                f"    {k:<20} 你的 {int(composition.get(k, 0)):>12,}  实测 {measured[k]:>12,}（差 {d:+,}）"
                for k, d in off.items()
            ]
            vocab_grads = 2 * b * s * cfg.vocab_size * 4
            if off.get("upstream_grads") == -vocab_grads:
                lines.append(
                    "    提示：漏了两块词表大小的 fp32 上游梯度：NLL 的梯度和 log-softmax 对 logits 的梯度，各 b·s·V·4 字节"
                )
            if "optimizer_states" in off:
                lines.append(
                    "    提示：稳态更新时 AdamW 的两个矩在更新之前就在；CPU 上每个参数张量还有一个 4 字节的 step 计数"
                )
            if "gradients" in off and phase == "backward.loss":
                lines.append("    提示：set_to_none=True 时，上一次更新后梯度已被释放：反向刚开始时梯度是 0")
            if "saved" in off:
                lines += _saved_hint(cfg, b, s, -off["saved"])
            if "parameters" in off:
                lines.append(
                    "    提示：参数在每个候选时刻都在：4 字节 × 参数个数（共享的嵌入与输出头只算一次）"
                )
            raise _Wrong(lines, f"{', '.join(off)} 与实测不符")
        run.ok(
            f"{where}：峰值在 {phase}，{len(CATEGORIES)} 个类别都在实测的 2% 以内（实测峰值 {peak:,} 字节）"
        )


@_exercise("task4.fsdp_held_bytes", "FSDP2 的每个 rank 持有多少字节")
def _task4_fsdp_held(run: _Run) -> None:
    from trainmech import distributed

    n = 3  # 3 ranks: the model's 64- and 176-row tensors do not split evenly
    reports = {
        r.rank: r for r in distributed.run(stages=(3,), world_sizes=(n,), batch=n, seq=16, torch_tracker=())
    }
    model = _tiny_model()
    for c, rank in enumerate((0, n - 1), 1):
        where = f"输入 {c}（qwen2-tiny，FSDP2 每层 + 根模块，world_size={n}，rank={rank}）"
        ours = run.call(where, model, n, rank)
        if not isinstance(ours, dict) or set(ours) != {"parameters", "gradients", "optimizer_states"}:
            raise _Wrong(
                f"✗ {where}：应返回 {{'parameters', 'gradients', 'optimizer_states'}} 三个键的字典，你返回了 {ours!r:.80}"
            )
        measured = reports[rank].held
        if {k: int(v) for k, v in ours.items()} == measured:
            run.ok(
                f"{where}：参数 {measured['parameters']:,}、梯度 {measured['gradients']:,}、优化器状态 "
                f"{measured['optimizer_states']:,} 字节，与实测逐字节一致"
            )
            continue
        lines = [f"✗ {where}：与 {n} 个进程实测的持有字节不一致："]
        lines += [
            f"    {k:<17} 你的 {int(ours.get(k, 0)):>9,}  实测 {measured[k]:>9,}（差 {int(ours.get(k, 0)) - measured[k]:+,}）"
            for k in measured
            if int(ours.get(k, 0)) != measured[k]
        ]
        psi = sum(p.numel() for p in model.parameters())
        if int(ours["parameters"]) in (4 * psi // n, -(-4 * psi // n)):
            lines.append(
                "    提示：FSDP2 按每个张量的第 0 维切，不是把全部元素平均分：每个 rank 存 ⌈d0/N⌉ 行"
            )
        elif int(ours["parameters"]) < measured["parameters"]:
            lines.append(
                "    提示：行数除不尽时，每个 rank 的分片都填充到 ⌈d0/N⌉ 行（最后一个 rank 也一样），字节按填充后的大小算"
            )
        if (
            int(ours["optimizer_states"]) != measured["optimizer_states"]
            and int(ours["parameters"]) == measured["parameters"]
        ):
            lines.append(
                "    提示：AdamW 的两个矩只覆盖本 rank 自己的行（不含填充）；每个参数张量另有一个 4 字节的 step 计数"
            )
        raise _Wrong(lines, "FSDP2 每个 rank 的持有字节与实测不符")
