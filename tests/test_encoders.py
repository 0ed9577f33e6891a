"""The encoder families (BERT, RoBERTa, XLM-RoBERTa, ModernBERT) against transformers on tiny random checkpoints
loaded through load_model: packed forward rows equal each sequence's last_hidden_state, the EncoderRunner's pooled
vectors ("row" at 0 = CLS, "mean") equal transformers' pooled vectors, and with the head its
*ForSequenceClassification logits. Every weight is perturbed away from its initialisation (LayerNorms off 1,
biases off 0), so a tensor loaded into the wrong place shows. ModernBERT's checkpoint has global and local layers
with a local window shorter than most sequences.

The `family` tests are parametrized over families_verifying("encoder") (test_models_registry.py holds the claim)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from batchrun.engine.contract import PoolingRequest, ScheduledSeq, SchedulerOutput
from batchrun.model.arch.registry import families_verifying
from batchrun.model.layers.varlen_attention import varlen_attention
from batchrun.model.runner.encoder_runner import EncoderRunner
from batchrun.model.weights.loader import load_model

VOCAB = 160
LOCAL_WINDOW = 8
LENGTHS = [1, 5, 13, 30]
COMMON = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=80,
              num_labels=3, initializer_range=0.1)
# family -> (transformers' config class, bare model class, classification class, config overrides)
CHECKPOINTS = {
    "bert": ("BertConfig", "BertModel", "BertForSequenceClassification",
             dict(max_position_embeddings=64, type_vocab_size=2, pad_token_id=0)),
    "roberta": ("RobertaConfig", "RobertaModel", "RobertaForSequenceClassification",
                dict(max_position_embeddings=40, type_vocab_size=1, pad_token_id=1, bos_token_id=0,
                     eos_token_id=2)),
    "xlm_roberta": ("XLMRobertaConfig", "XLMRobertaModel", "XLMRobertaForSequenceClassification",
                    dict(max_position_embeddings=40, type_vocab_size=1, pad_token_id=1, bos_token_id=0,
                         eos_token_id=2, hidden_act="gelu_new")),
    # layers global, local, global; mean pooling in the head
    "modernbert": ("ModernBertConfig", "ModernBertModel", "ModernBertForSequenceClassification",
                   dict(hidden_size=64, num_hidden_layers=3, global_attn_every_n_layers=2,
                        local_attention=LOCAL_WINDOW, classifier_pooling="mean", max_position_embeddings=128,
                        pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3,
                        global_rope_theta=1000.0, local_rope_theta=50.0)),
}
WORDS = ("the a of to and in is it that was for on are with as be at by this had not but from or have an they "
         "which one you were her all she there would their we him been has when who will more no if out so said "
         "what up its about into than them can only other new some could time these two may then do first any "
         "my now such like our over man me even most made after also did many before must through back years "
         "where much your way well down should because each just those people how too little state good very").split()


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    """A WordPiece tokenizer over a small vocabulary (ids below VOCAB)."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    assert len(vocab) <= VOCAB
    file = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    file.write_text("\n".join(vocab) + "\n")
    return transformers.BertTokenizer(vocab_file=str(file))


def perturb_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)


_MADE: dict = {}


def checkpoint(family: str, head: bool, root: Path, tokenizer) -> tuple[Path, torch.nn.Module]:
    """(folder, transformers' model in fp32) of the family's bare or classification checkpoint."""
    key = (family, head)
    if key not in _MADE:
        config_cls, bare, classify, overrides = CHECKPOINTS[family]
        config = getattr(transformers, config_cls)(**{**COMMON, **overrides})
        name = classify if head else bare
        config.architectures = [name]
        torch.manual_seed(0)
        model = getattr(transformers, name)(config).float().eval()
        perturb_(model, 1)
        path = root / f"{family}-{'head' if head else 'bare'}"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        _MADE[key] = (path, model)
    return _MADE[key]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    yield tmp_path_factory.mktemp("encoders")
    _MADE.clear()


@pytest.fixture(scope="module")
def sequences():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def load(path: Path):
    return load_model(str(path), dtype=torch.float32, device=torch.device("cpu"), max_model_len=None)


def base_of(hf: torch.nn.Module) -> torch.nn.Module:
    """The encoder inside a *ForSequenceClassification (the model itself for a bare one)."""
    return getattr(hf, hf.base_model_prefix, hf)


def packed_forward(model, seqs: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + len(s))
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.inference_mode():
        return model(ids, positions, starts), starts


def reference_hidden(hf: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    ids = torch.tensor([seq])
    with torch.inference_mode():
        return base_of(hf)(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]


def assert_rows_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    cos = F.cosine_similarity(ours.double(), ref.double(), dim=-1)
    assert cos.min().item() >= 0.99999, cos.min().item()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def step(seqs: list[list[int]], pooling: list[PoolingRequest]) -> SchedulerOutput:
    scheduled = [ScheduledSeq(seq_id=i, token_ids=s, start=0, block_table=[], sample=False)
                 for i, s in enumerate(seqs)]
    return SchedulerOutput(seqs=scheduled, num_decodes=0, pooling=pooling)


@pytest.mark.parametrize("head", [False, True], ids=["bare", "classify"])
@pytest.mark.parametrize("family", families_verifying("encoder"))
def test_packed_rows_and_pooled_vectors_equal_transformers(family, head, root, word_tokenizer, sequences):
    path, hf = checkpoint(family, head, root, word_tokenizer)
    loaded = load(path)
    model = loaded.model
    assert model.is_encoder and model.has_head == head and model.hidden_size == hf.config.hidden_size
    refs = [reference_hidden(hf, s) for s in sequences]
    hidden, starts = packed_forward(model, sequences)
    for i, ref in enumerate(refs):
        assert_rows_close(hidden[starts[i] : starts[i + 1]], ref)

    # the runner: CLS and mean pooling of every sequence, in one step
    pooling = [PoolingRequest(i, 0, len(s), reduce) for reduce in ("row", "mean") for i, s in enumerate(sequences)]
    pooled = EncoderRunner(model, torch.device("cpu")).execute(step(sequences, pooling)).pooled
    expected = [ref[0] for ref in refs] + [ref.mean(0) for ref in refs]
    assert len(pooled) == len(expected)
    for got, want in zip(pooled, expected):
        assert_rows_close(torch.tensor([got]), want[None])


@pytest.mark.parametrize("family", families_verifying("encoder"))
def test_the_head_gives_transformers_classification_logits(family, root, word_tokenizer, sequences):
    path, hf = checkpoint(family, True, root, word_tokenizer)
    model = load(path).model
    assert model.num_labels == hf.config.num_labels == 3
    pooling_kind = getattr(hf.config, "classifier_pooling", "cls")
    assert model.default_pooling == pooling_kind
    reduce = "row" if pooling_kind == "cls" else "mean"
    pooling = [PoolingRequest(i, 0, len(s), reduce, head=True) for i, s in enumerate(sequences)]
    runner = EncoderRunner(model, torch.device("cpu"))
    pooled = runner.execute(step(sequences, pooling)).pooled
    assert runner.timers.forward_s > 0 and runner.model_time_s >= runner.timers.forward_s
    with torch.inference_mode():
        want = torch.cat([hf(input_ids=torch.tensor([s])).logits for s in sequences])
    got = torch.tensor(pooled)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (want.std(0) > 1e-2).all()  # the sequences' logits differ: the comparison means something


def test_a_bare_checkpoint_defaults_to_cls_and_has_no_head(root, word_tokenizer, sequences):
    path, _ = checkpoint("bert", False, root, word_tokenizer)
    model = load(path).model
    assert model.default_pooling == "cls" and model.classifier is None
    with pytest.raises(ValueError, match="no classification head"):
        EncoderRunner(model, torch.device("cpu")).execute(step(sequences[:1], [PoolingRequest(0, 0, 1, "row", True)]))


def test_the_runner_refuses_a_chunk_that_does_not_start_the_prompt(root, word_tokenizer):
    path, _ = checkpoint("bert", False, root, word_tokenizer)
    runner = EncoderRunner(load(path).model, torch.device("cpu"))
    out = SchedulerOutput(seqs=[ScheduledSeq(0, [5, 6, 7], 4, [], False)], num_decodes=0,
                          pooling=[PoolingRequest(0, 0, 3, "mean")])
    with pytest.raises(ValueError, match="whole prompts"):
        runner.execute(out)


def test_a_pool_over_part_of_a_sequence_and_sum(root, word_tokenizer, sequences):
    path, hf = checkpoint("modernbert", False, root, word_tokenizer)
    model = load(path).model
    seq = sequences[-1]
    ref = reference_hidden(hf, seq)
    pooling = [PoolingRequest(0, 7, 1, "row"), PoolingRequest(0, 4, 10, "mean"), PoolingRequest(0, 4, 10, "sum")]
    pooled = EncoderRunner(model, torch.device("cpu")).execute(step([seq], pooling)).pooled
    for got, want in zip(pooled, [ref[7], ref[4:14].mean(0), ref[4:14].sum(0)]):
        assert_rows_close(torch.tensor([got]), want[None])


def test_roberta_positions_reach_the_last_row_of_the_table(root, word_tokenizer):
    path, hf = checkpoint("roberta", False, root, word_tokenizer)
    loaded = load(path)
    # positions start at padding_idx + 1 = 2: a 40-row table holds 38 positions
    assert loaded.max_model_len == 38
    seq = torch.randint(5, VOCAB, (38,), generator=torch.Generator().manual_seed(5)).tolist()
    hidden, _ = packed_forward(loaded.model, [seq])
    assert_rows_close(hidden, reference_hidden(hf, seq))


@pytest.mark.parametrize("prefix", ["bert.", "model."])
def test_a_prefixed_bert_checkpoint_loads_the_same(prefix, root, word_tokenizer, sequences, tmp_path):
    path, hf = checkpoint("bert", False, root, word_tokenizer)
    tensors = load_file(str(path / "model.safetensors"))
    save_file({prefix + name: t for name, t in tensors.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    word_tokenizer.save_pretrained(tmp_path)
    hidden, starts = packed_forward(load(tmp_path).model, sequences)
    for i, s in enumerate(sequences):
        assert_rows_close(hidden[starts[i] : starts[i + 1]], reference_hidden(hf, s))


def reference_attention(q, k, v, window: int | None) -> torch.Tensor:
    """Softmax over masked scores, one sequence [L, H, D]."""
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / q.shape[-1] ** 0.5
    if window is not None:
        pos = torch.arange(q.shape[0])
        scores = scores.masked_fill((pos[:, None] - pos[None, :]).abs() > window // 2, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("window", [None, 8, 5])
def test_varlen_attention_keeps_sequences_apart_and_windows(window):
    g = torch.Generator().manual_seed(7)
    lengths = [3, 1, 20, 9]
    q, k, v = (torch.randn(sum(lengths), 4, 16, generator=g) for _ in range(3))
    starts = [0, 3, 4, 24, 33]
    out = varlen_attention(q, k, v, starts, window=window)
    for a, b in zip(starts[:-1], starts[1:]):
        torch.testing.assert_close(out[a:b], reference_attention(q[a:b], k[a:b], v[a:b], window),
                                   atol=1e-5, rtol=1e-5)
    if window is not None:  # the window is real: the 20-token sequence differs from its unwindowed attention
        assert not torch.allclose(out[4:24], varlen_attention(q, k, v, starts)[4:24], atol=1e-3)


def sentence_transformers_modules():
    try:
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Normalize, Pooling, Transformer
    return Transformer, Pooling, Normalize


NEEDS_SENTENCE_TRANSFORMERS = pytest.mark.skipif(importlib.util.find_spec("sentence_transformers") is None,
                                                 reason="sentence-transformers not installed")
ST_TEXTS = ["the man said that it was good", "we have been there", "a state of people who may be very little"]


def sentence_transformers_folder(root, word_tokenizer, folder) -> torch.Tensor:
    """The tiny BERT saved as a sentence-transformers model (Transformer, mean Pooling, Normalize) into `folder`;
    its `encode` of ST_TEXTS."""
    from sentence_transformers import SentenceTransformer

    Transformer, Pooling, Normalize = sentence_transformers_modules()
    path, _ = checkpoint("bert", False, root, word_tokenizer)
    encoder = Transformer(str(path))
    st = SentenceTransformer(modules=[encoder, Pooling(encoder.get_embedding_dimension(), "mean"), Normalize()],
                             device="cpu")
    st.save(str(folder))
    return st.encode(ST_TEXTS, convert_to_tensor=True, batch_size=8).float()


@NEEDS_SENTENCE_TRANSFORMERS
def test_a_sentence_transformers_folder_gives_its_normalised_mean_vectors(root, word_tokenizer, tmp_path):
    folder = tmp_path / "st"
    want = sentence_transformers_folder(root, word_tokenizer, folder)
    assert (folder / "modules.json").is_file() and (folder / "config.json").is_file()
    texts = ST_TEXTS

    loaded = load(folder)
    seqs = [loaded.tokenizer(t)["input_ids"] for t in texts]
    pooling = [PoolingRequest(i, 0, len(s), "mean") for i, s in enumerate(seqs)]
    pooled = EncoderRunner(loaded.model, torch.device("cpu")).execute(step(seqs, pooling)).pooled
    got = F.normalize(torch.tensor(pooled), dim=-1)
    assert_rows_close(got, want)


# ---- through LLM: the engine admits whole prompts, pools them, and the API finishes the vectors ----------------
@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_llm_embeds_and_classifies_as_transformers(family, root, word_tokenizer, sequences):
    from batchrun import LLM

    bare_path, bare = checkpoint(family, False, root, word_tokenizer)
    head_path, head = checkpoint(family, True, root, word_tokenizer)
    # a step budget below the prompts' tokens: the scheduler spreads whole prompts over steps
    llm = LLM(str(bare_path), dtype="float32", device="cpu", max_num_batched_tokens=32, max_num_seqs=2)
    prompts = [{"prompt_token_ids": [2, *seq, 3]} for seq in sequences]  # (CLS, SEP: no id a RoBERTa pads with)
    with torch.inference_mode():
        for prompt, out in zip(prompts, llm.embed(prompts, use_tqdm=False)):
            cls = reference_hidden(base_of(bare), prompt["prompt_token_ids"])[0]
            assert F.cosine_similarity(torch.tensor(out.outputs.embedding), cls, dim=0) >= 0.99999
        classifier = LLM(str(head_path), dtype="float32", device="cpu")
        for prompt, out in zip(prompts, classifier.classify(prompts, use_tqdm=False)):
            logits = head(torch.tensor([prompt["prompt_token_ids"]])).logits[0]
            assert torch.allclose(torch.tensor(out.outputs.probs), torch.softmax(logits, -1), atol=1e-5)
    with pytest.raises(ValueError, match="pools only"):
        llm.generate("the man", use_tqdm=False)


@NEEDS_SENTENCE_TRANSFORMERS
def test_llm_embed_equals_sentence_transformers_encode(root, word_tokenizer, tmp_path):
    from batchrun import LLM

    want = sentence_transformers_folder(root, word_tokenizer, tmp_path / "st")
    got = LLM(str(tmp_path / "st"), dtype="float32", device="cpu").embed(ST_TEXTS, use_tqdm=False)
    assert_rows_close(torch.tensor([o.outputs.embedding for o in got]), want)


def test_a_bert_cross_encoder_scores_pairs_with_their_token_types(tmp_path, word_tokenizer):
    """A one-label BertForSequenceClassification (a reranker): the pair's second text is token type 1, as the
    tokenizer marks it for transformers."""
    from batchrun import LLM

    config_cls, _, classify, overrides = CHECKPOINTS["bert"]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides, "num_labels": 1})
    config.architectures = [classify]
    torch.manual_seed(0)
    model = getattr(transformers, classify)(config).float().eval()
    perturb_(model, 2)
    model.save_pretrained(tmp_path)
    word_tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu")
    query, docs = "the man said", ["it was good", "we have been there", "a state of people"]
    scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    tok = llm.get_tokenizer()
    with torch.inference_mode():
        want = [torch.sigmoid(model(**tok(query, d, return_tensors="pt")).logits[0, 0]).item() for d in docs]
        assert all(abs(a - b) < 1e-5 for a, b in zip(scores, want))
        no_types = [torch.sigmoid(model(input_ids=tok(query, d, return_tensors="pt").input_ids).logits[0, 0]).item()
                    for d in docs]
    assert max(abs(a - b) for a, b in zip(want, no_types)) > 1e-4  # the types matter to this model


@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_bf16_embeddings_follow_the_fp32_model(family, root, word_tokenizer, sequences):
    """bf16 through LLM (where oneDNN runs bf16: every linear packed once, GELU and the residual adds in the
    linears' own pass) against transformers' fp32 hidden states, within bf16's rounding."""
    from batchrun import LLM
    from batchrun.model.layers.linear import OneDNNLinear

    path, hf = checkpoint(family, False, root, word_tokenizer)
    llm = LLM(str(path), dtype="bfloat16", device="cpu")
    model = llm.engine.runner.model
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert all(isinstance(m, OneDNNLinear) for layer in model.layers for m in layer.children()
                   if isinstance(m, (torch.nn.Linear, OneDNNLinear)))
    prompts = [{"prompt_token_ids": [2, *seq, 3]} for seq in sequences]
    with torch.inference_mode():
        for prompt, out in zip(prompts, llm.embed(prompts, use_tqdm=False)):
            cls = reference_hidden(hf, prompt["prompt_token_ids"])[0]
            cos = F.cosine_similarity(torch.tensor(out.outputs.embedding).double(), cls.double(), dim=0).item()
            assert cos >= 0.999, cos


@pytest.mark.parametrize("activation", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_a_packed_linear_with_its_activation_or_add_in_its_pass(activation):
    """linear_act / linear_add on a packed bf16 linear: act(linear(x)) and linear(x) + other within bf16 rounding;
    on a plain nn.Linear exactly the unfused ops."""
    from transformers.activations import ACT2FN

    from batchrun.model.layers.linear import OneDNNLinear, linear_act, linear_add

    torch.manual_seed(0)
    plain = torch.nn.Linear(64, 96).to(torch.bfloat16)
    act = ACT2FN[activation]
    x, other = torch.randn(40, 64, dtype=torch.bfloat16), torch.randn(40, 96, dtype=torch.bfloat16)
    assert torch.equal(linear_act(plain, x, activation, act), act(plain(x)))
    assert torch.equal(linear_add(plain, x, other), plain(x) + other)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN runs no bf16 here: the packed linear is not made")
    packed = OneDNNLinear(plain, few_rows_copy=False)
    want = act(F.linear(x.float(), plain.weight.float(), plain.bias.float()))
    torch.testing.assert_close(linear_act(packed, x, activation, act).float(), want, atol=2e-2, rtol=2e-2)
    want = F.linear(x.float(), plain.weight.float(), plain.bias.float()) + other.float()
    torch.testing.assert_close(linear_add(packed, x, other).float(), want, atol=3e-2, rtol=2e-2)
