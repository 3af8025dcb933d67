"""The real base model of another family (`model=gemma3_270m`: google/gemma-3-270m from its GGUF file): Gemma-3's
sliding-window attention, a tied 262,144-token vocabulary, and a tokenizer without a chat template (the project
supplies Gemma-3's published one). The conversion against the GGUF's own de-quantized tensors, the labels under that
template, and sft's loss against the model's own at this vocabulary, padded and packed, each kernel, on a row long
enough for the sliding window to matter. The base-to-chat recipe is tests/e2e/test_examples.py's."""

import json

import pytest
import torch
from conftest import GEMMA3, assert_dequantized, labelled_runs, sft_loss, write_jsonl

pytestmark = pytest.mark.slow

WINDOW = 512  # Gemma-3-270M's sliding window: 15 of its 18 layers attend to the last 512 keys


@pytest.fixture(scope="module")
def real(gemma3_dir):
    from sft.model.loading import load_tokenizer

    return gemma3_dir, load_tokenizer(GEMMA3[0], gguf_file=GEMMA3[1], stop_tokens=["<end_of_turn>"],
                                      chat_template="sft/model/chat_templates/gemma3.jinja")


def chats() -> list[dict]:
    """Three short chats (one with a system turn, one with a follow-up) and one whose question is long enough that
    its answer is past the sliding window."""
    long_question = " ".join(f"Fact {i}: the {i}th stone of the old wall is grey." for i in range(1, 32))
    return [
        {"messages": [{"role": "user", "content": "What is the capital of France?"},
                      {"role": "assistant", "content": "The capital of France is Paris."}]},
        {"messages": [{"role": "system", "content": "Answer in one sentence."},
                      {"role": "user", "content": "What do bees make?"},
                      {"role": "assistant", "content": "Bees make honey."}]},
        {"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."},
                      {"role": "user", "content": "And 4 + 4?"}, {"role": "assistant", "content": "4 + 4 = 8."}]},
        {"messages": [{"role": "user", "content": long_question + " Which stone is the last one named?"},
                      {"role": "assistant", "content": "The last stone named is number 31, and it is grey."}]},
    ]


def test_the_converted_weights_are_the_gguf_files_own_tensors_dequantized_with_no_quantization_left(real):
    model_dir, _ = real
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "gemma3_text"
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (18, 640, 262144)
    assert config["sliding_window"] == WINDOW and config["layer_types"].count("sliding_attention") == 15
    assert_dequantized(model_dir, GEMMA3[1], [("model.embed_tokens.weight", "token_embd.weight"),
                                              ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"),
                                              ("model.layers.17.self_attn.v_proj.weight", "blk.17.attn_v.weight")])


def test_the_labels_are_each_answer_and_end_of_turn_as_gemma3s_template_renders_the_chat(real, tmp_path):
    """The base model's tokenizer has no template: sft's copy of Gemma-3's renders the chat (the system turn folded into
    the first user turn, answers as `model` turns); every answer and its `<end_of_turn>` trained, nothing else."""
    from sft.data.load import load_sft_datasets
    from sft.data.spec import DataSpec

    _, tokenizer = real
    rows = chats()
    data = load_sft_datasets(DataSpec(train_file=str(write_jsonl(tmp_path / "rows.jsonl", rows)), max_length=1024),
                             tokenizer)
    for row, sequence in zip(rows, data.train):
        rendered = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        assert rendered.startswith("<bos><start_of_turn>user\n") and "<start_of_turn>model\n" in rendered
        assert sequence["input_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        answers = [m["content"] + "<end_of_turn>" for m in row["messages"] if m["role"] == "assistant"]
        assert [tokenizer.decode(run) for run in labelled_runs(sequence["input_ids"], sequence["labels"])] == answers
    assert len(data.train[3]["input_ids"]) > WINDOW + 40  # the long chat's answer lies past the window


@pytest.fixture(scope="module")
def real_batch(real, tmp_path_factory):
    """The four chats tokenised; the model's own loss and gradients on them padded, with transformers' own sdpa
    attention and sliding-window mask; the cross entropy of its own hidden states taken in float64, and its
    gradients (through the same fp32 model); the same weights loaded with sft's sdpa_varlen kernel, which packed rows
    train with."""
    from sft.data.tokens.collator import WeightedDataCollator
    from sft.data.load import load_sft_datasets
    from sft.data.spec import DataSpec
    from sft.model.loading import load_model

    _, tokenizer = real
    rows = write_jsonl(tmp_path_factory.mktemp("real-rows") / "rows.jsonl", chats())
    features = list(load_sft_datasets(DataSpec(train_file=str(rows), max_length=1024), tokenizer).train)
    padded = WeightedDataCollator(tokenizer)(features)
    inputs = {k: padded[k] for k in ("input_ids", "attention_mask", "labels")}
    theirs = load_model(GEMMA3[0], gguf_file=GEMMA3[1], attn_implementation="sdpa")
    theirs.train()
    own = theirs(**inputs).loss
    own_grads = torch.autograd.grad(own, trainable(theirs))
    hidden = theirs(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                    output_hidden_states=True).hidden_states[-1][:, :-1]
    targets = inputs["labels"][:, 1:]
    logits = hidden[targets != -100].double() @ theirs.lm_head.weight.double().T
    exact = torch.nn.functional.cross_entropy(logits, targets[targets != -100])
    exact_grads = [g.float() for g in torch.autograd.grad(exact, trainable(theirs))]
    with torch.no_grad():
        theirs.config.sliding_window = 10**6  # the same rows with full attention everywhere: the window matters
        theirs.config.get_text_config().sliding_window = 10**6
        unwindowed = theirs(**inputs).loss.item()
    del theirs, logits, hidden
    model = load_model(GEMMA3[0], gguf_file=GEMMA3[1], attn_implementation="sdpa_varlen")
    model.train()
    return features, model, own.item(), own_grads, (exact.item(), exact_grads), unwindowed, padded["labels"]


def trainable(model) -> list:
    """The tied embedding (the output layer too), a sliding-window layer's query and the last (global) layer's MLP."""
    return [model.model.embed_tokens.weight, model.model.layers[0].self_attn.q_proj.weight,
            model.model.layers[17].mlp.down_proj.weight]


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("impl", ["naive", "chunked"])
def test_the_loss_at_a_262k_vocabulary_on_the_real_weights_is_the_models_own(real, real_batch, tmp_path, packing, impl):
    """sft's loss and gradients, padded or packed into one row, with the model's own logits or the chunked kernel,
    equal transformers' own loss (sdpa, its sliding-window mask) on the padded batch, and the cross entropy of its
    hidden states in float64.

    At 262,144 logits fp32's own cross entropy drifts: the model's loss is 8e-6 (relative) off the float64 cross
    entropy of its own hidden states, and its gradients 2e-4 to 5e-4 (of their norm) off that loss's gradients
    (measured 2026-12-04). The naive path is the model's own computation (held to 1e-6 and 1e-5 of it, measured: equal);
    the chunked kernel, which sums each token's exponentials in its own pass, is held to the float64 loss: 1e-6 of
    its value and 5e-5 of its gradients (measured 1.3e-7 and 7e-6), and to 2e-5 of the model's own value."""
    _, tokenizer = real
    features, model, own, own_grads, (exact, exact_grads), unwindowed, labels = real_batch
    assert abs(unwindowed - own) > 1e-3 * own  # the long row's answer sees other keys without the window
    ours = sft_loss(model, tokenizer, features, labels, impl, packing, tmp_path)
    grads = torch.autograd.grad(ours, trainable(model))
    if impl == "naive":
        assert ours.item() == pytest.approx(own, rel=1e-6)
        assert all((b - a).norm() <= 1e-5 * a.norm() for a, b in zip(own_grads, grads))
    else:
        assert ours.item() == pytest.approx(exact, rel=1e-6) and ours.item() == pytest.approx(own, rel=2e-5)
        assert all((b - a).norm() <= 5e-5 * a.norm() for a, b in zip(exact_grads, grads))
