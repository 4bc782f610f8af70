"""docs/PERFORMANCE.md is exactly what ``benchmarks/performance_page.py`` builds from the committed
records, every record is in the one format, every plot beside the page is shown, and merging a
run's records replaces what it measured again."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _page():
    bench = str(ROOT / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module("performance_page")


def test_committed_page_is_what_the_records_give() -> None:
    page = _page()
    assert page.PAGE.read_text() == page.render(page.load()), "run: python benchmarks/performance_page.py"
    assert page.main(["--check"]) == 0


def test_every_table_has_rows_and_every_plot_is_shown() -> None:
    page = _page()
    tables = page.load()
    assert tables, "no records under docs/performance"
    assert all(recs for recs in tables.values())
    named = {image for _, _, images in page.SECTIONS.values() for image in images}
    on_disk = {p.name for p in page.RECORDS.glob("*.png")}
    assert named == on_disk, "a plot in docs/performance that no section shows, or one a section names that is missing"
    text = page.PAGE.read_text()
    for image in named:
        assert f"(performance/{image})" in text


def test_add_replaces_a_measurement_and_appends_a_new_one(tmp_path: Path) -> None:
    page = _page()
    records = importlib.import_module("records")
    tables = tmp_path / "tables"
    tables.mkdir()
    for path in page.RECORDS.glob("*.json"):
        shutil.copy(path, tables / path.name)
    old = page.load(tables)["union-build"]
    again = dict(old[0], value=old[0]["value"] / 2, date="2026-12-02", commit="0000000")
    again["ratio"] = records.ratio_of(again["value"], again["baseline"]["value"], again["better"])
    new = dict(old[0], config={**old[0]["config"], "tokens": 65536})
    elsewhere = dict(old[0], gpu="NVIDIA B200")  # the same measurement on another GPU: a row beside it
    run = tmp_path / "run.json"
    run.write_text(json.dumps([again, new, elsewhere]))
    assert page.add([run], tables) == 3
    merged = page.load(tables)["union-build"]
    assert merged[0] == again and merged[1:-2] == old[1:] and merged[-2:] == [new, elsewhere]


def test_a_record_filed_under_another_table_is_refused(tmp_path: Path) -> None:
    page = _page()
    recs = json.loads((page.RECORDS / "gqa-decode.json").read_text())
    (tmp_path / "lse-merge.json").write_text(json.dumps(recs))
    with pytest.raises(ValueError, match="a record of benchmark 'gqa-decode'"):
        page.load(tmp_path)
    (tmp_path / "lse-merge.json").unlink()
    (tmp_path / "unknown-op.json").write_text("[]")
    with pytest.raises(ValueError, match="no section for benchmark 'unknown-op'"):
        page.load(tmp_path)


def test_plots_take_the_latest_ratio_of_their_gpu_and_cache() -> None:
    _page()  # puts benchmarks/ on the path
    plots = importlib.import_module("plot_records")

    def rec(date: str, ratio: float, gpu: str = "NVIDIA H200", rows: int = 262144, metric: str = "step us") -> dict:
        config = {"kv": "bf16", "heads": 16, "batch": 64, "topk": 512, "cache_rows": rows}
        return {"date": date, "ratio": ratio, "gpu": gpu, "metric": metric, "config": config}

    records = [rec("2026-12-05", 0.8), rec("2026-12-04", 0.5), rec("2026-12-06", 0.1, gpu="NVIDIA H100 80GB HBM3")]
    records += [rec("2026-12-06", 0.2, rows=40000000), rec("2026-12-06", 0.3, metric="best swept us")]
    data, dates = plots.ratios("read-floor", records, "NVIDIA H200", 262144)
    assert data == {("bf16", 512): {"16 heads": {64: 0.8}}} and dates == ["2026-12-05"]
    peer = [{**r, "config": {"heads": 64, "tokens": 8, "kv_rows": 65536}} for r in records[:2]]
    peer += [{**records[0], "metric": "step us, rows_unique=True", "ratio": 1.1, "config": peer[0]["config"]}]
    data, dates = plots.ratios("fp8-peer", peer, "NVIDIA H200", 65536)
    assert data == {(64,): {"step us": {8: 0.8}, "step us, rows_unique=True": {8: 1.1}}}
