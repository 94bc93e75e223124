"""A tiny local Qwen2 model with a byte-level tokenizer, warm-started on a built-in task.

Owns: the tokenizer (one token per byte, saved in Hugging Face format), the model config,
the short supervised warm start that makes the base policy weak but not hopeless, and a
fast transformers-side greedy evaluation. Knows nothing about vLLM, Ray, RL or checkpoints:
what it writes is an ordinary ``save_pretrained`` directory that
``AutoTokenizer``/``AutoModelForCausalLM`` and vLLM load by path. Nothing is downloaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import msgspec
import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from async_rl.models.tool_eval import evaluate_with_environment
from async_rl.models.warm_start import supervised_warm_start
from async_rl.tasks.calculator import (
    CALL_CLOSE,
    MAX_TURNS,
    TURN_MAX_NEW_TOKENS,
    CalculatorEnv,
    CalculatorTask,
)
from async_rl.tasks.longtail import MAX_NEW_TOKENS as LONGTAIL_MAX_NEW_TOKENS
from async_rl.tasks.longtail import RemainderTask
from async_rl.tasks.rewards import EOS_TEXT, arithmetic_reward, remainder_reward
from async_rl.tasks.sources import ArithmeticTask
from workers.eval.greedy import evaluate_accuracy
from workers.rewards.function import RewardFn

PAD_TEXT: Final = "<pad>"
UNK_TEXT: Final = "<unk>"
PAD_ID: Final = 0
EOS_ID: Final = 1
UNK_ID: Final = 2
# transformers' Qwen2Tokenizer pre-tokenizer split (see build_tokenizer for why it matters).
_QWEN2_SPLIT: Final = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
BYTE_OFFSET: Final = 3
"""Token id of byte ``b`` is ``BYTE_OFFSET + b``; ids 0-2 are the specials."""
VOCAB_SIZE: Final = 264
"""3 specials + 256 bytes + 5 reserved tokens: a multiple of 8 (tidy matmul shapes)."""
CHAT_TEMPLATE: Final = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""The tokenizer's chat template (Jinja): ``<|role|>content`` lines, then
``<|assistant|>`` for the generation prompt. Short, since the model's context is short;
the role markers are plain bytes, so the warm start (on raw prompts) is unchanged."""


def _byte_symbols() -> list[str]:
    # GPT-2's byte-to-unicode table, the alphabet of a ByteLevel pre-tokenizer: printable
    # bytes stand for themselves, the rest are shifted above U+0100 (space is "Ġ").
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    table = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    return [table[b] for b in range(256)]


class MadeModel(msgspec.Struct, frozen=True, kw_only=True):
    """What ``make_model`` wrote and how good the base policy is."""

    path: str
    """Directory holding config, weights, generation config and tokenizer."""
    size: str
    """Name of the ``ModelSize`` it was built at."""
    num_parameters: int
    base_accuracy: float
    """Greedy exact-answer accuracy on the task's held-out eval set after the warm start."""
    eval_size: int
    seed: int
    sft_steps: int
    teacher_accuracy: float
    task: str = "arithmetic"
    """The built-in task (``task.kind``) it was warm-started and measured on; an RL run
    should use the same task."""
    max_operand: int
    """The arithmetic task's ``max_operand`` (arithmetic builds only)."""
    dtype: str
    """Weight dtype in config.json. vLLM's CPU build turns ``dtype="auto"`` for float32
    weights into bfloat16, so pass ``dtype="float32"`` to it explicitly."""
    seconds: float
    """Wall time of the whole build (warm start, evaluation, save)."""


class ModelSize(msgspec.Struct, frozen=True, kw_only=True):
    """A model shape and the warm start tuned for it."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    sft_steps: int
    """Warm-start steps on the arithmetic task that leave the model knowing the
    arithmetic but preferring the teacher's wrong last digit (see
    ``async_rl.models.warm_start.supervised_warm_start``)."""
    sft_lr: float


TINY: Final = ModelSize(name="tiny", hidden_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, intermediate_size=512, sft_steps=1200, sft_lr=2e-3)
"""0.53M parameters: what tests build. On one core a training step of 16 groups takes
about as long as generating them, so rollout, not training, bounds an async run."""
SMALL: Final = ModelSize(name="small", hidden_size=256, num_layers=4, num_heads=8,
                         num_kv_heads=4, intermediate_size=1024, sft_steps=800, sft_lr=1e-3)
"""4.0M parameters: the CPU default's model. vLLM's cost here is mostly per request and
per token bookkeeping, which barely grows with width, while training grows with the
parameter count: one core generates 16 groups in about 0.2 s and another trains on them
in about 0.4 s. Like a deployment with enough rollout workers, the trainer is then the
bottleneck, and asynchrony is what keeps it busy. Warm start: base greedy accuracy about
0.25, and 99% of greedy answers right or one too high; about 100 s on two threads."""
MODEL_SIZES: Final = {size.name: size for size in (TINY, SMALL)}


class TaskRecipe(msgspec.Struct, frozen=True, kw_only=True):
    """How ``make_model`` warm-starts and measures a model for one built-in task."""

    name: str
    max_positions: int
    """Longest sequence (prompt + completion) the model is built for."""
    eval_max_new_tokens: int
    """Greedy evaluation's completion limit (the RL config's ``rollout.max_new_tokens``)."""
    sft_steps: dict[str, int]
    """Warm-start steps per model size: enough to learn the task, not the right answer."""
    teacher_accuracy: float
    """How often the warm start's teacher writes the right final answer."""
    default_size: str
    """The size ``async-rl make-model --task`` builds unless told otherwise."""


ARITHMETIC: Final = TaskRecipe(name="arithmetic", max_positions=128, eval_max_new_tokens=4,
                               sft_steps={"tiny": TINY.sft_steps, "small": SMALL.sft_steps},
                               teacher_accuracy=0.3, default_size="small")
LONGTAIL: Final = TaskRecipe(name="longtail", max_positions=512,
                             eval_max_new_tokens=LONGTAIL_MAX_NEW_TOKENS,
                             sft_steps={"tiny": 400, "small": 300}, teacher_accuracy=0.45,
                             default_size="tiny")
"""Tiny by default: its 400-step warm start learns the traces in about 2 minutes on one
core (base greedy accuracy about 0.23), where the small model would need several times
longer; on long traces generation, not training, is then the slower stage."""
CALCULATOR: Final = TaskRecipe(name="calculator", max_positions=256,
                               eval_max_new_tokens=TURN_MAX_NEW_TOKENS,
                               sft_steps={"tiny": 800, "small": 800}, teacher_accuracy=0.3,
                               default_size="tiny")
"""The teacher calls the tool on every two-term expression and on 30% of the longer
ones (see ``CalculatorTask.teacher_completion``); base accuracy is measured with the
tool in the loop (``evaluate_with_environment``). Tuned on tiny: copying the expression
into the call and the result into the answer is learnt between steps 160 and 320
(loss 0.87 -> 0.26); after 800 steps greedy accuracy is 0.385 on the 200 held-out
prompts, and sampling calls the tool on 35-42% of the longer ones and copies almost
always right. 300 steps are too few (accuracy 0). Small is untuned."""
TASK_RECIPES: Final = {recipe.name: recipe
                       for recipe in (ARITHMETIC, LONGTAIL, CALCULATOR)}


MADE_MODEL_FILE: Final = "made_model.json"
"""The ``MadeModel`` record, written beside the weights."""


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer without merges: one token per byte (per character for ASCII).

    ``<pad>``=0, ``</s>``=1 (EOS), ``<unk>``=2 (never produced: every byte has a token).
    No BOS and nothing else is added around the text. It is built exactly the way
    transformers' ``Qwen2Tokenizer`` rebuilds a tokenizer from its vocabulary (NFC, the
    Qwen2 split regex, ByteLevel pre-tokenizer and decoder, BPE with no merges), because
    ``AutoTokenizer`` (and so vLLM) loads a qwen2 model directory's tokenizer through that
    class whatever ``tokenizer_config.json`` says: a plain character WordLevel tokenizer
    would silently lose every space and newline there. ``decode(encode(s)) == s`` for any
    NFC-normalised string. It carries a small chat template (``CHAT_TEMPLATE``), so
    ``task.chat_template = true`` runs on these models too.
    """
    symbols = _byte_symbols()
    reserved = [f"<reserved_{i}>" for i in range(VOCAB_SIZE - BYTE_OFFSET - len(symbols))]
    vocab = {tok: i for i, tok in enumerate([PAD_TEXT, EOS_TEXT, UNK_TEXT, *symbols, *reserved])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TEXT,
        eos_token=EOS_TEXT,
        unk_token=UNK_TEXT,
        additional_special_tokens=reserved,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
        chat_template=CHAT_TEMPLATE,
    )


def build_config(
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    max_positions: int = 128,
) -> Qwen2Config:
    """A Qwen2 config sized for CPU; head_dim = hidden/heads must be >= 32 for vLLM CPU."""
    if hidden_size % num_heads or hidden_size // num_heads < 32:
        raise ValueError(
            f"hidden_size/num_heads must be an integer >= 32 (vLLM CPU attention), "
            f"got {hidden_size}/{num_heads}"
        )
    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        use_sliding_window=False,
    )


def size_config(size: ModelSize, max_positions: int = 128) -> Qwen2Config:
    """The ``build_config`` of a named size."""
    return build_config(
        hidden_size=size.hidden_size,
        num_layers=size.num_layers,
        num_heads=size.num_heads,
        num_kv_heads=size.num_kv_heads,
        intermediate_size=size.intermediate_size,
        max_positions=max_positions,
    )


def make_model(
    out_dir: str | Path,
    *,
    size: ModelSize = TINY,
    task: TaskRecipe = ARITHMETIC,
    seed: int = 0,
    sft_steps: int | None = None,
    batch_size: int = 64,
    teacher_accuracy: float | None = None,
    max_operand: int = 29,
    eval_size: int = 200,
    num_threads: int | None = 1,
    log: Callable[[str], None] | None = print,
) -> MadeModel:
    """Builds, warm-starts, evaluates and saves a ``size`` model and tokenizer to ``out_dir``.

    The warm start imitates a teacher whose final answer is right ``teacher_accuracy``
    of the time and otherwise one too high (see ``supervised_warm_start``), on prompts
    of ``task``: ``ArithmeticTask(seed=seed, max_operand=max_operand)``,
    ``RemainderTask(seed=seed)`` or ``CalculatorTask(seed=seed)`` (whose teacher uses
    the tool imperfectly instead). Accuracy is measured by greedy decoding on that
    task's held-out ``eval_prompts(eval_size)``, which training never sees (the
    calculator's with the tool answering each call). Same seed and
    thread count give the same weights and accuracy. Existing files in ``out_dir`` are
    overwritten.

    ``sft_steps`` overrides the size's tuned warm-start length (tests use a few steps).
    ``num_threads`` (torch intra-op threads, restored afterwards; ``None`` leaves them):
    one suits ``TINY``, too small to gain from more (on a busy machine extra threads made
    its build several times slower); ``SMALL`` builds about 1.7x faster on two.
    """
    start = time.perf_counter()
    out = Path(out_dir)
    steps = task.sft_steps[size.name] if sft_steps is None else sft_steps
    if teacher_accuracy is None:
        teacher_accuracy = task.teacher_accuracy
    config = size_config(size, task.max_positions)
    with _torch_threads(num_threads):
        torch.manual_seed(seed)
        tokenizer = build_tokenizer()
        model = Qwen2ForCausalLM(config)
        n_params = sum(p.numel() for p in model.parameters())
        if log is not None:
            log(
                f"{size.name} qwen2: {n_params / 1e6:.2f}M parameters, vocab {VOCAB_SIZE}; "
                f"{task.name} warm start {steps} steps x {batch_size} (teacher accuracy "
                f"{teacher_accuracy})"
            )
        source: ArithmeticTask | RemainderTask | CalculatorTask
        reward: RewardFn | None
        if task.name == "calculator":
            source, reward = CalculatorTask(seed=seed), None
        elif task.name == "longtail":
            source, reward = RemainderTask(seed=seed), remainder_reward
        else:
            source, reward = ArithmeticTask(seed=seed, max_operand=max_operand), arithmetic_reward
        supervised_warm_start(
            model,
            tokenizer,
            source,
            steps=steps,
            eos_id=EOS_ID,
            batch_size=batch_size,
            lr=size.sft_lr,
            teacher_accuracy=teacher_accuracy,
            seed=seed,
            log=log,
        )
        evals = source.eval_prompts(eval_size)
        if reward is None:  # the calculator: the tool answers in the loop
            accuracy = evaluate_with_environment(
                model, tokenizer, evals, CalculatorEnv, stops=(CALL_CLOSE,),
                max_turns=MAX_TURNS, max_new_tokens=task.eval_max_new_tokens)
        else:
            accuracy = evaluate_accuracy(model, tokenizer, evals, reward,
                                         max_new_tokens=task.eval_max_new_tokens)
    model.generation_config = GenerationConfig(
        eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    made = MadeModel(
        path=str(out),
        size=size.name,
        num_parameters=n_params,
        base_accuracy=accuracy,
        eval_size=eval_size,
        seed=seed,
        sft_steps=steps,
        teacher_accuracy=teacher_accuracy,
        task=task.name,
        max_operand=max_operand,
        dtype=str(model.dtype).removeprefix("torch."),
        seconds=time.perf_counter() - start,
    )
    (out / MADE_MODEL_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(made)))
    if log is not None:
        log(
            f"base greedy accuracy {accuracy:.3f} on {eval_size} held-out prompts; "
            f"saved to {out} in {made.seconds:.1f}s"
        )
    return made


@contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    previous = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
