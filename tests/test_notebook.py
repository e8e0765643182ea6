"""notebooks/quickstart.ipynb runs headless, top to bottom, so it never rots.

nbformat and nbclient (test extras) are imported by the test itself, so that collecting the
suite on an accelerator's image without them (`pytest -m accelerator`) does not fail here."""
import os

import pytest

ROOT = __file__.rsplit("/tests/", 1)[0]


def _text(cell) -> str:
  return "".join(o.get("text", "") or str(o.get("data", {}).get("text/plain", ""))
                 for o in cell.get("outputs", []))


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, optimised_xla):  # 300 SFT + 12 RL steps
  import nbformat
  from nbclient import NotebookClient
  nb = nbformat.read(os.path.join(ROOT, "notebooks", "quickstart.ipynb"), as_version=4)
  NotebookClient(nb, timeout=900, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  outputs = [_text(c) for c in nb.cells if c.cell_type == "code"]
  assert "8 devices" in outputs[0]
  rl_log = next(o for o in outputs if "held-out" in o and "reward" in o)
  assert rl_log.count("step") == 12
  assert any(o.get("output_type") == "display_data" for c in nb.cells
             for o in c.get("outputs", []))  # the plot and the treescope views
  assert "restored at RL step 12" in outputs[-1]
