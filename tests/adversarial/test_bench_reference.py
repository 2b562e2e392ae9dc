"""`bench MODEL` on a user's model without its module printed "max abs err 0.0e+00" for an error it never
measured (issue 31, defect 7): with no reference, the error columns say "-"."""

from __future__ import annotations

import json

from click.testing import CliRunner

from mha_deploy.cli import main

BENCH = ["--shapes", "2x8", "--budget-s", "0.02", "--gemm-sizes", "64"]


def test_bench_without_a_reference_prints_no_error_it_never_measured(own_model):
    path = own_model("classifier")[0]
    text = CliRunner().invoke(main, ["bench", str(path), *BENCH])
    assert text.exit_code == 0, text.output
    header = next(line for line in text.stdout.splitlines() if "max abs err" in line and "backend" in line)
    row = next(line for line in text.stdout.splitlines() if f"ORT {path.name}" in line)
    assert "e+00" not in row and "e-" not in row, row
    # The two error columns hold "-": the last two fields of the row, under their headings.
    assert row.split()[-2:] == ["-", "-"], (header, row)
    assert "no reference" in text.stdout and "--module" in text.stdout

    as_json = CliRunner().invoke(main, ["bench", str(path), *BENCH, "--json"])
    assert as_json.exit_code == 0, as_json.output
    rows = json.loads(as_json.stdout[as_json.stdout.index("{"):])["rows"]
    assert [(r["max_abs_err"], r["rel_err"]) for r in rows] == [(None, None)]
