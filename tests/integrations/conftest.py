"""Fixtures of the trainer-integration tests."""
import pytest

from trl_support import tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama built from a config (``trl_support.tiny_llama``), saved once per test module."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(path)
    return path
