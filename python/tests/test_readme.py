"""The README's Python example runs as written: one refit between two spawned processes."""

import os
import re
import subprocess
import sys

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_readme_python_example_refits(tmp_path):
    blocks = re.findall(r"^```python\n(.*?)^```", open(README, encoding="utf-8").read(), flags=re.M | re.S)
    assert len(blocks) == 1, "README.md should hold one ```python example"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # The destination started from zeros: 1.5 is what the source sent.
    assert out.stdout.strip().splitlines()[-1] == "destination holds w[-1] = 1.5", out.stdout
