"""The world's tokenizer: a byte-fallback-free BPE over the world's text, saved as a PreTrainedTokenizerFast.

Words get a leading "▁" (Metaspace, prepended always), so a word is the same token at the start of an
assistant turn and inside a sentence: "red" answers and "a red circle" share the token "▁red".
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from tqdm import tqdm

BOS, EOS, PAD, IMAGE = "<s>", "</s>", "<pad>", "<image>"
USER, ASSISTANT, SYSTEM = "<|user|>", "<|assistant|>", "<|system|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IMAGE, USER, ASSISTANT, SYSTEM]

# Messages may carry a string or a list of parts ({"type": "image"} / {"type": "text", "text": ...}).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{% elif m['role'] == 'assistant' %}<|assistant|>{% else %}<|system|>{% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def format_turns(prompt: str, response: str | None = None, system: str = "") -> str:
    """The chat template applied to one user turn (and optionally the assistant's answer), as plain text; a
    non-empty ``system`` comes first as a system turn."""
    text = f"{BOS}{SYSTEM}{system}{USER}{prompt}{ASSISTANT}" if system else f"{BOS}{USER}{prompt}{ASSISTANT}"
    return text if response is None else text + response + EOS


def format_dialogue(prompt: str, response: str, followups: tuple[tuple[str, str], ...] = (),
                    system: str = "") -> str:
    """The chat template applied to a whole dialogue: the first turn, then each (question, answer) follow-up."""
    return format_turns(prompt, response, system) + "".join(f"{USER}{q}{ASSISTANT}{a}{EOS}" for q, a in followups)


def corpus(n_samples: int, seed: int = 0) -> Iterator[str]:
    from specula.world.suites import SUITES, generate, train_stream

    stream = train_stream(seed=seed)
    for _ in tqdm(range(n_samples), desc="tokenizer corpus", unit="sample", leave=False, mininterval=2.0):
        s = next(stream)
        yield s.prompt.replace(IMAGE, " ")
        yield s.response
    for name in SUITES:  # make sure every suite's phrasing is covered
        for i in range(50):
            s = generate(name, "train", 10_000_000 + i, seed)
            yield s.prompt.replace(IMAGE, " ")
            yield s.response


def train_tokenizer(out_dir: str | Path, vocab_size: int = 1024, n_samples: int = 20_000, seed: int = 0):
    """Train the BPE deterministically and save it with its chat template; returns the fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always"),
        pre_tokenizers.Punctuation(behavior="isolated"),  # "left." -> "▁left" "." so words stay one token
    ])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    alphabet = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?'\"-()+*/=▁"))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet,
                                  show_progress=False, min_frequency=2)
    tok.train_from_iterator(corpus(n_samples, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        extra_special_tokens={"image_token": IMAGE}, additional_special_tokens=[IMAGE, USER, ASSISTANT, SYSTEM],
        model_max_length=4096, padding_side="right",
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast
