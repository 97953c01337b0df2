"""hugehead.integrations.transformers.patch against the unpatched models: losses and every gradient (float64
against a plain-PyTorch reference on the unpatched model's logits, float32 against the unpatched model's
own loss), gradient accumulation, generate, sequence classifiers' heads, checkpoints, PEFT and refusals.
Tiny random configs only: nothing is downloaded."""
import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from conftest import NUM_GPUS, requires_cuda, requires_multigpu  # noqa: E402
from hugehead import lce_op as hh_lce_op, plan as hh_plan  # noqa: E402
from hugehead.integrations import transformers as hh_tf  # noqa: E402
from hugehead.integrations.transformers import ClassifierHead, head_inputs, patch  # noqa: E402

V, D = 96, 32
_DECODER = dict(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, attn_implementation="eager")


def _causal_lm(name: str, dtype=torch.float64):
    from transformers import (Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, GraniteConfig,
                              GraniteForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM)

    torch.manual_seed(0)
    if name == "llama":
        model = LlamaForCausalLM(LlamaConfig(**_DECODER))
    elif name == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**_DECODER))
    elif name == "mistral":
        model = MistralForCausalLM(MistralConfig(**_DECODER, sliding_window=None))
    elif name == "gemma2":  # a small softcap, so that it changes the loss a lot
        model = Gemma2ForCausalLM(Gemma2Config(**_DECODER, head_dim=8, final_logit_softcapping=1.5))
    elif name == "granite":  # the forward divides the logits by logits_scaling
        model = GraniteForCausalLM(GraniteConfig(**_DECODER, logits_scaling=4.0))
    elif name == "gpt2":  # lm_head tied to the input embeddings
        model = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=D, n_layer=2, n_head=4, n_positions=64,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                           attn_implementation="eager"))
    else:
        raise AssertionError(name)
    with torch.no_grad():  # logits of order 1-10 (random init gives ~0.1), where softcap and shift matter
        model.get_output_embeddings().weight.mul_(30.0)
    return model.to(dtype)


CAUSAL = ["llama", "qwen2", "mistral", "gemma2", "granite", "gpt2"]


def _tokens(batch=3, length=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (batch, length), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt that is not trained on
    labels[2, -2:] = -100
    return ids, labels


def _hf_loss_float64(logits, labels, num_items=None):
    """transformers' ForCausalLMLoss in float64 (it upcasts to float32 itself): shift, ignore -100, and
    sum / num_items_in_batch when that is given."""
    target = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    logits = logits.double().reshape(-1, logits.shape[-1])
    if num_items is None:
        return F.cross_entropy(logits, target, ignore_index=-100)
    return F.cross_entropy(logits, target, ignore_index=-100, reduction="sum") / num_items


def _assert_grads_equal(model, ref, rtol):
    names = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        expected = names[name].grad
        assert param.grad is not None, name
        err = (param.grad - expected).norm() / expected.norm().clamp_min(1e-30)
        assert err < rtol, f"{name}: relative error {float(err):.3g}"


@pytest.mark.parametrize("num_items", [None, 17])
@pytest.mark.parametrize("name", CAUSAL)
def test_causal_lm_loss_and_every_gradient_float64(name, num_items):
    model = _causal_lm(name)
    ref = copy.deepcopy(model)
    patch(model)
    ids, labels = _tokens()
    n = None if num_items is None else torch.tensor(num_items)

    out = model(input_ids=ids, labels=labels, num_items_in_batch=n)
    expected = _hf_loss_float64(ref(input_ids=ids).logits, labels, n)
    assert out.logits is None
    assert out.loss.dtype == torch.float64
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=0)
    out.loss.backward()
    expected.backward()
    _assert_grads_equal(model, ref, rtol=1e-10)


@pytest.mark.parametrize("num_items", [None, 17])
@pytest.mark.parametrize("name", CAUSAL)
def test_causal_lm_rows_plan_loss_and_every_gradient_float64(name, num_items, monkeypatch):
    """patch(model, memory_budget=...) small enough that the loss takes the rows plan (every gradient made in
    the forward, over row blocks; the backward scales them by 1 / num_items_in_batch when that is given)."""
    model = _causal_lm(name)
    ref = copy.deepcopy(model)
    ids, labels = _tokens()
    rows_per_block = 8  # 27 rows (3 x 9 tokens): 4 blocks
    monkeypatch.setattr(hh_plan, "ROWS_MIN_SPLIT_ROWS", {"cpu": 1, "cuda": 1})
    patch(model, memory_budget=rows_per_block * V * 8 + ids.numel() * D * 8)
    calls = []
    rows_pass = hh_lce_op.rows_pass  # (read by the rows op's body, eager twin or op)
    monkeypatch.setattr(hh_lce_op, "rows_pass", lambda *a, **k: calls.append(a[5]) or rows_pass(*a, **k))
    n = None if num_items is None else torch.tensor(num_items)
    out = model(input_ids=ids, labels=labels, num_items_in_batch=n)
    assert calls and -(-ids.numel() // calls[0].rows) == 4, calls  # the rows plan: 4 blocks
    expected = _hf_loss_float64(ref(input_ids=ids).logits, labels, n)
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=0)
    out.loss.backward()
    expected.backward()
    _assert_grads_equal(model, ref, rtol=1e-10)


@pytest.mark.parametrize("name", CAUSAL)
def test_causal_lm_float32_equals_the_unpatched_models_own_loss(name):
    model = _causal_lm(name, torch.float32)
    ref = copy.deepcopy(model)
    patch(model)
    ids, labels = _tokens(seed=2)
    for n in (None, torch.tensor(11)):
        out = model(input_ids=ids, labels=labels, num_items_in_batch=n)
        expected = ref(input_ids=ids, labels=labels, num_items_in_batch=n)
        torch.testing.assert_close(out.loss, expected.loss, rtol=2e-6, atol=0)
        model.zero_grad()
        ref.zero_grad()
        out.loss.backward()
        expected.loss.backward()
        _assert_grads_equal(model, ref, rtol=2e-5)


def test_softcap_and_scale_change_the_loss():
    # The references above would also pass if the model ignored both; here they must matter.
    for name, attr in (("gemma2", "final_logit_softcapping"), ("granite", "logits_scaling")):
        model = _causal_lm(name)
        ids, labels = _tokens()
        plain = copy.deepcopy(model)
        setattr(plain.config, attr, None if attr == "final_logit_softcapping" else 1.0)
        patch(model)
        patch(plain)
        with torch.no_grad():
            assert abs(float(model(input_ids=ids, labels=labels).loss - plain(input_ids=ids, labels=labels).loss)) > 0.1


def test_gradient_accumulation_with_num_items_in_batch_equals_one_big_batch():
    model = _causal_lm("llama")
    ref = copy.deepcopy(model)
    patch(model)
    ids, labels = _tokens(batch=4, length=9, seed=3)
    labels[1, :6] = -100  # micro-batches with different numbers of trained tokens
    items = int((labels[..., 1:] != -100).sum())
    for half in (slice(0, 1), slice(1, 4)):  # uneven micro-batches, as a Trainer step with accumulation
        model(input_ids=ids[half], labels=labels[half], num_items_in_batch=torch.tensor(items)).loss.backward()
    _hf_loss_float64(ref(input_ids=ids).logits, labels).backward()  # the step's mean over all its tokens
    _assert_grads_equal(model, ref, rtol=1e-10)


def test_tied_embeddings_get_both_gradients():
    model = _causal_lm("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    ref = copy.deepcopy(model)
    patch(model)
    ids, labels = _tokens()
    model(input_ids=ids, labels=labels).loss.backward()
    _hf_loss_float64(ref(input_ids=ids).logits, labels).backward()
    assert model.lm_head.weight is model.transformer.wte.weight
    grad = model.transformer.wte.weight.grad
    # Rows of tokens that occur in the input get the embedding's gradient on top of the head's.
    head_only = copy.deepcopy(ref)
    head_only.zero_grad()
    hidden = head_only.transformer(input_ids=ids).last_hidden_state.detach()
    _hf_loss_float64(head_only.lm_head(hidden), labels).backward()
    assert (grad - head_only.lm_head.weight.grad).abs().max() > 1e-6
    torch.testing.assert_close(grad, ref.transformer.wte.weight.grad, rtol=1e-10, atol=1e-14)


def test_shift_labels_and_logits_to_keep():
    model = _causal_lm("llama")
    ref = copy.deepcopy(model)
    patch(model)
    ids, labels = _tokens()
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
    torch.testing.assert_close(model(input_ids=ids, labels=labels, shift_labels=shift).loss,
                               _hf_loss_float64(ref(input_ids=ids).logits, labels), rtol=1e-12, atol=0)
    # logits_to_keep=4: lm_head sees the last 4 positions; shift_labels of that length is the target.
    kept = model(input_ids=ids, labels=labels, shift_labels=shift[:, -4:], logits_to_keep=4).loss
    logits = ref(input_ids=ids).logits[:, -4:]
    torch.testing.assert_close(kept, F.cross_entropy(logits.reshape(-1, V), shift[:, -4:].reshape(-1)), rtol=1e-12,
                               atol=0)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=ids, labels=labels, logits_to_keep=4)


@pytest.mark.parametrize("name", CAUSAL)
def test_without_labels_and_generate_unchanged(name):
    model = _causal_lm(name, torch.float32)
    ref = copy.deepcopy(model)
    patch(model)
    ids, _ = _tokens()
    assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    mask = torch.ones_like(ids)
    kwargs = dict(max_new_tokens=6, do_sample=False, attention_mask=mask, pad_token_id=0)
    tokens = model.generate(ids, **kwargs)
    assert tokens.shape == (3, 15)
    assert torch.equal(tokens, ref.generate(ids, **kwargs))
    # generate reads the forward's signature (logits_to_keep=1 when it is there): the patch keeps it.
    assert inspect.signature(model.forward) == inspect.signature(ref.forward)


def test_return_dict_false_and_deepcopy():
    model = _causal_lm("llama")
    patch(model)
    ids, labels = _tokens()
    loss = model(input_ids=ids, labels=labels).loss
    as_tuple = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], loss, rtol=0, atol=0)
    twin = copy.deepcopy(model)
    assert twin.forward.model is twin
    with torch.no_grad():
        twin.lm_head.weight.mul_(2.0)
    assert float(twin(input_ids=ids, labels=labels).loss.detach()) != float(loss.detach())
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, loss, rtol=0, atol=0)


def test_a_transform_hugehead_cannot_reproduce_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    class SquaredLlamaForCausalLM(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits ** 2
            return out

    model = SquaredLlamaForCausalLM(LlamaConfig(**_DECODER)).double()
    patch(model)
    ids, labels = _tokens()
    with pytest.raises(NotImplementedError, match="maps lm_head's outputs"):
        model(input_ids=ids, labels=labels)


# --------------------------------------------------------------------------------------------------
# Sequence classification
# --------------------------------------------------------------------------------------------------
NUM_LABELS = 40


def _classifier(name: str, num_labels=NUM_LABELS, dtype=torch.float64, **config):
    from transformers import (BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForSequenceClassification,
                              RobertaConfig, RobertaForSequenceClassification)

    torch.manual_seed(0)
    encoder = dict(vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=num_labels,
                   attn_implementation="eager", **config)
    if name == "bert":
        model = BertForSequenceClassification(BertConfig(**encoder))
    elif name == "roberta":  # head = RobertaClassificationHead(dense, tanh, out_proj)
        model = RobertaForSequenceClassification(RobertaConfig(**encoder, pad_token_id=1))
    elif name == "llama":  # score over every token, pooled at the last non-padding one
        model = LlamaForSequenceClassification(LlamaConfig(**{**_DECODER, "num_labels": num_labels}, pad_token_id=0,
                                                           **config))
    else:
        raise AssertionError(name)
    return model.to(dtype)


def _head_linear(ref, name):
    return {"bert": lambda m: m.classifier, "roberta": lambda m: m.classifier.out_proj,
            "llama": lambda m: m.score}[name](ref)


def _sentences(seed=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (4, 7), generator=g)
    ids[1, 5:] = 0  # right padding
    ids[3, 4:] = 0
    mask = (ids != 0).long()
    labels = torch.randint(0, NUM_LABELS, (4,), generator=g)
    labels[2] = -100
    return ids, mask, labels


@pytest.mark.parametrize("devices", [None, ["cpu", "cpu", "cpu"]])
@pytest.mark.parametrize("name", ["bert", "roberta", "llama"])
def test_classifier_loss_logits_and_every_gradient(name, devices):
    model = _classifier(name)
    ref = copy.deepcopy(model)
    patch(model, devices=devices)
    head = _head_linear(model, name)
    assert isinstance(head, ClassifierHead) and len(head.shards) == (1 if devices is None else 3)
    ids, mask, labels = _sentences()

    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    expected = ref(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-12, atol=1e-14)
    out.loss.backward()
    expected.loss.backward()
    linear = _head_linear(ref, name)
    prefix = {"bert": "classifier.", "roberta": "classifier.out_proj.", "llama": "score."}[name]
    names = dict(ref.named_parameters())
    for pname, param in model.named_parameters():
        if pname.startswith(prefix + "shards."):
            continue
        torch.testing.assert_close(param.grad, names[pname].grad, rtol=1e-10, atol=1e-14, msg=pname)
    grad_w = torch.cat([s.weight.grad for s in head.shards])
    torch.testing.assert_close(grad_w, linear.weight.grad, rtol=1e-10, atol=1e-14)
    if linear.bias is not None:
        torch.testing.assert_close(torch.cat([s.bias.grad for s in head.shards]), linear.bias.grad, rtol=1e-10,
                                   atol=1e-14)
    # Without labels: the same logits, no loss.
    plain = model(input_ids=ids, attention_mask=mask)
    assert plain.loss is None
    torch.testing.assert_close(plain.logits, expected.logits, rtol=1e-12, atol=1e-14)


def test_logits_rule_head_inputs_and_topk(monkeypatch):
    model = _classifier("bert")
    ref = copy.deepcopy(model)
    ids, mask, labels = _sentences()
    patch(model, return_logits=False)
    assert model(input_ids=ids, attention_mask=mask, labels=labels).logits is None
    rows = head_inputs(model, input_ids=ids, attention_mask=mask)
    assert rows.shape == (4, D)
    values, classes = model.classifier.topk(rows, k=5)
    top = ref(input_ids=ids, attention_mask=mask).logits.topk(5)
    torch.testing.assert_close(values, top.values, rtol=1e-12, atol=1e-14)
    assert torch.equal(classes, top.indices)

    monkeypatch.setattr(hh_tf, "LOGITS_MAX_CLASSES", NUM_LABELS - 1)  # the default rule, at a lower bar
    auto = _classifier("bert")
    patch(auto)
    assert auto(input_ids=ids, attention_mask=mask, labels=labels).logits is None
    forced = _classifier("bert")
    patch(forced, return_logits=True)
    assert forced(input_ids=ids, attention_mask=mask).logits.shape == (4, NUM_LABELS)


def test_save_pretrained_loads_into_the_unpatched_class_and_back(tmp_path):
    from safetensors import safe_open
    from transformers import BertForSequenceClassification

    model = _classifier("bert", dtype=torch.float32)
    ref = copy.deepcopy(model)
    patch(model, devices=["cpu", "cpu"])
    ids, mask, labels = _sentences()
    with torch.no_grad():  # trained weights, different from the initial ones
        for shard in model.classifier.shards:
            shard.weight.add_(torch.randn_like(shard.weight))
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("classifier.weight").shape == (NUM_LABELS, D)
    assert {"classifier.weight", "classifier.bias"} <= keys and not any("shards" in k for k in keys)

    loaded = BertForSequenceClassification.from_pretrained(tmp_path)
    torch.testing.assert_close(loaded.classifier.weight, torch.cat([s.weight for s in model.classifier.shards]))
    expected = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask, labels=labels).loss, expected, rtol=1e-6,
                               atol=0)
    patch(loaded, devices=["cpu", "cpu", "cpu"])
    torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask, labels=labels).loss, expected, rtol=1e-6,
                               atol=0)
    # A patched model loads an unpatched state dict through the logical keys.
    ref_state = ref.state_dict()
    model.load_state_dict(ref_state)
    torch.testing.assert_close(torch.cat([s.weight for s in model.classifier.shards]), ref.classifier.weight)


def test_classifier_refusals():
    with pytest.raises(NotImplementedError, match="multi_label"):
        patch(_classifier("bert", problem_type="multi_label_classification"))
    with pytest.raises(NotImplementedError, match="regression"):
        patch(_classifier("bert", num_labels=1))
    model = _classifier("bert")
    patch(model)
    ids, mask, _ = _sentences()
    float_labels = torch.zeros(4, NUM_LABELS, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="multi_label_classification"):
        model(input_ids=ids, attention_mask=mask, labels=float_labels)
    with pytest.raises(ValueError, match="already patched"):
        patch(model)
    with pytest.raises(ValueError, match="out of range"):
        model.config.problem_type = None
        model(input_ids=ids, attention_mask=mask, labels=torch.full((4,), NUM_LABELS))


def test_causal_lm_refusals():
    from transformers import BertConfig, BertModel

    with pytest.raises(TypeError, match="supports decoder-only causal LMs"):
        patch(BertModel(BertConfig(vocab_size=V, hidden_size=D, num_hidden_layers=1, num_attention_heads=4,
                                   intermediate_size=64)))
    with pytest.raises(ValueError, match="lm_head stays"):
        patch(_causal_lm("llama"), devices=["cpu"])
    custom = _causal_lm("llama")
    custom.loss_function = lambda *a, **k: None
    with pytest.raises(ValueError, match="loss_function was replaced"):
        patch(custom)


# --------------------------------------------------------------------------------------------------
# PEFT: an adapter on the patched head is an error, never a silently untrained adapter
# --------------------------------------------------------------------------------------------------
def test_peft_adapter_on_the_head_is_refused():
    peft = pytest.importorskip("peft")
    ids, labels = _tokens()

    before = peft.get_peft_model(_causal_lm("llama", torch.float32), peft.LoraConfig(target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="PEFT module"):
        patch(before)

    after = patch(_causal_lm("llama", torch.float32))
    after = peft.get_peft_model(after, peft.LoraConfig(target_modules=["q_proj", "lm_head"]))
    with pytest.raises(RuntimeError, match="PEFT adapter"):
        after(input_ids=ids, labels=labels)

    classifier = patch(_classifier("bert", dtype=torch.float32))
    sentences, mask, y = _sentences()
    classifier = peft.get_peft_model(classifier, peft.LoraConfig(task_type="SEQ_CLS", target_modules=["query"]))
    with pytest.raises(RuntimeError, match="modules_to_save"):
        classifier(input_ids=sentences, attention_mask=mask, labels=y)


def test_peft_adapter_elsewhere_trains_with_the_patched_head():
    peft = pytest.importorskip("peft")
    ids, labels = _tokens()
    config = peft.LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(5)
    ref = peft.get_peft_model(_causal_lm("llama", torch.float32), config)
    torch.manual_seed(5)
    model = patch(peft.get_peft_model(_causal_lm("llama", torch.float32), config))
    out, expected = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.loss, expected.loss, rtol=2e-6, atol=0)
    out.loss.backward()
    expected.loss.backward()
    trained = dict(ref.named_parameters())
    lora = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n, _ in lora)
    for n, p in lora:
        assert (p.grad - trained[n].grad).norm() <= 2e-5 * trained[n].grad.norm(), n


# --------------------------------------------------------------------------------------------------
# GPUs
# --------------------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt2"])
def test_cuda_causal_lm_matches_and_autocast(name):
    model = _causal_lm(name, torch.float32).cuda()
    ref = copy.deepcopy(model)
    patch(model)
    ids, labels = (t.cuda() for t in _tokens())
    n = torch.tensor(20, device="cuda")
    torch.testing.assert_close(model(input_ids=ids, labels=labels, num_items_in_batch=n).loss,
                               ref(input_ids=ids, labels=labels, num_items_in_batch=n).loss, rtol=1e-5, atol=0)
    exact = _hf_loss_float64(ref.double()(input_ids=ids).logits, labels)
    ref.float()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours = model(input_ids=ids, labels=labels).loss
        theirs = ref(input_ids=ids, labels=labels).loss
    assert ours.dtype == torch.float32
    # bf16: within 2x the error of transformers' own bf16 loss (+ a floor for a lucky draw).
    assert abs(float(ours - exact)) <= 2 * abs(float(theirs - exact)) + 2e-3 * abs(float(exact))


@requires_multigpu
def test_heads_on_a_gpu_that_is_not_the_current_one():
    assert NUM_GPUS >= 2 and torch.cuda.current_device() == 0
    model = _causal_lm("llama", torch.float32)
    ref = copy.deepcopy(model)
    model.cuda(1)
    patch(model)
    ids, labels = _tokens()
    loss = model(input_ids=ids.cuda(1), labels=labels.cuda(1)).loss
    assert loss.device == torch.device("cuda", 1)
    torch.testing.assert_close(loss.cpu(), ref(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=0)

    classifier = _classifier("bert", dtype=torch.float32)
    cref = copy.deepcopy(classifier)
    classifier.cuda(0)
    patch(classifier, devices=["cuda:1"])
    sentences, mask, y = _sentences()
    out = classifier(input_ids=sentences.cuda(), attention_mask=mask.cuda(), labels=y.cuda())
    out.loss.backward()
    expected = cref(input_ids=sentences, attention_mask=mask, labels=y)
    expected.loss.backward()
    torch.testing.assert_close(out.loss.cpu(), expected.loss, rtol=1e-5, atol=0)
    assert classifier.classifier.shards[0].weight.grad.device == torch.device("cuda", 1)
    torch.testing.assert_close(classifier.classifier.shards[0].weight.grad.cpu(), cref.classifier.weight.grad,
                               rtol=1e-4, atol=1e-7)


@requires_cuda
@pytest.mark.parametrize("placement", [dict(devices=["cuda:0"]), dict(offload=True)])
def test_cuda_classifier_head_placements(placement):
    model = _classifier("bert", dtype=torch.float32)
    ref = copy.deepcopy(model)
    model.cuda()
    patch(model, **placement)
    assert all(s.compute_device == torch.device("cuda", 0) for s in model.classifier.shards)
    ids, mask, labels = _sentences()
    out = model(input_ids=ids.cuda(), attention_mask=mask.cuda(), labels=labels.cuda())
    expected = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    expected.loss.backward()
    torch.testing.assert_close(out.loss.cpu(), expected.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(out.logits.cpu(), expected.logits, rtol=1e-4, atol=1e-5)
    grad = torch.cat([s.weight.grad.cpu() for s in model.classifier.shards])
    assert (grad - ref.classifier.weight.grad).norm() <= 1e-4 * ref.classifier.weight.grad.norm()


def test_trainer_with_gradient_accumulation_matches_the_unpatched_model(tmp_path):
    """transformers' Trainer passes num_items_in_batch to a forward that takes **kwargs (it reads the
    signature, which the patch keeps) and then does not divide by the accumulation steps itself: one
    optimizer step over two uneven micro-batches must move the weights as the unpatched model's does."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    ids, labels = _tokens(batch=4, length=9, seed=6)
    labels[0, :7] = -100  # micro-batch 1 has far fewer trained tokens than micro-batch 2
    data = [{"input_ids": i, "labels": t} for i, t in zip(ids, labels)]

    def one_step(model, name):
        args = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_steps=1, learning_rate=1.0, optim="sgd",
                                 lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, use_cpu=True,
                                 report_to=[], save_strategy="no", logging_strategy="no", dataloader_drop_last=False,
                                 seed=0, data_seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        assert trainer.model_accepts_loss_kwargs
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    model = _causal_lm("llama", torch.float32)
    ref = copy.deepcopy(model)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ours, theirs = one_step(patch(model), "patched"), one_step(ref, "unpatched")
    for name, value in theirs.items():
        moved = theirs[name] - start[name]
        assert moved.norm() > 0, name
        assert (ours[name] - start[name] - moved).norm() <= 1e-4 * moved.norm(), name
