"""What a trainer shard writes to disk and reads back: the final model, the policy folder
an engine can start from, and its part of a checkpoint.

Owns: the policy's weights seen whole (ddp's replica itself; with fsdp2 gathered onto
rank 0; with LoRA the base weights and the adapters apart, or merged under the base
model's names), the tokenizer kept in memory for the saves, the shard's
``CheckpointWriter`` (``workers.trainer.checkpoint_folder`` has the folder's layout and writes
in the background) with its buffers made ahead of the first checkpoint, and the
co-located critic's state beside the policy's. Knows nothing about training steps,
weight broadcasts, Ray, or the checkpoint's manifest and rotation
(``async_rl.control.checkpoint_files``).
"""

from __future__ import annotations

from typing import Any

import torch

from workers.trainer.checkpoint_folder import CheckpointWriter, load
from workers.trainer.config import Backend
from workers.trainer.critic import Critic
from workers.trainer.fsdp import full_shapes, full_state
from workers.trainer.lora import LoraPolicy, adapter_state, merged_state


class ShardSaves:
    """One trainer shard's saves and checkpoints; ``TrainerShard.setup`` builds it."""

    def __init__(self, *, rank: int, backend: Backend, module: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, tokenizer: Any,
                 lora: LoraPolicy | None, critic: Critic | None, save_merged: bool) -> None:
        """``tokenizer``: kept in memory, as model.path may be a checkpoint that a
        resumed run later rotates away (run.keep_checkpoints); ``save_merged``: with LoRA,
        ``save`` writes the merged policy too (run.save_merged)."""
        self.rank = rank
        self.backend = backend
        self.module = module
        self.optimizer = optimizer
        self.tokenizer = tokenizer
        self.lora = lora
        self.critic = critic
        self.save_merged = save_merged
        self.writer = CheckpointWriter(rank=rank, backend=backend)

    def whole(self) -> dict[str, torch.Tensor]:
        """The model's state dict, whole: ddp's replica itself; with fsdp2 gathered onto
        rank 0 in CPU memory ({} on the other shards, which must call it too). With LoRA
        it holds the base weights and the adapters apart."""
        if self.backend == "fsdp2":
            return full_state(self.module)
        return {name: t.detach() for name, t in self.module.state_dict().items()}

    def policy(self) -> dict[str, torch.Tensor]:
        """The policy's weights, whole, under the base model's names (with LoRA, the
        adapters merged in); {} where ``whole`` is."""
        whole = self.whole()
        return merged_state(whole, self.lora.lora) if self.lora and whole else whole

    def save(self, out_dir: str) -> bool:
        """Writes the current policy in Hugging Face format (model only); False on an
        fsdp2 shard that only took part in the gather (it writes nothing)."""
        if self.lora is not None:  # the adapter in peft's format, and merged on request
            whole = self.whole()
            if whole:
                self.lora.save_final(out_dir, whole, self.tokenizer, self.module,
                                     merged=self.save_merged)
            return bool(whole)
        state = self.policy()
        if state:
            self.module.save_pretrained(out_dir, state_dict=state)  # type: ignore[operator]
        return bool(state)

    def save_policy(self, out_dir: str) -> None:
        """The policy as a Hugging Face model with its tokenizer: an engine can start
        from the folder (a restarted rollout worker, a resumed run). With LoRA: the base
        model's files and the adapter in ``adapter/``."""
        if self.lora is not None:
            whole = self.whole()
            if whole:
                self.lora.save_policy(out_dir, adapter_state(whole), self.tokenizer)
        elif self.save(out_dir):
            self.tokenizer.save_pretrained(out_dir)

    def save_checkpoint(self, out_dir: str) -> None:
        """Snapshots what a resumed run needs (``save_policy``'s folder, the optimizer
        and RNG state; ``workers.trainer.checkpoint_folder`` has the layout) and writes it in
        the background: ``checkpoint_written`` waits for it.

        ddp: shards are replicas, so one shard's copy is the checkpoint; fsdp2: every
        shard is called and writes its own part.
        """
        lora = self.lora
        self.writer.start(
            out_dir, module=self.module, optimizer=self.optimizer,
            whole=adapter_state(self.whole()) if lora else self.policy(),
            tokenizer=self.tokenizer,
            save_model=(lambda out, adapters: lora.save_policy(out, adapters, self.tokenizer))
            if lora else None)
        if self.critic is not None:
            self.critic.save(out_dir)  # small beside the policy: written here

    def prepare_checkpoint(self) -> None:
        """Starts making the snapshot buffers once, after the optimizer's first step
        (``CheckpointWriter.prepare``), so that the first checkpoint costs what later
        ones do."""
        if self.writer.prepared or not self.optimizer.state:
            return
        whole = (self.whole() if self.backend == "ddp"
                 else full_shapes(self.module) if self.rank == 0 else {})
        if self.lora is not None:
            whole = adapter_state(whole)
        self.writer.prepare(module=self.module, optimizer=self.optimizer, whole=whole)

    def checkpoint_written(self) -> None:
        """Returns once the last ``save_checkpoint`` is on disk; raises its error."""
        self.writer.wait()

    def load_training_state(self, checkpoint_dir: str) -> None:
        """Restores the optimizer (fsdp2: and model shards) and RNG state saved by
        ``save_checkpoint`` (the weights came with ``model.path`` pointing at the same
        folder); raises ``BackendMismatch`` for the other backend's checkpoint."""
        load(checkpoint_dir, backend=self.backend, module=self.module,
             optimizer=self.optimizer)
        if self.critic is not None:
            self.critic.load(checkpoint_dir)

    def close(self) -> None:
        """Waits for the last checkpoint's write."""
        self.writer.close()
