"""Chat messages to prompt tokens: the tokenizer's own chat template, or — for a
tokenizer without one (the embedded default's WordPiece vocabulary) — this plain one:

    system: You are terse.
    user: Hello
    assistant:

one ``role: content`` line per message, then ``assistant:`` for the model to go on;
it is tokenized with the tokenizer's special tokens (``[CLS] ... [SEP]`` for WordPiece)."""

from __future__ import annotations

from typing import Any, Sequence

from .protocol import ApiError, ChatMessage

__all__ = ["DEFAULT_CHAT_TEMPLATE", "chat_prompt_ids"]

#: The template used when the tokenizer has none (see the module docstring).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def chat_prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage]) -> list[int]:
    """The prompt token ids of ``messages`` under the tokenizer's chat template (or
    :data:`DEFAULT_CHAT_TEMPLATE`), ending with the assistant's turn."""
    if tokenizer is None:
        raise ApiError(400, "chat completions need a tokenizer; this model has none",
                       param="messages")
    own = getattr(tokenizer, "chat_template", None)
    convo = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(convo, chat_template=own or DEFAULT_CHAT_TEMPLATE,
                                             tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template that raises on these messages (roles, order)
        raise ApiError(400, f"messages: the chat template refused them: {e}",
                       param="messages") from e
    # a tokenizer's own template writes its special tokens itself; the plain one does not
    return list(tokenizer(text, add_special_tokens=not own).input_ids)
