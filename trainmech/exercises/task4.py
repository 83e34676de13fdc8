"""Task4 exercises: the bytes one decoder layer saves for backward; the gradients' bytes and lifetime."""

from __future__ import annotations

from itertools import combinations

import torch

from trainmech.exercises import _Run, _Wrong, _exercise, _tiny_model


def _added_saved_per_layer(measured, n_layers: int) -> list[int]:
    """Saved-tensor bytes each layer's forward added (Task4 · 1, `saved_at_end_of`)."""
    def at_end(phase):
        return measured.by_category(max(k for k, p in enumerate(measured.phases) if p == phase))["saved"]

    ends = ["forward.embed"] + [f"forward.layer.{i}" for i in range(n_layers)]
    return [at_end(b) - at_end(a) for a, b in zip(ends, ends[1:])]


@_exercise("task4.layer_saved_bytes", "一个解码层为反向保存的字节数（fp32，CPU）")
def _task4_layer(run: _Run) -> None:
    from trainmech import ledger, profiles, workload

    profile = profiles.for_mode("cpu")
    for c, (model_name, b, s) in enumerate((("qwen2-tiny", 2, 16), ("qwen2-small", 1, 24)), 1):
        cfg = workload.qwen2_config(profile.model(model_name))
        where = f"输入 {c}（{model_name}：hidden={cfg.hidden_size}, heads={cfg.num_attention_heads}, " \
                f"kv_heads={cfg.num_key_value_heads}, intermediate={cfg.intermediate_size}；batch={b}, seq={s}）"
        ours = run.call(where, cfg, b, s)
        point, = ledger.measure_point(model_name, b, s, steps=("first",))
        added = _added_saved_per_layer(point.measured, cfg.num_hidden_layers)
        measured = added[0]
        if not isinstance(ours, (int, float)) or isinstance(ours, bool) or ours != int(ours):
            raise _Wrong(f"✗ {where}：应返回一个整数（字节数），你返回了 {ours!r}")
        ours = int(ours)
        if ours == measured:
            run.ok(f"{where}：{ours:,} 字节，等于实测每层前向新增的保存张量字节（{', '.join(f'{x:,}' for x in added)}）")
            continue
        diff = ours - measured
        lines = [f"✗ {where}：你算出 {ours:,} 字节，实测每层新增 {measured:,} 字节，{'多' if diff > 0 else '少'}了 {abs(diff):,} 字节"
                 f"（每个位置 {abs(diff) / (b * s):g} 字节，即 {abs(diff) / (4 * b * s):g} 个 fp32 元素）"]
        shape = ledger.model_shape(cfg)
        if diff > 0 and diff == 4 * b * shape.num_heads * s * s:
            lines.append("    多出的正好是 s×s 的注意力概率 (B, H, T, T)：CPU 上 SDPA 的 flash 内核不保存它，只保存每行的 logsumexp")
        elif diff > 0 and diff == 4 * b * (shape.num_heads - shape.num_kv_heads) * s * shape.head_dim * 2:
            lines.append("    多出的正好是把 K、V 复制到每个查询头的量：分组查询注意力只保存 kv_heads 个头的 K、V")
        else:
            rows = ledger.layer_saved(shape, b, s, "fp32")
            for size in (1, 2, 3):
                hit = next((combo for combo in combinations(rows, size) if sum(t.nbytes for t in combo) == abs(diff)), None)
                if hit:
                    names = "、".join(f"{t.name} {t.shape}" for t in hit)
                    lines.append(f"    账本清单里{'恰好' if size == 1 else '这几项加起来'}是这么多字节的：{names}"
                                 + ("——是不是漏了？" if diff < 0 else "——是不是算了两遍？"))
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
            raise _Wrong(f"✗ {where}：应返回 dict {{(创建阶段, 释放阶段): 字节数}}，你返回了 {type(ours).__name__}")
        model.zero_grad(set_to_none=True)
        step = measure.training_step_memory(model, torch.optim.AdamW(model.parameters(), lr=1e-4), batch)
        measured = {(born, died): n for (cat, born, died), n in step.lifecycles().items() if cat == "gradients"}
        try:
            ours = {(str(k[0]), str(k[1])): int(v) for k, v in ours.items()}
        except Exception:  # noqa: BLE001
            raise _Wrong(f"✗ {where}：字典的键应是 (创建阶段, 释放阶段) 两个字符串，值是整数字节数") from None
        if ours == measured:
            run.ok(f"{where}：{len(measured)} 组生命周期、共 {sum(measured.values()):,} 字节，与实测逐字节一致")
            continue
        lines = [f"✗ {where}：与实测（trainmech.measure 追踪的 .grad 存储）不一致："]
        for key in sorted(ours.keys() | measured.keys()):
            a, m = ours.get(key, 0), measured.get(key, 0)
            if a != m:
                lines.append(f"    {_phase_label(key):<32} 你的 {a:>9,} 字节，实测 {m:>9,} 字节（差 {a - m:+,}）")
        released = {k[1] for k in ours}
        if "optimizer" in released:
            lines.append("    提示：更新读完梯度（最后消费）并不释放它；要等 zero_grad(set_to_none=True) 才释放，释放阶段是 zero_grad")
        head = model.lm_head.weight.numel() * 4
        if tied and ours.get(("backward.head", "zero_grad"), 0) - measured.get(("backward.head", "zero_grad"), 0) == head:
            lines.append("    提示：共享权重时，输出头那份梯度先在自动求导引擎里等着，到 backward.embed 与查表那份相加后才写进 .grad")
        if tied and sum(ours.values()) - sum(measured.values()) == head:
            lines.append("    提示：共享的权重只有一个 .grad，只算一次")
        raise _Wrong(lines, "梯度的生命周期与实测不一致")
