"""Fixtures shared by the data tests."""
import pytest

from megarl.data import ChatTokenizer


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """A chat tokenizer of the tiny models (one token per byte, ChatML template), written once."""
    from megarl.models.tiny import write_char_tokenizer

    path = tmp_path_factory.mktemp("tok")
    write_char_tokenizer(str(path))
    return ChatTokenizer.from_pretrained(str(path))
