"""--chat-template: a file or the template itself; every bad value is one error naming the flag."""

import os

import pytest

from services.gateway.chat_template import ChatTemplateError, load_chat_template
from services.gateway.requests import InvalidRequest
from services.gateway.server import GatewayApp
from services.gateway.settings import GatewaySettings

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def test_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    assert load_chat_template("") is None


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: str(d / "missing.jinja"), "no such file"),
        (lambda d: str(d), "is a directory"),
        (lambda d: "{% for m in messages %}{{ m }}", "line 1"),
        (lambda d: (d / "empty.jinja").write_text("  \n") and str(d / "empty.jinja"), "is empty"),
    ],
)
def test_bad_values_name_the_flag(tmp_path, make, message):
    with pytest.raises(ChatTemplateError) as err:
        load_chat_template(make(tmp_path))
    assert str(err.value).startswith("--chat-template: ") and message in str(err.value)


def test_what_apply_chat_template_accepts_passes():
    # loop controls and the {% generation %} tag are transformers' extensions, not plain Jinja
    template = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% break %}{% endfor %}"
    assert load_chat_template(template) == template


def test_the_flag_renders_chats_and_a_refusal_is_the_client_s_error(tiny_zoo):
    from common.runtime.checkpoints import load_tokenizer

    app = GatewayApp(GatewaySettings(), store=None)
    app.tokenizer = load_tokenizer(str(tiny_zoo.target.path))
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequest, match="no --chat-template") as err:
        app.render_chat(messages)
    assert err.value.field == "messages"
    app.chat_template = load_chat_template(TEMPLATE)
    assert app.render_chat(messages) == app.tokenizer("user: hi\n", add_special_tokens=False).input_ids
    app.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidRequest, match="the chat template refused the messages: roles must alternate"):
        app.render_chat(messages)


def test_a_file_that_is_not_text(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ChatTemplateError, match=r"--chat-template: cannot read .*chat\.jinja: 'utf-8' codec"):
        load_chat_template(str(path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    path.chmod(0)
    with pytest.raises(ChatTemplateError, match=r"--chat-template: cannot read .*chat\.jinja: Permission denied"):
        load_chat_template(str(path))
