"""What the trainer-side workers are built from: ``TrainerSpec`` for a trainer shard,
``ReferenceSpec`` and ``CriticSpec`` for the reference and the critic on workers of
their own.

Owns: the frozen records ``workers.trainer.shard.TrainerShard`` and
``workers.trainer.role_workers``' workers take, filled by the run's roster
(``async_rl.roster``: role paths resolved, which shards write checkpoints) or by a test
or bench. A process group's address (``master_addr``, ``master_port``) is known only
once its first member is placed: the roster leaves it empty and the Ray shell fills it
in just before it creates the actor.
"""

from __future__ import annotations

import msgspec

from workers.model_config import ModelConfig
from workers.rollout.config import Sampling
from workers.trainer.config import TrainerConfig
from workers.trainer.roles_config import CriticConfig
from workers.weights.config import WeightsConfig


class TrainerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One trainer shard: the policy on one device, a replica (ddp) or a shard (fsdp2)
    among ``world_size``."""

    rank: int
    world_size: int
    model: ModelConfig
    """The policy it starts from (model.path: a resumed run's checkpoint folder)."""
    trainer: TrainerConfig
    seed: int
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    """How the rollout workers sample (the one extra it takes of the rollout section)."""
    cpu_ids: tuple[int, ...] = ()
    """Cores it owns (CPU only); empty: no pinning."""
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    """The shards' process group: on shard 0's node."""
    record_spans: bool = True
    writes_checkpoints: bool = False
    """``save_checkpoint`` will be called on it: it makes its buffers ahead."""
    reference_path: str = ""
    """The frozen reference's weights beside the policy, path resolved ("" = none)."""
    critic: CriticConfig | None = None
    """The critic's section beside the policy, path resolved (None = none)."""
    own_roles: tuple[str, ...] = ()
    """The roles on workers of their own ("reference", "critic"), whose outputs it takes
    for each step."""
    save_merged: bool = False
    """With LoRA, ``save`` writes the merged policy too (run.save_merged)."""


class OwnRoleSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a role's worker of its own shares with a trainer shard's process."""

    rank: int
    model: ModelConfig
    """The policy's section: its dtype (the role's weights have their own path)."""
    trainer: TrainerConfig
    temperature: float
    """rollout.temperature: logprobs are of logits / temperature."""
    cpu_ids: tuple[int, ...] = ()
    record_spans: bool = True


class ReferenceSpec(OwnRoleSpec, frozen=True, kw_only=True):
    """The frozen reference on a worker of its own."""

    path: str
    """Its weights (reference.path, resolved: "" is the policy's initial weights)."""


class CriticSpec(OwnRoleSpec, frozen=True, kw_only=True):
    """One critic shard on a worker of its own, a DDP replica among ``world_size``."""

    critic: CriticConfig
    """Its section, the path resolved."""
    world_size: int = 1
    """critic.num_shards."""
    master_addr: str = "127.0.0.1"
    master_port: int = 29600
    """The critic workers' own process group: on the first one's node."""
