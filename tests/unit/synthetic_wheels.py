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
