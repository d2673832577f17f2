"""CI (.ci/run) runs the README's Quick start commands as .ci/readme_command.py reads them from README.md."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "readme_command.py"


def _quick_start_commands(text: str) -> list[str]:
    spec = importlib.util.spec_from_file_location("readme_command", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.quick_start_commands(text)


def test_readme_quick_start_has_the_install_run_and_test_commands():
    one, two = _quick_start_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    assert "pip install -e . && shardtune run --nproc_per_node 2 lora_finetune_distributed --config tiny/lora" in one
    assert "[test]" not in one  # the main job must run on the runtime dependencies alone
    assert 'pip install -e ".[test]" && python -m pytest tests' in two


def test_ci_runs_both_commands_read_from_the_readme_command_1_in_a_fresh_venv():
    for n, expected in enumerate(_quick_start_commands((ROOT / "README.md").read_text(encoding="utf-8")), start=1):
        printed = subprocess.run([sys.executable, str(SCRIPT), str(n)], capture_output=True, text=True, check=True)
        assert printed.stdout.strip() == expected
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "cmd1=$(python .ci/readme_command.py 1)" in ci and "cmd2=$(python .ci/readme_command.py 2)" in ci
    assert 'python -m venv "$work/venv"' in ci and "system-site-packages" not in ci
    assert ci.index('bash -eo pipefail -c "$cmd1"') < ci.index('bash -eo pipefail -c "$cmd2"')


@pytest.mark.parametrize(
    "readme, error",
    [
        ("# x\n", "no '## Quick start' section"),
        ("## Quick start\n\nnothing\n", "no ```bash blocks"),
        ("## Quick start\n\n```bash\npip install .\nshardtune run\n```\n", "one command line"),
    ],
)
def test_a_quick_start_ci_cannot_run_verbatim_is_an_error(readme, error):
    with pytest.raises(ValueError, match=error):
        _quick_start_commands(readme)
