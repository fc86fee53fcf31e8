"""`make doctor` before `make setup`: it runs on the standard library alone, and it checks the packages
of the environment the stages run in (the project venv), not those of the interpreter running it."""

from __future__ import annotations

import json
import socketserver
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from pipeline.host import doctor
from helpers import REPO

SYSTEM_PYTHON = sys._base_executable  # the interpreter the project venv was made from


def run_doctor(python: str, *args: str, flags: tuple[str, ...] = (), root: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PIPELINE_CHECKPOINTS": str(root), "HOME": str(root)}
    return subprocess.run([python, *flags, "-m", "pipeline", "doctor", "--target", "cpu", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def rows(stdout: str) -> dict[str, str]:
    """check name → the rest of its table line."""
    found = {}
    for line in stdout.splitlines()[3:]:
        name, _, rest = line.partition("  ")
        found[name.strip()] = rest
    return found


def assert_ran(result: subprocess.CompletedProcess) -> dict[str, str]:
    assert "Traceback" not in result.stderr, result.stderr
    table = rows(result.stdout)
    assert {"Python", "Neuron devices", "Docker engine", "Disk (checkpoints)"} <= set(table), result.stdout
    # exit 2 exactly when a row failed (this host may lack something; the table must still be there)
    assert result.returncode == (2 if any(line.rstrip().endswith("FAIL") for line in table.values()) else 0)
    return table


def test_runs_with_an_empty_site_before_setup(tmp_path):
    """`python -S`: no site-packages at all, so no torch, no docker SDK, no packaging."""
    result = run_doctor(SYSTEM_PYTHON, "--venv", str(tmp_path / "no-venv-yet"), flags=("-S",), root=tmp_path)
    table = assert_ran(result)
    assert "no project venv yet: `make setup` installs them" in table["Python packages (requirements-dev.lock)"]


def test_runs_in_a_fresh_minimal_venv(tmp_path):
    """A venv with nothing installed (not even pip): every host check runs; the package comparison,
    which needs `packaging`, says so instead of guessing."""
    fresh = tmp_path / "fresh"
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(fresh)], check=True, timeout=120)
    result = run_doctor(str(fresh / "bin" / "python"), "--venv", str(fresh), root=tmp_path)
    table = assert_ran(result)
    assert "not compared" in table["Python packages (requirements-dev.lock)"]
    assert f"{fresh}/bin/python -m pipeline doctor" in table["Python packages (requirements-dev.lock)"]


def test_imports_nothing_outside_the_standard_library(tmp_path):
    """Even where torch and the docker SDK are installed, doctor imports neither: only `packaging`, for
    the lock comparison (site hooks and private stdlib modules, `_…`, aside)."""
    code = ("import sys; from pipeline.__main__ import main; main(sys.argv[1:]); "
            "print(sorted({m.split('.')[0] for m in sys.modules if not m.startswith('_')} "
            "- set(sys.stdlib_module_names) - {'pipeline', 'packaging'}))")
    result = subprocess.run([sys.executable, "-c", code, "doctor", "--target", "cpu", "--venv", str(tmp_path / "none")],
                            cwd=REPO, capture_output=True, text=True, env={"PIPELINE_CHECKPOINTS": str(tmp_path),
                                                                            "PATH": "/usr/bin:/bin"})
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout[-2000:] + result.stderr[-2000:]


def fake_venv(root: Path, packages: dict[str, str]) -> Path:
    (root / "pyvenv.cfg").parent.mkdir(parents=True)
    (root / "pyvenv.cfg").write_text("home = /usr/bin\n")
    site = root / "lib" / "python3.11" / "site-packages"
    for name, version in packages.items():
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


def test_packages_are_those_of_the_venv_not_of_this_interpreter(tmp_path):
    venv = fake_venv(tmp_path / "venv", {"torch": "0.0.1", "Some_Pkg": "1.2+cpu", "neuronx_cc": "2.21.1"})
    lock = tmp_path / "x.lock"
    lock.write_text("# comment\ntorch==2.14.1\nsome-pkg==1.2\nneuronx-cc==2.*\nabsent-pkg==1.0\n"
                    "torchtitan-neuron @ git+https://github.com/aws-neuron/torchtitan-neuron@release-2.33\n")
    table = {r.name: r for r in doctor.checks("cpu", lock, packages="all", venv=venv)}
    assert table["python: torch"].found == "0.0.1" and table["python: torch"].status == "FAIL"  # here: 2.14.1
    assert table["python: some-pkg"].status == "ok"  # PEP 503 names; a +cpu build of the pin matches
    assert table["python: neuronx-cc"].status == "ok" and table["python: neuronx-cc"].needs == "2.*"
    assert table["python: absent-pkg"].found == "missing"
    assert table["python: torchtitan-neuron"].needs.startswith("git+https://")
    summary = table["Python packages (x.lock)"]
    assert summary.needs == f"5 pins in {venv}" and summary.found == "2 match, 3 differ" and summary.status == "FAIL"


def test_both_locks_parse():
    for lock in ("requirements.lock", "requirements-dev.lock"):
        names = [r.name for r in doctor._requirements(REPO / lock)]
        assert "transformers" in names and len(names) == len(set(names)), lock
    # torchtitan-neuron installs from a clone and is seen by pip as `torchtitan` (issue 12, finding 5).
    (titan,) = [r for r in doctor._requirements(REPO / "requirements.lock") if r.name == "torchtitan"]
    assert titan.url.startswith("git+https://github.com/aws-neuron/torchtitan-neuron")


@pytest.fixture
def fake_engine(tmp_path):
    """A Docker Engine API stand-in on a unix socket: GET /version only."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"Version": "99.1", "ApiVersion": "1.99"}).encode() if self.path == "/version" else b"{}"
            self.send_response(200 if self.path == "/version" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def address_string(self):
            return "unix"

        def log_message(self, *args):
            pass

    path = tmp_path / "docker.sock"
    server = socketserver.UnixStreamServer(str(path), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"unix://{path}"
    server.shutdown()
    server.server_close()


def test_docker_engine_is_asked_over_its_socket(fake_engine, monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", fake_engine)
    row = doctor.check_docker()
    assert (row.found, row.status) == ("99.1 (API 1.99)", "ok")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/nothing.sock")
    row = doctor.check_docker()
    assert row.status == "warn" and row.found.startswith("not reachable (FileNotFoundError")
