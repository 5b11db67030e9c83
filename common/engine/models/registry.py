"""Model families by Hugging Face `architectures` name; each is imported only when a checkpoint asks for it."""
from __future__ import annotations

from importlib import import_module

from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from common.engine.models.contract import CausalLM
from common.errors import InvalidConfig

# architectures name → "module:class" under common.engine.models. One line per family.
MODELS: dict[str, str] = {
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MistralForCausalLM": "llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "llama:LlamaForCausalLM",
    "LlavaForConditionalGeneration": "llava:LlavaForConditionalGeneration",
    "Phi3ForCausalLM": "phi3:Phi3ForCausalLM",
    "Qwen3MoeForCausalLM": "qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "mixtral:MixtralForCausalLM",
}


def architecture_of(config: PretrainedConfig) -> str:
    """The config's `architectures` entry we have; a config saved without one (a LLaVA checkpoint's text_config)
    gets its model_type's causal-LM class name, as transformers' Auto classes map it."""
    names = getattr(config, "architectures", None) or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, "")]
    for name in names:
        if name in MODELS:
            return name
    raise InvalidConfig(f"model {config.model_type!r} ({getattr(config, 'architectures', None)}) is not supported; "
                        f"supported architectures: {sorted(MODELS)}")


def model_class(config: PretrainedConfig) -> type[CausalLM]:
    module, name = MODELS[architecture_of(config)].split(":")
    return getattr(import_module(f"common.engine.models.{module}"), name)
