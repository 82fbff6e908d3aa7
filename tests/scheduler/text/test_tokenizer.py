"""`Tokenizer` against transformers: encode, decode, special tokens, chat templates, and its refusals."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from npuserve.scheduler.text.chat_template import ChatTemplateError, render
from npuserve.scheduler.text.tokenizer import Tokenizer, TokenizerError

transformers = pytest.importorskip("transformers")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)

FIXED_TEXTS = [
    "",
    " ",
    "   ",
    "Hello world",
    " Hello world ",
    "Once upon a time, there was a little girl named Lily.",
    "a  b   c    d",
    "\n",
    "\n\n\tindented\n  two spaces",
    "trailing spaces   ",
    "   leading spaces",
    "1234567890 3.14159 -42 1e-9 007",
    "héllo wörld çà et là — “quotes” ‘single’",
    "😀😃🎉 emoji 👩‍👩‍👧‍👦 family 🇫🇷 flag",
    "中文字符测试，日本語のテキスト、한국어 텍스트",
    "Ελληνικά кириллица עברית العربية हिन्दी",
    "<s> inside text </s> and <unk>",
    "tabs\tand\rcarriage returns\r\n",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "mixed: abc😀中e\u0301 combining",
    "!!!???...,,,;;;:::",
    "x" * 300,
]
FRAGMENTS = [
    "the",
    " cat",
    "sat",
    " on",
    "mat.",
    "  ",
    "   ",
    "\n",
    "\t",
    "42",
    "2024",
    "0.5",
    "é",
    "ü",
    "ß",
    "😀",
    "🎉",
    "🙂",
    "中",
    "文",
    "字",
    "日本",
    "한",
    "Ж",
    "!",
    "?",
    ",",
    "'s",
    "n't",
    "<s>",
    "</s>",
    "\u00a0",
    "Lily",
    " Ben",
    "happy",
]


def varied_texts(count: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = list(FIXED_TEXTS)
    while len(texts) < count:
        texts.append("".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12))))
    return texts


@pytest.fixture(scope="module")
def tok(stories_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(stories_dir)


@pytest.fixture(scope="module")
def hf(stories_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(stories_dir)


def make_model_dir(stories_dir: Path, path: Path, **config_updates: Any) -> Path:
    """A copy of stories260K's tokenizer files (not its chat template) with `config_updates` merged
    into tokenizer_config.json."""
    path.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (stories_dir / name).is_file():
            shutil.copy(stories_dir / name, path / name)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(config_updates)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


# -- encode / decode ------------------------------------------------------------------------------


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tok: Tokenizer, hf: Any, add_special_tokens: bool) -> None:
    for text in varied_texts():
        expected = hf.encode(text, add_special_tokens=add_special_tokens)
        assert tok.encode(text, add_special_tokens=add_special_tokens) == expected, repr(text)


def test_encode_adds_bos_once(tok: Tokenizer) -> None:
    assert tok.encode("Hello")[0] == 1  # <s>
    assert tok.encode("Hello", add_special_tokens=False)[0] != 1
    assert tok.encode("") == [1]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tok: Tokenizer, hf: Any, skip_special_tokens: bool) -> None:
    for text in varied_texts():
        ids = hf.encode(text)
        expected = hf.decode(ids, skip_special_tokens=skip_special_tokens)
        assert tok.decode(ids, skip_special_tokens=skip_special_tokens) == expected, repr(text)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_random_ids_matches_transformers(tok: Tokenizer, hf: Any, skip_special_tokens: bool) -> None:
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 40))]
        expected = hf.decode(ids, skip_special_tokens=skip_special_tokens)
        assert tok.decode(ids, skip_special_tokens=skip_special_tokens) == expected, ids


def test_decode_skips_special_tokens_by_default(tok: Tokenizer) -> None:
    ids = [*tok.encode("Hello"), tok.eos_token_ids[0]]
    assert tok.decode(ids) == "Hello"
    assert tok.decode(ids, skip_special_tokens=False) == "<s> Hello</s>"


def test_vocabulary_facts_match_transformers(tok: Tokenizer, hf: Any) -> None:
    assert tok.vocab_size == len(hf) == 512
    assert tok.eos_token_ids[0] == hf.eos_token_id == 2
    assert tok.eos_token_ids == (2,)
    ids = list(range(0, 512, 7))
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert tok.convert_ids_to_tokens([1, 3 + 0xE4]) == ["<s>", "<0xE4>"]


def test_convert_ids_to_tokens_rejects_unknown_id(tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="token id 512 is outside the vocabulary of size 512"):
        tok.convert_ids_to_tokens([5, 512])


def test_generation_config_eos_ids_are_added(stories_dir: Path, tmp_path: Path) -> None:
    model_dir = make_model_dir(stories_dir, tmp_path / "m")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok = Tokenizer.from_pretrained(model_dir)
    assert tok.eos_token_ids[0] == 2
    assert tok.eos_token_ids == (2, 7)


def test_add_bos_token_applies_without_post_processor(stories_dir: Path, tmp_path: Path) -> None:
    """tokenizer.json without a post-processor: `add_bos_token`/`add_eos_token` decide (our choice)."""

    def without_post_processor(path: Path, **config: Any) -> Tokenizer:
        model_dir = make_model_dir(stories_dir, path, **config)
        spec = json.loads((model_dir / "tokenizer.json").read_text())
        spec["post_processor"] = None
        (model_dir / "tokenizer.json").write_text(json.dumps(spec))
        return Tokenizer.from_pretrained(model_dir)

    tok = without_post_processor(tmp_path / "both", add_eos_token=True)
    body = tok.encode("Hello", add_special_tokens=False)
    assert tok.encode("Hello") == [1, *body, 2]
    tok = without_post_processor(tmp_path / "neither", add_bos_token=False, add_eos_token=False)
    assert tok.encode("Hello") == body


# -- chat templates -------------------------------------------------------------------------------

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Multi-line: exercises trim_blocks/lstrip_blocks, tojson (non-ASCII kept), loop controls, namespace.
MULTILINE_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% if message['role'] == 'tool' %}
        {% continue %}
    {% endif %}
    {% set ns.count = ns.count + 1 %}
    <|{{ message['role'] }}|>
    {{ message['content'] | tojson }}
    {{ message | tojson(indent=2, sort_keys=true) }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|> ({{ ns.count }} messages, unk={{ unk_token }})
{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "You are a helpful storyteller."},
    {"role": "user", "content": "Tell me a story about Lily 😀."},
    {"role": "assistant", "content": "  Once upon a time, 中文 Lily found a ball.  "},
    {"role": "user", "content": "And then?"},
]


@pytest.mark.parametrize("template", [LLAMA2_TEMPLATE, CHATML_TEMPLATE, MULTILINE_TEMPLATE])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    stories_dir: Path, tmp_path: Path, template: str, add_generation_prompt: bool
) -> None:
    model_dir = make_model_dir(stories_dir, tmp_path / "m", chat_template=template)
    tok = Tokenizer.from_pretrained(model_dir)
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = (
        [*MESSAGES, {"role": "tool", "content": "ignored"}] if template == MULTILINE_TEMPLATE else MESSAGES
    )
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.chat_template is not None
    assert render(tok.chat_render(messages, add_generation_prompt=add_generation_prompt)) == expected
    assert render(tok.chat_render(messages[1:2])) == hf.apply_chat_template(
        messages[1:2], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_demo_model_template_writes_one_story(tok: Tokenizer, hf: Any, add_generation_prompt: bool) -> None:
    """The bundled stories260K template (chat_template.jinja): user and assistant turns joined into
    one story, system messages left out; transformers renders it the same."""
    story = "<s>Tell me a story about Lily 😀. Once upon a time, 中文 Lily found a ball. And then?"
    rendered = render(tok.chat_render(MESSAGES, add_generation_prompt=add_generation_prompt))
    assert rendered == story
    assert rendered == hf.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    once = render(tok.chat_render([{"role": "user", "content": "Once upon a time"}]))
    assert (
        tok.encode(once, add_special_tokens=False)
        == tok.encode("Once upon a time")
        == [1, 403, 407, 261, 378]
    )


def test_list_form_template_takes_default(stories_dir: Path, tmp_path: Path) -> None:
    templates = [
        {"name": "tool_use", "template": "TOOLS {{ messages[0]['content'] }}"},
        {"name": "default", "template": CHATML_TEMPLATE},
    ]
    tok = Tokenizer.from_pretrained(make_model_dir(stories_dir, tmp_path / "m", chat_template=templates))
    assert render(tok.chat_render(MESSAGES[1:2])) == (
        "<|im_start|>user\nTell me a story about Lily 😀.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_jinja_file_template_wins_over_config(stories_dir: Path, tmp_path: Path) -> None:
    model_dir = make_model_dir(stories_dir, tmp_path / "m", chat_template="CONFIG {{ messages }}")
    (model_dir / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    tok = Tokenizer.from_pretrained(model_dir)
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert render(tok.chat_render(MESSAGES)) == hf.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )


def test_override_template_string_and_file(stories_dir: Path, tmp_path: Path) -> None:
    model_dir = make_model_dir(stories_dir, tmp_path / "m", chat_template=CHATML_TEMPLATE)
    template_file = tmp_path / "llama2.jinja"
    template_file.write_text(LLAMA2_TEMPLATE)
    messages = MESSAGES[1:2]
    llama2 = "<s>[INST] Tell me a story about Lily 😀. [/INST]"
    assert (
        render(Tokenizer.from_pretrained(model_dir, chat_template=LLAMA2_TEMPLATE).chat_render(messages))
        == llama2
    )
    assert (
        render(Tokenizer.from_pretrained(model_dir, chat_template=str(template_file)).chat_render(messages))
        == llama2
    )
    tok = Tokenizer.from_pretrained(model_dir)
    assert render(tok.chat_render(messages, chat_template=LLAMA2_TEMPLATE)) == llama2
    assert render(tok.chat_render(messages)).startswith("<|im_start|>user")


def test_request_template_is_never_read_as_a_file(stories_dir: Path, tmp_path: Path) -> None:
    """A per-request template is client input: a path in it renders as text, no file is read."""
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    tok = Tokenizer.from_pretrained(
        make_model_dir(stories_dir, tmp_path / "m", chat_template=CHATML_TEMPLATE)
    )
    rendered = render(tok.chat_render(MESSAGES[1:2], chat_template=str(secret)))
    assert "top secret" not in rendered and rendered == str(secret)


def test_override_gives_a_template_to_a_model_without_one(stories_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(
        make_model_dir(stories_dir, tmp_path / "m"), chat_template=CHATML_TEMPLATE
    )
    assert tok.chat_template is not None
    prompt = render(tok.chat_render(MESSAGES[1:2], add_generation_prompt=False))
    assert prompt == "<|im_start|>user\nTell me a story about Lily 😀.<|im_end|>\n"


def test_text_parts_are_joined(stories_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(stories_dir, chat_template=CHATML_TEMPLATE)
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    messages = [{"role": "user", "content": parts, "name": "lily"}]
    assert (
        render(tok.chat_render(messages))
        == "<|im_start|>user\nfirst\nsecond<|im_end|>\n<|im_start|>assistant\n"
    )
    assert messages[0]["content"] is parts  # the caller's messages are left alone


def test_strftime_now_is_available(stories_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(stories_dir, chat_template="{{ strftime_now('%Y') }}")
    assert render(tok.chat_render(MESSAGES)).isdigit()


# -- refusals -------------------------------------------------------------------------------------


def test_missing_tokenizer_json_names_file_and_fix(stories_dir: Path, tmp_path: Path) -> None:
    model_dir = make_model_dir(stories_dir, tmp_path / "m")
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=r"tokenizer\.json is missing.*save_pretrained"):
        Tokenizer.from_pretrained(model_dir)


def test_missing_model_dir(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")


def test_malformed_config_names_file(stories_dir: Path, tmp_path: Path) -> None:
    model_dir = make_model_dir(stories_dir, tmp_path / "m")
    (model_dir / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json is not valid JSON"):
        Tokenizer.from_pretrained(model_dir)


def test_no_chat_template(stories_dir: Path, tmp_path: Path) -> None:
    model_dir = make_model_dir(stories_dir, tmp_path / "m")
    tok = Tokenizer.from_pretrained(model_dir)
    assert tok.chat_template is None
    with pytest.raises(TokenizerError, match=r"has no chat template; pass --chat-template") as info:
        render(tok.chat_render(MESSAGES))
    assert str(model_dir) in str(info.value)


def test_template_exception_carries_its_message(stories_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(stories_dir, chat_template=LLAMA2_TEMPLATE)
    bad_order = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate user/assistant"):
        render(tok.chat_render(bad_order))


def test_template_syntax_error(stories_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(stories_dir, chat_template="{% for m in messages %}{{ m }")
    with pytest.raises(ChatTemplateError, match="not valid jinja"):
        render(tok.chat_render(MESSAGES))


def test_template_sandbox_blocks_escape(stories_dir: Path) -> None:
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer.from_pretrained(stories_dir, chat_template=template)
    with pytest.raises(ChatTemplateError, match="failed"):
        render(tok.chat_render(MESSAGES))


def test_override_that_is_neither_file_nor_template(stories_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="neither a readable file nor a jinja template"):
        Tokenizer.from_pretrained(stories_dir, chat_template=str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages must be a non-empty list"),
        ("hello", "messages must be a non-empty list"),
        ([{"role": "user", "content": "a"}, "text"], r"messages\[1\] must be an object"),
        ([{"content": "a"}], r"messages\[0\]\.role"),
        ([{"role": "", "content": "a"}], r"messages\[0\]\.role"),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "robot", "content": "c"},
            ],
            r"messages\[2\]\.role",
        ),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string"),
        ([{"role": "user"}], r"messages\[0\]\.content must be a string"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            r"messages\[0\]\.content\[0\]\.type",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\]\.content\[0\]\.text"),
        ([{"role": "user", "content": ["plain"]}], r"messages\[0\]\.content\[0\]\.type"),
    ],
)
def test_invalid_messages_name_the_field(stories_dir: Path, messages: Any, field: str) -> None:
    tok = Tokenizer.from_pretrained(stories_dir, chat_template=CHATML_TEMPLATE)
    with pytest.raises(TokenizerError, match=field):
        render(tok.chat_render(messages))


def test_tokenizer_error_is_a_value_error() -> None:
    assert issubclass(TokenizerError, ValueError)
