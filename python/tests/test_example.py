"""The example is a TorchRec user's loop with the imports changed: run as it
is (Ember's tables) and with TorchRec's imports put back, on the same data
and order, the DLRM reaches the same AUC (within 0.002)."""

import json
import pathlib
import subprocess
import sys

from conftest import require

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "dlrm.py"
TORCHREC_IMPORTS = """\
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter
"""


def run(source: str, tmp_path: pathlib.Path, name: str) -> dict:
    script = tmp_path / name
    script.write_text(source)
    out = subprocess.run([sys.executable, str(script), "--steps", "300", "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_example_with_torchrec_imports_reaches_the_same_auc(tmp_path):
    require("torchrec")
    source = EXAMPLE.read_text()
    begin, end = "# imports: begin\n", "# imports: end\n"
    head, rest = source.split(begin)
    ember_imports, tail = rest.split(end)
    assert "from ember" in ember_imports and "torchrec" not in ember_imports
    torchrec_source = head + begin + TORCHREC_IMPORTS + end + tail
    ours = run(source, tmp_path, "dlrm_ember.py")
    theirs = run(torchrec_source, tmp_path, "dlrm_torchrec.py")
    assert ours["auc"] > 0.7, ours  # it learned (0.5 is chance)
    assert abs(ours["auc"] - theirs["auc"]) <= 0.002, (ours, theirs)
    print("ember", ours, "torchrec", theirs)
