"""The custom-metric example of docs/contract.md runs as written."""
import os
import re

ROOT = os.path.abspath(os.path.join(__file__, "../../.."))


def test_contract_example_runs():
    text = open(os.path.join(ROOT, "docs", "contract.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "docs/contract.md has no python example"
    for block in blocks:
        exec(compile(block, "docs/contract.md", "exec"), {"__name__": "contract_example"})
