"""Data plane: replay queue, admission gate, batching and balancing.

Pure Python + anyio + msgspec."""

from buffers.balance import ShardPlan, StepPlan, pack, plan_step, sequence_costs
from buffers.drop_accounting import DropHandler
from buffers.errors import (
    GateShutDown,
    NotEnoughGroups,
    QueueClosed,
    QueueFull,
    QueueTooSmall,
    SequenceTooLong,
    WouldBlock,
)
from buffers.partition import partition
from buffers.queue_records import (
    DROP_STALE,
    BucketStatistics,
    Dropped,
    QueueItem,
    ReplayQueueSnapshot,
    ReplayQueueStatistics,
    WaitStatistics,
)
from buffers.replay_queue import ReplayQueue
from buffers.staleness import AdmissionGate, GateSnapshot, GateStatistics

__all__ = [
    "DROP_STALE",
    "AdmissionGate",
    "BucketStatistics",
    "DropHandler",
    "Dropped",
    "GateShutDown",
    "GateSnapshot",
    "GateStatistics",
    "NotEnoughGroups",
    "QueueClosed",
    "QueueFull",
    "QueueItem",
    "QueueTooSmall",
    "ReplayQueue",
    "ReplayQueueSnapshot",
    "ReplayQueueStatistics",
    "SequenceTooLong",
    "ShardPlan",
    "StepPlan",
    "WaitStatistics",
    "WouldBlock",
    "pack",
    "partition",
    "plan_step",
    "sequence_costs",
]
