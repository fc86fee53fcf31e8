"""README's table of measured figures is bench/readme_table.py's rendering of bench/results.json: a figure
the last `make bench` did not measure cannot stand in the README."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest

from helpers import REPO

spec = importlib.util.spec_from_file_location("readme_table", REPO / "bench" / "readme_table.py")
readme_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(readme_table)
RESULTS = json.loads((REPO / "bench" / "results.json").read_text())


def test_the_readme_table_is_the_one_results_json_gives():
    readme = (REPO / "README.md").read_text()
    assert readme.count(readme_table.BEGIN) == readme.count(readme_table.END) == 1
    assert readme_table.replaced(readme, readme_table.render(RESULTS)) == readme, \
        "README's bench table is stale: run `python bench/readme_table.py`"
    assert readme_table.main(["--check"]) == 0


def test_every_figure_comes_from_results_json():
    table = readme_table.render(RESULTS)
    ratio = RESULTS["overhead"]["ratio"]["median"]
    assert f"| {ratio:.2f}× (samples " in table
    assert f"| {RESULTS['pipeline']['wall_s']['median']:.0f} s |" in table
    for path, marks in RESULTS["ttfs"].items():
        assert f"| `make train-{path}` → step 1 | {marks['total']['median']:.1f} s |" in table
    for kind in ("sft", "dpo"):  # peers: pipeline vs TRL, each side's tokens/s and their ratio
        entry = RESULTS["peers"][kind]
        assert (f"| {entry['pipeline_tokens_per_s']['median']:.0f} vs {entry['trl_tokens_per_s']['median']:.0f} = "
                f"{entry['ratio']['median']:.2f}× (samples ") in table
        assert f"step-1 loss {entry['pipeline_step1_loss']:.4f} vs {entry['trl_step1_loss']:.4f}" in table
    changed = copy.deepcopy(RESULTS)
    changed["peers"]["sft"]["ratio"]["median"] = 9.87
    assert "= 9.87× (samples" in readme_table.render(changed) and "= 9.87×" not in table
    changed["pipeline"]["wall_s"]["median"] = 999.0  # a new bench run: the README follows it
    assert "| 999 s |" in readme_table.render(changed) and "| 999 s |" not in table


def test_a_stale_table_is_found(monkeypatch, tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text((REPO / "README.md").read_text().replace("| native step vs", "| native step (edited) vs"))
    monkeypatch.setattr(readme_table, "README", readme)
    assert readme_table.main(["--check"]) == 1
    assert "bench table is not what" in capsys.readouterr().err
    assert readme_table.main([]) == 0 and readme_table.main(["--check"]) == 0  # rewritten from results.json
    with pytest.raises(SystemExit, match="no bench table markers"):
        readme_table.replaced("no markers here", "")
