"""tools/flash_false_alarms.py at a small size, in fp32, bf16 and fp16: clean realistic inputs
(outlier rows and channels, an attention sink, near-one-hot softmax; causal and not) raise no
alarm in any section, forward or backward, and the largest clean residual sits well inside its
bound. (fp32 rows whose P~ underflowed to subnormals raised alarms before the bounds took an
absolute floor.)"""

import json


def test_clean_realistic_inputs_raise_no_alarm(tmp_path):
    out = tmp_path / "alarms.json"
    from tools import flash_false_alarms as tool

    assert tool.main(["--tiles", "60", "--seq", "64", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for result in report["results"]:
        assert min(result["tiles"].values()) >= 60
        assert sum(result["false_alarms"].values()) == 0 and result["alarms"] == []
        assert set(result["largest_ratio_by_inputs"]) == set(tool.KINDS)
        checked = [m for m in result["margin"].values() if m is not None]
        assert len(checked) == 7 and min(checked) > 4, result["margin"]
