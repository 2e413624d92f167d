"""The one chat-templating function (actors/engine/shell/chat_template.py) on SmolLM2's
real tokenizer and template."""

from __future__ import annotations

from typing import Any

import pytest

from spur.actors.engine.shell.chat_template import ChatTemplateError, chat_token_ids, render_chat


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    from spur.actors.worker.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("SmolLM2-135M-Instruct"))


MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]


def test_generation_prompt_is_applied_or_not(tok: Any) -> None:
    with_prompt = render_chat(tok, MESSAGES[:1], add_generation_prompt=True)
    without = render_chat(tok, MESSAGES[:1], add_generation_prompt=False)
    assert with_prompt.endswith("<|im_start|>assistant\n")
    assert with_prompt.startswith(without) and not without.endswith("assistant\n")


def test_a_lone_surrogate_from_the_template_kwargs_is_a_template_error(tok: Any) -> None:
    """The messages are checked for valid text; a kwarg's string the template renders
    (Llama 3.1's date_string) is not: it must still be a 400 (ChatTemplateError), not
    the tokenizer's TypeError (a 500)."""
    import copy

    dated = copy.deepcopy(tok)
    dated.chat_template = "{{ date_string }}: {{ messages[0]['content'] }}"
    with pytest.raises(ChatTemplateError, match="not UTF-8"):
        chat_token_ids(dated, MESSAGES[:1], template_kwargs={"date_string": "\ud800"})
    assert dated.decode(chat_token_ids(dated, MESSAGES[:1], template_kwargs={"date_string": "x"}))


def test_continue_final_message_leaves_the_last_message_open(tok: Any) -> None:
    text = render_chat(tok, MESSAGES, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("Hello the")
    closed = render_chat(tok, MESSAGES, add_generation_prompt=False)
    assert closed.rstrip().endswith("<|im_end|>")
    ids = chat_token_ids(tok, MESSAGES, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(ids).endswith("Hello the")


def test_contradictions_and_missing_templates_are_errors(tok: Any) -> None:
    with pytest.raises(ChatTemplateError, match="cannot be combined"):
        render_chat(tok, MESSAGES, add_generation_prompt=True, continue_final_message=True)
    # Any role's last message can be left open (vLLM has no role rule either).
    opened = render_chat(
        tok, MESSAGES[:1], add_generation_prompt=False, continue_final_message=True
    )
    assert opened.endswith(MESSAGES[0]["content"])

    class NoTemplate:
        chat_template = None

    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(NoTemplate(), MESSAGES)


def test_a_template_that_raises_is_a_chat_template_error(tok: Any) -> None:
    strict = "{% for m in messages %}{% if m.role == 'system' %}" \
        "{{ raise_exception('system messages are not supported') }}{% endif %}" \
        "{{ m.content }}{% endfor %}"  # fmt: skip
    original = tok.chat_template
    tok.chat_template = strict
    try:
        assert render_chat(tok, MESSAGES[:1], add_generation_prompt=False) == "Hi"
        with pytest.raises(ChatTemplateError, match="system messages are not supported"):
            render_chat(tok, [{"role": "system", "content": "x"}], add_generation_prompt=False)
    finally:
        tok.chat_template = original


def test_template_kwargs_and_message_names_reach_the_template(tok: Any) -> None:
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking) and a message's `name`
    are the template's to use."""
    template = (
        "{% for m in messages %}[{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}]"
        "{{ m.content }}{% endfor %}{% if enable_thinking is defined and not enable_thinking %}"
        "<no-think>{% endif %}"
    )
    original = tok.chat_template
    tok.chat_template = template
    try:
        named = [{"role": "user", "content": "hi", "name": "bob"}]
        assert render_chat(tok, named, add_generation_prompt=False) == "[user:bob]hi"
        quiet = render_chat(
            tok, named, add_generation_prompt=False, template_kwargs={"enable_thinking": False}
        )
        assert quiet == "[user:bob]hi<no-think>"
    finally:
        tok.chat_template = original


def test_offline_messages_follow_the_http_apis_rule(tok: Any) -> None:
    """OpenAI content-part lists and the developer role: the HTTP API joins the parts
    and maps developer to system; the offline LLM.chat passed messages as given (a
    template error on the list, and a 'developer' turn plus SmolLM2's default system
    prompt). One rule now (template_message), the same prompt either way."""
    from spur.actors.engine.shell.chat_template import template_message
    from spur.cluster.api_requests import ChatMessage

    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "you"}]
    chats = [
        [{"role": "user", "content": parts}],
        [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    ]
    for messages in chats:
        offline = chat_token_ids(tok, [template_message(m) for m in messages])
        http = chat_token_ids(tok, [ChatMessage(**m).template_dict() for m in messages])
        assert offline == http
    assert "Be brief." in tok.decode(offline) and "developer" not in tok.decode(offline)
    with pytest.raises(ChatTemplateError, match="content part 0 is of type 'image_url'"):
        template_message({"role": "user", "content": [{"type": "image_url", "image_url": {}}]})
