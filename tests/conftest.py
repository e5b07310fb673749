import pytest


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """Run each test in a directory of its own: what a run writes to its working directory (the
    default events file, abft_events.jsonl) stays out of the repository."""
    monkeypatch.chdir(tmp_path)
