"""speculative_config builds every compared method from one place, with clear errors."""

import pytest

from integrations.vllm_ext.engine import PROPOSER_CLASS, make_llm, speculative_config


def test_each_method():
    assert speculative_config("none") is None
    assert speculative_config("das") == {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": 16}
    assert speculative_config("ngram", 3)["num_speculative_tokens"] == 3
    assert speculative_config("suffix")["method"] == "suffix"


@pytest.mark.slow  # importing the proposer imports vLLM
def test_proposer_class_path_imports():
    import importlib

    module, name = PROPOSER_CLASS.rsplit(".", 1)
    assert hasattr(importlib.import_module(module), name)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="eagle"):
        speculative_config("eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        speculative_config("das", 0)
    with pytest.raises(ValueError, match="das_config"):
        make_llm("/nonexistent", "ngram", das_config={"window": 4})
