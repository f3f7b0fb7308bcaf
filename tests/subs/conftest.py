import pytest

import fdq
from fdqtest import database_url
from subs_helpers import Workers


@pytest.fixture
def url(tmp_path):
    return database_url(tmp_path / "subs.db")


@pytest.fixture
def db(url):
    return fdq.connect(url)


@pytest.fixture
def workers():
    w = Workers()
    yield w
    w.close()
