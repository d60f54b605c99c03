"""--chat-template: a file or the template itself; every bad value is one error naming the flag."""

import os

import pytest

from services.gateway.chat_template import ChatTemplateError, load_chat_template

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
