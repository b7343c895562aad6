"""Shared fixtures: checkpoints written into a temporary directory once per test session."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/reference helpers


@pytest.fixture(scope="session")
def tiny_mlx_dir(tmp_path_factory):
    """A tiny random-weight checkpoint in the MLX 4-bit layout, with a tokenizer."""
    from lily import synthetic

    return synthetic.write_checkpoint(tmp_path_factory.mktemp("tiny_mlx"), layout="mlx", seed=0)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """The same tiny architecture in the Hugging Face bf16 layout."""
    from lily import synthetic

    return synthetic.write_checkpoint(tmp_path_factory.mktemp("tiny_hf"), layout="hf", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_mlx_dir):
    import lily

    return lily.Model.load(str(tiny_mlx_dir), device="cpu")
