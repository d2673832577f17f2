"""Print the README's Quick start command N, so CI runs exactly what the README tells users to run.

Rule: the Quick start section holds numbered one-line ```bash blocks; command N is the Nth. A block
of any other shape is an error, so the README and CI cannot drift apart silently.
Usage: python .ci/readme_command.py N [README]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_SECTION = re.compile(r"^## Quick start\s*$(.*?)(?=^## |\Z)", re.MULTILINE | re.DOTALL)
_BLOCK = re.compile(r"^[ \t]*```bash[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.MULTILINE | re.DOTALL)


def quick_start_commands(readme: str) -> list[str]:
    """The one-line commands of the Quick start section, in order."""
    section = _SECTION.search(readme)
    if section is None:
        raise ValueError("README.md has no '## Quick start' section; CI runs its commands")
    commands = []
    for block in _BLOCK.findall(section.group(1)):
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        if len(lines) != 1:
            raise ValueError(f"README.md Quick start: each bash block must be one command line, got {lines}")
        commands.append(lines[0])
    if not commands:
        raise ValueError("README.md Quick start has no ```bash blocks; CI runs them")
    return commands


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or not argv[1].isdigit():
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    readme = Path(argv[2]) if len(argv) == 3 else Path(__file__).resolve().parent.parent / "README.md"
    commands = quick_start_commands(readme.read_text(encoding="utf-8"))
    n = int(argv[1])
    if not 1 <= n <= len(commands):
        print(f"README.md Quick start has {len(commands)} commands, not {n}", file=sys.stderr)
        return 2
    print(commands[n - 1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
