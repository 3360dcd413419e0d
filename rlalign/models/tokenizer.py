"""A checkpoint's tokenizer through the ``tokenizers`` library (no transformers needed).

Reads ``tokenizer.json`` and, when present, ``tokenizer_config.json`` (special tokens, chat
template), ``chat_template.jinja``, ``generation_config.json`` and ``config.json`` (eos ids).
Plain encoding applies the tokenizer's post-processor (e.g. Llama-3's BOS) like transformers'
``tokenizer(text)``; chat encoding renders the chat template (Jinja, as transformers does:
``trim_blocks``, ``lstrip_blocks``, sandboxed) and encodes the result without adding special
tokens, like ``apply_chat_template(..., tokenize=True)``. A template that does not compile, that Jinja's
sandbox stops, or that fails while rendering is a one-line :class:`TokenizerError` naming the template's file
and line.

:meth:`Tokenizer.encodability_problem` is the one check that a prompt's characters can be encoded (not mapped
to the unknown token, which silently became ``<pad>``): the trainer and ``rlalign generate`` both refuse with it.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import traceback
from pathlib import Path
from typing import Sequence

from rlalign.contract.errors import RLAlignError


class TokenizerError(RLAlignError, RuntimeError):
    """A tokenizer cannot be loaded, or cannot do what was asked (e.g. no chat template)."""


class Tokenizer:
    def __init__(self, backend, config: dict | None = None, chat_template: str | None = None,
                 extra_eos_ids: Sequence[int] = (), chat_template_file: str | None = None):
        self.backend = backend
        self.config = config or {}
        self.chat_template = chat_template
        self.chat_template_file = chat_template_file   # where the template came from, for error messages
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.pad_token = _token_str(self.config.get("pad_token"))
        eos = [self.token_to_id(self.eos_token)] if self.eos_token else []
        self.eos_token_ids = tuple(dict.fromkeys(i for i in [*eos, *extra_eos_ids] if i is not None))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token) if self.pad_token else None

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def unknown_characters(self, text: str) -> list[str]:
        """Characters of ``text`` that the tokenizer can only map to its unknown token (when that token does not
        itself occur in ``text``), each once, in order of appearance."""
        unk = getattr(getattr(self.backend, "model", None), "unk_token", None)
        if not unk or unk in text:
            return []
        unk_id = self.token_to_id(unk)
        enc = self.backend.encode(text, add_special_tokens=False)
        return list(dict.fromkeys(text[a:b] for i, (a, b) in zip(enc.ids, enc.offsets) if i == unk_id and b > a))

    def encodability_problem(self, text: str) -> str | None:
        """The one-line refusal of a prompt with characters the tokenizer cannot encode, or None."""
        unknown = self.unknown_characters(text)
        if not unknown:
            return None
        return (f"the model's tokenizer cannot encode {''.join(unknown)!r} in the prompt {text[:60]!r} (it maps them "
                "to its unknown token); use a tokenizer that covers the task's characters")

    def encode(self, text: str, *, chat: bool = False, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``chat=True`` wraps it as one user message of the chat template
        (with the generation prompt)."""
        if chat:
            return self.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tokenize: bool = True, **kwargs) -> list[int] | str:
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template (tokenizer_config.json 'chat_template' "
                                 "or chat_template.jinja)")
        text = _render(self.chat_template, self.chat_template_file or "the chat template", messages=messages,
                       add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                       eos_token=self.eos_token or "", **kwargs)
        if not tokenize:
            return text
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Tokenizer of a checkpoint directory (needs ``tokenizer.json``)."""
    from tokenizers import Tokenizer as Backend

    d = Path(directory)
    path = d / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"{path}: missing tokenizer.json (only fast-tokenizer checkpoints are supported)")
    try:
        backend = Backend.from_file(str(path))
    except Exception as exc:
        raise TokenizerError(f"{path}: cannot load tokenizer ({exc})") from None
    config = _read_json(d / "tokenizer_config.json")
    template, template_file = config.get("chat_template"), f"{d / 'tokenizer_config.json'} (chat_template)"
    if (d / "chat_template.jinja").is_file():
        template, template_file = (d / "chat_template.jinja").read_text(), str(d / "chat_template.jinja")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    extra_eos = []
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(d / name).get("eos_token_id")
        extra_eos += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    return Tokenizer(backend, config, template, extra_eos, template_file if template else None)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: cannot parse ({exc})") from None


def _token_str(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialisation
        return value.get("content")
    return value


class _TemplateRaised(Exception):
    """The template called ``raise_exception(message)``."""


def _render(template: str, source: str, **variables) -> str:
    """The chat template rendered; every failure is one :class:`TokenizerError` line naming ``source`` (its file)."""
    try:
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import SecurityError
    except ImportError:
        raise TokenizerError("chat templates need the jinja2 package (pip install jinja2)") from None
    try:
        return _compiled(template).render(**variables)
    except TemplateSyntaxError as e:
        raise TokenizerError(f"{source}: the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None
    except SecurityError as e:
        raise TokenizerError(f"{source}: Jinja's sandbox stopped the chat template{_template_line(e)}: {e} (a chat "
                             "template may not reach Python internals; fix or replace the template)") from None
    except _TemplateRaised as e:
        raise TokenizerError(f"{source}: the chat template raised an error{_template_line(e)}: {e}") from None
    except Exception as e:   # any failure while rendering: the template's, told in one line
        raise TokenizerError(f"{source}: the chat template failed{_template_line(e)} ({type(e).__name__}: {e})"
                             ) from None


def _template_line(exc: BaseException) -> str:
    """`` at line N`` of the template, from the traceback Jinja rewrites to template lines; "" when unknown."""
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<template>"]
    return f" at line {lines[-1]}" if lines else ""


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    return _environment().from_string(template)


@functools.lru_cache(maxsize=1)
def _environment():
    """Jinja as transformers renders chat templates: sandboxed and immutable, ``trim_blocks``, ``lstrip_blocks``."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise _TemplateRaised(message)

    def tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env
