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


@pytest.fixture(scope="module", params=["synthetic", "lily-tiny"])
def tiny_checkpoint(request, tiny_mlx_dir) -> str:
    """Each small checkpoint an executor is checked on: the synthetic tiny one and lily-tiny."""
    import lily

    return str(tiny_mlx_dir) if request.param == "synthetic" else str(Path(lily.__file__).parent / "models" / "lily-tiny")


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """The same tiny architecture in the Hugging Face bf16 layout."""
    from lily import synthetic

    return synthetic.write_checkpoint(tmp_path_factory.mktemp("tiny_hf"), layout="hf", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_mlx_dir):
    import lily

    return lily.Model.load(str(tiny_mlx_dir), device="cpu")


@pytest.fixture(scope="module")
def client(app):
    """The official openai client against a live server of the module's `app` fixture (the
    modules that speak to the server otherwise define their own `client`)."""
    openai = pytest.importorskip("openai")
    from test_server import live_server

    with live_server(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
