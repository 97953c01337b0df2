"""Every python snippet of README.md runs as written.

A fence's info string says where a snippet runs: ```python on the CPU (run here), ```python gpu on one CUDA
GPU, ```python gpu-2 on two, ```python torchrun in several processes (compiled here, run by hand with
torchrun). Each snippet runs in a fresh namespace of its own, the way a reader would paste it.
"""
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)
NEEDS = {"": 0, "gpu": 1, "gpu-2": 2}


def _snippets():
    text = README.read_text()
    out = []
    for m in FENCE.finditer(text):
        heading = re.findall(r"^## (.+)$", text[: m.start()], re.M)
        out.append(pytest.param(m.group(1).strip(), m.group(2),
                                id=f"{len(out)}-{heading[-1] if heading else 'top'}".replace(" ", "_")))
    return out


SNIPPETS = _snippets()


def test_the_readme_has_cpu_snippets_and_every_fence_kind_is_known():
    kinds = [p.values[0] for p in SNIPPETS]
    assert kinds.count("") >= 8, kinds
    assert set(kinds) <= set(NEEDS) | {"torchrun"}, kinds


@pytest.mark.parametrize("kind, code", SNIPPETS)
def test_readme_snippet_runs(kind, code, tmp_path, monkeypatch):
    compiled = compile(code, f"README.md snippet ({kind or 'cpu'})", "exec")
    if kind == "torchrun":
        pytest.skip("runs under torchrun (several processes); compiled only")
    gpus = NEEDS[kind]
    if gpus and (not torch.cuda.is_available() or torch.cuda.device_count() < gpus):
        pytest.skip(f"needs {gpus} CUDA GPU(s)")
    if code.lstrip().startswith("import lightning") or "\nimport lightning" in code:
        pytest.importorskip("lightning")
    if "transformers" in code:
        pytest.importorskip("transformers")
    if "AccuracyAtK" in code:
        pytest.importorskip("torchmetrics")
    monkeypatch.chdir(tmp_path)  # a snippet that writes files writes them here, never into the tree
    torch.manual_seed(0)
    exec(compiled, {"__name__": "__readme__"})
