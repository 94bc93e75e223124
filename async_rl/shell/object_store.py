"""Groups' tokens in Ray's object store, as a checkpoint of the replay queue needs them.

Owns: ``RayTokens``, the shell's ``TokenStore``: a checkpoint fetches the queued groups'
``GroupTokens`` from the object store to write them (each fetch with a deadline, a
group whose rollout worker is gone coming back as None), and a resumed run puts them
back, the driver owning the new objects. The one place the driver holds tokens: the
queue's groups, while a checkpoint is written or a resume restores them. Knows nothing
about the run's logic.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import anyio
import ray

from buffers.common.concurrent_calls import each
from buffers.common.records import GroupTokens, TokensRef
from workers.common.errors import first_line

log = logging.getLogger(__name__)


class RayTokens:
    """The object store as the checkpoints' ``TokenStore``; ``timeout_s``: the longest
    one fetch may take (run.call_timeout_s)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    async def fetch(self, refs: Sequence[TokensRef]) -> list[GroupTokens | None]:
        return await each([functools.partial(self._one, ref) for ref in refs])

    async def _one(self, ref: TokensRef) -> GroupTokens | None:
        if not isinstance(ref, ray.ObjectRef):
            return ref if isinstance(ref, GroupTokens) else None
        try:
            with anyio.fail_after(self.timeout_s):
                tokens = await ref
        except (ray.exceptions.RayError, TimeoutError) as err:
            log.debug("a queued group's tokens cannot be fetched: %s", first_line(err))
            return None
        return tokens if isinstance(tokens, GroupTokens) else None

    def put(self, tokens: GroupTokens) -> TokensRef:
        return ray.put(tokens)
