"""`IncrementalDetokenizer`: streamed text equals one-shot decoding, and stop strings never leak.

The reference for decoding is transformers' `decode` of the whole output. Id streams mix sentencepiece
pieces ('▁the', 'he'), byte-fallback ids (3..258) forming multi-byte characters, and special tokens.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from harness.byte_tokens import BYTE_ID_OFFSET, byte_ids

from npuserve.scheduler.text.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from npuserve.scheduler.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

MULTIBYTE_CHARS = "😀🎉👍é中文字ß한Ж€\n"


@pytest.fixture(scope="module")
def tok(stories_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(stories_dir)


@pytest.fixture(scope="module")
def hf(stories_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(stories_dir)


def random_stream(rng: random.Random, length: int, specials: bool = True) -> list[int]:
    """Ids of a plausible output: pieces, whole characters as byte-fallback ids, some special ids."""
    ids: list[int] = []
    while len(ids) < length:
        kind = rng.random()
        if kind < 0.6:
            ids.append(rng.randrange(259, 512))
        elif kind < 0.9:
            ids += byte_ids(rng.choice(MULTIBYTE_CHARS))
        elif specials:
            ids.append(rng.choice([0, 1, 2]))
    return ids


def random_split(rng: random.Random, ids: list[int]) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 5, 8])
        chunks.append(ids[i : i + n])
        i += n
    return chunks


def stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> tuple[list[DetokenizerUpdate], str]:
    updates = [detok.update(chunk) for chunk in chunks]
    return updates, detok.flush()


def streamed_text(updates: list[DetokenizerUpdate], tail: str) -> str:
    return "".join(u.text for u in updates) + tail


# -- decoding -------------------------------------------------------------------------------------


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_concatenate_to_full_decode(tok: Tokenizer, hf: Any, skip_special_tokens: bool) -> None:
    rng = random.Random(0)
    for trial in range(30):
        ids = random_stream(rng, rng.randint(200, 600))
        expected = hf.decode(ids, skip_special_tokens=skip_special_tokens)
        for chunks in (random_split(rng, ids), [[i] for i in ids], [ids]):
            detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip_special_tokens)
            updates, tail = stream(detok, chunks)
            assert streamed_text(updates, tail) == expected, f"trial {trial}"
            assert [u.num_tokens_kept for u in updates] == [len(c) for c in chunks]


def test_no_replacement_char_mid_stream(tok: Tokenizer) -> None:
    """A character split over byte-fallback ids is sent whole, once its last byte arrives."""
    ids = tok.encode("Hi", add_special_tokens=False) + byte_ids("😀") + byte_ids("中")
    detok = IncrementalDetokenizer(tok, [])
    texts = [detok.update([i]).text for i in ids]
    assert "\ufffd" not in "".join(texts)
    assert texts[-7:] == ["", "", "", "😀", "", "", "中"]
    assert detok.flush() == ""


def test_sentencepiece_spaces(tok: Tokenizer) -> None:
    ids = tok.encode("Once upon a   time", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    texts = [detok.update([i]).text for i in ids]
    assert "".join(texts) + detok.flush() == "Once upon a time"
    assert texts[0] == "Once"  # the first token's '▁' is not a space, as in decode()


def test_prompt_context_keeps_leading_space(tok: Tokenizer, hf: Any) -> None:
    """After a prompt the first token's '▁' is a space: text = decode(prompt+output) minus decode(prompt)."""
    rng = random.Random(1)
    prompts = [
        tok.encode("Once upon a time there was a girl named Lily."),
        tok.encode("中文 😀"),
        [1],
        [],
        [*tok.encode("Hi"), 2, 1, 2, 1, 2, 1, 2, 1],  # the last ids decode to nothing
    ]
    for prompt in prompts:
        for _ in range(5):
            output = random_stream(rng, 80, specials=False)
            full, head = (
                hf.decode(prompt + output, skip_special_tokens=True),
                hf.decode(prompt, skip_special_tokens=True),
            )
            assert full.startswith(head)
            detok = IncrementalDetokenizer(tok, prompt)
            updates, tail = stream(detok, random_split(rng, output))
            assert streamed_text(updates, tail) == full[len(head) :], prompt
    detok = IncrementalDetokenizer(tok, tok.encode("Once upon a"))
    assert detok.update(tok.encode("time", add_special_tokens=False)).text == " time"


def test_prompt_ending_mid_character(tok: Tokenizer) -> None:
    """Bytes of a character split between prompt and output come out as the whole character."""
    prompt = tok.encode("Look:") + byte_ids("😀")[:2]
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok.update(byte_ids("😀")[2:3]).text == ""
    assert detok.update(byte_ids("😀")[3:]).text == "😀"
    assert detok.update(tok.encode("ok", add_special_tokens=False)).text == " ok"


def test_invalid_bytes_become_replacement_chars(tok: Tokenizer, hf: Any) -> None:
    ids = [BYTE_ID_OFFSET + 0x80, BYTE_ID_OFFSET + 0xBF, *tok.encode("end", add_special_tokens=False)]
    detok = IncrementalDetokenizer(tok, [])
    assert (
        streamed_text([detok.update([i]) for i in ids], detok.flush()) == hf.decode(ids) == "\ufffd\ufffd end"
    )
    detok = IncrementalDetokenizer(tok, [])
    assert detok.update(byte_ids("😀")[:2]).text == ""
    assert detok.flush() == "\ufffd\ufffd"  # an unfinished character at the end is flushed as is


def test_window_stays_small(tok: Tokenizer) -> None:
    """Each token costs decodes of a few recent ids, however long the output grows."""
    longest = 0

    class CountingTokenizer:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            nonlocal longest
            longest = max(longest, len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    prompt = tok.encode("Once upon a time")
    ids = random_stream(random.Random(2), 5000, specials=False)
    detok = IncrementalDetokenizer(CountingTokenizer(), prompt, stop=["zzzzzz"])  # type: ignore[arg-type]
    text = streamed_text([detok.update([i]) for i in ids], detok.flush())
    assert text == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert longest <= 16
    assert len(detok._ids) <= 1100  # ids before the window are dropped


# -- stop strings ---------------------------------------------------------------------------------


def first_completion(tok: Tokenizer, ids: list[int], stop: str) -> int:
    """The number of ids after which `stop` first appears in the decoded text."""
    return next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(tok: Tokenizer, include: bool) -> None:
    rng = random.Random(3)
    checked = 0
    for _ in range(40):
        ids = random_stream(rng, 300)
        full = tok.decode(ids)
        start = rng.randrange(len(full) // 2, len(full) - 8)
        stop = full[start : start + rng.randint(2, 7)]
        if not stop.strip() or "\ufffd" in stop:
            continue
        index = full.index(stop)
        expected = full[: index + len(stop)] if include else full[:index]
        chunks = random_split(rng, ids)
        detok = IncrementalDetokenizer(
            tok, [], stop=[stop, "never-there"], include_stop_str_in_output=include
        )
        updates, tail = stream(detok, chunks)
        sent = ""
        for update in updates:
            sent += update.text
            assert expected.startswith(sent)  # nothing beyond the output, no part of the stop string
        assert sent + tail == expected
        assert tail == ""
        assert detok.stop_str == stop and [u.stop_str for u in updates if u.stop_str] == [stop]
        assert sum(u.num_tokens_kept for u in updates) == first_completion(tok, ids, stop)
        checked += 1
    assert checked > 20


def test_partial_stop_string_is_held_then_released(tok: Tokenizer) -> None:
    """The last len(stop)-1 characters wait: ' the' might begin 'the end' until ' egg' arrives."""
    ids = tok.encode("Once the egg fell", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["the end"])
    sent = ""
    for k in range(1, len(ids) + 1):
        sent += detok.update(ids[k - 1 : k]).text
        decoded = tok.decode(ids[:k])
        assert sent == decoded[: max(0, len(decoded) - 6)]
    assert sent + detok.flush() == "Once the egg fell"
    assert detok.stop_str is None


def test_stop_string_in_single_update_drops_later_ids(tok: Tokenizer) -> None:
    ids = tok.encode("Lily said stop now and ran", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["stop"])
    update = detok.update(ids)
    assert update == DetokenizerUpdate("Lily said ", "stop", first_completion(tok, ids, "stop"))
    assert update.num_tokens_kept < len(ids)
    assert detok.finished
    assert detok.update(ids) == DetokenizerUpdate("", None, 0)
    assert detok.flush() == ""


def test_earliest_stop_string_wins(tok: Tokenizer) -> None:
    ids = tok.encode("one two three four", add_special_tokens=False)
    for include, expected in ((False, "one "), (True, "one two")):
        detok = IncrementalDetokenizer(
            tok, [], stop=["four", "two", "three"], include_stop_str_in_output=include
        )
        updates, tail = stream(detok, [[i] for i in ids])
        assert streamed_text(updates, tail) == expected
        assert detok.stop_str == "two"


def test_stop_string_with_special_tokens_kept(tok: Tokenizer) -> None:
    ids = [*tok.encode("Hi", add_special_tokens=False), 2, *tok.encode("there", add_special_tokens=False)]
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False, stop=["</s>"])
    updates, tail = stream(detok, [[i] for i in ids])
    assert streamed_text(updates, tail) == "Hi"
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True, stop=["</s>"])
    updates, tail = stream(detok, [[i] for i in ids])
    assert streamed_text(updates, tail) == tok.decode(ids) == "Hi there"


def test_no_stop_found_flushes_everything(tok: Tokenizer) -> None:
    ids = random_stream(random.Random(4), 300)
    detok = IncrementalDetokenizer(tok, [], stop=["\x00never\x00"])
    updates, tail = stream(detok, random_split(random.Random(5), ids))
    assert len(tail) <= len("\x00never\x00") - 1
    assert streamed_text(updates, tail) == tok.decode(ids)
    assert detok.stop_str is None and detok.finished


def test_empty_stop_string_is_refused(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, [], stop=["ok", ""])
