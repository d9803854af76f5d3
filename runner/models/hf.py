"""Hugging Face causal language models built from config (``model=hf_causal_lm``), trained by runner's loop
(``causal_lm``; https://huggingface.co/docs/transformers/model_doc/auto; docs/language-models.md). ``transformers``
is an optional dependency (``pip install -e ".[hf]"``), imported only when such a model is built.
"""

from __future__ import annotations

import difflib
from typing import Any

from torch import nn

from runner.config.targets import OPTIONAL_PACKAGES
from runner.errors import ConfigError

#: Config attributes that hold a model's context length (positions), in the order they are looked for.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")

#: Special token ids: a default outside the data's vocabulary (GPT-2's 50256 for 65 characters) is dropped.
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def require_transformers(what: str):
    """Import and return ``transformers``.

    Raises:
        ConfigError: it is not installed; names ``what`` needed it and the install command.
    """
    try:
        import transformers
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"{what} needs the transformers package, which is not installed: {OPTIONAL_PACKAGES['transformers']}"
        ) from e
    return transformers


def causal_lm_types() -> list[str]:
    """The ``model_type`` names of the installed ``transformers`` that have a causal-LM class
    (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: gpt2, llama, mistral, qwen2, ...)."""
    require_transformers("listing Hugging Face model types")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _settings_of(config) -> list[str]:
    """The settings a config class adds to ``PretrainedConfig``'s common ones, and their aliases."""
    from transformers import PretrainedConfig

    common = set(PretrainedConfig().to_dict())
    return sorted((set(config.to_dict()) - common) | set(getattr(config, "attribute_map", {})))


def causal_lm(
    vocab_size: int | None = None, model_type: str = "gpt2", block_size: int | None = None, **settings: Any
) -> nn.Module:
    """A randomly initialised Hugging Face causal LM: token ids ``(B, T)`` int64 -> an output with ``.logits``
    ``(B, T, vocab_size)``, ``T`` <= the context length.

    Args:
        vocab_size: number of token ids (from the data: ``data=text`` passes its character count); None (data
            without a vocabulary) is refused.
        model_type: a ``transformers`` model type with a causal-LM class (``gpt2``, ``llama``, ``mistral``, ...).
        block_size: the context length; written to the config's position count (``max_position_embeddings``,
            which GPT-2's config maps to ``n_positions``) unless ``settings`` sets one. None: the config's default.
        settings: the config's own keys (``n_layer``, ``n_head``, ``n_embd`` for gpt2; ``hidden_size``,
            ``num_hidden_layers``, ``num_attention_heads``, ``intermediate_size`` for llama; the aliases
            ``hidden_size``/``num_hidden_layers``/``num_attention_heads`` work for gpt2 too). Unset keys keep
            the architecture's defaults (gpt2: GPT-2 small, 12 x 768).

    ``AutoModelForCausalLM.from_config(AutoConfig.for_model(...))``
    (https://huggingface.co/docs/transformers/model_doc/auto#transformers.AutoConfig.for_model), with ``use_cache``
    False (runner's sampler uses no key/value cache) and a special-token id outside the vocabulary set to None.

    Raises:
        ConfigError: no vocabulary (labelled data, ``task=classification``); ``transformers`` is not
            installed; ``model_type`` has no causal-LM class (names the
            closest and a few valid types); a setting the config does not have (names the closest and the
            config's settings); the config or the model cannot be built with these settings.
    """
    if vocab_size is None:
        raise ConfigError(
            "model=hf_causal_lm is a causal language model: it needs token data and the language-model "
            "task (task=language_model data=text data.path=<file>)"
        )
    transformers = require_transformers(f"model=hf_causal_lm (model.model_type={model_type})")
    from transformers import AutoConfig, AutoModelForCausalLM

    types = causal_lm_types()
    if model_type not in types:
        close = difflib.get_close_matches(str(model_type), types, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        common = [t for t in ("gpt2", "llama", "mistral", "qwen2", "gpt_neox", "opt") if t in types]
        raise ConfigError(
            f"model.model_type={model_type!r} is not a causal language model type of transformers "
            f"{transformers.__version__}{hint}; valid types include {', '.join(common)} ({len(types)} "
            f"in all: transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)"
        )
    defaults = AutoConfig.for_model(model_type)
    known = _settings_of(defaults)
    for key in settings:
        if not hasattr(defaults, key):
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean model.{close[0]}?)" if close else ""
            raise ConfigError(
                f"model.{key}={settings[key]!r} is not a setting of {type(defaults).__name__} "
                f"(model.model_type={model_type}){hint}. Its settings: {', '.join(known)}"
            )
    config: dict[str, Any] = {"use_cache": False, **settings, "vocab_size": vocab_size}
    if block_size is not None and not any(k in settings for k in CONTEXT_KEYS):
        key = next((k for k in CONTEXT_KEYS if hasattr(defaults, k)), None)
        if key is not None:
            config[key] = block_size
    for key in _TOKEN_ID_KEYS:
        value = getattr(defaults, key, None)
        if key not in settings and isinstance(value, int) and not 0 <= value < vocab_size:
            config[key] = None
    given = ", ".join(f"model.{k}={v!r}" for k, v in settings.items()) or "its defaults"
    try:
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    except Exception as e:  # noqa: BLE001 - the architecture's own checks (e.g. hidden size % heads)
        raise ConfigError(
            f"model=hf_causal_lm could not build a {model_type} model from {given}: "
            f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        ) from e


def context_length(model: nn.Module) -> tuple[int | None, str]:
    """The longest input a model takes and where it is set: runner's ``block_size`` attribute, else the first
    of ``CONTEXT_KEYS`` on a Hugging Face model's ``config``; ``(None, "")`` when neither says."""
    if isinstance(getattr(model, "block_size", None), int):
        return model.block_size, "model.block_size"
    config = getattr(model, "config", None)
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value, f"{type(config).__name__}.{key}"
    return None, ""


def vocab_size(model: nn.Module) -> int | None:
    """The model's vocabulary size: its ``vocab_size`` attribute, else its Hugging Face ``config.vocab_size``."""
    value = getattr(model, "vocab_size", None)
    if value is None:
        value = getattr(getattr(model, "config", None), "vocab_size", None)
    return value if isinstance(value, int) else None


def fill_nested_config(kwargs: dict, data_kwargs: dict[str, int], names: list[str], any_name: bool) -> None:
    """A model built from a config object (Hugging Face style, ``model._target_=transformers.GPT2LMHeadModel``
    with ``model.config._target_=transformers.GPT2Config``): the data's sizes that the model's constructor does
    not take (``vocab_size``) go into that nested ``config`` node instead, as they would go into the
    constructor.

    Raises:
        ConfigError: ``model.config.<size>`` set (it follows the data).
    """
    config = kwargs.get("config")
    if not isinstance(config, dict) or "_target_" not in config:
        return
    for key, value in data_kwargs.items():
        if key in names or any_name:
            continue
        if key in config:
            raise ConfigError(f"model.config.{key}={config[key]} cannot be set: it follows the data ({value}); drop it")
        config[key] = value
