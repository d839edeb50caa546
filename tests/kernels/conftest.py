"""Fixtures the kernel tests share."""
import pytest

from tritonchat.kernels import _common


@pytest.fixture
def own_table(tmp_path, monkeypatch):
    """use(text): the decode table is a file of the test's own with this text (again for a new
    text); the table's cache is cleared each time and after the test, so later tests read the
    packaged table again."""
    path = tmp_path / "decode_tuning.json"
    monkeypatch.setattr(_common, "DECODE_TABLE_PATH", str(path))

    def use(text: str):
        path.write_text(text)
        _common.clear_table_cache()
        return path

    yield use
    _common.clear_table_cache()
