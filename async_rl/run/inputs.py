"""A run's inputs checked before anything starts: what would otherwise fail in a worker.

Owns: ``check_inputs`` (autopilot.keys are live keys; the model is a Hugging Face model,
in a local directory or the hub cache: ``async_rl.run.model_source``; the prompt file or
dataset reads and has the columns the task names; the tokenizer has the chat template
the task asks for; the task's own reward functions, named in task.rewards or passed as
callables, import and can take a completion on those columns; task.eval_reward names
one; the environment class of task.environment imports and has its methods; the optional
loggers are installed; trainer.backend = "fsdp2" finds the model's decoder layers;
trainer.packed = true is not asked of a model whose features the packed path cannot
compute (``workers.trainer.packed_support``); trainer.router_aux_coef > 0 has a model
with routers; without model.lora, full weight versions can reach the engine of the
model's type (``workers.rollout.engine.update_refusal``); reference.path and critic.path
are models of the policy's architecture and tokenizer; rollout.tool_call_parser names a
tool parser of the installed vLLM that can use the model's tokenizer;
rollout.chat_template is a Jinja file that renders a conversation with it), raising
``ConfigError`` with one line. Used by ``async_rl.train`` (so ``async-rl train``) and by
each trial of ``async-rl sweep`` before it is launched.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from functools import cache, partial
from pathlib import Path
from typing import Any

import msgspec

from async_rl.config import Config
from async_rl.knobs import check_live
from async_rl.run.loggers import check_installed
from async_rl.run.model_source import resolve_model_path
from async_rl.tasks.table import check_task
from buffers.common.config import ConfigError
from workers.common.errors import first_line
from workers.rewards.callables import Reward, check_function
from workers.rewards.spec import load_reward, reward_name, unique_names
from workers.rollout.environment import environment_class


def check_inputs(config: Config, rewards: Sequence[Reward] = ()) -> Config:
    """Fails fast, in one line, on inputs that would otherwise fail inside a worker.

    Returns ``config`` with ``model.path`` resolved to the local directory the workers
    load (a hub id's snapshot in the hub cache); ``rewards``: the callables a script
    passes besides ``task.rewards`` (``async_rl.train``).
    """
    check_installed(config.run.loggers)
    check_live(config)  # autopilot.keys
    path = resolve_model_path(config.model.path, task_kind=config.task.kind)
    config = msgspec.structs.replace(
        config, model=msgspec.structs.replace(config.model, path=path))
    if config.trainer.backend == "fsdp2":
        check_shardable(config.model.path)
    if config.trainer.packed:
        check_packed(config.model.path)
    if config.trainer.router_aux_coef > 0:
        check_router(config.model.path, config.trainer.router_aux_coef)
    check_role_models(config)
    if config.model.lora.enabled:
        check_lora_targets(config)
    else:
        check_engine_updates(config.model.path)
    columns = check_task(config.task)  # the prompt file or dataset
    tokenizer = cache(partial(_load_tokenizer, config.model.path))  # once, if asked
    if config.task.chat_template:
        check_chat_template(config, tokenizer)
    check_rewards(config, columns)
    if config.task.environment.enabled:
        check_environment(config)
    if config.rollout.tool_call_parser:
        check_tool_parser(config, tokenizer)
    if config.rollout.chat_template:
        config = check_gateway_template(config, tokenizer)
    for index, reward in enumerate(rewards):
        check_function(reward, index=index, columns=columns)  # naming rewards[i]
    return config


def _load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def check_tool_parser(config: Config, tokenizer: Callable[[], Any]) -> None:
    """rollout.tool_call_parser names one of the installed vLLM's tool parsers (what its
    ``--tool-call-parser`` takes), and it can read the tokenizer of model.path
    (``tokenizer()``)."""
    from workers.rollout.tool_parser import VllmToolParser, parser_names

    name, path = config.rollout.tool_call_parser, config.model.path
    names = parser_names()
    if name not in names:
        raise ConfigError(f"config error: rollout.tool_call_parser = {name!r}: not a tool "
                          f"parser of the installed vLLM (one of {', '.join(names)})")
    try:
        VllmToolParser(name, tokenizer())
    except Exception as err:
        raise ConfigError(f"config error: rollout.tool_call_parser = {name!r}: it cannot "
                          f"use the tokenizer of model.path = {path!r}: {first_line(err)}"
                          ) from None


TEMPLATE_PROBE = ({"role": "system", "content": "You add."},
                  {"role": "user", "content": "1+2="},
                  {"role": "assistant", "content": "3"},
                  {"role": "user", "content": "2+3="})
"""The conversation a rollout.chat_template must render (every role a chat agent sends
without tools)."""


def check_gateway_template(config: Config, tokenizer: Callable[[], Any]) -> Config:
    """rollout.chat_template is a Jinja file that renders a conversation with the
    tokenizer of model.path (``tokenizer()``); returns ``config`` with its path made
    absolute (the rollout workers read it)."""
    key = f"rollout.chat_template = {config.rollout.chat_template!r}"
    path = Path(config.rollout.chat_template)
    if not path.is_file():
        raise ConfigError(f"config error: {key}: no such file")
    try:
        tokenizer().apply_chat_template(list(TEMPLATE_PROBE), chat_template=path.read_text(),
                                      add_generation_prompt=True, tokenize=False)
    except Exception as err:
        raise ConfigError(f"config error: {key}: it does not render a conversation: "
                          f"{first_line(err)}") from None
    return msgspec.structs.replace(config, rollout=msgspec.structs.replace(
        config.rollout, chat_template=str(path.resolve())))


def check_shardable(model_path: str) -> None:
    """trainer.backend = "fsdp2" shards the model per decoder layer: its Hugging Face
    class must name them (``_no_split_modules``)."""
    from workers.trainer.fsdp import layer_classes

    if not layer_classes(model_path):
        raise ConfigError(
            f"config error: trainer.backend = 'fsdp2': the decoder layers of model.path = "
            f"{model_path!r} cannot be found (its transformers class names none in "
            "_no_split_modules); use trainer.backend = 'ddp'")


def check_router(model_path: str, coef: float) -> None:
    """trainer.router_aux_coef > 0 needs a mixture-of-experts model: one whose
    transformers config has ``output_router_logits`` (its class then returns the router
    load-balancing loss)."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_path)
    if not hasattr(hf_config, "output_router_logits"):
        raise ConfigError(
            f"config error: trainer.router_aux_coef = {coef}: model.path = {model_path!r} "
            f"({hf_config.model_type}) has no mixture-of-experts routers; set it to 0")


def check_packed(model_path: str) -> None:
    """trainer.packed = true: the model has no feature the packed layout computes
    otherwise than the model itself (its config.json read, no weights)."""
    from transformers import AutoConfig

    from workers.trainer.packed_support import packed_support

    reason = packed_support(AutoConfig.from_pretrained(model_path))
    if reason is not None:
        raise ConfigError(f"config error: trainer.packed = true: {reason}")


def check_engine_updates(model_path: str) -> None:
    """Full weight versions (no model.lora) reach an engine of the model's type
    (``workers.rollout.engine.update_refusal``; config.json read, no weights)."""
    from workers.rollout.engine import update_refusal

    hf_config = json.loads((Path(model_path) / "config.json").read_text())
    reason = update_refusal(str(hf_config.get("text_config", hf_config).get("model_type")))
    if reason is not None:
        raise ConfigError(f"config error: model.path = {model_path!r}: {reason}")


def check_role_models(config: Config) -> None:
    """reference.path and critic.path (when their role is built) hold a model of the
    policy's architecture whose tokenizer has the policy's vocabulary: the reference's
    logprobs and the critic's values are of the policy's tokens."""
    from transformers import AutoTokenizer

    roles = (("reference.path", config.reference.path, config.has_reference),
             ("critic.path", config.critic.path, config.has_critic))
    wanted = [(key, path) for key, path, built in roles if built and path]
    if not wanted:
        return
    policy = _architecture(config.model.path)
    for key, path in wanted:
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"config error: {key} = {path!r}: no Hugging Face model there "
                              "(config.json not found)")
        if (found := _architecture(path)) != policy:
            raise ConfigError(f"config error: {key} = {path!r}: architecture {found} is not "
                              f"the policy's ({policy}, model.path)")
    vocabulary = AutoTokenizer.from_pretrained(config.model.path).get_vocab()
    for key, path in wanted:
        if AutoTokenizer.from_pretrained(path).get_vocab() != vocabulary:
            raise ConfigError(f"config error: {key} = {path!r}: its tokenizer is not the "
                              "policy's (model.path): the vocabularies differ")


def _architecture(model_dir: str) -> str:
    """A model folder's class and type, from its config.json."""
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    return f"{','.join(hf_config.get('architectures') or [])}/{hf_config.get('model_type')}"


def check_lora_targets(config: Config) -> None:
    """model.lora.target_modules name linear layers the model has, and not its output
    embedding: the packed trainer's fused head reads the head's base weight, and vLLM
    serves an adapter on the head only for some architectures (not Qwen2's)."""
    from workers.trainer.lora import head_targets, layer_names

    targets = list(config.model.lora.target_modules)
    present, head = layer_names(config.model.path)
    missing = [name for name in targets if name not in present]
    if missing:
        raise ConfigError(
            f"config error: model.lora.target_modules = {targets}: {missing} not among the "
            f"linear layers of model.path = {config.model.path!r} ({sorted(present)})")
    if on_head := head_targets(targets, head):
        raise ConfigError(
            f"config error: model.lora.target_modules = {targets}: {on_head} is the output "
            f"embedding ({head!r}) of model.path = {config.model.path!r}; LoRA on the LM "
            "head is not supported, remove it")


def check_chat_template(config: Config, tokenizer: Callable[[], Any]) -> None:
    """task.chat_template = true needs a tokenizer (``tokenizer()``) with a chat
    template."""
    if not getattr(tokenizer(), "chat_template", None):
        raise ConfigError(
            f"config error: task.chat_template = true: the tokenizer of model.path = "
            f"{config.model.path!r} has no chat template (set task.chat_template = false)")


def check_rewards(config: Config, columns: tuple[str, ...]) -> None:
    """Each of task.rewards imports and takes a completion on rows with ``columns``;
    task.eval_reward names one of them."""
    specs = config.task.rewards
    # ConfigError naming task.rewards[i]
    functions = [load_reward(spec, index=i, columns=columns) for i, spec in enumerate(specs)]
    wanted = config.task.eval_reward
    if not wanted:
        return
    try:
        names = unique_names([reward_name(f) for f in functions], [s.name for s in specs])
    except ValueError:
        return  # clashing names: the run's reward runner says so, naming both
    if wanted not in names:
        raise ConfigError(f"config error: task.eval_reward = {wanted!r}: not one of "
                          f"task.rewards (their names: {', '.join(names)})")


def check_environment(config: Config) -> None:
    """task.environment's class imports and has its methods; a trajectory fits the
    model's context (``max_position_embeddings``, what vLLM sizes the engine by)."""
    env = config.task.environment
    environment_class(env)  # ConfigError naming task.environment.class
    try:
        model = json.loads((Path(config.model.path) / "config.json").read_text())
    except (OSError, ValueError):
        return  # resolve_model_path has judged the folder already
    context = model.get("max_position_embeddings", 0)
    if isinstance(context, int) and 0 < context < env.max_trajectory_tokens:
        raise ConfigError(
            f"config error: task.environment.max_trajectory_tokens = "
            f"{env.max_trajectory_tokens}: longer than the model's context ({context} "
            f"tokens, max_position_embeddings of {config.model.path})")
