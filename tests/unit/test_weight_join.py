"""Joining the weight group on the CUDA transports, on CPU: the handshake vLLM's trainer
engines send (IPC's real one, NCCL's worker payload), what a malformed one does, and
an NCCL rendezvous that one engine never joins.

Ray is swapped for futures (``ray.wait`` and ``ray.get`` are all the client calls): the
members below answer each call as a rollout worker's actor would, or never.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerWeightTransferEngine,
    IPCWeightTransferEngine,
)
from vllm.distributed.weight_transfer.nccl_common import worker_init_payload
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerInitInfo,
    NCCLWeightTransferInitInfo,
)

from buffers.common.reports import BroadcastTiming
from workers.weights import group_client, vllm_trainer_end
from workers.weights.config import WeightsConfig
from workers.weights.group_client import GroupClient, GroupFailed
from workers.weights.sender import WeightSender


def _answered(value: Any = None) -> Future[Any]:
    answer: Future[Any] = Future()
    answer.set_result(value)
    return answer


class Member:
    """A rollout worker's actor as the client calls it: every call answers at once (the
    handshake: never, if it does not ``join``), each answer a future."""

    def __init__(self, rank: int, *, joins: bool = True) -> None:
        self.rank, self.joins = rank, joins
        self.payloads: list[dict[str, Any]] = []
        self.abandoned: list[str] = []
        self.init_weight_transfer = SimpleNamespace(remote=self._join)
        self.start_weight_update = SimpleNamespace(remote=lambda version, mode: _answered())
        self.update_weights = SimpleNamespace(remote=lambda info: _answered())
        self.finish_weight_update = SimpleNamespace(remote=self._finish)
        self.abandon_weight_update = SimpleNamespace(remote=self.abandoned.append)

    def _join(self, payload: dict[str, Any]) -> Future[Any]:
        self.payloads.append(payload)
        return _answered() if self.joins else Future()

    def _finish(self) -> Future[Any]:
        return _answered(BroadcastTiming(version=1, rollout_rank=self.rank, publish_s=0.0,
                                         transfer_s=0.0, pause_s=0.0, load_s=0.0))


@pytest.fixture(autouse=True)
def futures_for_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    def wait(refs: list[Future[Any]], *, num_returns: int, timeout: float
             ) -> tuple[list[Future[Any]], list[Future[Any]]]:
        done, _ = concurrent.futures.wait(refs, timeout=timeout)
        return [r for r in refs if r in done], [r for r in refs if r not in done]

    monkeypatch.setattr(group_client, "ray",
                        SimpleNamespace(wait=wait, get=lambda ref: ref.result()))


@pytest.fixture
def cuda_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    """What vLLM's IPC trainer engine asks CUDA when it is built (its GPU's UUID)."""
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(uuid="GPU-0"))


def test_the_ipc_handshake_reaches_the_engine_as_vllm_sends_it(cuda_queries: None) -> None:
    sender = WeightSender(WeightsConfig(transport="ipc"), address="127.0.0.1",
                          device=torch.device("cpu"))
    member = Member(0)
    client = GroupClient([(0, member)], 5.0, sender_bounds_transfer=False)
    engine = vllm_trainer_end.trainer_init(sender._init_info(1), client, sender._source)
    assert isinstance(engine, IPCTrainerWeightTransferEngine) and engine.packed
    (payload,) = member.payloads
    assert payload == {"packed": True}  # no rank: IPC has no group
    # What the engine's side builds of it (its parse_init_info: the class, called).
    assert IPCWeightTransferEngine.init_info_cls(**payload).packed


def test_the_nccl_handshake_gives_each_engine_its_rank() -> None:
    members = [Member(0), Member(1)]
    client = GroupClient(list(enumerate(members)), 5.0, sender_bounds_transfer=False)
    client.init_weight_transfer_engine(worker_init_payload(NCCLWeightTransferInitInfo(
        master_address="127.0.0.1", master_port=29600, rank_offset=1, world_size=3,
        packed=True)))
    parsed = [NCCLWeightTransferInitInfo(**m.payloads[0]) for m in members]
    assert [p.rank_offset for p in parsed] == [1, 2]
    assert all(p.world_size == 3 and p.packed for p in parsed)


@pytest.mark.parametrize("handshake", [
    ["packed"],
    {"rank_offset": "1", "world_size": 2},
    {"rank_offset": True, "world_size": 2},
    {"rank_offset": 1},  # a rendezvous with no size
    {"rank_offset": 1, "world_size": 3},  # a rank nobody takes: the group never forms
])
def test_a_malformed_handshake_is_a_group_failure_and_reaches_nobody(handshake: Any) -> None:
    member = Member(0)
    client = GroupClient([(0, member)], 5.0, sender_bounds_transfer=False)
    with pytest.raises(GroupFailed, match="malformed weight-transfer handshake"):
        client.init_weight_transfer_engine(handshake)
    assert member.payloads == []


class Engine:
    """A trainer engine whose send runs the protocol's calls, and no collective."""

    def __init__(self, client: GroupClient) -> None:
        self.client = client
        self.shut = False

    def send_weights(self) -> None:
        self.client.start_weight_update()
        self.client.update_weights({})
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.shut = True


def _sender(transport: str, timeout_s: float, members: list[Member]) -> WeightSender:
    sender = WeightSender(WeightsConfig(transport=transport,  # type: ignore[arg-type]
                                        timeout_s=timeout_s),
                          address="127.0.0.1", device=torch.device("cpu"))
    for member in members:
        sender.connect(member.rank, member)
    sender.snapshot(1, [("w", torch.zeros(2))])
    return sender


def test_a_malformed_handshake_fails_the_group_not_the_sender(
        monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Engine] = []

    def trainer_init(init_info: Any, *, client: GroupClient, source: Any) -> Engine:
        client.init_weight_transfer_engine({"packed": True, "rank_offset": 1})
        built.append(Engine(client))
        return built[-1]

    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init", trainer_init)
    member = Member(0)
    delivery = _sender("ipc", 5.0, [member]).send(1, [0])
    # Nobody is to blame: no member lost, none retried; it takes the next version.
    assert delivery.failed == [] and delivery.timings == [] and delivery.attempts == 1
    assert built == [] and member.payloads == [] and member.abandoned == []


@pytest.fixture
def endpoint_released() -> Iterator[threading.Event]:
    released = threading.Event()
    yield released
    released.set()


def test_an_nccl_rendezvous_one_engine_never_joins_fails_at_the_deadline(
        monkeypatch: pytest.MonkeyPatch, endpoint_released: threading.Event) -> None:
    groups: list[list[int]] = []
    late: list[Engine] = []

    def trainer_init(init_info: NCCLTrainerInitInfo, *, client: GroupClient,
                     source: Any) -> Engine:
        """vLLM's NCCL trainer engine in miniature: the members join on a side thread
        while this end's rendezvous waits for every one of them."""
        groups.append(client.ranks)
        payload = worker_init_payload(NCCLWeightTransferInitInfo(
            master_address=init_info.master_address, master_port=init_info.master_port,
            rank_offset=1, world_size=init_info.world_size, packed=init_info.packed))
        with ThreadPoolExecutor(max_workers=1) as side:
            joined = side.submit(client.init_weight_transfer_engine, payload)
            if not all(member.joins for _, member in client.members):
                endpoint_released.wait(10)  # no deadline of its own
                late.append(Engine(client))
                return late[-1]
            joined.result()
        return Engine(client)

    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init", trainer_init)
    members = [Member(0), Member(1, joins=False)]
    sender = _sender("nccl", 0.2, members)
    began = time.monotonic()
    delivery = sender.send(1, [0, 1])
    assert time.monotonic() - began < 3
    # Rebuilt without the engine that never joined; the other took the version.
    assert groups == [[0, 1], [0]] and delivery.attempts == 2
    assert delivery.failed == [1] and [t.rollout_rank for t in delivery.timings] == [0]
    (why,) = members[1].abandoned
    assert "did not answer in time" in why and members[0].abandoned == []
    endpoint_released.set()  # the first rendezvous completes after all, too late
    for _ in range(100):
        if late and late[0].shut:
            break
        time.sleep(0.02)
    assert late and late[0].shut  # nobody will use it
