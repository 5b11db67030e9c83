"""benchmarks.grammar_backends: each backend compiles the bench's schemas itself (no fallback) and times a fill
before every token of two walks through a valid instance."""
import json

import pytest

from common.engine.default_model import default_model_dir
from common.engine.grammar import Grammars
from common.engine.structured import StructuredOutput
from common.tokenizer import load_tokenizer
from benchmarks.grammar_backends import SCHEMAS, measure


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_each_schema_compiles_on_its_backend_and_every_token_of_its_instance_is_timed(backend):
    model = str(default_model_dir())
    tokenizer = load_tokenizer(model).hf
    grammars = Grammars(model, 49152, [2], backend)
    try:
        for schema, instance in SCHEMAS.values():
            tokens = tokenizer.encode(json.dumps(instance, separators=(", ", ": ")), add_special_tokens=False)[:16]
            compile_ms, walks = measure(grammars, StructuredOutput.json_schema(schema), tokens, 49152)
            assert compile_ms > 0 and [len(w) for w in walks] == [len(tokens)] * 2
            assert all(w == sorted(w) and w[0] > 0 for w in walks)
    finally:
        grammars.close()
