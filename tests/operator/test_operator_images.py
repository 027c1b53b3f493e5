"""Images: the worker is CUDA + torch + FlashInfer, the control image has no torch; both non-root.

No container engine runs here, so this reads the Dockerfiles for what a user relies on; e2e/kind.sh
builds them for real.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def instructions(name: str) -> list[tuple[str, str]]:
    text = (REPO / name).read_text().replace("\\\n", " ")
    return [(m.group(1).upper(), m.group(2).strip())
            for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", text, re.M)
            if not m.group(0).lstrip().startswith("#")]


def final_stage(steps: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last_from:]


def test_worker_image_is_cuda_with_torch_and_flashinfer_running_as_uid_1000():
    steps = instructions("Dockerfile.worker")
    text = (REPO / "Dockerfile.worker").read_text()
    assert re.search(r"ARG CUDA_IMAGE=nvidia/cuda:[\d.]+-\S*runtime", text)
    assert any(op == "RUN" and "torch" in arg and "download.pytorch.org" in text
               for op, arg in steps)
    # torch at the release the GPU checks ran, not whatever is newest when the image is built
    assert re.search(r"ARG TORCH_VERSION=\d+\.\d+\.\d+\n", text)
    assert any(op == "RUN" and '"torch==${TORCH_VERSION}"' in arg for op, arg in steps)
    assert any(op == "RUN" and '[gpu]' in arg for op, arg in steps)  # flashinfer-python
    # FlashInfer's three packages at the one release the GPU tests passed with: unpinned, the
    # image took whatever was newest, with a cubin package of another release than the code.
    version = re.search(r"ARG FLASHINFER_VERSION=(\S+)", text).group(1)
    for package in ("flashinfer-cubin", "flashinfer-jit-cache"):
        assert re.search(rf'"{package}==\$\{{FLASHINFER_VERSION\}}"', text), package
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"flashinfer-python=={version}"' in pyproject
    final = final_stage(steps)
    assert ("USER", "1000:1000") in final
    assert ("ENTRYPOINT", '["radixpool"]') in final


def env_of(steps: list[tuple[str, str]]) -> dict[str, str]:
    """What the ENV instructions of `steps` set (the `KEY=VALUE ...` form)."""
    env = {}
    for op, arg in steps:
        if op == "ENV":
            env.update(item.split("=", 1) for item in arg.split() if "=" in item)
    return env


def test_worker_image_never_builds_tvm_ffi_torch_addon_at_import():
    """FlashInfer 0.5.3's tvm-ffi compiles a torch add-on when it is imported under a torch
    without `Tensor.__c_dlpack_exchange_api__` (2.11, 2.13): in the pod, with no compiler, each
    engine start ran a torch-importing subprocess whose build failed, then warned. The GPU tests
    passed with it turned off."""
    steps = instructions("Dockerfile.worker")
    final = final_stage(steps)
    assert env_of(final).get("TVM_FFI_DISABLE_TORCH_C_DLPACK") == "1"
    # the build stage's check imports flashinfer too, with a compiler at hand
    build = steps[:len(steps) - len(final)]
    check = next(i for i, (op, arg) in enumerate(build)
                 if op == "RUN" and "import torch, flashinfer" in arg)
    assert env_of(build[:check]).get("TVM_FFI_DISABLE_TORCH_C_DLPACK") == "1"


def test_control_image_has_no_torch_and_runs_as_uid_1000():
    steps = instructions("Dockerfile.control")
    installs = [arg for op, arg in steps if op == "RUN" and "pip install" in arg]
    assert installs and all("[worker" not in arg and "[gpu" not in arg and "torch" not in
                            arg.split("&&")[0] for arg in installs)
    assert any("! pip show torch" in arg for arg in installs)
    final = final_stage(steps)
    assert ("USER", "1000:1000") in final
    assert ("ENTRYPOINT", '["radixpool"]') in final


def test_operator_defaults_point_at_the_images_the_chart_installs():
    import yaml

    from radixpool.operator.desired import DEFAULT_CONTROL_IMAGE, DEFAULT_WORKER_IMAGE

    chart = yaml.safe_load((REPO / "charts/radixpool/Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "charts/radixpool/values.yaml").read_text())
    version = chart["appVersion"]
    chart_images = (f"{values['workerImage']['repository']}:{version}",
                    f"{values['image']['repository']}:{version}")
    assert chart_images == (DEFAULT_WORKER_IMAGE, DEFAULT_CONTROL_IMAGE)


@pytest.mark.parametrize("name", ["Dockerfile.worker", "Dockerfile.control"])
def test_images_run_under_an_arbitrary_uid_in_group_0(name):
    """OpenShift runs a container as a uid picked from the namespace's range, in group 0, with no
    passwd entry: HOME comes from the image's environment, and the home directory (where every
    cache goes: Hugging Face, FlashInfer's JIT, Triton, CUDA) must be group 0's with the owner's
    permissions, or nothing but the operator's volumes can be written."""
    final = final_stage(instructions(name))
    env = env_of(final)
    home = env["HOME"]
    runs = " && ".join(arg for op, arg in final if op == "RUN")
    assert re.search(rf"chown -R 1000:0 {home}( |$)", runs), runs
    assert re.search(rf"chmod -R g=u {home}( |$)", runs), runs
    # made before the chown, so under it: a cache directory made later would be root's alone
    assert runs.index(f"{home}/.cache") < runs.index(f"chown -R 1000:0 {home}")
    for variable, value in env.items():
        if variable.endswith(("_HOME", "_CACHE_DIR", "_CACHE_PATH")):
            assert value.startswith(f"{home}/.cache"), variable
    assert ("WORKDIR", home) in final
