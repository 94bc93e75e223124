"""The parallelism model and the MoE terms: each collective against a hand computation,
layouts as config keys (none given: nothing changes), the MoE shape from config.json,
activation recompute and the old log-prob pass."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from async_rl.config import Config
from async_rl.sim.architecture import moe_layout
from async_rl.sim.costs import Costs, ModelShape, Plan
from async_rl.sim.hardware_file import load_hardware
from async_rl.sim.parallel import Collectives, Dims, Layout, Links, all_reduce, all_to_all
from async_rl.sim.run import simulation_costs
from async_rl.sim.workers import proximal_pass
from buffers.common.config import ConfigError

LINKS = Links(per_node=8, intra_bandwidth=400e9, intra_latency=1e-5, inter_bandwidth=50e9,
              inter_latency=3e-5)
DIMS = Dims(layers=4, hidden=1000, moe_layers=4, experts_per_token=8,
            kv_bytes_per_token=4 * 2 * 1000, activation_bytes=2.0)


def test_all_reduce_and_all_to_all_against_a_hand_computation() -> None:
    assert all_reduce(1e6, 4, 1e11, 1e-5) == pytest.approx(2 * 3 / 4 * 1e6 / 1e11 + 1e-5)
    assert all_reduce(1e6, 1, 1e11, 1e-5) == 0.0
    # 16 members over two nodes: 7/16 of the bytes stay on the node, 8/16 cross the NIC.
    assert all_to_all(8e6, 16, 16, LINKS) == pytest.approx(
        max(8e6 * 7 / 16 / 400e9, 8e6 * 8 / 16 / 50e9) + 3e-5)
    assert all_to_all(8e6, 8, 8, LINKS) == pytest.approx(8e6 * 7 / 8 / 400e9 + 1e-5)
    assert all_to_all(8e6, 1, 1, LINKS) == 0.0


def test_decode_pays_tensor_parallel_all_reduces_per_layer() -> None:
    c = Collectives(DIMS, LINKS, Layout(tp=4, given=True), Layout())
    calls = 2 * 4  # 2 all-reduces per layer, 4 layers
    assert c.decode_fixed_s == pytest.approx(calls * 1e-5)
    assert c.decode_token_s == pytest.approx(calls * 2 * 3 / 4 * 1000 * 2 / 400e9)
    assert (c.train_fixed_s, c.train_token_s) == (0.0, 0.0)  # no trainer layout


def test_training_pays_expert_all_to_alls_per_moe_layer() -> None:
    c = Collectives(DIMS, LINKS, Layout(), Layout(ep=16, given=True))
    calls = 4 * 4  # dispatch and combine, forward and backward, 4 MoE layers
    sent = 8 * 1000 * 2  # a token to 8 experts
    assert c.train_fixed_s == pytest.approx(calls * 3e-5)
    assert c.train_token_s == pytest.approx(calls * max(sent * 7 / 16 / 400e9,
                                                        sent * 8 / 16 / 50e9))
    recompute = Collectives(DIMS, LINKS, Layout(), Layout(ep=16, given=True), recompute=True)
    assert recompute.train_token_s == pytest.approx(c.train_token_s * 6 / 4)


def test_context_and_pipeline_parallel_terms() -> None:
    cp = Collectives(DIMS, LINKS, Layout(), Layout(cp=2, given=True))
    kv_layer = 8000 / 4
    assert cp.train_token_s == pytest.approx(3 * 4 * 1 / 2 * kv_layer / 400e9)
    assert cp.train_fixed_s == pytest.approx(3 * 4 * 1e-5)
    pp = Collectives(DIMS, LINKS, Layout(pp=4, given=True), Layout(pp=4, given=True))
    assert pp.decode_token_s == pytest.approx(2000 / 400e9)  # one hop a stage
    assert pp.train_token_s == pytest.approx(2 * 2000 / 400e9)
    # Across nodes: a 16-device replica's hops cross the network.
    wide = Collectives(DIMS, LINKS, Layout(), Layout(tp=4, pp=4, given=True))
    tp_calls = 4 * 4 / 4  # a stage's layer, 4 all-reduces each
    assert wide.train_token_s == pytest.approx(
        tp_calls * 2 * 3 / 4 * 2000 / 400e9 + 2 * 2000 / 4 / 50e9)


SHAPE = ModelShape(parameters=30e9, active_parameters=3e9, kv_bytes_per_token=98304,
                   bytes_per_parameter=2.0, layers=48, hidden=2048, moe_layers=48,
                   experts_per_token=8)


def test_costs_add_the_collectives_and_nothing_without_a_layout() -> None:
    h = load_hardware("h100")
    plain = Costs(h, SHAPE)
    assert plain.collectives.decode_token_s == plain.collectives.train_token_s == 0.0
    wide = msgspec.structs.replace(h, devices_per_rollout_worker=8, devices_per_trainer_shard=8)
    flat = Costs(wide, SHAPE)
    laid = Costs(wide, SHAPE, Plan(rollout=Layout(tp=8, ep=8, given=True),
                                   trainer=Layout(tp=2, pp=4, ep=8, expert_stride=2,
                                                  given=True), shards=4))
    c = laid.collectives
    assert laid.decode_step(64, 1e5) == pytest.approx(
        flat.decode_step(64, 1e5) + c.decode_fixed_s + 64 * c.decode_token_s)
    assert laid.decode_steps(10, 64, 1e5) == pytest.approx(
        sum(laid.decode_step(64, 1e5 + 64 * s) for s in range(10)))
    assert laid.micro_batch([1000, 3000]) == pytest.approx(
        flat.micro_batch([1000, 3000]) + c.train_fixed_s + 4000 * c.train_token_s)
    assert laid.prefill(100) == pytest.approx(flat.prefill(100) + c.decode_fixed_s
                                              + 100 * c.decode_token_s)


def test_recompute_trains_with_a_second_forward() -> None:
    h = load_hardware("h100")
    flat = Costs(h, SHAPE)
    again = Costs(h, SHAPE, Plan(recompute=True))
    assert (again.micro_batch([2000]) - h.micro_batch_s) == pytest.approx(
        (flat.micro_batch([2000]) - h.micro_batch_s) * 8 / 6)
    assert again.forward_pass([2000]) == pytest.approx(again.micro_batch([2000]) / 4)


def test_moe_layout_from_config_json_fields() -> None:
    qwen3 = {"num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
             "decoder_sparse_step": 1, "mlp_only_layers": []}
    assert moe_layout(qwen3) == (48, 8)
    deepseek = {"num_hidden_layers": 61, "n_routed_experts": 256, "num_experts_per_tok": 8,
                "first_k_dense_replace": 3}
    assert moe_layout(deepseek) == (58, 8)
    assert moe_layout({"num_hidden_layers": 28}) == (0, 0)


def config(out: Path, **simulate_: object) -> Config:
    return msgspec.convert({
        "model": {"path": "not-needed"},
        "task": {"kind": "longtail", "eval_size": 0},
        "rollout": {"num_workers": 2, "group_size": 4, "max_new_tokens": 128},
        "queue": {"max_groups": 64, "bucket_edges": [128, 512]},
        "trainer": {"num_shards": 2, "groups_per_step": 8, "micro_batch_tokens": 512,
                    "mini_batches": 2},
        "run": {"num_steps": 3, "output_dir": str(out), "progress": False, "eval_every": 0},
        "simulate": {"parameters": 4.0e8, "kv_bytes_per_token": 4096, "hardware": "h100",
                     **simulate_},
    }, Config)


def test_layouts_as_config_keys_set_the_devices_and_are_checked(tmp_path: Path) -> None:
    plain = simulation_costs(config(tmp_path))
    assert not plain.plan.rollout.given and not plain.plan.trainer.given
    costs = simulation_costs(config(
        tmp_path, rollout_layout={"tp": 4, "ep": 4}, trainer_layout={"tp": 2, "pp": 2, "dp": 2},
        architecture={"layers": 24, "hidden_size": 1024, "experts": 64,
                      "experts_per_token": 4}))
    assert costs.hardware.devices_per_rollout_worker == 4
    assert costs.hardware.devices_per_trainer_shard == 4
    assert costs.model.moe_layers == 24 and costs.model.experts_per_token == 4
    assert costs.collectives.decode_token_s > 0 and costs.collectives.train_token_s > 0
    with pytest.raises(ConfigError, match=r"trainer_layout\.dp"):
        simulation_costs(config(tmp_path, trainer_layout={"dp": 3}))
    with pytest.raises(ConfigError, match="devices_per_rollout_worker"):
        simulation_costs(config(tmp_path, rollout_layout={"tp": 2},
                                hardware_overrides={"devices_per_rollout_worker": 4}))
    with pytest.raises(ConfigError, match=r"rollout_layout\.ep"):
        simulation_costs(config(tmp_path, rollout_layout={"tp": 2, "ep": 4}))


def test_the_old_logprob_pass_follows_the_trainer_unless_told(tmp_path: Path) -> None:
    base = config(tmp_path)
    assert proximal_pass(base, 2) and not proximal_pass(base, 1)
    always = config(tmp_path, old_logprob_pass="always")
    assert proximal_pass(always, 1)
    never = config(tmp_path, old_logprob_pass="never")
    assert not proximal_pass(never, 2)
