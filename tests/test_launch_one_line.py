"""``launch.one_line.report_once``: one line on the terminal from the whole job, and torchrun's
error file written by every rank that exits with it (torchrun's summary names whichever rank
failed first, which need not be the one that printed)."""

from __future__ import annotations

import datetime
import json

import pytest
from torch.distributed import TCPStore

import shardattn.launch.one_line as one_line
from shardattn.launch.one_line import report_once
from shardattn.testing.pool import free_port

MESSAGE = "shardattn.launch: error: --tokens must be >= 1, got -5"


def _env(rank: int, port: int, error_file: str) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_ERROR_FILE": error_file,
    }


def test_every_rank_writes_its_error_file_and_one_prints(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10))
    files = [tmp_path / f"error-{rank}.json" for rank in range(2)]
    for rank in (1, 0):  # rank 1 reaches the verdict first and prints; rank 0 waits for it
        assert report_once(MESSAGE, 2, environ=_env(rank, port, str(files[rank])), wait_s=5.0) == 2
    assert capsys.readouterr().err.count(MESSAGE) == 1
    for path in files:
        assert json.loads(path.read_text())["message"]["message"] == MESSAGE, path
    del store


@pytest.mark.parametrize(
    "environ",
    [{"RANK": "3", "WORLD_SIZE": "2"}, {"RANK": "0", "WORLD_SIZE": "two"}, {"RANK": "x"}],
    ids=["rank-past-the-world", "world-size-not-a-number", "rank-not-a-number"],
)
def test_a_rank_of_no_world_prints_the_line_itself(environ, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: a rank whose RANK / WORLD_SIZE make no rank of a world (the very error the
    launcher reports about that environment) printed nothing, or raised a ValueError itself."""
    error_file = tmp_path / "error.json"
    assert report_once(MESSAGE, 2, environ={**environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}, wait_s=1.0) == 2
    assert capsys.readouterr().err.count(MESSAGE) == 1
    assert json.loads(error_file.read_text())["message"]["message"] == MESSAGE


def test_an_error_file_appears_whole_or_not_at_all(monkeypatch, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: torchrun reads a stopped rank's error file if it exists, and failed itself on one a
    rank had opened but not yet written when torchrun stopped it (an empty file). A write cut short
    leaves no file (nor its partial copy); a whole one is valid JSON."""
    error_file = tmp_path / "error.json"
    environ = {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_ERROR_FILE": str(error_file)}

    def cut_short(data, f):
        f.write("{")
        f.flush()
        raise OSError("no space left on device")

    monkeypatch.setattr(one_line.json, "dump", cut_short)
    assert report_once(MESSAGE, 2, environ=environ) == 2
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert report_once(MESSAGE, 2, environ=environ) == 2
    assert json.loads(error_file.read_text())["message"]["message"] == MESSAGE
    assert list(tmp_path.iterdir()) == [error_file]
    assert capsys.readouterr().err.count(MESSAGE) == 2
