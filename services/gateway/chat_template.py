"""The gateway's ``--chat-template``: a Jinja chat template given as a file or as the template
itself, checked at start-up so that a wrong one ends the gateway with one line naming the flag."""

from __future__ import annotations

from pathlib import Path

import jinja2
from transformers.utils.chat_template_utils import _compile_jinja_template


class ChatTemplateError(ValueError):
    pass


def load_chat_template(value: str) -> str | None:
    """The template ``value`` names: ``None`` for an empty value, the text of the file at
    ``value``, or ``value`` itself when it holds Jinja tags (``{{`` or ``{%``) and no file has that
    name. A value that is neither, an unreadable file and a template that does not parse raise
    :class:`ChatTemplateError`."""
    if not value:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"--chat-template: cannot read {value}: {getattr(exc, 'strerror', None) or exc}")
        where = value
    elif "{{" in value or "{%" in value:
        text, where = value, "the template given"
    else:
        why = "is a directory" if path.is_dir() else "no such file"
        raise ChatTemplateError(f"--chat-template: {value}: {why} (nor a Jinja template: no '{{{{' or '{{%' in it)")
    if not text.strip():
        raise ChatTemplateError(f"--chat-template: {where} is empty")
    try:
        # compiled as apply_chat_template compiles it (its sandbox, loop controls and {% generation %}
        # tag), so a template that passes here renders there
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"--chat-template: {where}: line {exc.lineno}: {exc.message}") from None
    return text
