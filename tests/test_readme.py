"""README's first screen speaks to a newcomer (issue 58, item 8): what table 1 says and the
paper's numbers beside ours come before the lab's own terms, and `make smoke` stands there with
what its numbers mean."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# The terms a newcomer cannot read before the plain account: the manual defines each.
LAB_TERMS = ("check M", "MDE", "premise", "pinned", "sha256", "underpowered")


def _first_screen() -> str:
    """Everything above the table's own caption lines: title, introduction, the plain account
    and the table itself (a 1400 x 900 browser window shows about this much)."""
    return README[: README.index("<!-- TABLE1 -->")]


def test_the_plain_account_comes_before_any_lab_term() -> None:
    screen = _first_screen()
    assert "What it finds so far" in screen
    for term in LAB_TERMS:
        assert term not in screen, f"README's first screen says {term!r} before the plain account"


def test_the_table_puts_the_papers_numbers_beside_ours() -> None:
    block = README[README.index("<!-- TABLE1 -->") : README.index("<!-- /TABLE1 -->")]
    header = block.splitlines()[1]
    assert "paper" in header
    rows = {line.split("|")[1].strip(): line for line in block.splitlines() if line.startswith("|")}
    for method, paper in (("none", "29.44"), ("lbl", "31.91"), ("rpb", "45.77")):
        assert rows[method].rstrip(" |").endswith(paper), method
    assert "The paper's in-domain gaps" in block


def test_the_quick_look_says_what_its_numbers_are() -> None:
    install = README[README.index("## Install, reproduce, test") :]
    smoke = re.search(r"make smoke\s+#(.*)", install)
    assert smoke and "mean nothing" in smoke.group(1)
