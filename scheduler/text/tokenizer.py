"""Text <-> token ids and chat templates for one model, on the `tokenizers` library (no torch).

A `Tokenizer` reads a Hugging Face model directory: `tokenizer.json` (required), `tokenizer_config.json`,
`special_tokens_map.json`, `generation_config.json` and `chat_template.jinja` (each optional). It
encodes and decodes the way `transformers.AutoTokenizer` does for such a directory and renders chat
templates the way `apply_chat_template(tokenize=False)` does.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from npuserve.scheduler.text.chat_template import ChatRender, RenderLimits
from npuserve.scheduler.text.prompt_bound import PromptSizeBound, prompt_size_bound
from npuserve.scheduler.text.stream_pieces import StreamPieces

# The named special tokens, in transformers' order.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class TokenizerError(ValueError):
    """A model's tokenizer files, its chat template or a chat request cannot be used; ``field``
    names the request field at fault (`messages[0].role`, `chat_template`), when one is."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class Tokenizer:
    """One model's tokenizer: encode, decode, special tokens and chat template.

    Build it with `Tokenizer.from_pretrained(model_dir)`. Instances are read-only after
    construction, so one may be shared by every request of a process.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        name: str,
        special_tokens: dict[str, str],
        generation_eos_ids: Sequence[int] = (),
        chat_template: str | None = None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self._backend = backend
        self.name = name
        self.special_tokens = dict(special_tokens)
        self._generation_eos_ids = tuple(generation_eos_ids)
        self.chat_template = chat_template
        # NOTE: like transformers 5, the cleanup (" ." -> ".") is never applied to BPE models:
        # it was written for WordPiece and deletes real spaces from BPE output.
        is_bpe = type(backend.model).__name__ == "BPE"
        self._clean_up = clean_up_tokenization_spaces and not is_bpe
        data = json.loads(backend.to_str())
        # None: this tokenizer may turn any length of text into one token (see prompt_bound).
        self.size_bound: PromptSizeBound | None = prompt_size_bound(data)
        # None: a token's text in a stream is known only by decoding it in context (always so
        # with the cleanup, " ." -> ".", which reaches across tokens).
        self.stream_pieces: StreamPieces | None = (
            None if self._clean_up else StreamPieces.of(backend, data.get("decoder"))
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Loads the tokenizer of a model directory.

        `chat_template`, when given, replaces the model's own template: either the template itself
        or the path of a file holding it.
        """
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise TokenizerError(f"model directory {model_dir} does not exist")
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(
                f"{tokenizer_file} is missing: npuserve reads only the fast-tokenizer format. Create it "
                "once with transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir)"
            )
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise TokenizerError(f"{tokenizer_file} cannot be read ({exc}); re-download it") from exc
        config = _read_json(model_dir / "tokenizer_config.json")
        special_tokens = _special_tokens(config, _read_json(model_dir / "special_tokens_map.json"))
        generation = _read_json(model_dir / "generation_config.json")
        _ensure_post_processor(backend, config, special_tokens)
        template = (
            _resolve_template_override(chat_template)
            if chat_template is not None
            else _model_chat_template(model_dir, config)
        )
        return cls(
            backend,
            name=str(model_dir),
            special_tokens=special_tokens,
            generation_eos_ids=_as_id_list(generation.get("eos_token_id")),
            chat_template=template,
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` holds it (for the grammar engine's own tokenizer)."""
        return self._backend.to_str()

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, release_gil: bool = False) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the post-processor adds bos/eos.

        With `release_gil`, other Python threads run meanwhile (for long texts, from a worker
        thread; it costs a little more). NOTE: a prompt rendered by a chat template already holds
        its bos token: encode it with `add_special_tokens=False`, as transformers does.
        """
        if release_gil:  # the batch calls of `tokenizers` release the GIL, the single ones do not
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, release_gil: bool = False) -> str:
        """The text of `ids`. Ids outside the vocabulary decode to nothing. `release_gil`: as in `encode`."""
        id_list = ids if isinstance(ids, list) else list(ids)
        if release_gil:
            text = self._backend.decode_batch([id_list], skip_special_tokens=skip_special_tokens)[0]
        else:
            text = self._backend.decode(id_list, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of `ids` (e.g. '▁the', '<0xE4>')."""
        tokens = []
        for token_id in ids:
            token = self._backend.id_to_token(token_id)
            if token is None:
                raise TokenizerError(
                    f"token id {token_id} is outside the vocabulary of size {self.vocab_size}"
                )
            tokens.append(token)
        return tokens

    # -- vocabulary facts ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (transformers' `len(tokenizer)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the tokenizer's eos, then those of generation_config.json."""
        token = self.special_tokens.get("eos_token")
        eos = None if token is None else self._backend.token_to_id(token)
        return tuple(dict.fromkeys([*([] if eos is None else [eos]), *self._generation_eos_ids]))

    # -- chat -----------------------------------------------------------------------------------

    def chat_render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        limits: RenderLimits | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> ChatRender:
        """What rendering `messages` takes: checked messages, the template and its variables
        (`tools` as transformers' `apply_chat_template` passes them: None when there are none).

        NOTE: a template given here comes from a client, so it is template text only and never
        read as a file path (that would let any client read the scheduler's files).
        """
        template = self.chat_template if chat_template is None else chat_template
        if template is None:
            raise TokenizerError(f"model {self.name} has no chat template; pass --chat-template")
        variables = {
            "messages": normalize_messages(messages),
            "tools": tools or None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            **self.special_tokens,
        }
        return ChatRender(
            template=template,
            variables=variables,
            limits=limits or RenderLimits(max_chars=sys.maxsize),
            field=None if chat_template is None else "chat_template",  # the client's own template
            model_name=self.name,
        )


# -- loading helpers ------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path} is not valid JSON ({exc}); re-download it") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object; re-download it")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as a string; configs store either the string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(config: dict[str, Any], special_map: dict[str, Any]) -> dict[str, str]:
    """Named special tokens; special_tokens_map.json overrides tokenizer_config.json, as in transformers."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = _token_content(special_map.get(name)) or _token_content(config.get(name))
        if value is not None:
            tokens[name] = value
    return tokens


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _ensure_post_processor(
    backend: BackendTokenizer, config: dict[str, Any], special: dict[str, str]
) -> None:
    """Adds bos/eos from `add_bos_token`/`add_eos_token` when tokenizer.json has no post-processor.

    NOTE: tokenizer.json's post-processor, when present, is the source of truth (transformers 5
    does the same); older Llama tokenizers without one rely on `add_bos_token` instead.
    """
    if backend.post_processor is not None:
        return
    wanted = {"bos_token": config.get("add_bos_token"), "eos_token": config.get("add_eos_token")}
    present = {
        name: special[name]
        for name, flag in wanted.items()
        if flag and name in special and backend.token_to_id(special[name]) is not None
    }
    if not present:
        return

    def template(sequence: str, type_id: int) -> str:
        pieces = (present.get("bos_token"), sequence, present.get("eos_token"))
        return " ".join(f"{piece}:{type_id}" for piece in pieces if piece is not None)

    backend.post_processor = processors.TemplateProcessing(
        single=template("$A", 0),
        pair=f"{template('$A', 0)} {template('$B', 1)}",
        special_tokens=[(token, backend.token_to_id(token)) for token in present.values()],
    )


def _clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`: no space before punctuation and English contractions."""
    for old, new in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(old, new)
    return text


# -- chat templates -------------------------------------------------------------------------------


def _model_chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    """The model's template: chat_template.jinja wins over tokenizer_config.json, as in transformers."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


_JINJA_MARKERS = re.compile(r"\{\{|\{%|\{#")


def _resolve_template_override(value: str) -> str:
    """An override is the path of a template file, or else the template text itself."""
    if not _JINJA_MARKERS.search(value) and "\n" not in value:
        path = Path(value).expanduser()
        if not path.is_file():
            raise TokenizerError(f"chat template {value!r} is neither a readable file nor a jinja template")
        return path.read_text(encoding="utf-8")
    return value


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Checks chat messages and returns copies whose content is a string.

    A content given as a list of `{"type": "text", "text": ...}` parts becomes their texts joined
    by newlines. Keys other than role and content pass through unchanged.
    """
    if not isinstance(messages, list) or not messages:
        raise TokenizerError("messages must be a non-empty list", "messages")
    return [_normalize_message(i, message) for i, message in enumerate(messages)]


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise TokenizerError(f"{where} must be an object with role and content", where)
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise TokenizerError(
            f"{where}.role must be one of {sorted(CHAT_ROLES)}, got {role!r}", f"{where}.role"
        )
    return {**message, "content": _content_text(f"{where}.content", message.get("content", None))}


def _content_text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TokenizerError(
            f"{where} must be a string or a list of text parts, got {type(content).__name__}", where
        )
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise TokenizerError(f"{where}[{i}].type must be 'text'", f"{where}[{i}].type")
        text = part.get("text")
        if not isinstance(text, str):
            raise TokenizerError(f"{where}[{i}].text must be a string", f"{where}[{i}].text")
        texts.append(text)
    return "\n".join(texts)
