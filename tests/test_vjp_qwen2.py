"""Task2 guard: a whole Qwen2 decoder layer and Qwen2ForCausalLM's loss, backward by hand
(trainmech.vjp_qwen2), against the real transformers modules and torch.autograd.

float64, tolerance 1e-10 relative. The stock HF Qwen2 modules compute RMSNorm
(`hidden_states.to(torch.float32)`), the eager softmax (`softmax(..., dtype=torch.float32)`) and the
loss (`logits.float()`) in float32 even in a float64 model, so a float64 HF model is only
float32-accurate there. The float64 reference therefore runs the real modules with those three
float32 islands removed (fixture `hf_float64`, i.e. `vjp_qwen2.hf_float64_reference`: RMSNorm and
eager attention keep float64; the loss is `vjp_qwen2.causal_lm_loss` on the model's float64 logits).

float32, tolerance 1e-4 relative, against the stock, unpatched model: both sides round every op to
float32 (eps 1.2e-7) but sum in different orders over up to V*B*T terms through two layers, which
leaves ~1e-6 relative; 1e-4 keeps a wide margin while any wrong formula is off by >= 1e-2.
"""

import pytest
import torch
from transformers.models.qwen2 import modeling_qwen2

from trainmech import vjp
from trainmech import vjp_qwen2 as q2
from trainmech.checks import close

pytestmark = pytest.mark.task2

RTOL64 = 1e-10
RTOL32 = 1e-4
B, T, V = 2, 12, 97  # V: the vocabulary of conftest's tiny Qwen2


def batch():
    gen = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, V, (B, T), generator=gen)
    labels = input_ids.clone()
    labels[0, 3] = -100  # a masked position in the middle
    labels[1, 8:] = -100  # a masked tail (as right padding would be)
    return input_ids, labels


shifted_loss = q2.causal_lm_loss  # HF's causal-LM loss in the logits' own dtype


def autograd_grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.fixture
def hf_float64():
    """Remove the stock modules' float32 islands so the HF model is a true float64 reference."""
    with q2.hf_float64_reference():
        yield


# ----------------------------------------------------------------------------------------------
# the whole model


def test_task2_model_loss_and_every_grad_match_autograd_float64(hf_float64, tiny_qwen2):
    model = tiny_qwen2(torch.float64, off_init=True)
    input_ids, labels = batch()
    loss, saved = q2.model_loss_forward(model, input_ids, labels)
    grads = q2.model_loss_backward(saved)

    ref_loss = shifted_loss(model(input_ids=input_ids).logits, labels)
    ref_grads = autograd_grads(model, ref_loss)
    close("loss", loss, ref_loss, rtol=RTOL64)
    assert list(grads) == list(ref_grads)  # every parameter, named and ordered as named_parameters()
    for name in ref_grads:
        close(name, grads[name], ref_grads[name], rtol=RTOL64)


def test_task2_model_loss_is_hfs_shifted_loss_float32(tiny_qwen2):
    """Our loss is HF's own `labels=` loss (shift by one, ignore -100, mean over valid) on the stock model."""
    model = tiny_qwen2(torch.float32, off_init=True)
    input_ids, labels = batch()
    loss, _ = q2.model_loss_forward(model, input_ids, labels)
    hf_loss = model(input_ids=input_ids, labels=labels).loss
    close("loss[f32]", loss, hf_loss, rtol=RTOL32)


def test_task2_model_every_grad_matches_stock_hf_float32(tiny_qwen2):
    model = tiny_qwen2(torch.float32, off_init=True)
    input_ids, labels = batch()
    loss, saved = q2.model_loss_forward(model, input_ids, labels)
    grads = q2.model_loss_backward(saved)
    ref_grads = autograd_grads(model, model(input_ids=input_ids, labels=labels).loss)
    assert list(grads) == list(ref_grads)
    for name in ref_grads:
        close(f"{name}[f32]", grads[name], ref_grads[name], rtol=RTOL32)


def test_task2_tied_lm_head_grad_is_the_sum_of_both_uses(tiny_qwen2):
    model = tiny_qwen2(torch.float64, off_init=True)
    names = [name for name, _ in model.named_parameters()]
    assert model.lm_head.weight is model.model.embed_tokens.weight  # one Parameter, two uses
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # listed once
    input_ids, labels = batch()
    _, saved = q2.model_loss_forward(model, input_ids, labels)
    assert saved["lm_head"]["weight"].data_ptr() == model.model.embed_tokens.weight.data_ptr()
    grads = q2.model_loss_backward(saved)
    dlogits, _ = vjp.cross_entropy_backward(saved["loss"], torch.tensor(1.0, dtype=torch.float64))
    _, head_use, _ = vjp.linear_backward(saved["lm_head"], dlogits.reshape(B, T, V))  # (V, C)
    embedding_use = grads["model.embed_tokens.weight"] - head_use  # (V, C)
    assert head_use.abs().sum(1).gt(0).all()  # the softmax touches every vocabulary row
    # the lookup touches only rows of input ids that can reach a supervised position: causal
    # attention carries position t forward only, so ids after a sequence's last target get no grad
    reaches = torch.zeros(V, dtype=torch.bool)
    for b in range(B):
        last = int((labels[b, 1:] != -100).nonzero().max())  # last position with a target
        reaches[input_ids[b, : last + 1]] = True
    assert embedding_use[reaches].abs().sum(1).gt(0).all()
    assert not embedding_use[~reaches].any()


def test_task2_untied_model_has_separate_lm_head_grad(hf_float64, tiny_qwen2):
    model = tiny_qwen2(torch.float64, off_init=True, tie_word_embeddings=False)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    input_ids, labels = batch()
    loss, saved = q2.model_loss_forward(model, input_ids, labels)
    grads = q2.model_loss_backward(saved)
    ref_grads = autograd_grads(model, shifted_loss(model(input_ids=input_ids).logits, labels))
    assert list(grads) == list(ref_grads) and "lm_head.weight" in grads
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        close(name, grads[name], ref_grads[name], rtol=RTOL64)


# ----------------------------------------------------------------------------------------------
# one decoder layer


def causal_additive_mask(T, dtype):
    """What eager attention needs: eager applies no causal mask of its own."""
    return torch.full((T, T), float("-inf"), dtype=dtype).triu(1)[None, None]  # (1, 1, T, T)


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, RTOL64), (torch.float32, RTOL32)])
def test_task2_decoder_layer_matches_hf_layer(request, dtype, rtol, tiny_qwen2):
    if dtype == torch.float64:
        request.getfixturevalue("hf_float64")
    model = tiny_qwen2(dtype, off_init=True)
    layer, config = model.model.layers[1], model.config
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, config.hidden_size, generator=gen, dtype=dtype)
    grad_out = torch.randn(B, T, config.hidden_size, generator=gen, dtype=dtype)
    cos, sin = q2.rope_cos_sin(config, T, dtype=dtype)

    out, saved = q2.layer_forward(x, q2.layer_params(layer), cos, sin, config)
    dx, dparams = q2.layer_backward(saved, grad_out)

    x_ref = x.clone().requires_grad_(True)
    out_ref = layer(
        x_ref, attention_mask=causal_additive_mask(T, dtype), position_embeddings=(cos[None], sin[None])
    )
    layer.zero_grad()
    (out_ref * grad_out).sum().backward()
    tag = "" if dtype == torch.float64 else "[f32]"
    close(f"layer.out{tag}", out, out_ref, rtol=rtol)
    close(f"layer.dx{tag}", dx, x_ref.grad, rtol=rtol)
    assert set(dparams) == {name for name, _ in layer.named_parameters()}
    for name, p in layer.named_parameters():
        close(f"layer.{name}{tag}", dparams[name], p.grad, rtol=rtol)


def test_task2_rope_cos_sin_match_hf_rotary_embedding_bitwise(tiny_qwen2):
    for dtype in (torch.float32, torch.float64):
        model = tiny_qwen2(dtype, off_init=True)
        x = torch.zeros(1, T, 32, dtype=dtype)
        cos, sin = model.model.rotary_emb(x, torch.arange(T)[None])
        ours_cos, ours_sin = q2.rope_cos_sin(model.config, T, dtype=dtype)
        assert torch.equal(ours_cos, cos[0]) and torch.equal(ours_sin, sin[0])


def test_task2_rms_norm_forward_is_qwen2_rmsnorm_bitwise_in_low_precision():
    """Same casts as Qwen2RMSNorm: float32 math for bfloat16 input, cast back, then the weight."""
    norm = modeling_qwen2.Qwen2RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(16, generator=torch.Generator().manual_seed(4)))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(5)).to(dtype)
        ours, saved = vjp.rms_norm_forward(x, norm.weight.detach(), eps=1e-6)
        assert torch.equal(ours, norm(x).detach())
        assert saved["rstd"].dtype == torch.float32


# ----------------------------------------------------------------------------------------------
# what backward consumes; refusals


def test_task2_saved_inventory_lists_each_tensor_and_sums_to_saved_bytes(tiny_qwen2):
    model = tiny_qwen2(torch.float32, off_init=True)
    input_ids, labels = batch()
    _, saved = q2.model_loss_forward(model, input_ids, labels)
    layer_rows = q2.saved_inventory(saved["model.layers"][0])
    by_name = {name: (shape, dtype, nbytes) for name, shape, dtype, nbytes in layer_rows}
    assert by_name["self_attn.attention.probs"][0] == (B, 4, T, T)  # P is (B, H, T, T): quadratic in T
    assert by_name["input_layernorm.rstd"][0] == (B, T, 1)
    assert by_name["self_attn.k_proj.x (= self_attn.q_proj.x)"][2] == 0  # one tensor read by q, k and v
    assert sum(row[3] for row in layer_rows) == vjp.saved_bytes(saved["model.layers"][0])
    all_rows = q2.saved_inventory(saved)
    assert sum(row[3] for row in all_rows) == vjp.saved_bytes(saved)
    assert any(name.startswith("model.layers.1.mlp.gate") for name, *_ in all_rows)
    # every weight is referenced by some backward; the q/k/v biases are not (d bias = summed grad_out)
    referenced = sum(p.nbytes for name, p in model.named_parameters() if not name.endswith(".bias"))
    assert vjp.saved_bytes(saved, exclude=model.parameters()) == vjp.saved_bytes(saved) - referenced


def test_task2_model_loss_refuses_padding_mask_and_all_ignored_labels(tiny_qwen2):
    model = tiny_qwen2(torch.float32, off_init=True)
    input_ids, labels = batch()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, -2:] = 0
    with pytest.raises(ValueError, match="padding"):
        q2.model_loss_forward(model, input_ids, labels, attention_mask=mask)
    with pytest.raises(ValueError, match="mean"):
        q2.model_loss_forward(model, input_ids, torch.full_like(labels, -100))
    q2.model_loss_forward(model, input_ids, labels, attention_mask=torch.ones(B, T))  # all ones is fine


def test_task2_unsupported_config_is_refused(tiny_qwen2, tiny_qwen2_config):
    with pytest.raises(ValueError, match="rope_type"):
        q2.rope_cos_sin(
            tiny_qwen2_config(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), T
        )
    model = tiny_qwen2(
        torch.float32, off_init=True, use_sliding_window=True, sliding_window=4, max_window_layers=1
    )
    input_ids, labels = batch()
    with pytest.raises(ValueError, match="full"):
        q2.model_loss_forward(model, input_ids, labels)


# ----------------------------------------------------------------------------------------------
# the float64 reference helper and the benchmark


def test_task2_hf_float64_reference_changes_only_float64_and_restores_the_stock_modules(tiny_qwen2):
    stock_norm, stock_eager = modeling_qwen2.Qwen2RMSNorm.forward, modeling_qwen2.eager_attention_forward
    input_ids, labels = batch()
    model32, model64 = tiny_qwen2(torch.float32, off_init=True), tiny_qwen2(torch.float64, off_init=True)
    stock32, stock64 = model32(input_ids=input_ids).logits, model64(input_ids=input_ids).logits
    with pytest.raises(RuntimeError, match="boom"), q2.hf_float64_reference():
        assert modeling_qwen2.Qwen2RMSNorm.forward is not stock_norm
        assert torch.equal(
            model32(input_ids=input_ids).logits, stock32
        )  # float32: exactly the stock numerics
        patched64 = model64(input_ids=input_ids).logits
        raise RuntimeError("boom")  # the patches are undone even when the block fails
    assert (
        modeling_qwen2.Qwen2RMSNorm.forward is stock_norm
        and modeling_qwen2.eager_attention_forward is stock_eager
    )
    ours, _ = q2.model_loss_forward(model64, input_ids, labels)
    close("loss[f64 reference]", q2.causal_lm_loss(patched64, labels), ours, rtol=RTOL64)
    stock_error = abs(q2.causal_lm_loss(stock64, labels) - ours).item() / ours.abs().item()
    assert 1e-10 < stock_error < 1e-5  # the stock float64 model is only float32-accurate


def test_task2_benchmark_runs_its_correctness_gate_and_reports_medians(capsys):
    result = q2.benchmark("qwen2-tiny", batch=1, seq=8, repeats=2, warmup=1)
    assert set(result) == {"by_hand", "autograd", "ratio"} and all(v > 0 for v in result.values())
    out = capsys.readouterr().out
    assert "correctness gate" in out and "ratio by hand / autograd" in out


@pytest.mark.task0  # Task0 shows the float32 islands too
def test_task0_task2_every_float32_island_is_measured_in_a_float64_model(tiny_qwen2):
    model, (ids, labels) = tiny_qwen2(torch.float64, off_init=True, attn_implementation="sdpa"), batch()
    gaps = q2.float32_island_gaps(model, ids, labels)
    assert list(gaps) == list(q2.FLOAT32_ISLANDS) and all(g > 0 for g in gaps.values())
    assert model.config._attn_implementation == "sdpa"  # restored after the eager entry
    with pytest.raises(ValueError, match="float64"):
        q2.float32_island_gaps(tiny_qwen2(torch.float32, off_init=True), ids, labels)
    with pytest.raises(ValueError, match="can remove only"):
        with q2.hf_float64_reference(islands=("ForCausalLMLoss",)):
            pass
