"""The project speaks of itself: no tracked text file talks about how the work on it was organised.

Code, docs, tests, benchmarks and examples say what is true of the library (with a date and a
command anyone can rerun where they give a number), never which work period, tracker ticket or
machine budget a change came from, nor paths of the machines it was written on. The patterns are
tight, so ordinary English passes ("a function call", "the host issues a message").
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: (what it catches, pattern), matched case-insensitively per line.
FORBIDDEN = (
    ("a work period", r"\bsessions?\b"),
    ("a numbered call", r"\bcalls? \d"),
    ("a tracker issue", r"\bissues? #?\d"),
    ("a tracker reference", r"(?<![\w&/#])#\d+\b"),
    ("the people who started it", r"\bfounders?\b"),
    ("a machine budget", r"\bdevice[ -]time\b|\bdevice calls?\b"),
    ("a work plan", r"\bsprints?\b|\btodo from review\b"),
    ("a path of the machines it was written on", r"(?<![\w.])/work/"),
)
PATTERN = re.compile("|".join(f"(?:{p})" for _, p in FORBIDDEN), re.IGNORECASE)
#: Suffixes of binary files (read as text they would only match by accident).
BINARY = {".png", ".jpg", ".jpeg", ".gif", ".pdf", ".so", ".whl", ".gz", ".zip", ".pt", ".safetensors"}


def tracked_text_files() -> list[Path]:
    """``git ls-files`` of the repository (every file under it, outside virtual environments and
    caches, when it is not a git checkout), binary files and this file (whose examples below must
    match) left out."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
        paths = [ROOT / p for p in out.stdout.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", "build", "dist"}
        paths = [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]
    me = Path(__file__).resolve()
    return [p for p in paths if p.suffix.lower() not in BINARY and p.is_file() and p.resolve() != me]


def offending_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line of ``text`` a :data:`FORBIDDEN` pattern matches."""
    return [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1) if PATTERN.search(line)]


def test_no_tracked_text_speaks_of_how_the_work_was_organised() -> None:
    files = tracked_text_files()
    assert len(files) > 50, f"found only {len(files)} files under {ROOT}"
    found = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{path.relative_to(ROOT)}:{i}: {line[:160]}" for i, line in offending_lines(text)]
    assert not found, "text about how the work was organised:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "RESULTS, eighth session: the split kernel",
        "measured in call 7 of the run",
        "calls 8-9 timed the merge",
        "the regression of issue 11",
        "as issue #14 asked",
        "fixed in #123",
        "the founders' rule G = 128 / heads",
        "no device time was left",
        "one device call",
        "TODO from review: rename",
        "see /work/main/README.md",
    ],
)
def test_the_patterns_catch_talk_about_the_work(line: str) -> None:
    assert offending_lines(line)


@pytest.mark.parametrize(
    "line",
    [
        "the function calls the kernel twice",
        "every call to sparse_mla_attention validates first",
        "the host issues three messages per chunk",
        "issue the next pair's Q K^T behind P V",
        "pytest's worker pool of --nproc ranks",
        "the step's device span (kernels and gaps)",
        "columns 0-255 (a width of 256), call_count = 2",
        "f(x)  # 2 warps",
        "color = '#1f77b4'",
        "GPU time, not the host's Python overhead",
        "run it from the repository root: python benchmarks/decode.py",
    ],
)
def test_ordinary_english_passes(line: str) -> None:
    assert not offending_lines(line)
