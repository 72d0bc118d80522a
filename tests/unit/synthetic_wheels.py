"""Synthetic vLLM wheels for the audit's unit tests: a few files of a release, zipped (support module)."""
import zipfile

VLLM_FILES = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '0.17.0'\n",
    "vllm/v1/request.py": "class Request:\n    def __init__(self, request_id, prompt_token_ids, sampling_params, pooling_params):\n        pass\n",
}


def make_wheel(path, files):
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


def declaring_wheel(directory, package: str = "declaring", package_source: str = "import vllm\n"):
    """``<package>-1.0`` as a wheel whose dist-info declares one touch point in the audit's entry-point
    group (``<package>:x``, pointing at a module that does not exist: it must be read, never loaded)."""
    from vllm_compat.consumer import TOUCHPOINTS_GROUP

    return make_wheel(directory / f"{package}-1.0-py3-none-any.whl", {
        f"{package}/__init__.py": package_source,
        f"{package}-1.0.dist-info/METADATA": f"Name: {package}\nVersion: 1.0\n",
        f"{package}-1.0.dist-info/entry_points.txt":
            f"[{TOUCHPOINTS_GROUP}]\n{package}:x = {package}_never_imported:TOUCHPOINTS\n"})
