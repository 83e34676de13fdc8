"""The seven state categories, the vocabulary the ledger and `trainmech.measure` share.

They follow the glossary: 激活 (activation) is every tensor the forward produces, and 保存张量
(saved tensor) is the part of it a backward formula needs, so the forward's tensors split into
`saved` and `unsaved_activations`. 上游梯度 (upstream gradient) is the loss gradient an op receives
for its output in the backward: every gradient in flight that is not yet a parameter's `.grad`
(the cross-entropy's dlogits, a layer's input gradient, a tied weight's contribution waiting in the
autograd engine to be summed). 工作区 (workspace) is what remains: buffers an op, a kernel or the
optimizer asks for for one moment (AdamW's sqrt temporaries).
"""

from __future__ import annotations

__all__ = ["CATEGORIES", "CATEGORY_ZH", "MODEL_STATES", "BATCH_STATES"]

CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_states",
    "unsaved_activations",
    "saved",
    "upstream_grads",
    "workspace",
)
CATEGORY_ZH = {
    "parameters": "参数",
    "gradients": "梯度",
    "optimizer_states": "优化器状态",
    "unsaved_activations": "未保存的激活",
    "saved": "保存张量",
    "upstream_grads": "上游梯度",
    "workspace": "工作区",
}
MODEL_STATES = ("parameters", "gradients", "optimizer_states")  # ZeRO's "model states"
BATCH_STATES = ("unsaved_activations", "saved", "upstream_grads", "workspace")  # grow with batch × sequence
