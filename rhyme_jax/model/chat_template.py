"""A tokenizer's chat template: prompts rendered as transformers' ``apply_chat_template`` does.

Where the template comes from, as transformers' ``AutoTokenizer.from_pretrained`` reads a local
tokenizer directory: ``chat_template.jinja`` if present, else ``tokenizer_config.json``'s
``chat_template`` (a string, or a list of ``{"name", "template"}`` entries of which ``default``
is used). Rendering follows transformers' ``render_jinja_template``: a jinja2
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` / ``lstrip_blocks`` and the ``loopcontrols``
extension, a ``tojson`` filter that does not escape HTML, the globals ``raise_exception`` and
``strftime_now``, the ``{% generation %}`` block (rendered as its body), and the tokenizer's named
special tokens (``bos_token``, ``eos_token``, ...) as variables. ``tests/test_chat_template.py``
checks equality with ``apply_chat_template`` on SmolLM2's tokenizer and a Qwen2.5-style one.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rhyme_jax.model.tokenizer import TokenizerError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES): template variables when set
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(TokenizerError):
    """A chat template is missing, unreadable or fails to render (the message names the file)."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text for transformers'
    assistant-token masks; a prompt renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(text: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(text)


@dataclass(frozen=True)
class ChatTemplate:
    """A jinja chat template and the special tokens it may refer to.

    Attributes:
      text: the jinja source.
      source: the file it came from (for messages).
      special_tokens: ``{"eos_token": "<|im_end|>", ...}`` from ``tokenizer_config.json``.
    """

    text: str
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        try:
            _compile(self.text)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{self.source}: not a valid jinja chat template: {exc}") from None

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (``[{"role": "system" | "user" | "assistant",
        "content": str}, ...]``), as ``apply_chat_template(messages, tokenize=False,
        add_generation_prompt=...)`` renders it.

        Raises:
          ChatTemplateError: the template raised (``raise_exception``) or failed to render.
        """
        try:
            return _compile(self.text).render(messages=messages, tools=None, documents=None,
                                              add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{self.source}: the chat template failed: {exc}") from None

    def prompt(self, question: str, system_prompt: str = "") -> str:
        """``render`` of one user turn ``question`` (after a system turn ``system_prompt`` when it is
        not empty) with the generation prompt: the text the policy continues."""
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return self.render([*messages, {"role": "user", "content": question}])


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ChatTemplateError(f"{path}: not readable JSON: {exc}") from None
    return config if isinstance(config, dict) else {}


def special_tokens(directory: str | Path) -> dict[str, str]:
    """The named special tokens of ``<directory>/tokenizer_config.json`` (strings, or the
    ``content`` of AddedToken objects); ``{}`` without the file."""
    config, out = _read_config(Path(directory)), {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[name] = value
    return out


def _config_template(config: dict, path: Path) -> str | None:
    value = config.get("chat_template")
    if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
        value = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
    if isinstance(value, dict):
        if "default" not in value:
            raise ChatTemplateError(f"{path}: chat_template has named templates {sorted(map(str, value))} "
                                    f"but no 'default'")
        value = value["default"]
    if value is not None and not isinstance(value, str):
        raise ChatTemplateError(f"{path}: chat_template must be a string")
    return value


def tokenizer_chat_template(directory: str | Path) -> ChatTemplate | None:
    """The chat template of a tokenizer directory (see the module docstring), or ``None``.

    Raises:
      ChatTemplateError: a template file is unreadable or not valid jinja.
    """
    directory = Path(directory)
    tokens = special_tokens(directory)
    if (directory / TEMPLATE_FILE).is_file():
        return template_file(directory / TEMPLATE_FILE, tokens)
    text = _config_template(_read_config(directory), directory / CONFIG_FILE)
    return ChatTemplate(text, str(directory / CONFIG_FILE), tokens) if text else None


def template_file(path: str | Path, tokens: dict[str, str] | None = None) -> ChatTemplate:
    """A chat template from a jinja file (with ``tokens`` as its special tokens).

    Raises:
      ChatTemplateError: the file is missing, unreadable or not valid jinja.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ChatTemplateError(f"{path}: cannot read the chat template: {exc}") from None
    return ChatTemplate(text, str(path), dict(tokens or {}))


def select(choice: str, tokenizer_dir: str | Path, key: str = "model.chat_template") -> ChatTemplate | None:
    """The chat template a config asks for, ``None`` for the string prompt template.

    Args:
      choice: ``"none"`` | ``"auto"`` (the tokenizer's if it has one) | ``"tokenizer"`` (the
        tokenizer's, required) | a jinja file.
      tokenizer_dir: the directory of the run's ``tokenizer.json``.
      key: the config key, named in errors.

    Raises:
      ChatTemplateError: ``"tokenizer"`` and the tokenizer has none, or a file fails to load
        (the message starts with ``key``).
    """
    if choice == "none":
        return None
    try:
        if choice not in ("auto", "tokenizer"):
            return template_file(choice, special_tokens(tokenizer_dir))
        found = tokenizer_chat_template(tokenizer_dir)
    except ChatTemplateError as exc:
        raise ChatTemplateError(f"{key}={choice!r}: {exc}") from None
    if found is None and choice == "tokenizer":
        raise ChatTemplateError(f"{key}='tokenizer' but the tokenizer in {tokenizer_dir} has no chat template "
                                f"({TEMPLATE_FILE}, or chat_template in {CONFIG_FILE}); use 'auto', 'none' "
                                f"(model.prompt_template) or a jinja file")
    return found
