"""The README's example runs and does what it says."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_starts_with_the_two_commands():
    first = README.read_text().splitlines()[:4]
    assert any("make demo" in line for line in first)
    assert any("make test" in line for line in first)


def test_the_readme_examples_run_and_the_core_one_corrects_the_fault(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    namespaces = []
    for code in blocks:
        namespace: dict = {}
        exec(compile(code, str(README), "exec"), namespace)
        namespaces.append(namespace)
    core = next(n for n in namespaces if "result" in n)
    counts = core["report"](core["result"])
    assert sum(counts["detected"].values()) == sum(counts["corrected"].values()) == 1
    assert core["torch"].isfinite(core["s"]).all()
    assert "'corrected'" in capsys.readouterr().out
    specs = next(n for n in namespaces if "spec" in n)
    built = {
        name: specs[name].submodules.self_attention.submodules.core_attention.module.__name__
        for name in ("spec", "flash_spec")
    }
    # attention="auto" settles at build (tests/flash/test_flash_megatron.py)
    assert built == {"spec": "AutoProtectedAttention", "flash_spec": "ProtectedFlashAttention"}
