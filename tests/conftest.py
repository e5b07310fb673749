import random
import zlib

import interpreter_bounds
import pytest
import torch

interpreter_bounds.install()  # every kernel the interpreter runs in the suite, bounds-checked


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """Run each test in a directory of its own: what a run writes to its working directory (the
    default events file, abft_events.jsonl) stays out of the repository."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _seeded(request):
    """Seed the global generators from the test's id: a test draws the same numbers whichever
    tests ran before it on its worker, so a result in CI is one that reruns here."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)
