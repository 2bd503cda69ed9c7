"""The ingress Detokenizer: however the verifier chunks the tokens (one per step, or accepted blocks of any size),
the text sent is the text of plain decoding, ``tokenizer.decode(all tokens)``; a speculative answer's text may not
depend on where its blocks fell."""

from __future__ import annotations

import random

import pytest

from specula.runtime.serve.ingress import Detokenizer
from specula.targets.processor import load_processor


def _stream(tok, tokens, sizes) -> str:
    d, text, i = Detokenizer(tok), "", 0
    for k, n in enumerate(sizes):
        part = tokens[i:i + n]
        i += n
        last = i >= len(tokens)
        out = d.add({"tokens": part, "finished": last, "finish_reason": "length" if last else None})
        text += out["text"]
        if last:
            break
    return text


def _chunkings(n: int, rng: random.Random) -> list[list[int]]:
    return [[1] * n, [n]] + [[rng.randint(1, 4) for _ in range(n)] for _ in range(8)]


@pytest.mark.parametrize("layout", ["llava15_dir", "qwen25vl_dir"])
def test_streamed_text_is_plain_decodings_whatever_the_chunks(layout, request):
    tok = load_processor(request.getfixturevalue(layout)).tokenizer
    rng = random.Random(0)
    vocab = [i for i in range(len(tok)) if i not in tok.all_special_ids]
    byte_ids = [i for i in vocab if (tok.convert_ids_to_tokens(i) or "").startswith("<0x")]
    seqs = [[rng.choice(vocab) for _ in range(24)] for _ in range(20)]
    if byte_ids:  # runs of byte-fallback tokens, valid and invalid UTF-8 (what a random LLaVA emits)
        word = tok("hit the star", add_special_tokens=False)["input_ids"]
        b = {tok.convert_ids_to_tokens(i): i for i in byte_ids}
        seqs.append([b["<0x75>"], b["<0x03>"], b["<0xCC>"], b["<0x68>"], *word])
        seqs.append([*word, b["<0xE2>"], b["<0x82>"], b["<0xAC>"], *word, b["<0xE2>"], b["<0x82>"]])
        seqs += [[rng.choice(byte_ids + vocab[:8]) for _ in range(24)] for _ in range(10)]
    for seq in seqs:
        want = tok.decode(seq, skip_special_tokens=True)
        for sizes in _chunkings(len(seq), rng):
            assert _stream(tok, seq, sizes) == want, (seq, sizes)
