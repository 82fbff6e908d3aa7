"""`StreamPieces`: a plain token adds its piece after any non-empty text, so the detokenizer's fast
path streams exactly what decoding the window gives, for sentencepiece (byte fallback, Strip,
Metaspace) and byte-level BPE decoders alike; decoders that join tokens otherwise get no pieces."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from harness.byte_tokens import BYTE_ID_OFFSET, byte_ids
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

from npuserve.scheduler.text.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from npuserve.scheduler.text.stream_pieces import has_fixed_pieces, has_known_bytes
from npuserve.scheduler.text.tokenizer import Tokenizer

REPLACE_SPACE = {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}
REPLACE_FFFD = {"type": "Replace", "pattern": {"String": "\ufffd"}, "content": "?"}
STRIP = {"type": "Strip", "content": " ", "start": 1, "stop": 0}
STRIP_E = {"type": "Strip", "content": "é", "start": 1, "stop": 0}
TEXTS = [
    'Once upon a time there was a little girl named Lily. She said: "Hi!"\n\n',
    "Ünïcödé tëxt, 東京 and emoji 😀🎉 too; naïve café 한국어 Жж €5.",
]


def byte_level_bpe() -> Tokenizer:
    """GPT-2 style: tokens are bytes, some of them parts of a character; one added special token."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|end|>"]
    )
    backend.train_from_iterator(TEXTS * 10, trainer)
    return Tokenizer(backend, name="byte-level", special_tokens={"eos_token": "<|end|>"})


def metaspace_byte_fallback() -> Tokenizer:
    """A sentencepiece unigram with byte fallback decoded by Metaspace (the first token loses its '▁')."""
    backend = BackendTokenizer(models.Unigram())
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=150, unk_token="<unk>", special_tokens=["<unk>", "</s>"])
    backend.train_from_iterator(TEXTS * 10, trainer)
    data = json.loads(backend.to_str())
    data["model"]["byte_fallback"] = True
    data["model"]["vocab"] += [[f"<0x{b:02X}>", -20.0] for b in range(256)]
    backend = BackendTokenizer.from_str(json.dumps(data))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    backend.add_tokens([AddedToken("▁added", special=False)])
    return Tokenizer(backend, name="metaspace", special_tokens={"unk_token": "<unk>", "eos_token": "</s>"})


@pytest.fixture(scope="module", params=["demo", "byte-level", "metaspace"])
def tok(request: pytest.FixtureRequest, stories_dir: Path) -> Tokenizer:
    if request.param == "demo":
        return Tokenizer.from_pretrained(stories_dir)
    return byte_level_bpe() if request.param == "byte-level" else metaspace_byte_fallback()


class DecodeOnly:
    """The tokenizer without its pieces: the detokenizer decodes every token."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def random_ids(rng: random.Random, tok: Tokenizer, length: int) -> list[int]:
    """Text's ids (pieces, whole characters as bytes) mixed with any ids at all (partial characters,
    stray bytes, special and added tokens)."""
    ids: list[int] = []
    while len(ids) < length:
        if rng.random() < 0.7:
            text = rng.choice(TEXTS)
            start = rng.randrange(len(text))
            ids += tok.encode(text[start : start + rng.randint(1, 12)], add_special_tokens=False)
        else:
            ids.append(rng.randrange(tok.vocab_size))
    return ids


def chunks_of(rng: random.Random, ids: list[int]) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 1, 2, 3, 16])  # 16: a multi-step update's
        chunks.append(ids[i : i + n])
        i += n
    return chunks


def streamed(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> tuple[list[DetokenizerUpdate], str]:
    return [detok.update(chunk) for chunk in chunks], detok.flush()


def test_fast_path_streams_what_decoding_does(tok: Tokenizer) -> None:
    assert tok.stream_pieces is not None
    rng = random.Random(0)
    for trial in range(40):
        prompt = random_ids(rng, tok, rng.choice([0, 1, 3, 20]))
        ids = random_ids(rng, tok, 150)
        chunks = chunks_of(rng, ids)
        full = tok.decode(ids)
        stop = [full[len(full) // 2 : len(full) // 2 + 3]] if trial % 3 == 0 and len(full) > 8 else []
        options: dict[str, Any] = {
            "skip_special_tokens": trial % 2 == 0,
            "stop": stop,
            "include_stop_str_in_output": trial % 4 == 0,
        }
        fast = streamed(IncrementalDetokenizer(tok, prompt, **options), chunks)
        slow = streamed(IncrementalDetokenizer(DecodeOnly(tok), prompt, **options), chunks)  # type: ignore[arg-type]
        assert fast == slow, f"trial {trial}"


def test_pieces_follow_any_whole_text(tok: Tokenizer) -> None:
    """After text that is non-empty and ends on a whole character, decode(ids + [t]) is
    decode(ids) + piece(t), or ends in U+FFFD for a non-ASCII byte."""
    pieces = tok.stream_pieces
    assert pieces is not None
    rng = random.Random(1)
    known = [t for t in range(tok.vocab_size) if pieces[t] is not None]
    assert len(known) > 40
    checked = 0
    for _ in range(400):
        ids = random_ids(rng, tok, rng.randint(1, 6))
        skip = rng.random() < 0.5
        text = tok.decode(ids, skip_special_tokens=skip)
        if not text or text.endswith("\ufffd"):
            continue
        token = rng.choice(known)
        after = tok.decode([*ids, token], skip_special_tokens=skip)
        if isinstance(pieces[token], int):  # a byte: the text ends inside a character, or bad
            assert after.endswith("\ufffd")
        else:
            piece, alone = pieces[token]  # type: ignore[misc]
            assert after == text + piece
            assert alone == tok.decode([token])
        checked += 1
    assert checked > 200


def test_pieces_of_the_demo_model(stories_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(stories_dir)
    pieces = tok.stream_pieces
    assert pieces is not None
    for token_id in (0, 1, 2, tok.vocab_size):  # special, outside the vocabulary
        assert pieces[token_id] is None
    assert tok.vocab_size not in pieces  # ids outside the vocabulary are not kept
    assert pieces[tok.encode("time", add_special_tokens=False)[0]] == (" time", "time")
    emoji = tok.encode("😀", add_special_tokens=False)[-4:]
    assert tok.convert_ids_to_tokens(emoji[:1]) == ["<0xF0>"]
    assert [pieces[byte] for byte in emoji] == list("😀".encode())  # held until the character is whole
    assert pieces[BYTE_ID_OFFSET + ord("A")] == ("A", "A")
    assert pieces[BYTE_ID_OFFSET + ord(" ")] == (" ", "")  # alone, the leading space is stripped


def test_bytes_of_other_decoders_are_decoded() -> None:
    """Metaspace after ByteFallback: byte tokens have no pieces (the detokenizer decodes them)."""
    tok = metaspace_byte_fallback()
    pieces = tok.stream_pieces
    assert pieces is not None
    first_byte = tok.vocab_size - 257
    assert tok.convert_ids_to_tokens([first_byte, first_byte + 255]) == ["<0x00>", "<0xFF>"]
    assert all(pieces[t] is None for t in range(first_byte, first_byte + 256))


@pytest.mark.parametrize(
    ("decoder", "known"),
    [
        ({"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]}, True),
        ({"type": "Sequence", "decoders": [REPLACE_SPACE, {"type": "ByteFallback"}, {"type": "Fuse"}, STRIP]}, True),
        ({"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Metaspace"}]}, False),
        ({"type": "Sequence", "decoders": [{"type": "ByteFallback"}, REPLACE_SPACE, {"type": "Fuse"}]}, False),
        ({"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}, REPLACE_FFFD]}, False),
        ({"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}, STRIP_E]}, False),
        ({"type": "ByteLevel"}, False),
    ],
)  # fmt: skip
def test_which_decoders_know_bytes(decoder: dict[str, Any], known: bool) -> None:
    assert has_fixed_pieces(decoder)
    assert has_known_bytes(decoder) == known


@pytest.mark.parametrize(
    "decoder",
    [
        None,  # tokens joined with spaces
        {"type": "WordPiece", "prefix": "##", "cleanup": True},
        {"type": "Sequence", "decoders": [{"type": "Fuse"}, {"type": "Replace", "pattern": {"String": "ab"}, "content": "x"}]},
        {"type": "Sequence", "decoders": [{"type": "ByteLevel"}, {"type": "Strip", "content": " ", "start": 0, "stop": 1}]},
        {"type": "Sequence", "decoders": [{"type": "Fuse"}, {"type": "ByteFallback"}]},
        {"type": "Sequence", "decoders": [{"type": "Fuse"}, {"type": "Metaspace"}]},
    ],
)  # fmt: skip
def test_decoders_that_reach_across_tokens_have_no_pieces(decoder: dict[str, Any] | None) -> None:
    assert not has_fixed_pieces(decoder)


def test_cleanup_of_spaces_has_no_pieces() -> None:
    """The cleanup (" ." -> ".") of a non-BPE tokenizer reaches across tokens."""
    backend = BackendTokenizer(models.WordPiece({"[UNK]": 0, "a": 1, ".": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.Fuse()
    assert Tokenizer(backend, name="w", special_tokens={}).stream_pieces is not None
    cleaned = Tokenizer(backend, name="w", special_tokens={}, clean_up_tokenization_spaces=True)
    assert cleaned.stream_pieces is None


@pytest.mark.parametrize("byte_share", [0.5, 0.9])
def test_runs_of_bytes_stream_what_decoding_does(stories_dir: Path, byte_share: float) -> None:
    """Any ids at all, most of them byte tokens (stray, partial and invalid runs, ASCII bytes inside
    runs, specials between them): holding byte runs streams what decoding the window does."""
    tok = Tokenizer.from_pretrained(stories_dir)
    pieces = tok.stream_pieces
    assert pieces is not None and len(pieces.ascii_bytes) == 128
    rng = random.Random(7)
    for trial in range(60):
        ids = [
            rng.randrange(BYTE_ID_OFFSET, BYTE_ID_OFFSET + 256)
            if rng.random() < byte_share
            else rng.randrange(tok.vocab_size)
            for _ in range(120)
        ]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.choice([0, 1, 7]))]
        chunks = chunks_of(rng, ids)
        options: dict[str, Any] = {"skip_special_tokens": trial % 2 == 0}
        fast = streamed(IncrementalDetokenizer(tok, prompt, **options), chunks)
        slow = streamed(IncrementalDetokenizer(DecodeOnly(tok), prompt, **options), chunks)  # type: ignore[arg-type]
        assert fast == slow, f"trial {trial}"


def test_a_held_run_is_streamed_without_decoding(stories_dir: Path) -> None:
    """After a plain token, an invalid run of bytes and the plain token after it come out as one
    U+FFFD per byte and that token's piece, and a run that becomes a character as the character,
    with no decoding at all."""
    tok = Tokenizer.from_pretrained(stories_dir)
    the = tok.encode("the", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Once upon a time", add_special_tokens=False))
    calls = 0
    decode = tok.decode

    def counted(ids: list[int], skip_special_tokens: bool = True) -> str:
        nonlocal calls
        calls += 1
        return decode(ids, skip_special_tokens=skip_special_tokens)

    detok.tokenizer.decode = counted  # type: ignore[method-assign]
    stray = [BYTE_ID_OFFSET + b for b in (0xE4, 0x41, 0x80)]  # a lead byte, 'A', a stray byte
    texts = [detok.update([i]).text for i in the + stray + the + byte_ids("中") + byte_ids("😀")]
    assert texts == [" the", "", "", "", "\ufffd" * 3 + " the", "", "", "中", "", "", "", "😀"]
    assert calls == 0
