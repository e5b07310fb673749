"""The README's example runs and does what it says."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_starts_with_the_two_commands():
    first = README.read_text().splitlines()[:4]
    assert any("make demo" in line for line in first)
    assert any("make test" in line for line in first)


def test_the_readme_example_corrects_the_fault(capsys):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    counts = namespace["report"](namespace["result"])
    assert sum(counts["detected"].values()) == sum(counts["corrected"].values()) == 1
    assert namespace["torch"].isfinite(namespace["s"]).all()
    assert "'corrected'" in capsys.readouterr().out
