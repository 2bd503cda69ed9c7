"""``text_lm`` with any HF causal LM (the draft-model method): Llama, Qwen2 and Mistral drafters saved with
``save_pretrained`` beside a tokenizer that is the target's, a prefix of it, or a different one.

The drafters are the tiny target's own language model copied into each architecture (Qwen2's q/k/v biases zero,
Mistral's sliding window shorter than the prompts), so greedy drafts on text-only prompts are the target's. Three
vocabularies: ``same`` (985 rows, the target's tokenizer), ``prefix`` (a target of 992 whose tokenizer adds 7
tokens after the drafter's 985, as LLaVA's 32,064 over Llama's 32,000; the extra tokens are made likely, so the
target emits them and its law has mass on them) and ``padded`` (1,000 rows over the target's 985 tokens, as
Qwen2.5-0.5B's 151,936 over its 151,665). Greedy output must equal plain decoding, q must be 0 on every id the
drafter lacks, and sampled output must follow the exact law (``tests/runtime/distribution_check.py``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from drafter_kit import assert_equals_plain, eos, lively_target, plain, world_requests
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig, Qwen2Config

from specula.drafters import DraftContext, create
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.engine.loop import SpecEngine
from specula.targets import load_target
from specula.targets.processor import load_processor
from specula.zoo.store import TOKENIZER_DIR

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # the shared distribution check
from distribution_check import chi2_test, exact_law, sample_first_tokens  # noqa: E402

ARCHS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
EXTRA = 7  # tokens the wide target's tokenizer adds after the drafter's
PADDED_ROWS = 1000
PARAMS = SamplingParams(temperature=1.0, top_k=4)
ALPHA = 1e-4


def _wide_target(tok, processor, scale: float = 1.2):
    """The lively target over ``tok`` (985 + EXTRA tokens), its head untied and the extra rows copies (x ``scale``)
    of the rows of the tokens likeliest at positions 2 and 3 after the text prompt the sampled test uses, so the
    target often emits the extra tokens exactly where drafts are verified."""
    model = lively_target(SimpleNamespace(tokenizer=tok))
    base = world_requests(processor, 1, SamplingParams(), suites=["text"])[0]
    law = exact_law(model, base, PARAMS, 3)
    later = torch.zeros(len(tok), dtype=torch.float64)  # [V] marginal mass at positions 2 and 3
    for j in (1, 2):
        later.index_add_(0, law.cells[:, j], law.probs)
    later[len(tok) - EXTRA:] = 0
    common = later.topk(EXTRA).indices  # [EXTRA]
    head = model.lm_head.weight.detach().clone()  # [V, H]
    head[len(tok) - EXTRA:] = head[common] * scale
    model.lm_head.weight = torch.nn.Parameter(head)
    model.config.tie_word_embeddings = model.config.text_config.tie_word_embeddings = False
    return model


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    processor = load_processor(TOKENIZER_DIR)
    tok = processor.tokenizer
    wide_tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR, local_files_only=True)
    wide_tok.add_tokens([f"<extra_{i}>" for i in range(EXTRA)])
    assert len(wide_tok) == len(tok) + EXTRA
    root = tmp_path_factory.mktemp("any_lm")
    return {"processor": processor, "tok": tok, "wide_tok": wide_tok, "root": root,
            "target": lively_target(processor), "wide": _wide_target(wide_tok, processor)}


def causal_lm(target, arch: str, rows: int):
    """The target's language model as an ``arch`` causal LM with ``rows`` embedding / head rows: the target's
    first rows, then (rows past the target's) random ones."""
    t = target.config.text_config
    lm = target.model.language_model
    cfg = ARCHS[arch](vocab_size=rows, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                      num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
                      num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, rms_norm_eps=t.rms_norm_eps,
                      max_position_embeddings=t.max_position_embeddings, rope_parameters=dict(t.rope_parameters),
                      tie_word_embeddings=False, bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id,
                      pad_token_id=t.pad_token_id, **({"sliding_window": 16} if arch == "mistral" else {}))
    model = AutoModelForCausalLM.from_config(cfg).eval()
    g = torch.Generator().manual_seed(7)
    state = {k: v for k, v in lm.state_dict().items() if k != "embed_tokens.weight"}
    with torch.no_grad():
        missing = model.model.load_state_dict(state, strict=False).missing_keys
        assert all(k == "embed_tokens.weight" or k.endswith("_proj.bias") for k in missing), missing
        for k in missing:
            if k.endswith("bias"):
                model.model.get_parameter(k).zero_()
        n = min(rows, lm.embed_tokens.weight.shape[0])
        for dst, src in ((model.model.embed_tokens.weight, lm.embed_tokens.weight),
                         (model.lm_head.weight, target.lm_head.weight)):
            dst.normal_(0, 0.3, generator=g)
            dst[:n] = src[:n]
    return model


def save_drafter(kit, name: str, arch: str, rows: int, target: str = "target", tok: str = "tok") -> Path:
    d = kit["root"] / name
    if not d.exists():
        causal_lm(kit[target], arch, rows).save_pretrained(d)
        kit[tok].save_pretrained(d)
    return d


CASES = {  # case -> (target, drafter rows, the drafter's tokenizer)
    "same": ("target", 985, "tok"),
    "prefix": ("wide", 985, "tok"),
    "padded": ("target", PADDED_ROWS, "tok"),
}


def case_drafter(kit, arch: str, case: str, **opts):
    target_name, rows, tok = CASES[case]
    d = save_drafter(kit, f"{arch}-{case}", arch, rows, target_name, tok)
    target = load_target(kit[target_name])
    tokenizer = kit["wide_tok"] if target_name == "wide" else kit["tok"]
    return target, create({"kind": "text_lm", "path": str(d), **opts}, target=target, tokenizer=tokenizer)


# ---------------------------------------------------------------------------------------------- loading, greedy


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_equals_plain_decoding(kit, arch, case):
    """Any architecture, any of the three vocabularies: the output is plain decoding's, and drafts are accepted."""
    target_name = CASES[case][0]
    reqs = world_requests(kit["processor"], 4, SamplingParams(max_tokens=16))
    ref = plain(kit, target_name, reqs, 4)
    target, d = case_drafter(kit, arch, case, structure="tree" if arch == "qwen2" else "chain",
                             branching=[2, 1, 1])
    assert type(d.model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                      "mistral": "MistralForCausalLM"}[arch]
    assert d._lean == (arch != "qwen2")  # Qwen2's q/k/v biases: the stock forward
    assert (d.vocab_size, d.vocab.shared) == (kit[target_name].config.text_config.vocab_size, 985)
    t = assert_equals_plain(SpecEngine(target, d, gamma=4, eos_token_ids=eos(kit)), reqs, ref, 4)
    assert t.accepted > 0
    if case == "prefix":  # the target emitted tokens the drafter lacks, which it was fed as its substitute
        assert any(x >= 985 for r in ref.values() for x in r.tokens)


def test_lean_and_stock_forward_agree_on_mistral(kit):
    """Mistral runs the lean Llama forward: its drafts and q equal the stock forward's (sampled, tree)."""
    reqs = world_requests(kit["processor"], 2, SamplingParams(), suites=["text"])
    props = []
    for lean in (True, False):
        _, d = case_drafter(kit, "mistral", "same", lean=lean, structure="tree", branching=[2, 2], quantize="none")
        d.begin([DraftContext(r.request_id, r.input_ids, first_token=9, temperature=1.0, seed=i)
                 for i, r in enumerate(reqs)])
        props.append(d.propose(["r0", "r1"], gamma=2))
    assert props[0].tokens.tolist() == props[1].tokens.tolist()
    torch.testing.assert_close(props[0].q, props[1].q, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------- the vocabulary rule


@torch.no_grad()
def _ref_q(model, ids: list[int], shared: int, width: int, image: int) -> torch.Tensor:
    """q by a full forward over ``ids``: the first ``shared`` logits renormalised, zero up to ``width``: [width]."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, -1, :shared].float()
    logits[image] = float("-inf")
    return torch.cat([torch.softmax(logits, -1), torch.zeros(width - shared)])


@pytest.mark.parametrize("case", ["prefix", "padded"])
def test_q_is_zero_on_ids_the_drafter_lacks(kit, case):
    """Prefix: q [B, N, 992] is 0 on ids 985.. and the target's ids past the drafter's are fed as its substitute
    (a prompt holding them drafts as one holding the substitute). Padded: q [B, N, 985] is the drafter's softmax
    over the target's 985 ids, renormalised, its 15 padded rows cut. Either way q is the law the drafts came from."""
    target, d = case_drafter(kit, "qwen2", case)
    width = target.info.vocab_size
    image = target.info.image_token_id
    base = world_requests(kit["processor"], 1, SamplingParams(), suites=["text"])[0].input_ids
    prompt = torch.cat([base, torch.tensor([990, 3, 986])]) if case == "prefix" else base
    d.begin([DraftContext("r0", prompt, first_token=12, temperature=1.0, seed=0)])
    prop = d.propose(["r0"], gamma=3)
    n = prop.counts[0]
    assert prop.q.shape == (1, 3, width) and n == 3
    assert (prop.q[0, :n, 985:] == 0).all() and (prop.tokens[0, :n] < 985).all()
    torch.testing.assert_close(prop.q[0, :n].sum(-1), torch.ones(n))
    fed = [t if t < 985 else d.vocab.substitute for t in prompt.tolist() if t != image] + [12]
    ref = _ref_q(d.model, fed, 985, width, image)
    torch.testing.assert_close(prop.q[0, 0], ref, atol=1e-5, rtol=0)
    if case == "prefix":
        assert d.context("r0")[-3:] == [990, 986, 12]  # the committed context keeps the target's ids
        # the served path knows the target's vocabulary only by size: the same q width
        alone = create({"kind": "text_lm", "path": str(kit["root"] / "qwen2-prefix"), "vocab_size": width,
                        "image_token_id": image})
        assert alone.vocab_size == width and alone.vocab.shared == 985


def _tokenizer_dir(kit, name: str, edit) -> Path:
    """The target's tokenizer saved to ``name`` with ``edit`` applied to its tokenizer.json dict."""
    d = kit["root"] / name
    kit["tok"].save_pretrained(d)
    j = json.loads((d / "tokenizer.json").read_text())
    edit(j)
    (d / "tokenizer.json").write_text(json.dumps(j))
    return d


def test_a_different_tokenizer_is_refused(kit):
    """Refused, saying what differs: a token at another id, more tokens than the target has, the same tokens split
    differently, or (no tokenizer saved) a different size."""
    lm = save_drafter(kit, "llama-same", "llama", 985)
    target = load_target(kit["target"])

    def swap(j):
        v = j["model"]["vocab"]
        v["."], v["/"] = v["/"], v["."]

    def no_merges(j):
        j["model"]["merges"] = []

    def refused(tok_dir, match, target=target, tokenizer=None):
        d = kit["root"] / f"lm-{Path(tok_dir).name}"
        if not d.exists():
            d.mkdir()
            for f in lm.iterdir():
                if f.name.startswith(("config", "generation", "model")):
                    (d / f.name).write_bytes(f.read_bytes())
            for f in Path(tok_dir).iterdir():
                (d / f.name).write_bytes(f.read_bytes())
        with pytest.raises(ValueError, match=match) as e:
            create({"kind": "text_lm", "path": str(d)}, target=target, tokenizer=tokenizer or kit["tok"])
        return str(e.value)

    msg = refused(_tokenizer_dir(kit, "swapped", swap), "token 16")
    assert "token 16 is '/' in the drafter's tokenizer but '.' in the target's (2 ids differ)" in msg
    msg = refused(_tokenizer_dir(kit, "unmerged", no_merges), "split text differently")
    wide_dir = kit["root"] / "wide_tok"
    kit["wide_tok"].save_pretrained(wide_dir)
    msg = refused(wide_dir, "992 tokens, the target's 985")
    assert "'<extra_0>'" in msg
    # only sizes to compare: a model instance of another size, or a tokenizer larger than the target's vocabulary
    small = causal_lm(kit["target"], "qwen2", 900)
    with pytest.raises(ValueError, match="drafter vocabulary 900 != target's 985.*no tokenizer"):
        create({"kind": "text_lm", "model": small}, target=target, tokenizer=kit["tok"])
    d = kit["root"] / "lm-wide_tok"
    with pytest.raises(ValueError, match="992 tokens, more than the target's vocabulary of 985"):
        create({"kind": "text_lm", "path": str(d), "vocab_size": 985, "image_token_id": 3})
    with pytest.raises(ValueError, match="vocab_size 992 != the target's vocabulary 985"):
        create({"kind": "text_lm", "path": str(lm), "vocab_size": 992}, target=target)
    # the target's own tokenizer loads
    assert create({"kind": "text_lm", "path": str(lm)}, target=target, tokenizer=kit["tok"]).vocab.identity


# ---------------------------------------------------------------------------------------------- sampled output


@pytest.fixture(scope="module")
def law_kit(kit):
    base = world_requests(kit["processor"], 1, SamplingParams(), suites=["text"])[0]
    return {"base": base, "laws": {}}


@pytest.mark.statistical
@pytest.mark.parametrize("arch, case", [("qwen2", "prefix"), ("mistral", "padded")])
def test_sampled_output_follows_the_exact_law(kit, law_kit, arch, case):
    """The first 3 tokens of n sampled requests (T = 1, top_k 4) against the exact joint law of plain sampling.
    Prefix: the law has mass on tokens the drafter lacks (q = 0 there), which only the verifier's residual emits;
    padded: q is the drafter's renormalised over the target's ids. Drafts are accepted and rejected often."""
    target_name = CASES[case][0]
    model, base = kit[target_name], law_kit["base"]
    if target_name not in law_kit["laws"]:
        law_kit["laws"][target_name] = exact_law(model, base, PARAMS, 3)
    law = law_kit["laws"][target_name]
    if case == "prefix":  # the law's support holds ids the drafter lacks, at drafted positions
        assert (law.cells[:, 1:] >= 985).any()
    n = 4096
    _, d = case_drafter(kit, arch, case, seed=3)
    run = sample_first_tokens(model, d, base, PARAMS, n, 3, seed0=500_000, gamma=2, max_tokens=4)
    result = chi2_test(run.tokens, law)
    emitted = float((run.tokens[:, 1:] >= 985).float().mean())
    print(f"{arch}/{case}: p={result.p_value:.3g} stat={result.stat:.1f} df={result.df} accepted={run.accepted} "
          f"rejected={run.rejected} ids>=985 {emitted:.3f}")
    assert run.accepted >= n // 10 and run.rejected >= n // 10, (run.accepted, run.rejected)
    assert result.p_value > ALPHA, result
