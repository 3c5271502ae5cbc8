"""The suite proves it never touches the network: the guard works, and the full default path runs under it."""

import socket

import pytest

from tests.conftest import NetworkAccessError


def test_guard_refuses_outside_connections():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with pytest.raises(NetworkAccessError):
        s.connect(("93.184.216.34", 80))
    s.close()
    with pytest.raises(NetworkAccessError):
        socket.getaddrinfo("huggingface.co", 443)


def test_guard_allows_loopback():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.connect(server.getsockname())
    client.close()
    server.close()


@pytest.mark.model
def test_default_model_corpus_and_generation_run_offline(default_model):
    from labkit.data import load_corpus
    from labkit.evaluate import generate
    from labkit.models import load_model

    model, tokenizer = load_model("smollm2-135m")  # resolved from the local cache under the guard
    assert load_corpus("wiki", "validation")
    assert generate(model, tokenizer, "Say hi.", max_new_tokens=3)
