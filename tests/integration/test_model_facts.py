"""Model facts read from JSON equal what transformers says; reading them, or importing the router, needs no torch."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, GenerationConfig

from common.engine.default_model import default_model_dir
from common.engine.models.llava import image_token_id, num_image_tokens, text_config_of
from common.errors import InvalidConfig
from common.model_facts import ModelFacts, load_model_facts
from benchmarks.tiny_llava import NUM_IMAGE_TOKENS, make_tiny_llava
from tests.tiny_models import TINY_FAMILIES

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory) -> str:
    return str(make_tiny_llava(tmp_path_factory.mktemp("facts-llava")))


def _eos(source) -> set[int]:
    eos = getattr(source, "eos_token_id", None)
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def transformers_facts(model_dir: str) -> ModelFacts:
    """The same facts through transformers' own config classes (what the engine used before)."""
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    text = text_config_of(config)
    generation = (GenerationConfig.from_pretrained(model_dir, local_files_only=True)
                  if (Path(model_dir) / "generation_config.json").exists() else None)
    token = image_token_id(config)
    dtype = getattr(config, "dtype", None) or getattr(text, "dtype", None)
    return ModelFacts(model_type=config.model_type, architectures=tuple(config.architectures or ()),
                      vocab_size=text.vocab_size, max_position_embeddings=text.max_position_embeddings,
                      eos_token_ids=frozenset(_eos(config) | _eos(text) | _eos(generation)),
                      image_token_id=token, num_image_tokens=num_image_tokens(config) if token is not None else 0,
                      checkpoint_dtype=str(dtype).removeprefix("torch.") if dtype is not None else None)


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_facts_of_each_tiny_family_equal_transformers(tiny_model_dirs, family):
    facts = load_model_facts(tiny_model_dirs[family])
    assert facts == transformers_facts(tiny_model_dirs[family])
    assert facts.image_token_id is None and not facts.accepts_images


def test_facts_of_tiny_llava_name_its_image_token(tiny_llava):
    facts = load_model_facts(tiny_llava)
    assert facts == transformers_facts(tiny_llava)
    assert facts.model_type == "llava" and facts.vocab_size == 49153  # SmolLM2's vocabulary + <image>
    assert facts.image_token_id == 49152 and facts.num_image_tokens == NUM_IMAGE_TOKENS


def test_facts_of_default_smollm2():
    facts = load_model_facts(default_model_dir())
    assert facts == transformers_facts(str(default_model_dir()))
    assert (facts.vocab_size, facts.max_position_embeddings, facts.eos_token_ids) == (49152, 8192, frozenset({2}))


def _copy_config(source: str, target: Path, **changes) -> Path:
    config = json.loads((Path(source) / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}))
    return target


def test_eos_ids_are_the_union_of_config_and_generation_config(tiny_model_dirs, tmp_path):
    _copy_config(tiny_model_dirs["llama-gqa"], tmp_path, eos_token_id=2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))
    facts = load_model_facts(tmp_path)
    assert facts.eos_token_ids == frozenset({0, 2, 7}) == transformers_facts(str(tmp_path)).eos_token_ids


def test_llava_defaults_match_transformers_when_config_leaves_them_out(tiny_llava, tmp_path):
    config = json.loads((Path(tiny_llava) / "config.json").read_text())
    for key in ("image_token_index", "vision_feature_select_strategy"):
        config.pop(key)
    for key in ("image_size", "patch_size"):
        config["vision_config"].pop(key)
    (tmp_path / "config.json").write_text(json.dumps(config))
    facts = load_model_facts(tmp_path)
    assert facts == transformers_facts(str(tmp_path))
    assert facts.image_token_id == 32000 and facts.num_image_tokens == (224 // 32) ** 2


def test_full_select_strategy_counts_the_cls_row(tiny_llava, tmp_path):
    _copy_config(tiny_llava, tmp_path, vision_feature_select_strategy="full")
    assert load_model_facts(tmp_path).num_image_tokens == NUM_IMAGE_TOKENS + 1 == num_image_tokens(
        AutoConfig.from_pretrained(str(tmp_path), local_files_only=True))


def test_missing_config_or_vocab_size_is_invalid_config_naming_the_file(tiny_model_dirs, tmp_path):
    with pytest.raises(InvalidConfig, match=r"config.json does not exist"):
        load_model_facts(tmp_path)
    config = json.loads((Path(tiny_model_dirs["llama-gqa"]) / "config.json").read_text())
    config.pop("vocab_size")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidConfig, match=r"config.json has no vocab_size"):
        load_model_facts(tmp_path)


def test_facts_are_read_once_per_directory(tiny_model_dirs, tmp_path):
    model = shutil.copytree(tiny_model_dirs["mistral"], tmp_path / "m")
    first = load_model_facts(model)
    (model / "config.json").write_text("not json")
    assert load_model_facts(str(model)) is first


def _loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_reading_model_facts_loads_neither_torch_nor_transformers():
    loaded = _loaded_after(f"from common.model_facts import load_model_facts\n"
                           f"load_model_facts({str(default_model_dir())!r})")
    assert "torch" not in loaded and "transformers" not in loaded


def test_importing_the_router_loads_no_torch():
    loaded = _loaded_after("import services.router.server, services.router.prepare, services.router.config, "
                           "services.router.orchestrator")
    assert "torch" not in loaded
    assert not any(m.startswith("common.engine.models") for m in loaded)


def test_the_router_learns_model_facts_without_engine_model_code(tiny_llava):
    loaded = _loaded_after(f"from services.router.prepare import RequestPreparer\n"
                           f"p = RequestPreparer.from_model_dir({tiny_llava!r})\n"
                           f"assert p.image_tokens.token_id == 49152")
    assert not any(m.startswith(("common.engine.models", "transformers.models.llava.modeling")) for m in loaded)
