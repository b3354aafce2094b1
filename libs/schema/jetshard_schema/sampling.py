"""Where a task's sampling values come from when its request leaves them out.

Like vLLM (`--generation-config auto`) and Ollama (a Modelfile's parameters), the model decides: per value,
the first of these that sets it wins:

1. the request (`temperature`, `top_p`, `top_k`, `min_p`, the penalties, `max_tokens` /
   `max_completion_tokens`);
2. the model directory's `generation_config.json` (`temperature`, `top_p`, `top_k`, `min_p`,
   `repetition_penalty`, `max_new_tokens`, the values vLLM's `--generation-config auto` reads; `do_sample` set
   to false means greedy, temperature 0, as in transformers);
3. the model card's `generation` table (its authors' recommended settings);
4. the documented defaults below.

The runner then clamps `max_tokens` to the room the prompt leaves in the context.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec

from jetshard_schema.cards import GenerationDefaults
from jetshard_schema.types import MAX_REPETITION_PENALTY, SamplingParams

DEFAULT_TEMPERATURE = 1.0
"""OpenAI's default: the model's own distribution."""
DEFAULT_TOP_P = 1.0
"""OpenAI's default: no nucleus cut."""
DEFAULT_TOP_K = 0
"""No cut (OpenAI has none; vLLM's default)."""
DEFAULT_MIN_P = 0.0
"""No cut (vLLM's default)."""
DEFAULT_REPETITION_PENALTY = 1.0
"""None (OpenAI has none; vLLM's and llama.cpp's default)."""
DEFAULT_PRESENCE_PENALTY = 0.0
DEFAULT_FREQUENCY_PENALTY = 0.0
"""OpenAI's defaults: none. Only the request sets these two: neither `generation_config.json` nor a card has them."""
DEFAULT_MAX_TOKENS = 512
"""mlx_lm.server's default. Bounded, so a request without `max_tokens` cannot run to the end of the context."""


class TokenSampling(msgspec.Struct, frozen=True, kw_only=True):
    """How an engine draws each next token. What it leaves out draws greedily, with no cut and no penalty: an
    engine's own default. (A request that leaves values out gets `resolve_sampling`'s, not these.)"""

    temperature: float = 0.0
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    min_p: float = DEFAULT_MIN_P
    repetition_penalty: float = DEFAULT_REPETITION_PENALTY
    presence_penalty: float = DEFAULT_PRESENCE_PENALTY
    frequency_penalty: float = DEFAULT_FREQUENCY_PENALTY


GREEDY = TokenSampling()


class ResolvedSampling(TokenSampling, frozen=True, kw_only=True):
    """A task's sampling from its sources (`resolve_sampling`), and the most tokens it may generate before the
    runner clamps them to the room its prompt leaves."""

    max_tokens: int


def documented_defaults(card_defaults: GenerationDefaults) -> ResolvedSampling:
    """What a request without sampling values gets from a card alone (no `generation_config.json`)."""
    return resolve_sampling(SamplingParams(), GenerationDefaults(), card_defaults)


def resolve_sampling(
    params: SamplingParams, model_defaults: GenerationDefaults, card_defaults: GenerationDefaults
) -> ResolvedSampling:
    """Each value from the first source that sets it: request, `generation_config.json`
    (`model_defaults`, see `generation_config_defaults`), card, documented default."""

    def first(*values: Any) -> Any:
        return next(v for v in values if v is not None)

    return ResolvedSampling(
        temperature=first(
            params.temperature, model_defaults.temperature, card_defaults.temperature, DEFAULT_TEMPERATURE
        ),
        top_p=first(params.top_p, model_defaults.top_p, card_defaults.top_p, DEFAULT_TOP_P),
        top_k=first(params.top_k, model_defaults.top_k, card_defaults.top_k, DEFAULT_TOP_K),
        min_p=first(params.min_p, model_defaults.min_p, card_defaults.min_p, DEFAULT_MIN_P),
        repetition_penalty=first(
            params.repetition_penalty,
            model_defaults.repetition_penalty,
            card_defaults.repetition_penalty,
            DEFAULT_REPETITION_PENALTY,
        ),
        presence_penalty=first(params.presence_penalty, DEFAULT_PRESENCE_PENALTY),
        frequency_penalty=first(params.frequency_penalty, DEFAULT_FREQUENCY_PENALTY),
        max_tokens=first(params.max_tokens, model_defaults.max_tokens, card_defaults.max_tokens, DEFAULT_MAX_TOKENS),
    )


def generation_config_defaults(config: object) -> GenerationDefaults:
    """The sampling values of a parsed Hugging Face `generation_config.json`.

    Tolerant, since the file is the model author's and not ours: a value of the wrong type or out of the
    API's range is ignored, not an error. `do_sample: false` (explicitly; transformers' own default is
    false too, but most files that omit it list values meant for sampling, so, as vLLM does, those are
    used) means greedy decoding: temperature 0, whatever `temperature` says.
    """
    if not isinstance(config, Mapping):
        return GenerationDefaults()
    temperature = _number(config.get("temperature"), lambda v: 0 <= v <= 2)
    if config.get("do_sample") is False:
        temperature = 0.0
    top_p = _number(config.get("top_p"), lambda v: 0 < v <= 1)
    top_k = config.get("top_k")
    min_p = _number(config.get("min_p"), lambda v: 0 <= v <= 1)
    repetition_penalty = _number(config.get("repetition_penalty"), lambda v: 0 < v <= MAX_REPETITION_PENALTY)
    max_new_tokens = config.get("max_new_tokens")
    return GenerationDefaults(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k if type(top_k) is int and top_k >= 0 else None,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        max_tokens=max_new_tokens if type(max_new_tokens) is int and max_new_tokens >= 1 else None,
    )


def _number(value: object, in_range: Any) -> float | None:
    # bool is an int in Python; `true` is not a temperature.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) and in_range(number) else None
