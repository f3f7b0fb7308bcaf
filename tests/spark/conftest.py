"""The Spark tests share their helpers through sparkhelpers.py (a module named
``conftest`` would clash with tests/conftest.py on import). One Spark session serves every
test of this directory (session-scoped fixture ``spark``: a JVM context and its Python
workers start once, not once per module); without pyspark or Java the tests are skipped,
with the reason."""
import pytest

# local[2] with up to 4 attempts per task, so a failed task is retried (the writer test in
# test_stream_write.py). A task that fails on every attempt still fails its job.
MASTER = "local[2,4]"


@pytest.fixture(scope="session")
def spark():
    from sparkhelpers import make_session   # skips here without pyspark, pyarrow or Java
    s = make_session(MASTER)
    yield s
    for q in s.streams.active:
        q.stop()
    s.stop()
