"""The one chat-templating function: messages -> token ids, through the
tokenizer's own template. Used by the HTTP ingress (chat completions and
/tokenize) and the offline `LLM.chat_prompt`. No torch, no Ray: the tokenizer
is passed in (any object with `apply_chat_template` and `__call__`).

    messages ──template (jinja, the model's)──> text ──tokenizer(no special tokens)──> ids

The template already writes the special tokens (BOS, role markers), so the
text is tokenized without adding them again (unless the caller asks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class ChatTemplateError(ValueError):
    """The messages cannot be templated for this model: it has no chat template,
    the template refused them (its own `raise_exception`), or the options
    contradict each other. The message names the problem; an HTTP API answers 400."""


ROLE_ALIASES = {"developer": "system"}
"""Roles a template gets under another name: `developer` is OpenAI's newer name for
`system`, which chat templates know."""


def join_text_parts(texts: Sequence[str]) -> str:
    """A message's text parts as one string: joined with newlines, as vLLM does."""
    return "\n".join(texts)


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message in OpenAI's form as a chat template gets it (the offline `LLM.chat`;
    the HTTP API's validated messages follow the same rule): role through
    ROLE_ALIASES, content given as text parts joined (`join_text_parts`), every other
    key as given. Raises ChatTemplateError for a part that is not text."""
    out = dict(message)
    role = out.get("role")
    if isinstance(role, str):
        out["role"] = ROLE_ALIASES.get(role, role)
    content = out.get("content")
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ChatTemplateError(
                    f"content part {i} is of type {kind!r}: only text parts are supported "
                    "(give the content as a string or as {'type': 'text', 'text': ...} parts)"
                )
            texts.append(str(part.get("text") or ""))
        out["content"] = join_text_parts(texts)
    return out


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    instead: str | None = None,
) -> str:
    """The prompt text of `messages` by the tokenizer's chat template.

    `add_generation_prompt`: end with the assistant's turn opener (the model then
    answers). `continue_final_message`: leave the last (assistant) message open,
    so that the model continues it; exclusive with `add_generation_prompt`.
    `template_kwargs`: extra variables for the template (vLLM's chat_template_kwargs,
    e.g. {"enable_thinking": False}); they cannot replace the arguments above.
    `instead`: what the caller's user can do without a template or tokenizer, in the
    error's words (None: the HTTP API's, /v1/completions; the offline LLM and
    `spur generate --chat` name theirs).

    Raises:
        ChatTemplateError: see the class.
    """
    if tokenizer is None:
        raise ChatTemplateError(
            f"the model has no tokenizer: {instead or 'send token ids to /v1/completions'}"
        )
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError(
            "continue_final_message cannot be combined with add_generation_prompt=true: "
            "set one of them to false"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            "the model has no chat template: "
            + (
                instead
                or "use /v1/completions with a prompt you format yourself, or serve a model "
                "whose tokenizer has a chat template"
            )
        )
    try:
        text = tokenizer.apply_chat_template(
            list(messages),
            **(template_kwargs or {}),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
        )
    except ChatTemplateError:
        raise
    except Exception as exc:  # jinja2.TemplateError (raise_exception), ValueError, ...
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ChatTemplateError(
            f"the model's chat template refused the messages: {detail}"
        ) from None
    if not isinstance(text, str):  # pragma: no cover - tokenize=False returns text
        raise ChatTemplateError("the chat template did not produce text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # the messages are checked: a kwarg's string
        raise ChatTemplateError(
            f"the chat template's text holds {text[exc.start : exc.end]!r}, which is not "
            "UTF-8 (a lone surrogate): send valid text in chat_template_kwargs"
        ) from None
    return text


def chat_token_ids(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    instead: str | None = None,
) -> list[int]:
    """Token ids of `messages` (see `render_chat`, which `instead` goes to);
    `add_special_tokens` adds the tokenizer's own (BOS, ...) on top of what the template
    writes (default: no).

    Raises:
        ChatTemplateError: see the class.
    """
    text = render_chat(
        tokenizer,
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
        instead=instead,
    )
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
