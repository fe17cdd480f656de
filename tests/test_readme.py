"""The README's quick start is what CI runs: keep the two in step."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_lines = [
        ln
        for ln in (ROOT / ".ci" / "run").read_text().splitlines()
        if ln.strip() and not ln.startswith(("#", "set ", "cd "))
    ]
    assert len(ci_lines) == 1, ci_lines
    assert ci_lines[0] in readme, "the CI command is not the README's quick-start test command"
    assert "wmoe-compile demo" in readme
