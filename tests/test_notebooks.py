"""Execute every notebook under notebooks/ top to bottom, as a user would (issue 8: a notebook that fails fails CI).

The kernel is this interpreter's ipykernel, through a kernelspec written to a temporary directory: it does not depend
on a 'python3' kernelspec being installed (or pointing at another Python) on the CI machine. Each notebook runs in
notebooks/ (relative paths resolve as in Jupyter), with a per-cell timeout, and matplotlib's Agg backend. Tests leave
nothing behind: nbclient does not stop a kernel whose manager it was given, so each test stops its kernel, closes
the client's sockets and removes the connection file, which lives in a temporary JUPYTER_RUNTIME_DIR.
"""
from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CELL_TIMEOUT_S = 300  # one cell; the whole set runs in about three minutes on 2 cores (notebook 02 most of it)
KERNEL = "offsim-test-python"


@pytest.fixture(scope="module")
def kernel_manager_factory(tmp_path_factory):
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    kdir = tmp_path_factory.mktemp("kernels") / KERNEL
    kdir.mkdir()
    (kdir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "offsim test kernel", "language": "python",
        "env": {"MPLBACKEND": "Agg", "PYTHONWARNINGS": "ignore::DeprecationWarning"}}))
    ksm = KernelSpecManager(kernel_dirs=[str(kdir.parent)])
    runtime = tmp_path_factory.mktemp("jupyter-runtime")

    def make():
        return KernelManager(kernel_name=KERNEL, kernel_spec_manager=ksm,
                             connection_file=str(runtime / f"kernel-{uuid.uuid4().hex}.json"))

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_RUNTIME_DIR", str(runtime))  # anything else Jupyter writes at run time goes here too
        yield make
    assert not list(runtime.iterdir()), "a kernel's connection file was left behind"


def _stop(client, km) -> None:
    """Stop what the test started: the client's channels (zmq sockets), the kernel process, its connection file."""
    if client.kc is not None:
        client.kc.stop_channels()
    if km.has_kernel:
        km.shutdown_kernel(now=True)
    km.cleanup_resources()


def _notebooks():
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def test_there_are_notebooks():
    names = [p.name for p in _notebooks()]
    assert {"01-policy-tradeoffs.ipynb", "02-sim-vs-hardware.ipynb", "03-reproducing-the-papers.ipynb"} <= set(names)


@pytest.mark.parametrize("path", _notebooks(), ids=lambda p: p.stem)
def test_notebook_runs(path, kernel_manager_factory):
    nb = nbformat.read(path, as_version=4)
    km = kernel_manager_factory()
    client = nbclient.NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}}, allow_errors=False)
    t0 = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:  # the cell, its traceback: say which notebook
        pytest.fail(f"{path.name} failed:\n{str(e)[-3000:]}")
    finally:
        _stop(client, km)
    wall_s = time.perf_counter() - t0
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    # every code cell ran (none skipped by an earlier failure) and the figures rendered
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code" and c.source.strip())
    print(f"{path.name}: {wall_s:.1f} s")
    assert os.environ.get("OFFSIM_NOTEBOOK_BUDGET_S") is None or wall_s < float(os.environ["OFFSIM_NOTEBOOK_BUDGET_S"])
