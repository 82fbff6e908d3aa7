"""`prompt_size_bound`: the fewest tokens a text can become never exceeds what the tokenizer makes of
it (so a prompt that fits is never refused), it is tight for runs of the longest token, and
pipelines that may drop text without bound have none."""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from npuserve.scheduler.text.prompt_bound import COMPOSE_SHRINK, PromptSizeBound, prompt_size_bound
from npuserve.scheduler.text.tokenizer import Tokenizer

CORPUS = [
    "Once upon a time there was a little girl named Lily.",
    "She loved to play outside in the park with her friends.",
    "Ünïcödé tëxt, 東京 and emoji 😀😀 too.",
] * 20


def adversarial_texts(longest: str) -> list[str]:
    rng = random.Random(0)
    alphabet = "ab cdé東😀\n\t  .,!"
    texts = [
        longest * 50,
        " " * 3000,
        "a" + " " * 5000 + "b",
        "😀" * 300,
        "\u1100\u1161\u11a8" * 200,  # Hangul jamo that NFC composes three to one
        "e\u0301" * 300,
        *CORPUS,
    ]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400))) for _ in range(200)]
    return texts


def byte_level_bpe() -> BackendTokenizer:
    tok = BackendTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def sentencepiece_like_unigram() -> BackendTokenizer:
    tok = BackendTokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=120, unk_token="<unk>", special_tokens=["<unk>"])
    tok.train_from_iterator(CORPUS, trainer)
    data = json.loads(tok.to_str())
    data["model"]["byte_fallback"] = True
    data["model"]["vocab"] += [[f"<0x{b:02X}>", -20.0] for b in range(256)]
    return BackendTokenizer.from_str(json.dumps(data))


def check_never_above(backend: BackendTokenizer, bound: PromptSizeBound) -> None:
    longest = max(backend.get_vocab(), key=len)
    for text in adversarial_texts(longest):
        tokens = len(backend.encode(text, add_special_tokens=False).ids)
        assert bound.min_tokens(text) <= tokens, (text[:40], bound, tokens)


def test_demo_model_bound_never_refuses_a_prompt_that_fits(stories_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(stories_dir)
    bound = tok.size_bound
    assert bound is not None and bound.uncounted == " "  # its normalizer collapses runs of spaces
    check_never_above(BackendTokenizer.from_file(str(stories_dir / "tokenizer.json")), bound)


@pytest.mark.parametrize("make", [byte_level_bpe, sentencepiece_like_unigram])
def test_trained_tokenizers_bound_never_refuses_a_prompt_that_fits(make: Any) -> None:
    backend = make()
    bound = prompt_size_bound(json.loads(backend.to_str()))
    assert bound is not None
    check_never_above(backend, bound)


def test_bound_is_tight_for_runs_of_the_longest_token() -> None:
    tok = BackendTokenizer(models.BPE(vocab={"a": 0, "aa": 1, "aaaa": 2}, merges=[("a", "a"), ("aa", "aa")]))
    bound = prompt_size_bound(json.loads(tok.to_str()))
    assert bound == PromptSizeBound(chars_per_token=4)
    assert bound.min_tokens("a" * 400) == len(tok.encode("a" * 400).ids) == 100


def test_compose_shrink_is_the_longest_canonical_decomposition() -> None:
    longest = max(
        len(unicodedata.normalize("NFD", chr(c))) for c in range(0x110000) if not 0xD800 <= c < 0xE000
    )
    assert longest == COMPOSE_SHRINK


def pipeline(**parts: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "normalizer": None,
        "pre_tokenizer": None,
        "added_tokens": [],
        "model": {"type": "BPE", "vocab": {"a": 0}, "fuse_unk": False, "byte_fallback": False},
    }
    return {**base, **parts}


@pytest.mark.parametrize(
    "tokenizer_json",
    [
        pipeline(pre_tokenizer={"type": "Whitespace"}),
        pipeline(pre_tokenizer={"type": "Split", "pattern": {"String": "x"}, "behavior": "Removed"}),
        pipeline(normalizer={"type": "BertNormalizer"}),
        pipeline(normalizer={"type": "Strip", "strip_left": True, "strip_right": True}),
        pipeline(normalizer={"type": "Replace", "pattern": {"Regex": "[a-z]+"}, "content": ""}),
        pipeline(model={"type": "BPE", "vocab": {"a": 0}, "fuse_unk": True, "byte_fallback": False}),
        pipeline(model={"type": "WordPiece", "vocab": {"a": 0}}),
        pipeline(model={"type": "Unigram", "vocab": [["a", 0.0]], "byte_fallback": False}),
        pipeline(added_tokens=[{"content": "<x>", "lstrip": True, "rstrip": False}]),
    ],
)
def test_pipelines_that_may_drop_text_have_no_bound(tokenizer_json: dict[str, Any]) -> None:
    assert prompt_size_bound(tokenizer_json) is None


def test_replacements_shrink_the_bound() -> None:
    replace = {"type": "Replace", "pattern": {"String": "abc"}, "content": "x"}
    composed = {"type": "Sequence", "normalizers": [replace, {"type": "NFC"}]}
    assert prompt_size_bound(pipeline(normalizer=composed)) == PromptSizeBound(
        chars_per_token=3 * COMPOSE_SHRINK
    )
    drop_tabs = {"type": "Replace", "pattern": {"String": "\t"}, "content": ""}
    assert prompt_size_bound(pipeline(normalizer=drop_tabs)) == PromptSizeBound(1, uncounted="\t")
