"""How a prompt reaches the model: its raw text, or rendered by the tokenizer's chat template.

Owns: ``PromptFormat`` (task.chat_template and task.system_prompt: the only task knobs
the rollout workers and the evaluator need), ``conversation`` (a prompt as the messages
the template renders, the system prompt first), ``render`` (what an engine or the
evaluator is given: the text, or the template's token ids with the generation prompt) and
``observation_ids`` (the tokens a multi-turn environment's observation adds: its text,
or the template's tool turn) and ``encode_plain`` (text to ids as the tokenizer's
``encode`` gives them, quicker).
Training, evaluation on a rollout engine and the idle-CPU evaluator all call ``render``,
so the three see the same tokens, and the driver measures prompt lengths with it too
(too-long prompts are refused before they reach an engine). Knows nothing about engines.
"""

from __future__ import annotations

from typing import Any

import msgspec

from buffers.common.records import Prompt

Message = dict[str, str]


class PromptFormat(msgspec.Struct, frozen=True, kw_only=True):
    """How prompts are rendered (from task.chat_template and task.system_prompt)."""

    chat_template: bool = False
    """Render with the tokenizer's chat template (add_generation_prompt); else raw text."""
    system_prompt: str = ""
    """Prepended as a system message when the template is on ("" = none)."""


def conversation(prompt: Prompt, system_prompt: str = "") -> list[Message]:
    """``prompt`` as chat messages: its own, or its text as one user message; with
    ``system_prompt`` first unless the prompt's messages already start with a system
    message of their own."""
    messages = [dict(m) for m in prompt.messages] or [{"role": "user", "content": prompt.text}]
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render(tokenizer: Any, prompt: Prompt, fmt: PromptFormat) -> str | list[int]:
    """What the model is given for ``prompt``: its text (the engine tokenises it, as the
    tokenizer's ``encode`` does), or, with the chat template on, the template's token ids
    (``apply_chat_template(..., add_generation_prompt=True)``), which engines take as
    they are."""
    if not fmt.chat_template:
        return prompt.text
    ids = tokenizer.apply_chat_template(conversation(prompt, fmt.system_prompt),
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    return [int(i) for i in ids]


_MARK = "\u2063async-rl-turn\u2063"
"""A placeholder assistant message: what the template writes after it is the tool turn."""


def encode_plain(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=special)``, through a fast tokenizer's
    own backend when its settings make that the same (no truncation or padding set,
    special tokens not split): 20 us a call against 45 us through transformers' Python
    (the test models' tokenizer; a gateway turn makes one or two)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (getattr(tokenizer, "is_fast", False) and backend is not None
            and backend.truncation is None and backend.padding is None
            and backend.encode_special_tokens
            == bool(getattr(tokenizer, "split_special_tokens", False))):
        return list(backend.encode(text, add_special_tokens=special).ids)
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=special)]


def observation_ids(tokenizer: Any, observation: str, fmt: PromptFormat,
                    after_eos: bool = False) -> list[int]:
    """The tokens an environment's observation adds to a trajectory: its text as the
    tokenizer's ``encode`` gives it; with the chat template on, the template's end of
    the assistant turn, a tool turn holding it (a user turn where the template has no
    tool role) and the next generation prompt. ``after_eos``: the policy's turn ended
    with the EOS token, which then is not written again."""
    if not fmt.chat_template:
        return encode_plain(tokenizer, observation)
    head = [{"role": "user", "content": "."}, {"role": "assistant", "content": _MARK}]
    text = ""
    for role in ("tool", "user"):
        try:
            text = str(tokenizer.apply_chat_template(
                [*head, {"role": role, "content": observation}],
                add_generation_prompt=True, tokenize=False))
        except Exception:  # a template that refuses the tool role
            continue
        if observation in text:
            break
    turn = text[text.index(_MARK) + len(_MARK):] if _MARK in text else observation
    eos = getattr(tokenizer, "eos_token", None)
    if after_eos and eos and turn.startswith(eos):
        turn = turn[len(eos):]
    return encode_plain(tokenizer, turn)


def prompt_tokens(tokenizer: Any, prompt: Prompt, fmt: PromptFormat) -> int:
    """How many tokens the model sees for ``prompt`` (``render``'s, tokenised)."""
    rendered = render(tokenizer, prompt, fmt)
    return len(rendered) if isinstance(rendered, list) else len(tokenizer.encode(rendered))


def reward_prompt(prompt: Prompt, fmt: PromptFormat) -> str | list[Message]:
    """The prompt as the task's own rewards get it: its text, or, with the chat template
    on, its conversation (system prompt included), as TRL passes conversational
    prompts."""
    return conversation(prompt, fmt.system_prompt) if fmt.chat_template else prompt.text
