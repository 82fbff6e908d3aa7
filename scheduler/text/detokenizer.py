"""Streams a request's generated text token by token and finds its stop strings.

Decoding token by token is not decoding each token alone: a character may span several byte-fallback
tokens ('<0xF0>' '<0x9F>' '<0x98>' '<0x80>' is one emoji) and a sentencepiece '▁' turns into a space
only after another piece. `IncrementalDetokenizer` therefore decodes a small window of recent ids
(`prefix_offset` .. end) and emits what the newest ids add to the text of the window's already-emitted
part (`prefix_offset` .. `read_offset`), as vLLM and TGI do. Most tokens skip the decoding: when
the window's ids are all emitted and its text is non-empty, a plain token adds its known piece
(`stream_pieces`), exactly the text the window's decoding would add.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from npuserve.scheduler.text.stream_pieces import REPLACEMENT_CHAR, StreamPieces
from npuserve.scheduler.text.tokenizer import Tokenizer

# Prompt ids decoded before the first generated token so its leading space comes out right.
INITIAL_CONTEXT_TOKENS = 6
# The longest UTF-8 character is 4 bytes: a prompt ending mid-character holds at most 3 of them.
MAX_PARTIAL_CHAR_TOKENS = 3
# Ids before the window are dropped once this many pile up (keeps memory O(window), amortised).
COMPACT_AFTER_TOKENS = 1024
# The bytes that begin a UTF-8 character of two or more bytes (RFC 3629).
MIN_LEAD_BYTE, MAX_LEAD_BYTE = 0xC2, 0xF4


class DetokenizerUpdate(NamedTuple):
    """What one `update` adds to a request's output.

    `text`: new text, safe to stream now. `stop_str`: the stop string that ended the output, or None.
    `num_tokens_kept`: how many of the update's ids belong to the output; fewer than given only
    when a stop string was found (the ids after the one that completed it are dropped).
    """

    text: str
    stop_str: str | None
    num_tokens_kept: int


NO_UPDATE = DetokenizerUpdate("", None, 0)


def _ends_whole(text: str) -> bool:
    """Whether text is non-empty and ends on a whole character (see `stream_pieces`)."""
    return bool(text) and not text.endswith(REPLACEMENT_CHAR)


class IncrementalDetokenizer:
    """The text of one request's output, emitted as it grows, truncated at its first stop string.

    Concatenating every `update(...).text` and the final `flush()` gives the output's text:
    `tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)):]`, which is
    `tokenizer.decode(output)` for an empty prompt, and the same for any split of the output into
    updates. Owned by one request; not thread-safe.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self.include_stop_str_in_output = include_stop_str_in_output
        # NOTE: the last `hold_back` characters stay unsent: a stop string that starts there may
        # still be completed by the next token, and none of it may reach the client.
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        # The text of ids[prefix_offset:read_offset]; None: not decoded yet (see `_decode_step`).
        self._prefix_text: str | None = ""
        self._pending = ""  # decoded, checked for stop strings, not yet sent
        # NOTE: a stand-in tokenizer with only `decode` (tests) decodes every token.
        self._pieces: StreamPieces | None = getattr(tokenizer, "stream_pieces", None)
        # The window is all emitted, its text non-empty and not ending in U+FFFD: a token with a
        # stream piece adds that piece.
        self._steady = False
        # The bytes of byte-fallback tokens that came right after whole text, held until they
        # decode (see `_next_in_run`); `_run_exact`: the token before them is not a byte token
        # (its bytes would join the run's), so how an invalid run decodes is known too.
        self._run: bytearray | None = None
        self._run_exact = False
        self._run_valid = False  # the run is a valid start of UTF-8 text: it may still decode
        self.stop_str: str | None = None  # the stop string that ended the output, once found
        # True after a stop string was found or `flush` was called; later updates add nothing.
        self.finished = False
        self._prime(prompt_token_ids)

    def update(self, new_token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Adds generated ids; returns the text that may be streamed now."""
        if self.finished:
            return NO_UPDATE
        if self.stop:
            for i, token_id in enumerate(new_token_ids):
                if self._add_text(self._next_text(token_id)):
                    return self._stopped(i + 1)
            text = self._release(self.hold_back)
        elif len(new_token_ids) == 1:  # nothing is held back: the text goes out as it comes
            text = self._next_text(new_token_ids[0])
        else:
            text = self._next_texts(new_token_ids)
        if self._prefix_offset >= COMPACT_AFTER_TOKENS:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return DetokenizerUpdate(text, None, len(new_token_ids))

    def flush(self) -> str:
        """Ends the output (eos, length limit, abort) and returns every character still held back."""
        if self.finished:
            return ""
        self.finished = True
        # NOTE: with every id emitted the window's text is the emitted text: nothing to add.
        unread = self._read_offset < len(self._ids)
        stopped = unread and self._add_text(self._decode_step(force=True))
        if stopped:
            return self._stopped(0).text
        return self._release(0)

    # -- decoding window ----------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _prime(self, prompt: Sequence[int]) -> None:
        """Puts the prompt's last ids in the window so the first output ids decode in context."""
        start = max(0, len(prompt) - INITIAL_CONTEXT_TOKENS)
        ids = list(prompt[start:])
        if self._plain_window(ids):
            # Its text is whole and non-empty, and is decoded only if it is needed (as a window
            # that `_decode_step` leaves ending in a plain token).
            self._ids, self._read_offset = ids, len(ids)
            self._prefix_text, self._steady = None, True
            return
        text = self._decode(ids)
        # NOTE: the window's text must not be empty (a sentencepiece decoder would then strip the
        # first output token's leading space) nor start inside a multi-byte character; if it does,
        # reach twice as far back.
        while start > 0 and (not text or text.startswith(REPLACEMENT_CHAR)):
            start = max(0, len(prompt) - 2 * (len(prompt) - start))
            ids = list(prompt[start:])
            text = self._decode(ids)
        self._ids, self._read_offset = ids, len(ids)
        if text.endswith(REPLACEMENT_CHAR):  # the prompt's trailing partial bytes count as output
            for back in range(1, min(MAX_PARTIAL_CHAR_TOKENS, len(ids)) + 1):
                head = self._decode(ids[: len(ids) - back])
                if not head.endswith(REPLACEMENT_CHAR):
                    self._read_offset, text = len(ids) - back, head
                    break
        self._prefix_text = text
        self._steady = self._read_offset == len(ids) and _ends_whole(text)

    def _plain_window(self, ids: list[int]) -> bool:
        """Whether every one of `ids` (at least one) has a stream piece, the first one a non-empty
        text alone: then their text is that, followed by the others' pieces (`stream_pieces`),
        whole and non-empty, and the window needs no decoding to start."""
        pieces = self._pieces
        if pieces is None or not ids:
            return False
        first = pieces[ids[0]]
        if not isinstance(first, tuple) or not first[1]:
            return False
        return all(isinstance(pieces[token_id], tuple) for token_id in ids[1:])

    def _next_texts(self, new_token_ids: Sequence[int]) -> str:
        """`_next_text` of each id in turn, joined (a multi-step update carries several ids): its
        usual cases, a plain token in a steady window and an id after held bytes, inline."""
        pieces = self._pieces
        if pieces is None:
            return "".join([self._next_text(token_id) for token_id in new_token_ids])
        ids = self._ids
        texts = []
        for token_id in new_token_ids:
            if self._steady:
                piece = pieces[token_id]
                if isinstance(piece, tuple):
                    ids.append(token_id)
                    self._prefix_offset, self._read_offset = self._read_offset, len(ids)
                    texts.append(piece[0])
                    self._prefix_text = piece[1]
                    if not piece[1]:
                        self._steady = False
                    continue
            elif (run := self._run) is not None:
                ids.append(token_id)
                texts.append(self._next_in_run(run, token_id, pieces))
                continue
            texts.append(self._next_text(token_id))
        return "".join(texts)

    def _next_text(self, token_id: int) -> str:
        """Adds one id to the window; returns the text it adds (see `_decode_step`)."""
        ids = self._ids
        ids.append(token_id)
        pieces = self._pieces
        if pieces is None:
            return self._decode_step(force=False)
        if self._steady:
            piece = pieces[token_id]
            if isinstance(piece, tuple):
                # What `_decode_step` does, its decodes known in advance.
                self._prefix_offset, self._read_offset = self._read_offset, len(ids)
                delta, self._prefix_text = piece
                self._steady = bool(self._prefix_text)
                return delta
            if piece is not None:  # a non-ASCII byte: the text now ends inside a character or bad
                self._steady = False
                self._run = bytearray((piece,))
                self._run_valid = MIN_LEAD_BYTE <= piece <= MAX_LEAD_BYTE
                before = ids[-2]
                # NOTE: an ASCII byte token alone in the window (its one character) turns into one
                # U+FFFD when it joins an invalid run, which leaves the run's delta as it is.
                self._run_exact = not isinstance(pieces[before], int) and (
                    before not in pieces.ascii_bytes or self._prefix_offset == len(ids) - 2
                )
                return ""
        elif self._run is not None:
            return self._next_in_run(self._run, token_id, pieces)
        return self._decode_step(force=False)

    def _next_in_run(self, run: bytearray, token_id: int, pieces: StreamPieces) -> str:
        """What `_decode_step` returns for one more id after a run of held bytes, worked out from
        the bytes: ByteFallback decodes a run of byte tokens to its UTF-8 text, or, when the run
        is not valid UTF-8, to one U+FFFD per byte (which only says where the window's text ends:
        the run's validity alone, since the text before it is whole). Anything else is decoded."""
        piece = pieces[token_id]
        value = piece if isinstance(piece, int) else pieces.ascii_bytes.get(token_id)
        if value is not None:  # the run goes on
            run.append(value)
            if not self._run_valid:
                return ""  # NOTE: the window's text ends in U+FFFD: `_decode_step` waits too
            try:
                text = run.decode()
            except UnicodeDecodeError as exc:
                # Cut short (the codec reached the end inside the run's one character), it may yet
                # become that character; invalid, it never will.
                self._run_valid = exc.start == 0 and exc.end == len(run)
                return ""
            self._run = None
            if text.endswith(REPLACEMENT_CHAR):  # U+FFFD itself makes `_decode_step` wait
                return self._decode_step(force=False)
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._prefix_text, self._steady = text, True
            return text
        self._run = None
        if isinstance(piece, tuple) and self._run_exact:
            # The run, held because it is not valid UTF-8, becomes a U+FFFD per byte; the token
            # after it adds its piece.
            delta = REPLACEMENT_CHAR * len(run) + piece[0]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._prefix_text, self._steady = delta, True
            return delta
        return self._decode_step(force=False)

    def _decode_step(self, force: bool) -> str:
        """The text the unread ids add, or "" while they end inside a character (unless `force`).

        Costs up to two decodes of the window, whatever the output's length.
        """
        ids = self._ids
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        text = self._decode(ids[self._prefix_offset :])
        if not force and (len(text) <= len(prefix_text) or text.endswith(REPLACEMENT_CHAR)):
            self._steady = False  # ids are left unread
            return ""
        delta = text[len(prefix_text) :]
        # The ids just read become the next window's already-emitted part.
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        last = self._pieces[ids[-1]] if self._pieces is not None else None
        if isinstance(last, tuple) and last[1]:
            # NOTE: ending in a plain token, its text is whole and non-empty (`stream_pieces`);
            # it is decoded only if it is needed, which it is not when a plain token comes next.
            self._prefix_text, self._steady = None, True
        else:
            self._prefix_text = prefix_text = self._decode(ids[self._prefix_offset :])
            self._steady = _ends_whole(prefix_text)
        return delta

    # -- stop strings -------------------------------------------------------------------------

    def _add_text(self, delta: str) -> bool:
        """Appends `delta` to the unsent text; True when that completed a stop string."""
        if not delta:
            return False
        # Only a stop string ending in `delta` is new; it starts at most len(stop)-1 chars before it.
        pending = self._pending
        search_from = len(pending) - self.hold_back if len(pending) > self.hold_back else 0
        self._pending = pending = pending + delta
        index, stop_str = -1, None  # the earliest stop string, the first listed on a tie
        for candidate in self.stop:
            found = pending.find(candidate, search_from)
            if found >= 0 and (stop_str is None or found < index):
                index, stop_str = found, candidate
        if stop_str is None:
            return False
        end = index + len(stop_str) if self.include_stop_str_in_output else index
        self._pending = pending[:end]
        self.stop_str = stop_str
        return True

    def _stopped(self, num_tokens_kept: int) -> DetokenizerUpdate:
        self.finished = True
        return DetokenizerUpdate(self._release(0), self.stop_str, num_tokens_kept)

    def _release(self, keep: int) -> str:
        """Takes the unsent text except its last `keep` characters."""
        pending = self._pending
        if len(pending) <= keep:
            return ""
        if not keep:
            self._pending = ""
            return pending
        self._pending = pending[-keep:]
        return pending[:-keep]
