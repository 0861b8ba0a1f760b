"""Chat messages -> one prompt: what ``POST /v1/chat/completions`` feeds the model.

A language model continues text; a chat is a list of messages. The two meet in a *chat
template*, which writes the messages into one prompt that ends where the assistant's reply
starts. Models trained for chat ship theirs with the tokenizer (``tokenizer.chat_template``, a
Jinja template that Hugging Face's ``apply_chat_template`` renders); the server uses it when
there is one, as vLLM does.

Base models -- GPT-2, OPT, the offline ``tiny-gpt2`` / ``tiny-opt`` with their byte tokenizer --
have none. For them the server writes a plain template of its own (:func:`plain_template`): one
line ``role: content`` per message, then ``assistant:``, which the model continues::

    system: You are a helpful assistant.
    user: Hello!
    assistant:

A base model was never trained on this layout, so its replies are only a continuation of the
text; it is what vLLM would need a ``--chat-template`` for. The prompt's text is then tokenized
without special tokens (a template writes its own, e.g. a BOS, where it wants them).

>>> plain_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
'system: Be brief.\\nuser: Hi\\nassistant:'
"""

from __future__ import annotations


def plain_template(messages: list[dict]) -> str:
    """The fallback template: ``role: content`` lines, then ``assistant:``."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def chat_prompt(tokenizer, messages: list[dict]) -> str:
    """``messages`` (``{"role", "content"}`` dicts, content as text) as one prompt: the
    tokenizer's chat template if it has one, else :func:`plain_template`. A template that
    refuses the messages (e.g. roles that do not alternate) is a 400 naming ``messages``."""
    if not getattr(tokenizer, "chat_template", None):
        return plain_template(messages)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2's TemplateError, or the template's own raise_exception
        # Imported here: the demo renders chats with this module in a core install, which has
        # no pydantic (the [serve] extra's).
        from pagedlearn.serve.protocol import ProtocolError

        why = f"the model's chat template refused the messages: {e}"
        raise ProtocolError(why, "messages") from e


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """:func:`chat_prompt`, tokenized without adding special tokens."""
    text = chat_prompt(tokenizer, messages)
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))  # (the byte tokenizer adds none, and takes no option)
