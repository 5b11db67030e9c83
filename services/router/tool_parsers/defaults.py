"""What a model directory says about tools, read from its files without loading the tokenizer: its chat template
(chat_template.jinja, chat_template.json, or tokenizer_config.json's chat_template, as transformers looks for it)
and the tool-call parser that fits it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# A marker the template writes → the parser that reads it back, in the order looked for.
_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"))
# With no marker in the template, the model type decides; failing both, hermes: the tools of a template that takes
# none are written into the prompt in its form (render.py), and it is the form small instruct models (SmolLM2,
# Qwen) follow best, being ChatML's.
_MODEL_TYPES = {"mistral": "mistral", "mixtral": "mistral", "llama": "llama3_json", "qwen2": "hermes",
                "qwen3": "hermes"}
FALLBACK_PARSER = "hermes"


@dataclass(frozen=True)
class TemplateTools:
    takes_tools: bool  # the chat template renders `tools` (else render.py writes them into the messages)
    parser: str  # the tool-call parser that fits the model


def read_chat_template(model_dir: str | Path) -> str:
    """Every chat template the directory holds, joined ("" for none)."""
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(errors="replace")
    for name in ("chat_template.json", "tokenizer_config.json"):
        value = _json(model_dir / name).get("chat_template")
        if isinstance(value, str):
            return value
        if isinstance(value, list):  # named templates: [{"name": "default", "template": ...}, {"name": "tool_use"}]
            return "\n".join(t.get("template", "") for t in value if isinstance(t, dict))
    return ""


def template_tools(model_dir: str | Path) -> TemplateTools:
    template = read_chat_template(model_dir)
    takes_tools = "tools" in template
    for marker, parser in _MARKERS:
        if marker in template:
            return TemplateTools(takes_tools, parser)
    model_type = _json(Path(model_dir) / "config.json").get("model_type")
    return TemplateTools(takes_tools, _MODEL_TYPES.get(model_type, FALLBACK_PARSER) if takes_tools else FALLBACK_PARSER)


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
