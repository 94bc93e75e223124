"""Stand-ins for what a ``TurnRunner`` is handed by a rollout worker: a tokenizer of one
id per character and vLLM's ``SamplingParams`` as far as the runner reads them. Shared
by the unit tests that drive real turns without an engine."""

from __future__ import annotations

import copy
from typing import Any


class ByteTokenizer:
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


class Params:
    def __init__(self) -> None:
        self.max_tokens, self.stop, self.detokenize = 8, [], False
        self.include_stop_str_in_output, self.seed = False, None

    def clone(self) -> Params:
        return copy.copy(self)
